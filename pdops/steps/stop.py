"""The stop every operation shares, carried out: leave the gateway (guarded while the instance is
routable), wait until it is empty and check twice, record what runs, stop by unit and verify the stop
(cgroup, recorded PIDs with their start times, ports, the gateway's list); and the end of a stop's
recorded survivors. The builders of these steps are pdops.steps.builders.drain_steps."""

from __future__ import annotations

import json
import time

from pdops.errors import DrainFailed, PdopsError, Refused, Unverified
from pdops.facts import nvidia as nv_facts, ports as port_facts, skipped_in
from pdops.model import membership
from pdops.model.placement import Instance
from pdops.steps.builders import GONE_WAIT_S
from pdops.steps.stopping import (alive_survivors, describe_survivor, held_ports, instance_ports, kill_command,
                                  last_stop_record, leave_gateway, read_emptiness, record_identities, stop_evidence,
                                  stop_units, verify_units_stopped)
from pdops.plans import Outcome, Step
from pdops.reads import orphans
from pdops.remote.gateway import Gateways, deadline_in
from pdops.runner import RunContext
from pdops.steps.orphans import abort_orphans


def do_check_units(ctx: RunContext, step: Step) -> Outcome:
    inst = _instance(ctx, step)
    for h, u in inst.units:
        st = ctx.pool.unit_states(h, [u])[u]
        if st.is_active:
            raise Refused(f"{u} on {h} is {st.active_state} again: its processes are not survivors now",
                          fix=f"`inv stop --instance {inst.id}` first")
    return Outcome(evidence={"units": [u for _, u in inst.units]})


def do_kill_survivors(ctx: RunContext, step: Step) -> Outcome:
    out = ctx.pool.run(step.host, kill_command(step.params["records"])).stdout
    results = json.loads(out.strip().splitlines()[-1])
    for res in results:
        ctx.say(f"  {step.host} PID {res['pid']}: {res['status']}" + (f" ({res['why']})" if res.get("why") else ""))
    killed = [f"PID {r['pid']}" for r in results if r["status"] == "killed"]
    return Outcome(evidence={"results": results},
                   verified=[f"ended {', '.join(killed) or 'nothing (already gone)'} on {step.host} by PID and "
                             "start time"])


def do_verify_gone(ctx: RunContext, step: Step) -> Outcome:
    inst = _instance(ctx, step)
    deadline = ctx.deadline(step) - 10
    while True:
        left = alive_survivors(ctx.pool, step.params["records"])
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    listeners = port_facts.parse(ctx.pool.run(inst.head.host, port_facts.command()).stdout)
    ports = [p for p in (inst.http_port, inst.bootstrap_port)
             if p and port_facts.is_listening(listeners, inst.head.data_addr, p)]
    sk = skipped_in(ctx.pool.run(inst.head.host, nv_facts.apps_command()).stdout)
    ev = {"instance": inst.id, "verified": not left and not ports, "survivors": left, "ports_open": ports,
          "gpu": f"skipped: {sk.reason}" if sk is not None else "read"}
    if left or ports:
        exc = Unverified(f"{inst.id}: the stop is still NOT verified",
                         evidence="\n".join([f"survivor: {describe_survivor(r)}" for r in left]
                                            + ([f"ports still listening: {ports}"] if ports else [])),
                         fix="inspect these by hand; pdops kills only recorded processes")
        exc.journal_evidence = ev
        raise exc
    return Outcome(evidence=ev, verified=["every recorded PID gone or reused",
                                          f"ports {', '.join(str(p) for p in (inst.http_port, inst.bootstrap_port) if p)}"
                                          " closed"],
                   unverified=[f"GPU processes: skipped: {sk.reason}"] if sk is not None else [])


def _earlier_drain_passed_empty_checks(j, instance: str, this_op: str) -> bool:
    """Did the last earlier drain of `instance` (a drain, scale or rollback step of it) pass
    empty-check-2? Read by step id and instance, never by free text."""
    drain_kinds = ("leave-gateway", "wait-empty", "empty-check-1", "empty-check-2")
    for op in reversed(j.operations()):
        if op == this_op:
            continue
        recs = j.read(op)
        plan_inst = (recs[0].get("evidence") or {}).get("instance") if recs and recs[0].get("step") == "plan" else None
        mine = [r for r in recs if r["step"].rsplit(": ", 1)[-1] in drain_kinds
                and ((r.get("evidence") or {}).get("instance", plan_inst) == instance)]
        if mine:
            return any(r["step"].endswith("empty-check-2") and r["status"] == "ok" for r in mine)
    return False


