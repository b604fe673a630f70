"""Serving, carried out: connect, preflight, render and deliver, the gateways and the admission
layer, start each instance health-gated, canary every pair, register, close the circuit breakers,
the gateway's start-up list, the front door, verify what runs and take back what a failed deploy
registered. Every operation that starts or restores an engine runs these (the builders are
pdops.steps.builders)."""

from __future__ import annotations

import json
import time

from pdops.errors import DeployFailed, PdopsError, Unverified
from pdops.facts import q
from pdops.facts.engine import failed_session_wait_s
from pdops.facts.gateway import BLOCKING, DRAINING
from pdops.model import membership
from pdops.model.admission import server_state_command, standby_server
from pdops.model.placement import Instance
from pdops.model.render import GATEWAY_UNIT, STANDBY_UNIT, write_build
from pdops.plans import Outcome, Step
from pdops.steps.preflight import PASS, preflight_gate
from pdops.remote.gateway import deadline_in
from pdops.remote.haproxy import gateway_stats, runtime, set_front_door, wait_gateways_up
from pdops.runner import RunContext
from pdops.steps.actions import (deliver, preflight_unverified, register_workers, running_evidence, start_admission,
                                 start_gateway, start_instance, undo_registrations, wait_healthy)
from pdops.steps.canary import canary_pairs


def _inst(ctx: RunContext, step: Step) -> Instance:
    return ctx.placement.get(step.instance)


def do_connect(ctx: RunContext, step: Step) -> Outcome:
    return Outcome(evidence=ctx.pool.connect_all(step.params["hosts"]))


def do_preflight(ctx: RunContext, step: Step) -> Outcome:
    skip = set(step.params["skip"])
    report, ev = preflight_gate(ctx.inv, step.params["placement"], ctx.pool, skip, ctx.say,
                                previous=step.params["previous"])

    passed = sum(r.status == PASS for r in report.results)
    pairing = "" if report.matrix is None or report.matrix.skipped else "; P x D pairing matrix: every cell ok"
    return Outcome(evidence=ev, verified=[f"preflight: {passed} check(s) passed on {len(report.hosts)} host(s), "
                                          f"none failed{pairing}"],
                   unverified=preflight_unverified(report, skip))


def do_render(ctx: RunContext, step: Step) -> Outcome:
    build = ctx.record.path / "builds" / ctx.op
    write_build(step.params["files"], build, {"op": ctx.op, **step.params["meta"]})
    ctx.give(step, "build", build)
    return Outcome(evidence={"build": str(build), "files": len(step.params["files"])})


def do_deliver(ctx: RunContext, step: Step) -> Outcome:
    if not step.params["files"]:  # a change whose every file goes out with its own wave
        return Outcome.noop("no file to deliver before the waves: each replaced instance's files go out in its wave")
    ctx.say(f"  delivering {len(step.params['files'])} rendered files with Ansible")
    return Outcome(evidence=deliver(ctx.inv, step.params["placement"], step.params["files"], ctx.get(step, "build"),
                                    None, ctx.say))


def do_gateway(ctx: RunContext, step: Step) -> Outcome:
    """Start one gateway; with `wait_for` ({instance: url}), until it lists each healthy and ready."""

    t0 = time.monotonic()
    node = ctx.inv.gateway.node(step.params["gateway"])
    if step.params.get("unlist"):
        membership.update_one(ctx.pool, node.host, remove=step.params["unlist"])
    ev = start_gateway(ctx.inv, ctx.pool, ctx.gateways, node, ctx.say, restart=step.params["restart"],
                       deadline_s=step.deadline, clear_list=step.params.get("clear_list"))
    ctx.give(step, "started", [f"{node.host}:{GATEWAY_UNIT}"])
    wait_for = step.params.get("wait_for") or {}
    deadline = deadline_in(max(step.deadline - (time.monotonic() - t0), 5))
    for url in wait_for.values():
        ctx.gateways.client(node.host).wait_worker_healthy(url, deadline)
    listed = ([f"the gateway lists {', '.join(wait_for)} healthy and ready (registered from its start-up list)"]
              if wait_for else [])
    return Outcome(evidence={**ev, "listed": sorted(wait_for)},
                   verified=[f"gateway {GATEWAY_UNIT} on {node.host} active and answering {node.url}/health"] + listed)


