"""A change plan compiled into the runner's steps (pure): adds before drains, rolling waves of
replacements (each a drain sub-plan, its own delivery, start, canary, register), the gateway
started first when it was observed down."""

from __future__ import annotations


from pdops.model.admission import UNIT as ADMISSION_UNIT
from pdops.model.render import GATEWAY_UNIT, manifest
from pdops.model.placement import Instance, Placement
from pdops.plans import Plan, Step
from pdops.steps.builders import (baseline_step, canary_step, close_breakers_step, connect_step, delivery_steps,
                                  drain_steps, end_orphans_step, front_door_step, gateway_restart_steps,
                                  healthy_steps, lost_work_step, preflight_step, register_steps, side_by_side,
                                  start_steps, verify_running_step)
from pdops.model.topology import Topology

from pdops.ops.scale.change import ScalePlan, change_facts, instance_files


def runner_steps(plan: ScalePlan) -> list[Step]:
    """The steps the runner walks for a change (pure): connect, preflight, render, deliver; then
    each add (consecutive adds start in parallel; each is canaried with the pairs it will serve,
    then registered) and each drain (the drain sub-plan, ids prefixed `drain <id>: `); record."""
    inv, cur, tgt = plan.inv, plan.current, plan.target
    first = gateway_start_steps(plan)
    if first:
        first += front_door_step(inv)
    if not plan.steps and not plan.gateway_restart and not plan.admission_reload and not plan.retired_gateways:
        # only the cordons change: what runs is checked, then the revision records them
        return first + [verify_running_step(tgt, inv, plan.files),
                        Step("record", None, f"record revision ({tgt.topology}) with hosts cordoned: "
                             f"{', '.join(plan.cordoned) or 'none'}; move `current` to it", kind="record-scale",
                             params={"change": change_facts(plan)})]
    # instances that take GPUs a removed one holds are checked after that one is drained (its ports
    # and GPUs are busy now, by design): preflight checks the others
    later = {s.instance.id for s in plan.steps if s.kind == "add" and s.why and not s.why.startswith("surge")}
    later |= {i.id for i in plan.replaced}  # their ports are the running processes' until the wave drains them
    pre = tuple(i for i in tgt.instances if i.id not in later)
    pre_pl = Placement(Topology(sum(i.role == "prefill" for i in pre), sum(i.role == "decode" for i in pre)), pre)
    out = [connect_step(plan.hosts)] + first + [preflight_step(plan.skip_checks, pre_pl, plan.current_placement)]
    meta = {"topology": str(tgt.topology), "from": cur.number}
    if plan.replaced:
        # the build holds every file; the replaced instances' own files go out in their waves, so an
        # engine not yet replaced keeps running beside the files it was started from (the gateway's
        # and the admission layer's changed files still go out here, for their restart or reload at
        # the end); a host whose other files are all as the current revision recorded them is not
        # touched before its wave (files on disk that differ from the record: `inv verify`)
        held = set(wave_files(plan, [i.id for i in plan.replaced])["files"])
        rest = [f for f in plan.files if f not in held]
        new_mf, old_mf = manifest(rest), cur.manifest or {}
        changed = {h for h, entries in new_mf.items() if any((old_mf.get(h) or {}).get(p) != e for p, e in entries.items())}
        held_ids = {i.id for i in plan.replaced}  # nor are their units verified and enabled before their waves
        out += delivery_steps(inv, tgt, plan.files, meta, hold=[i.id for i in plan.replaced],
                              now=([f for f in rest if f.host in changed],
                                   Placement(tgt.topology, tuple(i for i in tgt.instances if i.id not in held_ids))),
                              note=f"; not yet the files of {', '.join(i.id for i in plan.replaced)}: each gets its "
                                   "own files in its wave, after its old process stopped")
    else:
        out += delivery_steps(inv, tgt, plan.files, meta)
    live = {i.id for i in plan.current_placement.instances} - set(plan.seen.not_serving if plan.seen else ())
    down = plan.seen.down if plan.seen else frozenset()
    interval = float(inv.vars.get("pdops_empty_check_interval_s", 5))
    i, batch_no = 0, 0
    while i < len(plan.steps):
        batch = []
        while i < len(plan.steps) and plan.steps[i].kind == "add":
            batch.append(plan.steps[i].instance)
            i += 1
        if batch:
            batch_no += 1
            out += start_steps(inv, batch, restart=False, group=f"start-{batch_no}" if len(batch) > 1 else None)
            for x in batch:
                other = "decode" if x.role == "prefill" else "prefill"
                peers = [o for o in tgt.role(other) if o.id in live]
                pairs = [(x.id, o.id) if x.role == "prefill" else (o.id, x.id) for o in peers]
                if pairs:
                    out.append(canary_step(f"canary {x.id}", pairs, retry_once=True, instance=x.id,
                                           why="straight to each pair before it is registered (one retry per pair)"))
                out += register_steps(inv, [x], group=None)
                live.add(x.id)
            continue
        if plan.steps[i].kind == "replace-out":
            wave = []
            while i < len(plan.steps) and plan.steps[i].kind.startswith("replace"):
                if plan.steps[i].kind == "replace-out":
                    wave.append(plan.steps[i].instance)
                i += 1
                if i < len(plan.steps) and plan.steps[i].kind == "replace-out" and \
                        plan.steps[i - 1].kind == "replace-in":
                    break  # the next wave
            out += wave_steps(plan, wave, live)
            continue
        s = plan.steps[i]
        i += 1
        wid = (cur.instances.get(s.instance.id) or {}).get("worker_id")
        out += drain_steps(inv, s.instance, wid, wait_s=float(inv.drain_budget_s), interval_s=interval,
                           prefix=f"drain {s.instance.id}: ", in_change=True, wait=s.instance.id not in down,
                           guard=not plan.force)
        live.discard(s.instance.id)

    if plan.gateway_restart:
        out += gateway_restart_steps(inv, [i.id for i in tgt.instances])
    if plan.admission_reload:
        hosts = inv.admission.hosts
        for host in hosts:
            tag = f" {host}" if len(hosts) > 1 else ""
            out.append(Step(f"admission-check{tag}", host, f"{ADMISSION_UNIT} is active; its master's MainPID", 30,
                            kind="admission-check", params={"keys": False, "host": host}))
            out.append(Step(f"admission-reload{tag}", host, f"systemctl reload {ADMISSION_UNIT} (haproxy -c, then USR2: "
                            "old workers finish their streams); the master MainPID must stay", 60,
                            kind="admission-reload", params={"host": host}))
    known = {h.name for h in inv.hosts}
    for h in plan.retired_gateways:
        out.append(Step(f"retire-gateway {h}", h if h in known else None,
                        f"{h} is no longer a gateway: systemctl disable --now {GATEWAY_UNIT}, its files (unit, launch "
                        "script, env file, start-up list and its script) removed, daemon-reload"
                        + ("" if h in known else "; the host is not in the inventory: said, not done"), 60,
                        kind="retire-gateway", params={"host": h, "reachable": h in known}))
    rep = plan.repair or {}
    if (rep and plan.current_placement.get(rep["instance"]).role == "decode"
            or plan.fault and any(i.role == "decode" for i in plan.replaced)):
        # the halves the ended decode process left on the prefills wait for a side that is gone
        out.append(end_orphans_step([p.id for p in tgt.role("prefill")]))
    if plan.replaced:

        out.append(close_breakers_step(inv, tgt, [i.id for i in plan.replaced],
                                       f"{', '.join(i.id for i in plan.replaced)} started again at unchanged URLs"))
    out.append(verify_running_step(tgt, inv, plan.files))
    out.append(Step("record", None, f"record revision ({tgt.topology}) with the rollback record; move `current` to it",
                    kind="record-scale", params={"change": change_facts(plan)}))
    if rep or plan.fault:

        out.append(baseline_step(rep["instance"]) if rep else
                   baseline_step(fault=f"the fault this deploy observed and replaced ({plan.fault})"))
    return out


