"""Carrying a change out: the executors of its own step kinds and the walk under the lock (the
revision it records: pdops.ops.scale.revision)."""

from __future__ import annotations

import time

from pdops.errors import DeployFailed, PdopsError, Refused, ScaleFailed, Unreachable, Unverified
from pdops.remote.gateway import GatewayClient, Gateways, deadline_in
from pdops.remote.haproxy import gateway_stats, require_another_up, runtime, wait_gateways_up
from pdops.remote.hosts import HostPool
from pdops.model.commands import gateway_grace_s
from pdops.model.render import BIN_DIR, ENV_DIR, GATEWAY_UNIT, SLICE_UNIT, STANDBY_UNIT, UNIT_DIR
from pdops.plans import Outcome, Step
from pdops.runner import RunContext, Say
from pdops.record.local import StateDir
from pdops.ops.operate import run_operation

from pdops.ops.scale.change import ChangeFacts, ScalePlan, union_placement
from pdops.ops.scale.revision import record_change
from pdops.facts import q
from pdops.model.admission import UNIT, server_state_command, standby_server
from pdops.steps.actions import deliver, register_one
from pdops.model import membership


def do_gateway_restart(ctx: RunContext, step: Step) -> Outcome:
    """Restart one gateway on its new files; every instance of the target back in its /workers,
    routable (healthy, ready, circuit closed). Behind the admission layer no health check is ever
    paused: with other gateways, its server is set to `drain` (no new request; those on it finish)
    and back to `ready` after; alone, a stand-in smg is started beside it first (make before
    break: :func:`standby_cover`)."""

    inv, pool = ctx.inv, ctx.pool
    node = inv.gateway.node(step.params["gateway"])
    client = ctx.gateways.client(node.host)
    old_pid = pool.unit_states(node.host, [GATEWAY_UNIT])[GATEWAY_UNIT].main_pid
    adm_hosts = list(step.params.get("admission_hosts") or [])
    where = ", ".join(adm_hosts)
    others = [h for h in inv.gateway.hosts if h != node.host]
    insts = [ctx.placement.get(i) for i in step.params["instances"]]
    up: list[str] = []
    cover = None
    t0 = time.monotonic()
    if adm_hosts and others:
        up = require_another_up(pool, adm_hosts, others, node.host, "taking out")
    elif adm_hosts:
        cover = standby_cover(ctx, node, adm_hosts, insts, deadline_in(step.deadline))

    def out_of_service() -> None:
        for a in adm_hosts:
            runtime(pool, a, server_state_command(node.host, "drain"), "drain the gateway's server")
        wait_sessions_zero(pool, adm_hosts, node.host, deadline_in(float(inv.drain_budget_s) + 30))

    def back() -> None:
        for a in adm_hosts:
            runtime(pool, a, server_state_command(node.host, "ready"), "set the gateway's server ready")

    try:
        if adm_hosts:
            out_of_service()
        pool.run(node.host, f"systemctl restart {q(GATEWAY_UNIT)}", timeout=step.deadline)
        restarted_s = round(time.monotonic() - t0, 2)
        st = pool.unit_states(node.host, [GATEWAY_UNIT])[GATEWAY_UNIT]
        if st.active_state != "active" or st.main_pid == old_pid:
            raise Unverified(f"gateway {GATEWAY_UNIT} on {node.host} is {st.active_state}/{st.sub_state} (MainPID "
                             f"{st.main_pid}, was {old_pid}) after the restart",
                             evidence=pool.journal_tail(node.host, GATEWAY_UNIT))
        deadline = deadline_in(max(step.deadline - (time.monotonic() - t0), 30))
        for inst in insts:
            client.wait_worker_healthy(inst.url, deadline)
        if adm_hosts:
            back()
            for a in adm_hosts:  # in the front door again before the next gateway (or the stand-in) leaves it
                wait_gateways_up(pool, a, [node.host], 30)
    except BaseException:
        try:  # back whatever the restart did: HAProxy's own check judges a gateway really down
            if adm_hosts:
                back()
        except PdopsError as exc:
            ctx.say(f"  also: {exc.message}; fix: {exc.fix}")
        if cover is not None:
            cover.keep_or_retire(ctx)
        raise
    if cover is not None:
        cover.retire(ctx)
    ctx.say(f"  gateway{'' if not others else ' on ' + node.host} restarted in {restarted_s}s (MainPID {old_pid} -> "
            f"{st.main_pid}); {len(insts)} worker(s) routable again")
    held = []
    if adm_hosts and others:
        held = [f"the admission layer on {where} sent no new request to {node.host} during its restart (server "
                f"drained to 0 sessions, then ready and UP: {', '.join(up)} UP meanwhile)"]
    elif cover is not None:
        held = [f"the admission layer on {where} sent every request to a stand-in smg ({cover.node.url}, "
                f"transient unit {STANDBY_UNIT}) while the gateway restarted: the stand-in was admitted only once "
                "its /readiness answered 200 and its /workers listed every instance routable; the gateway was "
                "drained to 0 sessions before its restart and UP again before the stand-in was drained to 0 "
                "sessions and stopped; no health check was paused"]
    return Outcome(evidence={"gateway": node.host, "old_main_pid": old_pid, "main_pid": st.main_pid,
                             "restart_s": restarted_s, "ready_s": round(time.monotonic() - t0, 2),
                             **({"standby": cover.evidence} if cover is not None else {})},
                   verified=[f"gateway on {node.host} restarted from the new files (MainPID {st.main_pid}); every "
                             "instance listed routable by its /workers again (healthy, ready, circuit closed)"]
                   + held)