def do_front_door_ready(ctx: RunContext, step: Step) -> Outcome:
    adm = ctx.inv.admission
    seen = {}
    for a in adm.hosts:
        stats = wait_gateways_up(ctx.pool, a, ctx.inv.gateway.hosts, max(ctx.deadline(step) - time.monotonic(), 5))
        seen[a] = {h: vars(s) for h, s in stats.items()}
    return Outcome(evidence=seen, verified=[f"the admission layer on {a} sees {', '.join(ctx.inv.gateway.hosts)} UP"
                                            for a in adm.hosts])


def do_front_door_set(ctx: RunContext, step: Step) -> Outcome:
    """HAProxy's gateway servers set as the step says, on every admission host (a fenced rollout's
    steps and rescue; a repair of a front door a stopped change left drained)."""

    adms = step.params["admission_hosts"]
    if step.params.get("only_if_fenced") and not ctx.get(step, "fence", None):
        return Outcome.noop("the fence step did not run: the front door was never changed")
    done = set_front_door(ctx.pool, adms, weights=step.params.get("weights", {}), drain=step.params.get("drain", ()),
                          ready=step.params.get("ready", ()))
    up = list(step.params.get("ready", ()))
    for a in adms if up else ():
        wait_gateways_up(ctx.pool, a, up, max(ctx.deadline(step) - time.monotonic(), 5))
    retired = retire_standbys(ctx, adms, step.params.get("standbys", ()))
    return Outcome(evidence={"set": done, "standbys_retired": retired}, verified=[f"HAProxy: {'; '.join(done)}"]
                   + ([f"{', '.join(up)} UP"] if up else [])
                   + [f"the stand-in of gateway {h} drained to 0 sessions, MAINT, {STANDBY_UNIT} stopped"
                      for h in retired])


def retire_standbys(ctx: RunContext, adms, hosts) -> list[str]:
    """A stand-in a restart left in service (its gateway serves again, UP above): drained in HAProxy to
    0 sessions, MAINT as rendered, its transient unit stopped by name."""

    out = []
    for h in hosts:
        name = standby_server(h)
        for a in adms:
            runtime(ctx.pool, a, server_state_command(name, "drain"), "drain the stand-in's server")
        deadline = time.monotonic() + float(ctx.inv.drain_budget_s) + 30
        def carrying() -> int:
            return sum(st.sessions for a in adms if (st := gateway_stats(ctx.pool, a).get(name)) is not None)

        while carrying():
            if time.monotonic() > deadline:
                raise Unverified(f"the stand-in of gateway {h} still carries requests in HAProxy at the deadline")
            time.sleep(0.25)
        for a in adms:
            runtime(ctx.pool, a, server_state_command(name, "maint"), "put the stand-in's server in MAINT")
        ctx.pool.run(h, f"systemctl stop {q(STANDBY_UNIT)} || true", timeout=float(ctx.inv.drain_budget_s) + 60)
        ctx.say(f"  the stand-in of gateway {h} retired: drained, MAINT, {STANDBY_UNIT} stopped")
        out.append(h)
    return out


def do_admission(ctx: RunContext, step: Step) -> Outcome:
    ev = start_admission(ctx.inv, ctx.pool, ctx.say, restart=step.params["restart"], deadline_s=step.deadline,
                         host=step.params.get("host"))
    return Outcome(evidence=ev, verified=[f"admission layer answering {ev['url']}"])


def do_start(ctx: RunContext, step: Step) -> Outcome:
    inst = _inst(ctx, step)
    ctx.give(step, "started_instances", {inst.id: inst})
    ctx.give(step, "started", [f"{h}:{u}" for h, u in inst.units])
    try:
        ev = start_instance(ctx.inv, ctx.pool, inst, step.deadline, ctx.say, step.params["restart"])
    except PdopsError as exc:
        raise DeployFailed(f"{inst.id} did not start: {exc.message}", evidence=exc.evidence,
                           fix="nothing was registered with the gateway; read the evidence, fix the cause and "
                               "deploy again") from None
    ctx.give(step, "healthy", {inst.id})
    ctx.give(step, "main_pids", {inst.id: ev["main_pids"]})
    owned = not ev["port_owner"].startswith(f"port {inst.http_port} on")  # port_owner: "NOT verified ..." then
    return Outcome(evidence=ev, verified=[f"{inst.id} active and healthy on its own /health (MainPID "
                                          f"{', '.join(map(str, ev['main_pids'].values()))})"]
                   + ([f"{inst.id}: {ev['port_owner']}"] if owned else []),
                   unverified=[] if owned else [f"{inst.id}: {ev['port_owner']}"])


