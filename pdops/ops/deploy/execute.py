"""Carrying a deploy out: the executors of its step kinds (shared with a change), the record of a
deploy and of a repair, the walk under the lock, and `inv deploy` whole (operate_deploy)."""

from __future__ import annotations

import json
import time

from pdops.model import membership
from pdops.errors import DeployFailed, PdopsError, Refused, Unverified
from pdops.facts import q
from pdops.facts.gateway import BLOCKING, DRAINING
from pdops.model.admission import server_state_command, standby_server
from pdops.remote.gateway import Gateways, deadline_in
from pdops.remote.haproxy import gateway_stats, runtime, set_front_door, wait_gateways_up
from pdops.remote.hosts import HostPool
from pdops.model.placement import Instance, last_bootstrap_ports
from pdops.model.render import GATEWAY_UNIT, STANDBY_UNIT, manifest, snapshot_of, write_build
from pdops.plans import Outcome, Step
from pdops.runner import RunContext, Say

from pdops.steps.canary import canary_pairs
from pdops.steps.actions import (configs_of, deliver, processes_of, preflight_unverified, register_workers,
                                  running_evidence, start_admission, start_gateway, start_instance, undo_registrations,
                                  wait_healthy)
from pdops.ops.deploy.plan import DeployPlan, plan_reconcile
from pdops.ops.operate import operate, run_operation
from pdops.ops.scale import execute_scale
from pdops.reads.observe import observe
from pdops.remote.hosts import connections
from pdops.facts.engine import failed_session_wait_s
from pdops.reads.preflight import PASS, preflight_gate


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


def do_record_deploy(ctx: RunContext, step: Step) -> Outcome:
    pl, files, workers = step.params["placement"], step.params["files"], ctx.get(step, "workers")
    running, main_pids = ctx.get(step, "running"), ctx.get(step, "main_pids", {})
    instances = {i.id: {"role": i.role, "hosts": list(i.hosts), "units": [list(u) for u in i.units],
                        "worker_id": workers[i.id], "url": i.url,
                        "main_pids": main_pids.get(i.id)} for i in pl.instances}
    rev = ctx.record.write_revision(topology=str(pl.topology), inventory_hash=ctx.inv.digest,
                                   placement=pl.to_dict(), manifest=manifest(files), instances=instances,
                                   outcome="deployed", op_id=ctx.op,
                                   extra={"gateways": ctx.inv.gateway.urls, "build": str(ctx.get(step, "build")),
                                          "configs": configs_of(running), **processes_of(running, ctx.inv),
                                          "last_bootstrap": last_bootstrap_ports({}, pl)},
                                   snapshot=snapshot_of(ctx.inv, files))
    ctx.record.set_current(rev.number)
    ctx.verdict["revision"] = rev.number
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
    ctx.verdict["revision"] = rev.number
    return Outcome(evidence={"revision": rev.number, "main_pids": seen, "inventory_hash": ctx.inv.digest},
                   verified=[f"revision {rev.number} records the repair of revision {live.number}: every unit "
                             "active, MainPIDs as read from systemd now"])


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


# the executors of the step kinds made here (scale, rollback, repair and probe reuse the kinds)


def execute_deploy(plan: DeployPlan, say: Say = print, *, pool: HostPool, gateways: Gateways,
                   op: str | None = None) -> dict:
    """Walk a deploy plan under the cluster lock (pdops.ops.operate.run_operation; `op`: an operation
    whose lock the caller holds, `inv sweep` between its rows). Returns the verdict: the new revision,
    what was verified and what could not be (skipped checks never count as verified). Raises with a
    verdict on failure. `pool` and `gateway` are the operation's connections, opened by the caller
    (pdops.remote.hosts.connections)."""
    if plan.change is not None:  # the deploy is a rolling change of the live cluster: the change's walk
        raise PdopsError("a deploy plan whose `change` is a rolling change was given to execute_deploy: nothing "
                         "was run", fix="walk plan.change with pdops.ops.scale.execute_scale (as `inv deploy` does)")
    if plan.record is None:
        raise PdopsError("a deploy plan without the record it was read from (plan it with plan_deploy): nothing was run",
                         fix="a pdops bug to report")
    if plan.live is not None and not plan.steps:
        raise Refused(f"revision {plan.live.number} is live with these files: what to repair is decided from "
                      "observation", fix="plan it with plan_reconcile (as `inv deploy` does)")
    return run_operation(plan.plan, plan.inv, plan.record, say, pool=pool, gateways=gateways, kind="deploy",
                         basis=plan.basis, context={"placement": plan.placement}, failed=_deploy_failed, op=op,
                         lock_held=op is not None)


def _deploy_failed(ctx: RunContext, exc: PdopsError) -> tuple[str, dict]:
    """The failure verdict (after the plan's rescue ran): what runs, what is current."""
    started = ctx.output("started", [])
    current = ctx.record.current()
    exc.message += (f"\n  current revision unchanged: {current if current is not None else 'none'}; "
                    f"units started by this deploy (left for inspection): {', '.join(started) or 'nothing'}")
    return "failed", {"left_running": started, "current": current, "completed": ctx.done}


def operate_deploy(inv, record, make_plan, *, dry_run: bool, say: Say = print) -> tuple[str, object, dict | None]:
    """`inv deploy`, the whole of it (the CLI prints what it returns): `make_plan(seen)` -> a DeployPlan.
    A change of the live cluster (topology, inventory, files) is planned and walked as any change
    (pdops.ops.operate); a first deploy is walked as planned; a deploy of the live revision decides what to
    repair from what runs now (plan_reconcile), and processes found running other files are replaced as a
    change. Returns (how: "change", "repair" or "deploy"; the plan printed; its verdict, None when nothing was
    walked)."""
    plan = make_plan(None)
    if plan.change is not None:  # a rolling change: planned again from what runs now
        change, v = operate(inv, record, lambda seen: make_plan(seen).change,
                            lambda p, conns: execute_scale(p, record, **conns), dry_run=dry_run, first=plan.change,
                            say=say)
        return "change", change, v
    if plan.live is None:
        say(plan.render())
        if dry_run:
            return "deploy", plan, None
        with connections(inv) as conns:
            return "deploy", plan, execute_deploy(plan, say, **conns)
    with connections(inv) as conns:  # the live topology and files: decide from what runs now
        plan = plan_reconcile(plan, observe(plan.inv, plan.live, conns["pool"], conns["gateways"]))
        say(plan.render())
        if plan.change is not None:  # processes that run other files: replaced, rolling
            return "change", plan.change, None if dry_run else execute_scale(plan.change, record, **conns)
        if dry_run or plan.noop:
            return "repair", plan, None
        return "repair", plan, execute_deploy(plan, say, **conns)