def wait_sessions_zero(pool, adm_hosts, host: str, deadline: float) -> None:
    """Until HAProxy on every admission host carries no request on `host`'s server."""
    while True:
        left = {a: gateway_stats(pool, a).get(host) for a in adm_hosts}
        busy = {a: st.sessions for a, st in left.items() if st is not None and st.sessions > 0}
        if not busy:
            return
        if time.monotonic() > deadline:
            raise Unverified(f"gateway server {host} still carries requests in HAProxy at the deadline: "
                             + ", ".join(f"{a}: {n}" for a, n in busy.items()))
        time.sleep(0.25)


class Standby:
    """A lone gateway's stand-in while it restarts: a second smg from the same (new) launch script on
    the stand-in's ports, as the transient unit STANDBY_UNIT, in HAProxy as the server rendered for it."""

    def __init__(self, node, host: str, adm_hosts: list[str]):
        self.node, self.host, self.adm_hosts = node, host, adm_hosts
        self.evidence: dict = {"url": node.url, "unit": STANDBY_UNIT}

    def retire(self, ctx: RunContext) -> None:
        """Out of HAProxy (drained to 0 sessions, then MAINT as rendered), then its unit stopped."""

        name = standby_server(self.host)
        for a in self.adm_hosts:
            runtime(ctx.pool, a, server_state_command(name, "drain"), "drain the stand-in's server")
        wait_sessions_zero(ctx.pool, self.adm_hosts, name, deadline_in(float(ctx.inv.drain_budget_s) + 30))
        for a in self.adm_hosts:
            runtime(ctx.pool, a, server_state_command(name, "maint"), "put the stand-in's server in maintenance")
        ctx.pool.run(self.host, f"systemctl stop {q(STANDBY_UNIT)}", timeout=float(ctx.inv.drain_budget_s) + 60)
        left = ctx.pool.run(self.host, f"systemctl is-active {q(STANDBY_UNIT)} || true").stdout.strip()
        if left == "active":
            raise Unverified(f"the stand-in {STANDBY_UNIT} on {self.host} still runs after its stop")
        self.evidence["retired"] = f"drained to 0 sessions, MAINT, {STANDBY_UNIT} {left or 'gone'}"
        ctx.say(f"  stand-in {self.node.url} drained, out of HAProxy, stopped")

    def keep_or_retire(self, ctx: RunContext) -> None:
        """After a failed restart: when the gateway is UP in HAProxy again the stand-in is retired; else it
        is left serving, said, with the command that ends it."""
        try:
            # HAProxy's last check may still say UP for a gateway that just failed (it takes `fall` checks to
            # mark it DOWN): the gateway's own readiness decides, then HAProxy's view
            ready = ctx.gateways.client(self.host).readiness()["ready"]
            stats = {a: gateway_stats(ctx.pool, a).get(self.host) for a in self.adm_hosts}
            if ready and all(st is not None and st.up for st in stats.values()):
                self.retire(ctx)
                return
        except PdopsError as exc:
            ctx.say(f"  also: {exc.message}")
        ctx.say(f"  the gateway is not back: the stand-in {self.node.url} ({STANDBY_UNIT} on {self.host}) is left "
                "serving through HAProxy; `inv status` names it, and `inv deploy --topology <the current one>` retires "
                "it (drained, MAINT, stopped) once the gateway serves again")