def serving(ctx: RunContext, step: Step, iid: str) -> Instance:
    """The instance as it serves at this point of the operation: a replaced one that is not started
    yet still runs its old process (old ports; a prefill's old bootstrap port)."""
    if iid in ctx.replacing and iid not in ctx.get(step, "started_instances", {}):
        return ctx.old_placement.get(iid)
    return ctx.placement.get(iid)


def do_wait_healthy(ctx: RunContext, step: Step) -> Outcome:
    inst = _inst(ctx, step)
    ev = wait_healthy(ctx.pool, inst, step.deadline, ctx.say)
    return Outcome(evidence=ev, verified=[f"{inst.id} healthy on its own /health"])


def do_canary(ctx: RunContext, step: Step) -> Outcome:
    pairs = [(serving(ctx, step, p), serving(ctx, step, d)) for p, d in step.params["pairs"]]
    ev = canary_pairs(pairs, ctx.say, retry_once=step.params["retry_once"], deadline_s=step.deadline,
                      session_wait_s=failed_session_wait_s(ctx.inv.profile.env))
    return Outcome(evidence=ev, verified=[f"a canary generation through each of {len(pairs)} prefill x decode "
                                          f"pair(s): {', '.join(f'{p.id} x {d.id}' for p, d in pairs)}"])


def do_register(ctx: RunContext, step: Step) -> Outcome:
    inst = _inst(ctx, step)
    ctx.give(step, "posted", {inst.id})
    try:
        workers = register_workers(ctx.gateways.subset(step.params.get("gateways")), inst, ctx.say, step.deadline)
    except PdopsError as exc:
        raise DeployFailed(f"{inst.id} not registered healthy: {exc.message}", evidence=exc.evidence,
                           fix="read the instance's journal (`journalctl -u <unit>` on its host) and the "
                               "gateway's; fix the cause and deploy again") from None
    # the revision records the first gateway's worker id (each gateway has its own ids; a drain finds
    # the worker in each by its URL)
    wids = {h: w.id for h, w in workers.items()}
    wid = next(wids[h] for h in ctx.inv.gateway.hosts if h in wids)
    ctx.give(step, "workers", {inst.id: wid})
    where = "the gateway's /workers" if len(wids) == 1 else f"the /workers of each of the {len(wids)} gateways"
    breakers = {h: w.breaker.state for h, w in workers.items() if w.breaker is not None}
    closed = bool(breakers) and set(breakers.values()) == {"closed"}
    return Outcome(evidence={"worker_id": wid, "worker_ids": wids, "breakers": breakers},
                   verified=[f"{inst.id} registered (worker {', '.join(wids.values())}), listed healthy and ready "
                             f"by {where}" + (", its circuit breaker closed there (smg_worker_cb_state 0)"
                                              if closed else "")],
                   unverified=[f"{inst.id}: {w.breaker_unknown} on gateway {h}" for h, w in workers.items()
                               if w.breaker_unknown])