def gateway_start_steps(plan: ScalePlan) -> list[Step]:
    """A gateway observed not answering is started before anything else (it registers its start-up
    list itself after each start); the change goes on once it lists every instance that serves."""
    seen = plan.seen
    if not seen or not seen.gateways_down:
        return []

    inv = plan.inv
    serving = {i.id: i.url for i in plan.current_placement.instances if i.id not in seen.not_serving}
    # what this change starts again leaves the start-up list first: a worker the gateway queues while
    # its engine is down is retried in the background and may be listed later with its old identity
    # (a prefill's old bootstrap port); each is listed again once registered
    unlist = [i for i in seen.not_serving if i in {x.id for x in plan.replaced + plan.removed}]
    out = []
    for host, why in sorted(seen.gateways_down.items()):
        node = inv.gateway.node(host)
        active = host in seen.gateways_active
        verb = "restart" if active else "start"
        out.append(Step("gateway" if len(inv.gateway.nodes) == 1 else f"gateway {host}", host, f"observed: {why}; "
                        + (f"{', '.join(unlist)} out of its start-up list (started again by this change, listed again "
                           "once registered); " if unlist else "")
                        + f"{verb} {GATEWAY_UNIT} (after each start it registers its start-up list), wait for "
                        f"{node.url}/health" + (f" and until it lists {', '.join(serving)} healthy and ready"
                                                if serving else ""),
                        60 + 15 * len(serving), kind="gateway",
                        params={"gateway": host, "restart": active, "clear_list": False, "wait_for": serving,
                                "unlist": unlist}))
    return out