def _drain_state(ctx: RunContext, inst: Instance, step: Step) -> dict:
    """Per-instance scratch of a drain; whether its units were already stopped (inactive or
    failed, not restarting) is read once, at the instance's first step, from systemd: a resumed
    drain. With `resume=False` (undoing an add) the units are always stopped."""
    have = ctx.get(step, "drain_state", {})
    if inst.id not in have:
        states = {u: ctx.pool.unit_states(h, [u])[u] for h, u in inst.units}
        stopped = all(st.active_state in ("inactive", "failed") and st.sub_state != "auto-restart"
                      for st in states.values())
        ctx.give(step, "drain_state", {inst.id: {"already_stopped": stopped and step.params.get("resume", True)}})
    return ctx.get(step, "drain_state")[inst.id]


def _instance(ctx: RunContext, step: Step) -> Instance:
    """The instance a drain step names; for a replacement (`old`), its running process's placement."""
    if step.params.get("old"):
        return ctx.old_placement.get(step.instance)
    return ctx.placement.get(step.instance)


def routable_others(gateways: Gateways, inst: Instance, peers: list[Instance]) -> tuple[bool, dict[str, str]]:
    """(is `inst` routable on some gateway now, {peer id: "routable on <gw>" or why it is not on any})."""
    urls = {p.url.rstrip("/"): p.id for p in peers}
    mine = inst.url.rstrip("/")
    inst_routable = False
    why: dict[str, list[str]] = {p.id: [] for p in peers}
    urls.pop(mine, None)  # a peer at this very address (a replacement on its slot) is not another instance
    ok: dict[str, str] = {}
    for host, client in gateways.items():
        try:
            listed = client.list_workers()
        except PdopsError as exc:
            for p in peers:
                why[p.id].append(f"gateway {host} unreadable ({exc.message})")
            continue
        seen = set()
        for w in listed:
            u = w.url.rstrip("/")
            if u == mine and w.routable:
                inst_routable = True
            if u in urls:
                seen.add(u)
                if w.routable:
                    ok.setdefault(urls[u], f"routable on {host}")
                else:
                    why[urls[u]].append(f"{host}: " + (w.breaker_problem or f"{w.status}, "
                                                       f"{'healthy' if w.is_healthy else 'unhealthy'}"))
        for pid in set(urls.values()):
            if not any(u in seen for u, i in urls.items() if i == pid):
                why[pid].append(f"{host}: not listed")
    return inst_routable, {pid: ok.get(pid) or "; ".join(why[pid]) or "not listed" for pid in why}


def guard_serving(ctx: RunContext, step: Step, inst: Instance) -> dict:
    """Before a routable instance leaves the gateways: wait (up to the step's `guard_s`) until another
    instance of its role is routable on a gateway; refuse, nothing changed, when none gets there."""
    budget = float(step.params.get("guard_s") or 0)
    # its role's other instances as they run now: a change's placements both (one replaced in an earlier
    # wave runs at its new address, one added or surged is only in the target), by id, either address
    peers = [i for pl in (ctx.placement, ctx.old_placement) if pl is not None for i in pl.role(inst.role)
             if i.id != inst.id]
    if budget <= 0 or not peers:
        return {}
    t0 = time.monotonic()
    said = None
    while True:
        mine, others = routable_others(ctx.gateways, inst, peers)
        serving = sorted(p for p, v in others.items() if v.startswith("routable on"))
        if not mine:
            return {"guard": f"{inst.id} is not routable now: taking it out takes nothing away", "peers": others}
        if serving:
            waited = round(time.monotonic() - t0, 1)
            if waited:
                ctx.say(f"  waited {waited}s for another routable {inst.role}: {', '.join(serving)}")
            return {"guard": f"another {inst.role} routable: {', '.join(serving)}", "waited_s": waited, "peers": others}
        if time.monotonic() - t0 >= budget:
            raise Refused(f"{inst.id} is the only routable {inst.role}: no other {inst.role} became routable within "
                          f"{budget:g}s (" + "; ".join(f"{p}: {v}" for p, v in sorted(others.items())) + "); "
                          f"{inst.id} was not taken out of any gateway",
                          fix="`inv status` says why each is not routable; `inv deploy --topology <the current one>` "
                              "registers again a worker whose circuit is open; or --force to take it out anyway")
        line = "; ".join(f"{p}: {v}" for p, v in sorted(others.items()))
        if line != said:
            ctx.say(f"  {inst.id} is the only routable {inst.role} now ({line}); waiting up to {budget:g}s")
            said = line
        time.sleep(0.5)