def do_close_breakers(ctx: RunContext, step: Step) -> Outcome:
    """Each gateway routes to every instance of the step with its breaker closed: a worker listed healthy
    and ready whose breaker is open or half-open (its engine, or its PD peer, failed requests before a
    restart) is registered again; one that is not healthy is its engine's matter, named, not verified."""

    insts = [ctx.placement.get(i) for i in step.params["instances"]]
    deadline = ctx.deadline(step)
    reset: dict[str, list[str]] = {}
    states: dict[str, dict[str, str]] = {}
    not_routable: list[str] = []
    still_open: list[str] = []
    for host, client in ctx.gateways.items():
        by_url = {}
        for w in client.list_workers():
            if w.status != DRAINING:
                by_url[w.url.rstrip("/")] = w
        for inst in insts:
            w = by_url.get(inst.url.rstrip("/"))
            if w is not None and w.is_healthy and w.status == "ready" and w.breaker is not None \
                    and w.breaker.state in BLOCKING:
                ctx.say(f"  {inst.id} on gateway {host}: {w.breaker_problem}; registering it again")
                reset.setdefault(host, []).append(f"{inst.id} ({w.breaker_problem})")
                w = client.reregister(w, deadline)  # its start-up list entry is unchanged (same URL, role, port)
            states.setdefault(host, {})[inst.id] = (w.breaker.state if w is not None and w.breaker is not None
                                                    else "not listed" if w is None else "not read")
            if w is not None and w.is_healthy and w.status == "ready" and not w.routable:
                still_open.append(f"{inst.id} on gateway {host}: {w.describe()}")
            elif w is not None and w.breaker_unknown:
                not_routable.append(f"{inst.id} on gateway {host}: {w.breaker_unknown}")
            elif w is None or not w.routable:
                # not this step's to fix: an engine the operation did not start (observed down, left as it
                # was), or one the gateway does not list; said, never counted as verified
                not_routable.append(f"{inst.id} on gateway {host}: " + ("not listed" if w is None else w.describe()))
    ev = {"breakers": states, "registered_again": reset, "not_routable": not_routable}
    if still_open:
        exc = Unverified("a circuit breaker is still not closed after a new registration: " + "; ".join(still_open),
                         fix="read the gateway's log (`journalctl -u pdops-gateway`); `inv status` says what it "
                             "routes to", evidence=json.dumps(ev))
        exc.journal_evidence = ev
        raise exc
    ok = [i.id for i in insts if not any(x.startswith(f"{i.id} on gateway ") for x in not_routable)]
    where = "the gateway" if len(states) == 1 else f"each of the {len(states)} gateways"
    return Outcome(evidence=ev, verified=[f"{where} routes to {', '.join(ok) or 'none'}: healthy, ready, circuit "
                                          "breaker closed (smg_worker_cb_state 0)"
                                          + (f"; registered again to close its breaker: "
                                             f"{'; '.join(f'{h}: ' + ', '.join(v) for h, v in reset.items())}"
                                             if reset else "")],
                   unverified=[f"not routable (not this operation's to restart): {x}" for x in not_routable])


def do_gateway_list(ctx: RunContext, step: Step) -> Outcome:
    """One update of the start-up list for a registration group (each registered and ready by now)."""
    add = [ctx.placement.get(i) for i in step.params["instances"]]
    workers = ctx.get(step, "workers")
    missing = [i.id for i in add if i.id not in workers]
    if missing:
        raise Unverified(f"not registered, so not put in the gateway's start-up list: {', '.join(missing)}")
    listed = membership.listed_ids(membership.update(ctx.pool, ctx.inv, add=add, hosts=step.params.get("gateways")))
    return Outcome(evidence={"gateway_list": listed},
                   verified=[f"{', '.join(i.id for i in add)} in the gateway's start-up list"])


def do_verify_running(ctx: RunContext, step: Step) -> Outcome:
    ev = running_evidence(ctx.pool, ctx.inv, step.params["placement"], step.params["files"])
    ctx.give(step, "running", ev)
    return Outcome(evidence={"units": ev}, verified=[f"{len(ev)} unit(s) active, each MainPID started from this "
                                                     "revision's files (config id noted by its launch script)"])


def do_undo_register(ctx: RunContext, step: Step) -> Outcome:
    workers = ctx.get(step, "workers", {})
    posted = ctx.get(step, "posted", set())
    if not posted:
        return Outcome.noop("this deploy registered nothing")
    fresh = step.params["fresh"]
    pl = ctx.placement
    bad = [pl.get(i) for i in posted if i not in workers]
    undone = undo_registrations(ctx.gateways, pl, workers, bad, fresh, ctx.say)
    # what the gateway no longer serves leaves its start-up list too (a restart must not revive it)
    drop = [i.id for i in bad] + ([i for i in workers] if fresh else [])
    if drop:
        try:
            undone["gateway_list"] = membership.listed_ids(membership.update(ctx.pool, ctx.inv, remove=drop))
        except PdopsError as e:
            undone["left"].append(f"gateway start-up list not updated: {e.message}")
    if undone["left"]:
        exc = Unverified("the deploy's registrations were not all undone", evidence="\n".join(undone["left"]))
        exc.journal_evidence = undone
        raise exc
    return Outcome(evidence=undone)
