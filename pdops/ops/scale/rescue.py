"""A halted change: the plan's rescue steps and their executors."""

from __future__ import annotations

import time

from pdops.model import membership
from pdops.errors import PdopsError
from pdops.model.placement import Placement, last_bootstrap_ports
from pdops.model.render import config_ids, manifest, render_files
from pdops.plans import Outcome, Plan, Step
from pdops.runner import RunContext
from pdops.model.topology import Topology

from pdops.ops.scale.change import ROLES, ChangeFacts, cordoned_hosts, instance_files, shared_files
from pdops.ops.scale.revision import instances_doc
from pdops.facts.engine import failed_session_wait_s
from pdops.steps.actions import register
from pdops.steps.canary import canary_pairs
from pdops.remote.hosts import http_json


# ---------------------------------------------------------------- a halted change (the plan's rescue)
#
# What a failed step leaves is read from what the walk did (the steps that ran) and from what the
# hosts and the gateway report now; the three rescue steps are declared by the plan and printed by
# `--dry-run`: R1 undoes what the change added and cannot keep, R2 puts back in service every
# instance the change took out of the gateway but did not stop, R3 records what runs.

def do_undo_decide(ctx: RunContext, step: Step) -> Outcome:
    """R1: which instances the change started are undone, and how, from what the walk did. An added
    instance that is registered stays only if a drain or a replacement already happened (undoing it
    would drop capacity further); a replaced instance registered with its new files serves on (in a
    fenced rollout: only once committed). Every other one the change started is drained (if its
    registration was sent) or stopped; the `undo <id>` and `undo-stop <id>` plans after this step
    run only for the instances it names."""
    started = [i for i in ctx.get(step, "started_instances", {}) if i in step.params["instances"]]
    workers, posted = ctx.get(step, "workers", {}), ctx.get(step, "posted", set())
    changed = ctx.get(step, "committed") if step.params.get("fenced") else \
        ctx.get(step, "drained") or ctx.get(step, "replaced_out")
    replaced = set(step.params.get("replaced", ()))
    kept = [i for i in started if (changed or i in replaced) and i in workers]
    drain = [i for i in started if i not in kept and i in posted]
    stop = [i for i in started if i not in kept and i not in posted]
    ctx.give(step, "undo_drain", set(drain))
    ctx.give(step, "undo_stop", set(stop))
    ctx.give(step, "halt", {"kept_added": kept})
    if not started:
        return Outcome.noop("no start step ran")
    ev = {"kept": kept, "drain": drain, "stop": stop}
    return Outcome(evidence=ev, verified=[f"kept, serving: {k}" for k in kept])


def undo_outcome(step: Step, ctx: RunContext) -> dict:
    """What R1's undo plans did: `undone` (each plan walked to its end), `left` (one that failed: its
    steps and error are journalled under `undo <id>` / `undo-stop <id>`)."""
    walked = ctx.get(step, "plan_verdicts", {})
    undone, left = [], []
    for name, ids in (("undo", ctx.get(step, "undo_drain", set())), ("undo-stop", ctx.get(step, "undo_stop", set()))):
        for iid in sorted(ids):
            if f"{name} {iid}" in walked:
                undone.append(f"{iid} (drained and stopped, verified)" if name == "undo"
                              else f"{iid} (never registered; stopped, verified)")
            else:
                left.append(f"{iid}: undo failed (journal: step `{name} {iid}`)")
    return {"undone": undone, "left": left}


def do_restore_check(ctx: RunContext, step: Step) -> Outcome:
    """R2a: of the instances the change took out of the gateway and did not stop, those whose units
    are active and whose /health answers (read from systemd and the instance now) are to go back in
    service (`restore`); the others are named out of service."""
    stopped = set(ctx.get(step, "drained", [])) | set(ctx.get(step, "replaced_out", []))
    cands = [i for i in step.params["instances"] if i in ctx.get(step, "left_gateway", []) and i not in stopped]
    if not cands:
        return Outcome.noop("no instance left the gateway without being stopped")
    old: Placement = ctx.old_placement
    running, down = [], []
    for iid in cands:
        inst = old.get(iid)
        states = [ctx.pool.unit_states(h, [u])[u] for h, u in inst.units]
        try:
            health = http_json("GET", f"{inst.url}/health", timeout=5)[0]
        except PdopsError:
            health = None
        (running if all(st.is_active for st in states) and health == 200 else down).append(iid)
    ctx.give(step, "restore", set(running))
    ctx.give(step, "halt", {"down": down})
    return Outcome(evidence={"running": running, "down": down},
                   verified=[f"{i}: units active, /health 200" for i in running],
                   unverified=[f"not back in service: {i}: units not active or /health not answering" for i in down])


