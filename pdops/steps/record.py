"""The record steps every operation ends with, carried out: a revision written only from what was
verified to run (deploy, repair, drain), the work lost with an ended process named (never replayed),
and `inv status`'s baseline moved past a repaired fault."""

from __future__ import annotations

from pdops.errors import PdopsError, Unverified
from pdops.facts import q, requestlog
from pdops.model.placement import Placement, last_bootstrap_ports
from pdops.model.render import SLICE_UNIT, UNIT_DIR, snapshot_of, snapshot_subset
from pdops.plans import Outcome, Step
from pdops.reads.looks import move_baseline
from pdops.runner import RunContext
from pdops.steps.revisions import configs_of, processes_of, record_deploy


def do_record_drain(ctx: RunContext, step: Step) -> Outcome:
    rev0, pl0 = step.params["revision"], step.params["placement"]
    inst = pl0.get(step.instance)
    new_pl = Placement(pl0.topology.__class__(
        len([i for i in pl0.instances if i.role == "prefill" and i.id != inst.id]),
        len([i for i in pl0.instances if i.role == "decode" and i.id != inst.id])),
        tuple(i for i in pl0.instances if i.id != inst.id))
    instances = {k: v for k, v in rev0.instances.items() if k != inst.id}
    hosts_files = {h: {p: m for p, m in files.items() if f"pdops-{inst.id}" not in p}
                   for h, files in rev0.manifest.items()}
    # a host left with nothing of the revision but pdops.slice is no host of it (render agrees:
    # a deploy of the new topology renders no file there, so the manifests compare equal)
    slice_path = f"{UNIT_DIR}/{SLICE_UNIT}"
    hosts_files = {h: f for h, f in hosts_files.items() if set(f) - {slice_path}}
    removed_files = {h: {p: m for p, m in files.items() if f"pdops-{inst.id}" in p}
                     for h, files in rev0.manifest.items()}
    rollback = {"restore": inst.id, "from_revision": rev0.number,
                "how": "start its units, wait healthy, re-register with the gateway, canary its pairs",
                "holds_while": "its hosts and rendered files are unchanged",
                "files": {h: f for h, f in removed_files.items() if f},
                "placement": [i for i in pl0.to_dict()["instances"] if i["id"] == inst.id]}

    units = {f"{h}:{u}" for h, u in inst.units}
    carried = {"configs": {k: v for k, v in (rev0.extra.get("configs") or {}).items() if k not in units},
               "main_starts": {k: v for k, v in (rev0.extra.get("main_starts") or {}).items() if k not in units},
               "cordoned": list(rev0.extra.get("cordoned") or []),
               # the slot remembers its last prefill's bootstrap port: a re-add takes the other one
               "last_bootstrap": last_bootstrap_ports(rev0.extra.get("last_bootstrap") or {}, pl0)}
    rev = ctx.record.write_revision(topology=str(new_pl.topology), inventory_hash=rev0.inventory_hash,
                                   placement=new_pl.to_dict(), manifest=hosts_files, instances=instances,
                                   outcome="deployed", op_id=ctx.op,
                                   extra={"drained": inst.id, "rollback": rollback,
                                          **{k: rev0.extra[k] for k in ("gateway", "gateways", "gateway_main_pid",
                                                                        "gateway_main_pids") if k in rev0.extra},
                                          **carried},
                                   snapshot=snapshot_subset(ctx.record.revision_snapshot(rev0.number), hosts_files))
    ctx.record.set_current(rev.number)
    return Outcome(evidence={"revision": rev.number, "rollback": rollback},
                   verified=[f"revision {rev.number} ({new_pl.topology}) is current"])


def do_record_deploy(ctx: RunContext, step: Step) -> Outcome:
    pl = step.params["placement"]
    rev = record_deploy(ctx.record, ctx.inv, pl, step.params["files"], ctx.op, workers=ctx.get(step, "workers"),
                        build=ctx.get(step, "build"), running=ctx.get(step, "running"),
                        main_pids=ctx.get(step, "main_pids", {}))
    ctx.give(step, "revision", rev.number)
    return Outcome(evidence={"revision": rev.number}, verified=[f"revision {rev.number} ({pl.topology}) recorded and current"])


