"""What a deploy records: the revision of its placement and files, each instance with the worker id
and MainPIDs it runs with, and the processes verify-running read. Written to the record given: the
real one by the `record-deploy` step (pdops.steps.record), a forecast (pdops.record.forecast) by a
sweep's plan, which prints the rows after it from what this writes (no ids, no PIDs: None)."""

from __future__ import annotations

from pdops.model.placement import Placement, last_bootstrap_ports
from pdops.model.render import manifest, snapshot_of
from pdops.steps.actions import configs_of, processes_of


def record_deploy(record, inv, pl: Placement, files, op: str | None, *, workers: dict, build, running: dict,
                  main_pids: dict):
    """A deploy's revision of `pl` and `files`, written to `record` and made current: each instance
    with the worker id and MainPIDs it runs with, the processes verify-running read. (A forecast
    record, pdops.record.forecast, takes what a deploy not yet walked will write: no ids, no PIDs.)"""
    instances = {i.id: {"role": i.role, "hosts": list(i.hosts), "units": [list(u) for u in i.units],
                        "worker_id": workers[i.id], "url": i.url,
                        "main_pids": main_pids.get(i.id)} for i in pl.instances}
    rev = record.write_revision(topology=str(pl.topology), inventory_hash=inv.digest,
                                placement=pl.to_dict(), manifest=manifest(files), instances=instances,
                                outcome="deployed", op_id=op,
                                extra={"gateways": inv.gateway.urls, "build": str(build),
                                       "configs": configs_of(running), **processes_of(running, inv),
                                       "last_bootstrap": last_bootstrap_ports({}, pl)},
                                snapshot=snapshot_of(inv, files))
    record.set_current(rev.number)
    return rev