def do_leave_gateway(ctx: RunContext, step: Step) -> Outcome:
    inst = _instance(ctx, step)
    guarded = guard_serving(ctx, step, inst)
    _drain_state(ctx, inst, step)
    if step.params.get("in_change"):  # out of service from now on: a halted change's rescue reads this
        ctx.give(step, "left_gateway", [inst.id])
    # out of every gateway's start-up list first: a gateway restart from now on does not bring it back
    left = membership.update(ctx.pool, ctx.inv, remove=[inst.id])
    # then out of every gateway, each verified to route no new request to it, before the empty checks
    removed = {h: ids for h, c in ctx.gateways.items()
               if (ids := leave_gateway(c, inst, step.params.get("worker_id"), deadline_s=step.deadline))}
    where = "the gateway" if len(ctx.gateways) == 1 else f"each of the {len(ctx.gateways)} gateways"
    if not removed:
        return Outcome("noop", {"already_removed": step.params.get("worker_id"), **guarded,
                                "gateway_list": membership.listed_ids(left)},
                       verified=[f"{inst.id} is not in the /workers of {where}"],
                       reason=f"{inst.id} is not in the /workers of {where} (already removed)")
    ids = [i for v in removed.values() for i in v]
    ctx.say(f"  {inst.id} left {where}: worker {', '.join(ids)} removed, draining (no new request routed to it)")
    return Outcome(evidence={"removed": ids, "removed_by_gateway": removed, "gateway_list": membership.listed_ids(left),
                             **guarded},
                   verified=[f"{inst.id} out of the start-up list of {where} and draining or gone in each (no new "
                             "request routed to it)"] + ([f"before it left: {guarded['guard']}"]
                                                         if guarded.get("guard") else []))


def _resumed_without_checks(ctx: RunContext, step: Step, inst: Instance) -> Outcome | None:
    """For an instance stopped before this drain: the checks happened in an earlier drain, or it fails."""
    if not _drain_state(ctx, inst, step)["already_stopped"]:
        return None
    if not _earlier_drain_passed_empty_checks(ctx.journal, inst.id, ctx.op):
        raise DrainFailed(f"{inst.id}'s units are already stopped but no drain of it passed the empty checks: its "
                          "in-flight work cannot be accounted for",
                          fix="read the journal; use `inv stop` to verify the stop and record it")
    return Outcome.noop(f"{inst.id} was stopped by an earlier drain that passed both empty checks")


def do_wait_empty(ctx: RunContext, step: Step) -> Outcome:
    inst = _instance(ctx, step)
    resumed = _resumed_without_checks(ctx, step, inst)
    if resumed:
        return resumed
    deadline = ctx.deadline(step)
    last, t0 = "", time.monotonic()
    ended: dict[str, list[str]] = {}
    next_orphan_look = t0 + orphans.GRACE_S
    while True:
        r = read_emptiness(ctx.pool, inst)
        if r.empty:
            return Outcome(evidence={"waited_s": round(time.monotonic() - t0, 2),
                                     **({"orphans_ended": ended} if ended else {})},
                           verified=[f"{inst.id}: ended {len(v)} orphaned half(s) whose decode side is gone, the only "
                                     f"work it still held (lost, not replayed): {', '.join(v)}"
                                     for v in ended.values()])
        if inst.role == "prefill" and r.open_rids and time.monotonic() >= next_orphan_look:
            # what it still holds may be halves no decode will ever take: end those, named
            next_orphan_look = time.monotonic() + orphans.GRACE_S
            ended.setdefault(inst.id, []).extend(_end_orphans_if_all_open_are(ctx, inst, r.open_rids))
        desc = r.describe()
        if desc != last:
            ctx.say(f"  waiting ({time.monotonic() - t0:.0f}s): {desc}")
            last = desc
        if time.monotonic() + 0.5 > deadline:
            if step.params.get("force_after"):
                ctx.say(f"  deadline passed; --force-after: stopping with {len(r.open_rids)} request(s) open "
                        "(recorded in the journal as accepted loss)")
                ctx.give(step, "accepted_loss", {inst.id: list(r.open_rids)})
                return Outcome("accepted-loss", {"open_rids": r.open_rids, "reading": desc},
                               unverified=[f"{inst.id}: {len(r.open_rids)} request(s) still open at the deadline "
                                           "(--force-after: accepted loss)"])
            exc = DrainFailed(f"{inst.id} still has work after {step.deadline:g}s; the instance was NOT stopped "
                              f"(it is out of the gateway; re-add it with `inv rollback` or retry the drain)",
                              evidence="open request IDs: " + (", ".join(r.open_rids) or "none") + f"\n{desc}",
                              fix="wait and run the drain again, or --force-after to accept the loss")
            exc.journal_evidence = {"open_rids": r.open_rids, "reading": desc}
            raise exc
        time.sleep(0.5)