def do_restore_canary(ctx: RunContext, step: Step) -> Outcome:
    """R2b: a canary through each instance to restore and the instances the gateways route to now
    (and each other); those whose pairs all answered may be registered again (`restore_canaried`)."""
    old: Placement = ctx.old_placement
    back = [old.get(i) for i in sorted(ctx.get(step, "restore", set()))]
    by_url = {i.url.rstrip("/"): i for i in ctx.placement.instances + old.instances}
    serving_now = [by_url[u] for u in sorted(ctx.gateways.routable_everywhere()) if u in by_url]
    pairs = []
    for x in back:
        for o in serving_now + back:
            if o.role != x.role and o.id != x.id:
                pair = (x, o) if x.role == "prefill" else (o, x)
                if pair not in pairs:
                    pairs.append(pair)
    if pairs:
        try:
            canary_pairs(pairs, ctx.say, retry_once=True, deadline_s=max(ctx.deadline(step) - time.monotonic(), 30),
                         session_wait_s=failed_session_wait_s(ctx.inv.profile.env))
        except PdopsError as exc:
            ctx.give(step, "not_restored", [f"{x.id}: canary failed: {exc.message}" for x in back])
            raise
    ctx.give(step, "restore_canaried", {x.id for x in back})
    return Outcome(evidence={"pairs": [f"{p.id}+{d.id}" for p, d in pairs]},
                   verified=[f"canary through {', '.join(x.id for x in back)}: every pair answered"])


def do_restore_register(ctx: RunContext, step: Step) -> Outcome:
    """R2c: one instance registered again on every gateway (register() first waits out the worker its
    drain left draining at its URL)."""
    x = ctx.old_placement.get(step.instance)
    try:
        wid = register(ctx.gateways, x, ctx.say, step.deadline)[ctx.inv.gateway.hosts[0]]
    except PdopsError as exc:
        ctx.give(step, "not_restored", [f"{x.id}: not registered again: {exc.message}"])
        raise
    ctx.give(step, "workers", {x.id: wid})
    ctx.give(step, "restored", {x.id})
    return Outcome(evidence={"worker_id": wid},
                   verified=[f"{x.id} back in service: canaried, registered (worker {wid})"])


def do_restore_list(ctx: RunContext, step: Step) -> Outcome:
    """R2d: the instances registered again, back in every gateway's start-up list."""
    add = [ctx.old_placement.get(i) for i in sorted(ctx.get(step, "restored", set()))]
    listed = membership.listed_ids(membership.update(ctx.pool, ctx.inv, add=add))
    return Outcome(evidence={"gateway_list": listed},
                   verified=[f"{', '.join(i.id for i in add)} in the gateway's start-up list"])