def standby_cover(ctx: RunContext, node, adm_hosts: list[str], insts, deadline: float) -> Standby:
    """Make before break for the only gateway: start the stand-in smg from the gateway's (new) launch
    script on the stand-in's ports, register every instance with it (each routable: healthy, ready,
    circuit closed), wait for its /readiness 200, and put its server in HAProxy in service (UP by
    HAProxy's own check). Refused, nothing changed, when a stand-in already runs."""

    inv, pool = ctx.inv, ctx.pool
    sb = inv.gateway.standby(node.host)
    cover = Standby(sb, node.host, adm_hosts)
    reloaded = ensure_standby_server(ctx, adm_hosts, node.host)
    if reloaded:
        cover.evidence["admission_reloaded_first"] = reloaded
    running = pool.run(node.host, f"systemctl is-active {q(STANDBY_UNIT)} || true").stdout.strip()
    if running in ("active", "activating"):
        raise Refused(f"a stand-in gateway ({STANDBY_UNIT}) already runs on {node.host}: an earlier restart did not "
                      "finish", fix=f"`systemctl stop {STANDBY_UNIT}` on {node.host} once the gateway serves "
                                    "(`inv status`), then run the change again")
    pool.run(node.host, f"systemctl reset-failed {q(STANDBY_UNIT)} 2>/dev/null || true")
    argv = ["systemd-run", f"--unit={STANDBY_UNIT}", f"--slice={SLICE_UNIT}", "--collect",
            f"--property=EnvironmentFile={ENV_DIR}/gateway.env", "--property=KillMode=mixed",
            f"--property=TimeoutStopSec={gateway_grace_s(inv) + 30}", "--property=LimitNOFILE=1048576",
            f"{BIN_DIR}/pdops-gateway.sh", "--port", str(sb.port), "--prometheus-port", str(sb.prometheus_port)]
    client = GatewayClient(sb.url, api_key_file=inv.gateway.api_key_file, metrics_url=sb.metrics_url,
                           poll_interval=0.25)
    try:
        pool.run(node.host, " ".join(q(a) for a in argv), timeout=30)
        while True:
            try:
                client.health()
                break
            except PdopsError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.25)
        workers = {i.id: register_one(client, i, lambda m: None, deadline) for i in insts}
        while not client.readiness()["ready"]:
            if time.monotonic() > deadline:
                raise Unverified(f"the stand-in gateway {sb.url} lists every worker but its /readiness is not 200")
            time.sleep(0.25)
        name = standby_server(node.host)
        for a in adm_hosts:
            runtime(pool, a, server_state_command(name, "ready"), "put the stand-in's server in service")
        for a in adm_hosts:
            wait_gateways_up(pool, a, [name], 30)
    except BaseException:
        _end_standby(ctx, cover)
        raise
    cover.evidence.update({"workers": {i: w.id for i, w in workers.items()}, "readiness": 200,
                           "admitted": f"UP in HAProxy on {', '.join(adm_hosts)}"})
    ctx.say(f"  stand-in gateway {sb.url} routes to {len(workers)} worker(s), ready, UP in HAProxy: the gateway "
            "can leave the front door")
    return cover