def _end_orphans_if_all_open_are(ctx: RunContext, inst: Instance, open_rids: list[str]) -> list[str]:
    """When every request the prefill holds is an orphaned half (pdops.reads.orphans), end them by rid."""
    try:
        found = orphans.read(ctx.pool, ctx.placement, ctx.inv, prefills=[inst.id]).orphans.get(inst.id, [])
    except PdopsError as exc:  # a reading, not the drain: the wait goes on and its own deadline decides
        ctx.say(f"  {inst.id}: orphaned halves not read: {exc.message}")
        return []
    if not found or {o.rid for o in found} != set(open_rids):
        return []
    done, left = abort_orphans(inst, found, set(open_rids))
    ctx.say(f"  {inst.id}: all it still holds are orphaned halves (no decode holds them): ended {', '.join(done)}"
            + (f"; not ended: {'; '.join(left)}" if left else ""))
    return done


def do_empty_check(ctx: RunContext, step: Step) -> Outcome:
    inst = _instance(ctx, step)
    resumed = _resumed_without_checks(ctx, step, inst)
    if resumed:
        return resumed
    n, pause = step.params["n"], step.params["pause"]
    if inst.id in ctx.get(step, "accepted_loss", {}):
        return Outcome.noop(f"--force-after: {inst.id} is stopped with its open work at the deadline accepted as "
                            "lost (named by wait-empty); not checked for emptiness")
    time.sleep(pause)
    r = read_emptiness(ctx.pool, inst)
    if not r.empty:
        exc = DrainFailed(f"{inst.id}: empty check {n}" + (f" ({pause:g}s after check 1)" if n == 2 else "")
                          + f" found work: {r.describe()}; the instance was NOT stopped and stays out of the gateway",
                          fix="something still sends it requests directly (not through the gateway); find it, then "
                              "run the drain again")
        exc.journal_evidence = {"reading": r.describe(), "open_rids": r.open_rids}
        raise exc
    ctx.say(f"  empty-check {n} passed" + (f" ({pause:g}s later)" if n == 2 else ""))
    return Outcome(evidence={"reading": "empty", "interval_s": pause},
                   verified=[f"no open request ID and all queues 0, twice, {pause:g}s apart ({inst.id})"] if n == 2 else [])


def do_record_identity(ctx: RunContext, step: Step) -> Outcome:
    inst = _instance(ctx, step)
    st = _drain_state(ctx, inst, step)
    if st["already_stopped"]:
        return Outcome.noop(f"{inst.id}'s units are already inactive")
    idents = record_identities(ctx.pool, inst)
    # the ports its verified stop must find closed: every one of the instance's, or (an instance that
    # may never have listened: `check_ports: held`) those its own processes listen on now
    ports = held_ports(ctx.pool, inst, idents) if step.params.get("check_ports") == "held" else \
        instance_ports(inst) if step.params.get("check_ports", True) else []
    ctx.give(step, "drain_state", {inst.id: {**st, "idents": idents, "ports": ports}})
    return Outcome(evidence={**{u: {"main_pid": i.main_pid, "cgroup": i.control_group, "pids": sorted(i.tree)}
                                for u, i in idents.items()}, "ports_to_close": ports})