def do_record_halt(ctx: RunContext, step: Step) -> Outcome:
    """R3: what runs after the rescue, recorded (a `partial` revision when something was stopped or
    replaced), and what the failed verdict records (`halt_record`: what is current, what runs, what was
    undone and what was not). The journal holds the failure itself, under the step that failed; the
    line the operator reads is written from `halt_record` once the walk is over (:func:`halted_change_line`,
    the plan's `failure_line`)."""
    plan: ChangeFacts = step.params["change"]
    halt = {**ctx.get(step, "halt", {}), **undo_outcome(step, ctx)}
    workers, main_pids = dict(ctx.get(step, "workers", {})), ctx.get(step, "main_pids", {})
    removed_ids = {i.id for i in plan.removed} | {i.id for i in plan.replaced}
    drained = [i for i in ctx.get(step, "drained", []) if i in removed_ids]
    replaced_out = list(ctx.get(step, "replaced_out", []))
    down = list(halt.get("down", []))
    restored = sorted(ctx.get(step, "restored", set()))
    out_of_gateway = [i for i in ctx.get(step, "left_gateway", []) if i not in drained and i not in replaced_out
                      and i not in down and i not in restored]
    if replaced_out:
        how, rev, live = "rolling", *_halt_rolling(plan, ctx, drained + down, replaced_out, halt, workers, main_pids)
    elif drained or down:
        how, rev, live = "partial", *_halt_partial(plan, ctx, drained + down, halt, workers)
    else:
        how, rev, live = "unchanged", None, [i.id for i in plan.current_placement.instances]
    ctx.give(step, "halt_record", {  # the failed verdict's evidence (pdops.ops.operate.run_operation journals it)
        "how": how, "current": rev.number if rev else plan.current.number, "partial": rev is not None,
        "from_revision": plan.current.number, "topology": rev.topology if rev else plan.current.topology,
        "live": live, "drained": drained + down, "replaced": halt.get("replaced", []),
        "replaced_not_serving": halt.get("out_of_service", []),
        "untouched": [i.id for i in plan.replaced if i.id not in replaced_out],
        "out_of_service": halt.get("out_of_service", []) + down, "down": down,
        "restored": restored, "not_restored": list(ctx.get(step, "not_restored", [])),
        "out_of_gateway": out_of_gateway, "undone": halt.get("undone", []), "left": halt.get("left", [])})
    if rev is None:
        return Outcome.noop(f"nothing was stopped or replaced: revision {plan.current.number} stays current")
    return Outcome(evidence={"revision": rev.number, "partial": True},
                   verified=[f"revision {rev.number} (partial) recorded and current"])


def halted_change_line(ctx: RunContext, plan: Plan) -> str:
    """The verdict line a halted change adds to its error, written from what its rescue recorded
    (`halt_record`, read once the walk is over): what is current, what runs, what was undone and what
    was not (pdops.kinds.FAILURE_LINES "halted-change"). A rescue that did not get as far says so."""
    r = ctx.output("halt_record")
    if not r:
        return (f"verdict: the rescue did not finish (see the journal: `inv journal --op {ctx.op}`); "
                "read `inv status`")
    if r["how"] == "rolling":
        line = (f"verdict: the rollout halted; replaced with the new files: {', '.join(r['replaced']) or 'none'}; "
                f"out of service (old process stopped, new one not serving): "
                f"{', '.join(r['replaced_not_serving']) or 'none'}; still serving revision {r['from_revision']}'s "
                f"files, untouched: {', '.join(r['untouched']) or 'none'}; `current` moved to revision "
                f"{r['current']} (partial, {r['topology']}) to describe what is live; `inv rollback` returns to "
                f"revision {r['from_revision']}")
    elif r["how"] == "partial":
        line = (f"verdict: the change stopped after draining {', '.join(r['drained'])}; `current` moved to revision "
                f"{r['current']} (partial, {r['topology']}) to describe what is live: {', '.join(r['live'])}; "
                f"`inv rollback` returns to revision {r['from_revision']}")
    else:
        line = (f"verdict: the change stopped; current revision unchanged: {r['current']} ({r['topology']}); "
                f"live now: {', '.join(r['live'])}")
    line += f"; undone: {', '.join(r['undone']) or 'nothing was started'}"
    if r["restored"]:
        line += f"; back in service (were out of the gateway, never stopped): {', '.join(r['restored'])}"
    if r["down"]:
        line += f"; out of service (left the gateway, not running now): {', '.join(r['down'])}"
    if r["out_of_gateway"]:
        why_not = r["not_restored"]
        line += (f"; OUT OF THE GATEWAY but running, not restored: {', '.join(r['out_of_gateway'])} "
                 + (f"({'; '.join(why_not)}) " if why_not else "") + "(`inv deploy` puts them back)")
    if r["left"]:
        line += "; NOT undone: " + "; ".join(r["left"])
    return line