def do_record_repair(ctx: RunContext, step: Step) -> Outcome:
    """A new revision: the live one's files and topology, with the MainPIDs and worker ids seen now."""
    live, pl, files = step.params["live"], step.params["placement"], step.params["files"]
    instances = {k: dict(v) for k, v in live.instances.items()}
    workers, running = ctx.get(step, "workers", {}), ctx.get(step, "running")
    seen = {}
    for inst in pl.instances:
        pids = {}
        for host, unit in inst.units:
            st = ctx.pool.unit_states(host, [unit])[unit]
            if st.active_state != "active" or not st.main_pid:
                raise Unverified(f"{inst.id}: {host}:{unit} is {st.active_state}/{st.sub_state} after the repair")
            pids[f"{host}:{unit}"] = st.main_pid
        instances[inst.id]["main_pids"] = seen[inst.id] = pids
        if inst.id in workers:
            instances[inst.id]["worker_id"] = workers[inst.id]
    # the inventory this deploy ran with renders the live files (plan_deploy compared them): it is the
    # revision's inventory from now on, with its snapshot when it is not the recorded one
    same_inventory = ctx.inv.matches(live.inventory_hash)
    rev = ctx.record.write_revision(topology=live.topology, inventory_hash=ctx.inv.digest,
                                   placement=live.placement, manifest=live.manifest, instances=instances,
                                   outcome="deployed", op_id=ctx.op,
                                   extra={**live.extra, "repair_of": live.number, "repaired": step.params["findings"],
                                          **({"configs": configs_of(running), **processes_of(running, ctx.inv)}
                                             if running is not None else {})},
                                   snapshot=ctx.record.revision_snapshot(live.number) if same_inventory
                                   else snapshot_of(ctx.inv, files))
    ctx.record.set_current(rev.number)
    ctx.give(step, "revision", rev.number)
    return Outcome(evidence={"revision": rev.number, "main_pids": seen, "inventory_hash": ctx.inv.digest},
                   verified=[f"revision {rev.number} records the repair of revision {live.number}: every unit "
                             "active, MainPIDs as read from systemd now"])


def do_lost_work(ctx: RunContext, step: Step) -> Outcome:
    inst = ctx.old_placement.get(step.instance)
    host, unit = inst.units[0]
    out = ctx.pool.run(host, requestlog.invocations_command(unit, step.params.get("since", 0)), timeout=60).stdout
    logs = requestlog.by_invocation(out)
    st = ctx.pool.unit_states(host, [unit])[unit]
    current = ctx.pool.run(host, f"systemctl show -p InvocationID --value {q(unit)}").stdout.strip() \
        if st.active_state == "active" else None
    lost, failed = requestlog.lost_work(logs, current)
    ctx.give(step, "lost_work", {inst.id: {"lost": lost, "failed": failed}})
    ended = [k for k in logs if k != current]
    if lost:
        ctx.say(f"  lost with {inst.id}'s ended process(es): {len(lost)} request(s): {', '.join(lost)} "
                "(marked failed; pdops sends none of them again)")
    ev = {"instance": inst.id, "lost": lost, "lost_status": "failed (not replayed)", "failed_with_error": failed,
          "processes_read": len(logs), "ended_processes": len(ended)}
    verified = [f"lost work named: {len(lost)} request(s) in flight when {inst.id}'s process ended"
                + (f": {', '.join(lost)}" if lost else "") + " (failed, not replayed)"]
    if failed:
        verified.append(f"{len(failed)} request(s) ended with an error on {inst.id} since the revision "
                        f"(answered, not replayed): {', '.join(failed[:20])}{' ...' if len(failed) > 20 else ''}")
    return Outcome(evidence=ev, verified=verified)


def do_status_baseline(ctx: RunContext, step: Step) -> Outcome:
    """After the record: a baseline that cannot be read is said, never a failed repair (the repair is
    verified and recorded by then; `inv status` then counts the fault's failures as new)."""

    try:
        absorbed = move_baseline(ctx.inv, ctx.pool, ctx.placement)
    except (PdopsError, KeyError, OSError) as exc:
        why = getattr(exc, "message", None) or str(exc)
        return Outcome("noop", {"error": why}, unverified=[f"`inv status`'s baseline not moved ({why}): the "
                                                           "failures of the fault may show as new at the next look"],
                       reason=f"the failure counters could not be read: {why}")
    if absorbed:
        ctx.say("  failures inside the fault of " + step.params["instance"] + ": " + "; ".join(
            f"{k} " + ", ".join(f"{c} +{d}" for c, d in v.items()) for k, v in sorted(absorbed.items())))
    return Outcome(evidence={"fault_of": step.params["instance"], "failures_in_fault": absorbed},
                   verified=["`inv status`'s baseline moved past the fault"
                             + (": " + "; ".join(f"{k} " + ", ".join(f"{c} +{d}" for c, d in v.items())
                                                 for k, v in sorted(absorbed.items())) + " reported with it"
                                if absorbed else " (no failure counter rose)")])
