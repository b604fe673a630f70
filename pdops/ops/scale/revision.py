"""What a change records: the revision of its target, each instance as it runs (kept ones as
recorded, added and replaced ones new, with the worker ids and MainPIDs the walk saw), and the way
back. Written to the record given: the real one by the change's `record-scale` step, a forecast
(pdops.record.forecast) by a sweep's plan, which prints the rows after it from what this writes."""

from __future__ import annotations

from pdops.model.placement import Placement, last_bootstrap_ports
from pdops.model.render import manifest, snapshot_of
from pdops.record.local import Revision, StateDir
from pdops.steps.revisions import configs_of, processes_of

from pdops.ops.scale.change import ChangeFacts, instance_files


def instances_doc(plan: ChangeFacts, pl: Placement, workers: dict[str, str | None],
                   main_pids: dict | None = None) -> dict:
    """Each instance's record: kept ones as recorded, added ones new; the MainPIDs of what this
    change started (pdops.reads.observe compares them with what systemd reports later)."""
    out = {}
    main_pids = main_pids or {}
    for i in pl.instances:
        if i.id in plan.current.instances and i.id not in plan.why:
            out[i.id] = dict(plan.current.instances[i.id])
            if i.id in workers:
                out[i.id]["worker_id"] = workers[i.id]
        else:
            out[i.id] = {"role": i.role, "hosts": list(i.hosts), "units": [list(u) for u in i.units],
                         "worker_id": workers.get(i.id), "url": i.url}
        if i.id in main_pids:
            out[i.id]["main_pids"] = main_pids[i.id]
    return out


def record_change(plan: ChangeFacts, record: StateDir, op: str, workers: dict, build, main_pids: dict | None = None,
                  running: dict | None = None, lost_work: dict | None = None) -> Revision:

    cur, tgt = plan.current, plan.target
    new_mf = manifest(plan.files)
    rollback = {
        "to_revision": cur.number, "to_topology": cur.topology,
        "restore": [i.id for i in plan.removed], "drain": [i.id for i in plan.added],
        "replace": [i.id for i in plan.replaced],
        "how": "`inv rollback`: add back what was removed (start, health-gate, canary, register), then drain what "
               "was added",
        "holds_while": f"the inventory digest is {cur.inventory_hash[:12]} and the rendered files of the restored "
                       f"instances match revision {cur.number}'s manifest",
        "inventory_hash": cur.inventory_hash,
        "files": {f"{h}:{p}": m for i in plan.removed for (h, p), m in instance_files(cur.manifest, i.id).items()},
    }
    extra = {"gateways": plan.inv.gateway.urls, "build": str(build) if build else None, "rollback": rollback,
             "configs": configs_of(running or {}), **processes_of(running or {}, plan.inv),
             "cordoned": list(plan.cordoned),
             "last_bootstrap": last_bootstrap_ports((cur.extra or {}).get("last_bootstrap") or
                                                    last_bootstrap_ports({}, plan.current_placement), tgt),
             "scale": {"from_revision": cur.number, "from_topology": cur.topology,
                       "added": [i.id for i in plan.added], "removed": [i.id for i in plan.removed],
                       "replaced": {i.id: plan.why[i.id] for i in plan.replaced}, "surge": plan.surge,
                       "kept": [i.id for i in plan.kept], "capacity_dip": plan.dip}}
    if plan.rollback_of:
        extra["rollback_of"] = plan.rollback_of
    if plan.repair:
        lost = (lost_work or {}).get(plan.repair["instance"], {})
        extra["repair"] = {**{k: plan.repair.get(k) for k in ("instance", "state", "reasons")},
                           "lost": lost.get("lost"), "failed": lost.get("failed")}
    if plan.base_snapshot is not None:  # a rollback: what runs is the target's rendering
        snap = {**plan.base_snapshot, "files": snapshot_of(plan.inv, plan.files)["files"]}
        inv_hash = plan.rollback_inventory_hash or plan.inv.digest
    else:
        snap, inv_hash = snapshot_of(plan.inv, plan.files), plan.inv.digest
    return record.write_revision(topology=str(tgt.topology), inventory_hash=inv_hash,
                                placement=tgt.to_dict(), manifest=new_mf,
                                instances=instances_doc(plan, tgt, workers, main_pids), outcome="deployed", op_id=op,
                                extra=extra, snapshot=snap)