def _halt_partial(plan: ChangeFacts, ctx: RunContext, drained: list[str], halt: dict, workers: dict):
    """Something was drained (or is down): the old revision no longer describes the hosts. Returns the
    `partial` revision recorded and the ids of what is live, in its placement's order."""
    kept_added = set(halt.get("kept_added", []))
    cur = plan.current
    live_insts = [i for i in plan.current_placement.instances if i.id not in drained]
    live_insts += [i for i in plan.target.instances if i.id in kept_added]
    order = {i.id: n for n, i in enumerate(plan.target.instances)}
    live_insts.sort(key=lambda i: (i.role != "prefill", order.get(i.id, 999), i.id))
    pl = Placement(Topology(sum(i.role == "prefill" for i in live_insts), sum(i.role == "decode" for i in live_insts)),
                   tuple(live_insts))
    all_mf = manifest(render_files(plan.inv, pl))
    rev = ctx.record.write_revision(topology=str(pl.topology), inventory_hash=plan.inv.digest, placement=pl.to_dict(),
                                   manifest=all_mf, instances=instances_doc(plan, pl, workers),
                                   outcome="partial", op_id=ctx.op,
                                   extra={"halted": True, "from_revision": cur.number,
                                          "target": str(plan.target.topology), "drained": drained,
                                          "gateways": plan.inv.gateway.urls, "rollback": {"to_revision": cur.number}})
    ctx.record.set_current(rev.number)
    return rev, [i.id for i in live_insts]


def _halt_rolling(plan: ChangeFacts, ctx: RunContext, drained: list[str], replaced_out: list[str],
                  halt: dict, workers: dict, main_pids: dict):
    """The rollout halted after replacing (or taking out) some instances: record what is live as a
    `partial` revision whose every instance is described by the files its process runs: the ones not
    yet replaced by revision `current` (their files were never touched), the replaced ones by the new
    files. `inv rollback` returns to revision `current`."""
    kept_added = set(halt.get("kept_added", []))
    cur = plan.current
    cur_pl = plan.current_placement
    done = [i for i in replaced_out if i in kept_added]
    out_now = [i for i in replaced_out if i not in kept_added]
    halt["replaced"], halt["out_of_service"] = done, out_now
    live_insts = [i for i in cur_pl.instances if i.id not in drained and i.id not in replaced_out]
    live_insts += [plan.target.get(i) for i in kept_added]
    live_insts.sort(key=lambda i: (ROLES.index(i.role), int(i.id[1:])))
    pl = Placement(Topology(sum(i.role == "prefill" for i in live_insts), sum(i.role == "decode" for i in live_insts)),
                   tuple(live_insts))
    new_mf, new_cfg = manifest(plan.files), config_ids(plan.files)
    old_cfg = (cur.extra or {}).get("configs") or {}
    mf: dict = {}
    cfg: dict = {}
    for (h, p), m in shared_files(new_mf, {i.id for i in plan.target.instances}).items():
        mf.setdefault(h, {})[p] = m
    for i in live_insts:
        src_mf, src_cfg = (new_mf, new_cfg) if i.id in kept_added else (cur.manifest, old_cfg)
        for (h, p), m in instance_files(src_mf, i.id).items():
            mf.setdefault(h, {})[p] = m
        for h, u in i.units:
            if f"{h}:{u}" in src_cfg:
                cfg[f"{h}:{u}"] = src_cfg[f"{h}:{u}"]
    for gw_key in (k for k in old_cfg if k.endswith(":pdops-gateway.service")):
        cfg[gw_key] = old_cfg[gw_key]
    rev = ctx.record.write_revision(
        topology=str(pl.topology), inventory_hash=plan.inv.digest, placement=pl.to_dict(),
        manifest={h: dict(sorted(v.items())) for h, v in sorted(mf.items())},
        instances=instances_doc(plan, pl, workers, main_pids),
        outcome="partial", op_id=ctx.op,
        extra={"halted": True, "from_revision": cur.number, "target": str(plan.target.topology),
               "drained": drained, "replaced": done, "out_of_service": out_now, "gateways": plan.inv.gateway.urls,
               "configs": dict(sorted(cfg.items())), "cordoned": cordoned_hosts(cur),
               "last_bootstrap": last_bootstrap_ports((cur.extra or {}).get("last_bootstrap") or
                                                      last_bootstrap_ports({}, cur_pl), pl),
               "rollback": {"to_revision": cur.number}})
    ctx.record.set_current(rev.number)
    return rev, [i.id for i in live_insts]