def wave_files(plan: ScalePlan, ids: list[str]) -> dict:
    """The own files of a wave's instances and their placement (what its deliver-wave step delivers)."""
    mf = manifest(plan.files)
    own = set()
    for i in ids:
        own |= set(instance_files(mf, i))
    return {"files": [f for f in plan.files if (f.host, f.path) in own],
            "placement": Placement(plan.target.topology, tuple(plan.target.get(i) for i in ids))}


def wave_steps(plan: ScalePlan, wave: list[Instance], live: set[str]) -> list[Step]:
    """One wave of a rolling replacement: drain the wave's running processes side by side (the drain
    sub-plan of each, step for step in parallel), deliver their new files, start them, canary every
    pair through them, register them. `live` (ids serving) is updated."""

    inv, cur = plan.inv, plan.current
    old = {i.id: i for i in plan.current_placement.instances}
    down = plan.seen.down if plan.seen else frozenset()
    ids = [i.id for i in wave]
    tag = "+".join(ids)
    interval = float(inv.vars.get("pdops_empty_check_interval_s", 5))
    rep = plan.repair or {}
    subs = [drain_steps(inv, old[i.id], (cur.instances.get(i.id) or {}).get("worker_id"),
                        wait_s=float(rep.get("wait_s") or inv.drain_budget_s), interval_s=interval,
                        prefix=f"replace {i.id}: ", in_change=True, extra={"old": True},
                        force_after=bool(rep.get("force_after")), guard=not plan.force,
                        wait=not (rep.get("down") and rep.get("instance") == i.id) and i.id not in down) for i in wave]
    out: list[Step] = []
    for i in wave:
        if rep.get("instance") == i.id:

            if rep.get("state") == "restarted":
                # systemd started the running process (Restart=on-failure): real SGLang answers /metrics without
                # its queue gauges until its warm-up ends (17-64 s here), so its drain could not prove it idle.
                # Wait for its /health first (nothing is started); one that never answers stops the repair here.
                out += healthy_steps(inv, [old[i.id]], group=None)
            out.append(lost_work_step(old[i.id], rep))
    out += side_by_side(subs, f"out {tag}")
    live -= set(ids)
    out.append(Step(f"deliver {tag}", None, f"the new files of {', '.join(ids)} (units, launch scripts, 0600 env "
                    "files) with Ansible; daemon-reload; enable", kind="deliver-wave",
                    params={"instances": ids, **wave_files(plan, ids)}))
    out += start_steps(inv, wave, restart=False, group=f"start {tag}" if len(wave) > 1 else None)
    pairs = []
    for p in plan.target.role("prefill"):
        for d in plan.target.role("decode"):
            if {p.id, d.id} & set(ids) and {p.id, d.id} <= live | set(ids):
                pairs.append((p.id, d.id))
    if pairs:
        out.append(canary_step(f"canary {tag}", pairs, retry_once=True, instance=ids[0] if len(ids) == 1 else None,
                               why="straight to each pair before registration (no decode knows the new bootstrap "
                                   "address; one retry per pair all the same)"))
    out += register_steps(inv, wave, group=f"register {tag}" if len(wave) > 1 else None)
    live |= set(ids)
    return out


def undo_steps(inst: Instance, plan: ScalePlan, *, registered: bool) -> list[Step]:
    """Undo of one added instance: its drain if it was registered (leave the gateway, wait empty, the
    verified stop); else the verified stop alone, closing only the ports its own processes listen on
    (it may never have listened: its port may be another process's, the reason it failed)."""
    inv = plan.inv
    return drain_steps(inv, inst, None, wait_s=float(inv.drain_budget_s),
                       interval_s=float(inv.vars.get("pdops_empty_check_interval_s", 5)), gateway=registered,
                       prefix=f"undo {inst.id}: " if registered else f"undo-stop {inst.id}: ",
                       check_ports=True if registered else "held", resume=False)