def do_stop(ctx: RunContext, step: Step) -> Outcome:
    inst = _instance(ctx, step)
    st = _drain_state(ctx, inst, step)
    if st["already_stopped"]:
        return Outcome.noop(f"{inst.id}'s units are already inactive")
    seconds = stop_units(ctx.pool, inst, ctx.inv.stop_timeout_s, ctx.say)
    ctx.give(step, "drain_state", {inst.id: {**st, "seconds": seconds}})
    return Outcome(evidence={"seconds": seconds, "units": [u for _, u in inst.units]})


def do_verify_stop(ctx: RunContext, step: Step) -> Outcome:
    inst = _instance(ctx, step)
    st = _drain_state(ctx, inst, step)
    if st["already_stopped"]:
        out = _verify_resumed_stop(ctx, inst)
    else:
        res = verify_units_stopped(ctx.pool, inst, st["idents"], st["seconds"], ports=st.get("ports"), say=ctx.say)
        verified = [f"cgroup empty, every recorded PID gone or reused, ports closed ({inst.id})"]
        if res.strays:
            verified.append(f"stray process(es) found in the cgroup and stopped with it: {'; '.join(res.strays)}")
        if res.sigkill:
            verified.append("needed systemd's SIGKILL after TimeoutStopSec")
        if res.shm_removed:
            verified.append(f"left in /dev/shm by {inst.id}'s processes, mapped by no process now, removed: "
                            f"{', '.join(res.shm_removed)}")
        gone = [f"{e.host}:{e.runtime_dir}" for e in res.evidence if e.runtime_dir.endswith("removed by systemd")]
        if gone:
            verified.append(f"{inst.id}'s runtime directory (its TMPDIR: the engine's IPC sockets and scratch "
                            f"files) {', '.join(gone)}")
        unverified = sorted({f"GPU processes: {e.gpu}" for e in res.evidence if e.gpu.startswith("skipped")})
        unverified += [f"left in /dev/shm by {inst.id}'s processes, kept: {k}" for k in res.shm_kept]
        unverified += [f"{e.host}:{e.runtime_dir}" for e in res.evidence
                       if e.runtime_dir and not e.runtime_dir.endswith("removed by systemd")]
        out = Outcome(evidence=stop_evidence(inst, res), verified=verified, unverified=unverified)
    if step.params.get("gateway_gone") and ctx.gateways is not None:
        # right after the stop smg may still list the removed worker as draining: the drain ends when
        # each gateway's view is the revision's (an `inv status` at once then counts what runs)
        try:
            ctx.gateways.wait_url_gone(inst.url, deadline_in(GONE_WAIT_S))
            out.verified.append(f"no gateway lists a worker at {inst.url} any more ({inst.id})")
        except PdopsError as exc:
            out.unverified.append(f"a gateway still lists a worker of {inst.id} at {inst.url}: {exc.message}")
    if step.params.get("in_change"):
        ctx.give(step, "replaced_out" if step.params.get("old") else "drained", [inst.id])
    return out


def _verify_resumed_stop(ctx: RunContext, inst: Instance) -> Outcome:
    """The stop happened in an earlier run: verify what can still be read now."""
    pool = ctx.pool
    for h, u in inst.units:
        if pool.unit_states(h, [u])[u].is_active:
            raise Unverified(f"{u} on {h} is active again")
    listeners = port_facts.parse(pool.run(inst.head.host, port_facts.command()).stdout)
    open_ports = [p for p in (inst.http_port, inst.bootstrap_port)
                  if p and port_facts.is_listening(listeners, inst.head.data_addr, p)]
    if open_ports:
        raise Unverified(f"{inst.id} is stopped but ports {open_ports} are listening",
                         fix=f"`inv stop --instance {inst.id} --kill-survivors` if the last stop listed survivors")
    last = last_stop_record(ctx.journal, inst.id, failed_only=True)
    recorded = (last or {}).get("evidence", {}).get("survivors") or []
    left = alive_survivors(pool, recorded) if recorded else []
    if left:
        raise Unverified(f"{inst.id} is stopped but processes recorded by its last stop still run",
                         evidence="\n".join(describe_survivor(r) for r in left),
                         fix=f"`inv stop --instance {inst.id} --kill-survivors`")
    return Outcome(evidence={"instance": inst.id, "verified": True, "survivors": [], "resumed": True},
                   verified=["units inactive and ports closed (PIDs were recorded by the earlier run)"
                             + (f"; the {len(recorded)} survivor(s) the last unverified stop recorded are gone now"
                                if recorded else "")])