def ensure_standby_server(ctx: RunContext, adm_hosts: list[str], host: str) -> list[str]:
    """The stand-in's server must be in HAProxy's running config. A config from before this revision
    (the cluster had two gateways, or predates the stand-in) lacks it: the admission layer is reloaded
    now, gracefully (haproxy -c, USR2: the master stays, old workers finish their streams), with the
    files this change delivered, instead of only at the change's end. Returns the hosts reloaded."""

    name, done = standby_server(host), []
    for a in adm_hosts:
        if name in gateway_stats(ctx.pool, a):
            continue
        before = ctx.pool.unit_states(a, [UNIT])[UNIT].main_pid
        ctx.pool.run(a, f"systemctl reload {q(UNIT)}", timeout=60)
        deadline = time.monotonic() + 60
        while True:
            st = ctx.pool.unit_states(a, [UNIT])[UNIT]
            if st.active_state == "active" and name in gateway_stats(ctx.pool, a):
                break
            if time.monotonic() > deadline:
                raise Unverified(f"HAProxy on {a} has no stand-in server {name} after a reload of {UNIT} "
                                 f"({st.active_state}/{st.sub_state})", evidence=ctx.pool.journal_tail(a, UNIT))
            time.sleep(0.2)
        if st.main_pid != before:
            raise Unverified(f"{UNIT} on {a}: master MainPID {before} -> {st.main_pid} after the reload: not graceful",
                             evidence=ctx.pool.journal_tail(a, UNIT))
        ctx.say(f"  HAProxy on {a} had no server for the gateway's stand-in (its config predates this revision): "
                f"reloaded first, gracefully (master MainPID {st.main_pid} kept)")
        done.append(a)
    return done


def _end_standby(ctx: RunContext, cover: Standby) -> None:
    """A stand-in whose start or admission failed (it may have been set ready on some admission host):
    MAINT on each, then its unit stopped, each part tried whatever the other did."""

    for a in cover.adm_hosts:
        try:
            runtime(ctx.pool, a, server_state_command(standby_server(cover.host), "maint"), "put the stand-in in MAINT")
        except PdopsError as exc:
            ctx.say(f"  also: {exc.message}")
    try:  # whatever HAProxy answered: a stand-in that HAProxy may still hold is stopped gracefully (smg's grace)
        ctx.pool.run(cover.host, f"systemctl stop {q(STANDBY_UNIT)} || true",
                     timeout=float(ctx.inv.drain_budget_s) + 60)
    except PdopsError as exc:
        ctx.say(f"  also: the stand-in {STANDBY_UNIT} on {cover.host} was not stopped: {exc.message}; stop it there: "
                f"`systemctl stop {STANDBY_UNIT}`")