def undo_group(plan: ScalePlan, *, fenced: bool = False) -> list[Step]:
    """R1 of a halted change (pure): `undo-decide` names, from what the walk did, which instances the
    change started are kept and which are undone and how; then each started instance's two ways of
    being undone, each a plan of its own that the walker walks only if the decision named it (printed
    in full by `--dry-run`, journalled step by step)."""
    inv = plan.inv
    started = [s.instance for s in plan.steps if s.kind in ("add", "replace-in")]
    if not started:
        return []
    ids = ", ".join(i.id for i in started)
    keep = ("kept only after `commit` (the new generation serves alone then)" if fenced else
            "kept if it serves in place of one already drained or replaced (its `register` step passed)")
    out = [Step("undo-decide", None, f"each of {ids} that its `start` step started: {keep}; otherwise undone: "
                "drained if its `register` step ran, else the verified stop alone", 30, kind="undo-decide",
                params={"instances": [i.id for i in started], "replaced": [i.id for i in plan.replaced],
                        "fenced": fenced})]
    budget = float(inv.drain_budget_s) + inv.stop_timeout_s + 180
    for inst in started:
        for registered, output, how in ((True, "undo_drain", "drained (it was registered)"),
                                        (False, "undo_stop", "stopped (never registered)")):
            sub = Plan("undo", f"undo {inst.id}: {how}", undo_steps(inst, plan, registered=registered))
            out.append(Step(f"undo {inst.id}" if registered else f"undo-stop {inst.id}", None,
                            f"{inst.id} {how}, each stop verified", budget, kind="walk-plan",
                            params={"plan": sub, "instance": inst.id}, when=(output, True, inst.id)))
    return out


def restore_steps(plan: ScalePlan, taken_out: list[str], when: tuple | None = None) -> list[Step]:
    """R2 of a halted change (pure): what the change took out of the gateway and did not stop goes
    back in service, one decision a step: which of them run, a canary through those, each registered
    again (only if its canary passed), then the start-up list. `when`: restore-check's condition (a
    fenced rollout's: not once committed); the other steps follow its outputs."""
    if not taken_out:
        return []
    at, ids = plan.inv.gateway.step_host, ", ".join(taken_out)
    out = [Step("restore-check", None, f"each of {ids} whose `leave-gateway` step ran and whose `stop` step did "
                "not: running if its units are active and its /health answers (read now); otherwise named out "
                "of service", 30 + 10 * len(taken_out), kind="restore-check", params={"instances": taken_out},
                when=when),
           Step("restore-canary", None, "a canary through each one running and the instances the gateways route "
                "to now (one retry per pair)", 120, kind="restore-canary", when=("restore", True))]
    out += [Step(f"restore register {i}", at, f"{i} registered again{plan.inv.gateway.on_each()} once the worker "
                 "its drain left draining there is gone; listed healthy and ready", 60, kind="restore-register",
                 params={"instance": i}, when=("restore_canaried", True, i)) for i in taken_out]
    out.append(Step("restore gateway-list", at, "the instances registered again back in the gateway's start-up list",
                    60, kind="restore-list", when=("restored", True)))
    return out


def rescue_steps(plan: ScalePlan) -> list[Step]:
    """The rescue of a change (pure): which instances each rescue step may touch is decided here;
    which of them it does touch depends on how far the walk got, and each step names the steps it
    reads that from."""
    if plan.noop or not (plan.steps or plan.gateway_restart or plan.admission_reload):
        return []
    out: list[Step] = undo_group(plan)
    taken_out = [s.instance.id for s in plan.steps if s.kind in ("drain", "replace-out")]
    out += restore_steps(plan, taken_out)
    out.append(Step("record-halt", None, f"if the walk stopped or replaced an instance: record a `partial` revision "
                    "that describes what runs (replaced instances by their new files, the others by revision "
                    f"{plan.current.number}'s), and move `current` to it; otherwise "
                    f"revision {plan.current.number} stays current. The verdict names what was replaced, restored, "
                    "undone and left out of service", 60, kind="record-halt", params={"change": change_facts(plan)}))
    return out