def do_retire_gateway(ctx: RunContext, step: Step) -> Outcome:
    """A gateway host no longer named: its unit stopped and disabled, its files removed. A host that
    cannot be reached (or is not in the inventory) is said, not failed: nothing routes to it any more
    (HAProxy's config and every record have dropped it), but it would start at boot."""

    h = step.params["host"]
    later = f"when {h} answers again: `systemctl disable --now {GATEWAY_UNIT}` there"
    if not step.params.get("reachable"):
        return Outcome("noop", {"host": h}, unverified=[f"{h} is not in the inventory: its gateway unit was not "
                                                        f"disabled; {later}"], reason=f"{h} is not in the inventory")
    files = [f"{UNIT_DIR}/{GATEWAY_UNIT}", f"{BIN_DIR}/pdops-gateway.sh", f"{ENV_DIR}/gateway.env",
             membership.PATH, membership.SCRIPT_PATH]
    try:
        ctx.pool.run(h, f"systemctl disable --now {q(GATEWAY_UNIT)} 2>/dev/null || true; rm -f "
                     + " ".join(q(f) for f in files) + "; systemctl daemon-reload", timeout=step.deadline)
        st = ctx.pool.unit_states(h, [GATEWAY_UNIT])[GATEWAY_UNIT]
    except Unreachable as exc:
        return Outcome("noop", {"host": h, "error": exc.message},
                       unverified=[f"{h} unreachable: its gateway unit was not disabled; {later}"],
                       reason=f"{h} unreachable")
    if st.is_active:
        raise Unverified(f"{GATEWAY_UNIT} on {h} is still {st.active_state} after `systemctl disable --now`")
    ctx.say(f"  {h} is no longer a gateway: {GATEWAY_UNIT} stopped and disabled, its files removed")
    return Outcome(evidence={"host": h, "unit": f"{st.active_state}/{st.sub_state}", "removed": files},
                   verified=[f"{GATEWAY_UNIT} on {h} stopped and disabled, its files removed"])


def do_deliver_wave(ctx: RunContext, step: Step) -> Outcome:
    """The own files of a wave's instances (their old processes are stopped by now)."""

    ids = step.params["instances"]
    ev = deliver(ctx.inv, step.params["placement"], step.params["files"], ctx.get(step, "build"), None, ctx.say)
    return Outcome(evidence=ev, verified=[f"the new files of {', '.join(ids)} in place (Ansible)"])


def do_record_scale(ctx: RunContext, step: Step) -> Outcome:
    plan: ChangeFacts = step.params["change"]
    rev = record_change(plan, ctx.record, ctx.op, ctx.get(step, "workers", {}), ctx.get(step, "build"),
                        ctx.get(step, "main_pids"), ctx.get(step, "running"), ctx.get(step, "lost_work", {}))
    ctx.record.set_current(rev.number)
    ctx.give(step, "revision", rev.number)
    ctx.give(step, "topology", str(plan.target.topology))
    if plan.repair:  # what the repaired instance's ended process lost (its lost-work step named it)
        ctx.give(step, "lost", (rev.extra.get("repair") or {}).get("lost") or [])
    return Outcome(evidence={"revision": rev.number},
                   verified=[f"revision {rev.number} ({plan.target.topology}) recorded and current; kept "
                             f"{', '.join(i.id for i in plan.kept) or 'none'} untouched "
                             f"({plan.kept_files} rendered files identical)"])


def execute_scale(plan: ScalePlan, record: StateDir, say: Say = print, *, pool: HostPool,
                  gateways: Gateways, op: str | None = None) -> dict:
    """Walk a change plan (scale, rollback, repair, a deploy's change) under the cluster lock
    (pdops.ops.operate.run_operation; `op`: an operation whose lock the caller holds, `inv sweep`
    between its rows); returns the verdict (with the new revision). Raises ScaleFailed, its message
    ending with the verdict line written from what the plan's rescue recorded (its failure line,
    pdops.ops.scale.rescue.halted_change_line), after undoing what it can."""
    if plan.noop:
        raise Refused(f"nothing to do: {plan.noop}")

    def failed(ctx: RunContext, exc: PdopsError) -> tuple[str, dict]:
        return "failed", ctx.output("halt_record") or {"completed": ctx.done}

    try:
        return run_operation(plan.plan, plan.inv, record, say, pool=pool, gateways=gateways, basis=plan.current.number,
                             context={"placement": union_placement(plan), "old_placement": plan.current_placement,
                                      "replacing": frozenset(i.id for i in plan.replaced)}, failed=failed, op=op,
                             lock_held=op is not None)
    except DeployFailed as exc:  # a shared step (start, canary, register) failed in a change
        raise ScaleFailed(exc.message, evidence=exc.evidence, fix=exc.fix) from None
