"""`inv drain --instance p07` and `inv stop --instance p07` (rule 4 of docs/design/architecture.md).

Drain, in order: leave the gateway (remove by worker id, verify gone); wait until the
instance's in-flight work is finished, per request ID and per queue on every rank; two
independent empty-state checks separated in time; stop by identity (unit -> MainPID ->
cgroup, process tree with start times recorded first) and prove it stopped; record a
new revision without the instance, with the way back. Plan first, `--dry-run` prints it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from pdops import membership, orphans
from pdops.errors import DrainFailed, InvalidInput, PdopsError, Refused, Unreachable, Unverified
from pdops.facts import cgroup as cg_facts
from pdops.facts import engine as engine_facts
from pdops.facts import gateway as gw_facts
from pdops.facts import nvidia as nv_facts
from pdops.facts import ports as port_facts
from pdops.facts import procs as proc_facts
from pdops.facts import Skipped, q, requestlog, skipped_in
from pdops.gateway import GatewayClient, deadline_in
from pdops.hosts import HostPool, http_json
from pdops.identity import RankIdentity, record_identity
from pdops.inventory import Inventory
from pdops.observability import targets_step
from pdops.placement import Instance, Placement
from pdops.render import SLICE_UNIT, UNIT_DIR
from pdops.runner import Outcome, Plan, RunContext, Say, Step, register_executors, walk
from pdops.state import Revision, StateDir, new_op_id





@dataclass
class DrainPlan:
    inv: Inventory
    rev: Revision
    placement: Placement
    instance: Instance
    steps: list[Step]
    wait_s: float
    interval_s: float
    force_after: bool = False
    skip_gateway: bool = False
    persist: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def plan(self) -> Plan:
        i = self.instance
        verb = "drain" if not self.skip_gateway else "stop"
        title = (f"plan: {verb} {i.id} ({i.role}, {', '.join(f'{h}:{u}' for h, u in i.units)}) from revision "
                 f"{self.rev.number} ({self.rev.topology}), under the cluster lock")
        return Plan(verb, title, self.steps, self.notes, head={"instance": i.id, "revision": self.rev.number},
                    always=[targets_step()])

    def render(self) -> str:
        return self.plan.render()


def plan_drain(inv: Inventory, state: StateDir, instance_id: str, *, force: bool = False,
               wait_s: float | None = None, interval_s: float | None = None, force_after: bool = False,
               skip_gateway: bool = False, seen=None) -> DrainPlan:
    """What a drain of `instance_id` will do, or why it is refused. Reads the state dir and, with
    `seen` (pdops.observe.Seen), what serves now: the floor counts only instances that serve; one
    that does not serve may be drained even if it is the last of its role (nothing is lost that
    serves), and one whose units are not running is not waited for."""
    rev = state.current_revision()
    if rev is None:
        raise Refused(f"{inv.cluster} has no current revision: nothing to drain", fix="deploy first (inv deploy)")
    if rev.inventory_hash != inv.digest:
        raise Refused(f"the inventory changed since revision {rev.number} was deployed",
                      fix="use the inventory of the running revision")
    pl = Placement.from_dict(rev.placement)
    inst = pl.get(instance_id)
    same_role = pl.role(inst.role)
    ns = seen.not_serving if seen is not None else {}
    others = [i.id for i in same_role if i.id != inst.id and i.id not in ns]
    if not force and not skip_gateway and inst.id not in ns and not others:
        idle = [i.id for i in same_role if i.id != inst.id]
        raise Refused(f"{inst.id} is the last {inst.role} instance of {inv.cluster} that serves: draining it leaves no "
                      f"{inst.role}" + (f" ({', '.join(idle)} observed not serving)" if idle else ""),
                      fix="scale up first (or repair the others), or pass --force if serving must stop")
    wait_s = float(wait_s if wait_s is not None else inv.drain_budget_s)
    interval_s = float(interval_s if interval_s is not None else inv.vars.get("pdops_empty_check_interval_s", 5))
    if wait_s <= 0 or interval_s < 0:
        raise InvalidInput("--wait/--interval", "must be positive seconds", fix="e.g. --wait 600 --interval 5")
    worker = (rev.instances.get(inst.id) or {}).get("worker_id")
    down = seen is not None and inst.id in seen.down
    steps = drain_steps(inv, inst, worker, wait_s=wait_s, interval_s=interval_s, force_after=force_after,
                        gateway=not skip_gateway, wait=not down)
    notes = []
    if inst.id in ns:
        notes.append(f"observed: {inst.id} does not serve ({ns[inst.id]})" + (
            "; nothing runs to wait for: " + ("the verified stop reads what is left of it" if skip_gateway else
                                              "leave the gateway, then the verified stop")
            + " (`inv repair` names the work its ended process lost)" if down else ""))
    if not skip_gateway:
        steps.append(Step("record", None, f"new revision without {inst.id} becomes current; rollback record kept",
                          kind="record-drain", params={"instance": inst.id}))
        if inst.role == "prefill":
            notes.append("a drained prefill's prefix cache is lost: cold inputs will be slower for a while")
    else:
        notes.append("stop only: the instance stays in the current revision (shown as stopped by `inv status`)")
    return DrainPlan(inv, rev, pl, inst, steps, wait_s, interval_s, force_after, skip_gateway,
                     persist=not skip_gateway, notes=notes)


# How long a drain's verify-stop waits for the gateway to drop the removed worker (smg: ~5 s).
GONE_WAIT_S = 30.0


def drain_steps(inv: Inventory, inst: Instance, worker_id: str | None, *, wait_s: float, interval_s: float,
                force_after: bool = False, gateway: bool = True, prefix: str = "", in_change: bool = False,
                check_ports: bool = True, resume: bool = True, extra: dict | None = None,
                wait: bool = True) -> list[Step]:
    """Rule 4 for one instance as steps: the one drain sub-plan that drain, scale and rollback
    embed (`prefix` names the instance in the step ids when an operation has several drains).
    `gateway=False`: the verified stop alone (`inv stop`); `check_ports=False` for an instance
    that never listened (its port may be someone else's); `resume=False` (undoing an add): always
    stop, never accept units found stopped as the work of an earlier drain. `wait=False` (repairing
    an instance observed down: nothing of it runs to wait for): leave the gateway, then the verified
    stop, without the wait and the empty checks."""
    p = {"instance": inst.id, "in_change": in_change, "check_ports": check_ports, "resume": resume, **(extra or {})}
    steps = []
    if gateway:
        steps.append(
            Step(f"{prefix}leave-gateway", inv.gateway.host, f"out of the gateway's start-up worker list, then DELETE "
                 f"/workers/{worker_id}; verify the gateway lists it draining (no new request) or not at all; "
                 "requests already routed to it keep running", 30, kind="leave-gateway",
                 params={**p, "worker_id": worker_id}))
    if gateway and wait:
        steps += [
            Step(f"{prefix}wait-empty", inst.head.host, "until no request ID is open in its request log and every "
                 "queue (running, waiting, prefill bootstrap and in-flight KV, decode prealloc and transfer) is 0 on "
                 "/v1/loads and /metrics; progress shown"
                 + ("; what a prefill still holds that no decode holds (orphaned halves, pdops.orphans) is ended by "
                    "request ID and named" if inst.role == "prefill" else "")
                 + "; at the deadline stop WITHOUT stopping the instance"
                 + (" (--force-after: stop anyway, loss recorded)" if force_after else ""), wait_s,
                 kind="wait-empty", params={**p, "force_after": force_after}),
            Step(f"{prefix}empty-check-1", inst.head.host, "read every source again: request log, /v1/loads, /metrics",
                 60, kind="empty-check", params={**p, "n": 1, "pause": 0.0}),
            Step(f"{prefix}empty-check-2", inst.head.host, f"after {interval_s:g}s, read every source again",
                 interval_s + 60, kind="empty-check", params={**p, "n": 2, "pause": interval_s}),
        ]
    steps += [
        Step(f"{prefix}record-identity", inst.head.host, "MainPID, ControlGroup, the cgroup's processes and the "
             "process tree with start times, on every rank", 60, kind="record-identity", params=p),
        Step(f"{prefix}stop", inst.head.host, "systemctl stop, rank 0 first, then the other ranks; disable the units",
             inv.stop_timeout_s + 60, kind="stop", params=p),
        Step(f"{prefix}verify-stop", inst.head.host, "cgroup empty (or removed), every recorded PID gone or reused, "
             "ports closed, no GPU compute process of it (skipped where nvidia-smi is absent)"
             + (f"; the gateway no longer lists worker {worker_id} (smg drops a removed worker seconds after it is "
                f"empty; still listed after {GONE_WAIT_S:g}s: not verified)" if gateway and worker_id else ""),
             60 + (GONE_WAIT_S if gateway and worker_id else 0),
             kind="verify-stop", params={**p, "gateway_worker": worker_id if gateway else None}),
    ]
    return steps


# ---------------------------------------------------------------- reading the instance

@dataclass
class EmptyReading:
    open_rids: list[str]
    loads_busy: dict
    metrics_busy: dict
    metrics_missing: list[str]
    errors: list[str]

    @property
    def empty(self) -> bool:
        return not (self.open_rids or self.loads_busy or self.metrics_busy or self.metrics_missing or self.errors)

    def describe(self) -> str:
        parts = []
        if self.open_rids:
            shown = ", ".join(self.open_rids[:5]) + (" ..." if len(self.open_rids) > 5 else "")
            parts.append(f"{len(self.open_rids)} open request(s) [{shown}]")
        if self.loads_busy:
            parts.append(f"/v1/loads busy {self.loads_busy}")
        if self.metrics_busy:
            parts.append(f"/metrics busy {self.metrics_busy}")
        if self.metrics_missing:
            parts.append(f"/metrics lacks {self.metrics_missing}")
        parts += self.errors
        return "; ".join(parts) or "empty"


def _invocation(pool: HostPool, host: str, unit: str) -> str:
    return pool.run(host, f"systemctl show -p InvocationID --value {q(unit)}").stdout.strip()


def read_emptiness(pool: HostPool, inst: Instance) -> EmptyReading:
    """Every source, read afresh: the request log of rank 0, /v1/loads, /metrics."""
    errors: list[str] = []
    host, unit = inst.units[0]
    try:
        inv_id = _invocation(pool, host, unit)
        log = requestlog.parse(pool.run(host, requestlog.command(unit, inv_id or None), timeout=60).stdout)
        open_rids = log.open
    except Unreachable:
        raise  # the host itself is gone: not a reading, an interruption
    except PdopsError as exc:
        open_rids, errors = [], errors + [f"request log unreadable: {exc.message}"]
    loads_busy: dict = {}
    try:
        status, doc = http_json("GET", f"{inst.url}{engine_facts.LOADS_PATH}", timeout=5)
        if status != 200:
            errors.append(f"/v1/loads answered {status}")
        else:
            loads = engine_facts.parse_loads(doc)
            loads_busy = loads.busy()
    except PdopsError as exc:
        errors.append(f"/v1/loads: {exc.message}")
    metrics_busy, missing = {}, []
    try:
        status, text = http_json("GET", f"{inst.url}/metrics", timeout=5)
        if status != 200 or not isinstance(text, str):
            errors.append(f"/metrics answered {status}")
        else:
            queues = engine_facts.EngineQueues.from_metrics(engine_facts.parse_metrics(text))
            metrics_busy, missing = queues.busy(), queues.missing
    except PdopsError as exc:
        errors.append(f"/metrics: {exc.message}")
    return EmptyReading(open_rids, loads_busy, metrics_busy, missing, errors)


@dataclass
class StopEvidence:
    unit: str
    host: str
    result: str
    sigkill: bool
    cgroup_empty: bool
    survivors: list[str]
    ports_open: list[int]
    gpu: str
    # each surviving recorded process: host, pid, start_ticks, boot_id, cmdline, cgroup, ports
    survivor_records: list[dict] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        return self.cgroup_empty and not self.survivors and not self.ports_open


def _survivor_record(pool: HostPool, host: str, rec, listeners) -> dict:
    """What an operator needs to judge a survivor: PID, start time, command line, cgroup, ports held."""
    try:
        cgroup = cg_facts.parse_proc_cgroup(pool.run(host, cg_facts.proc_cgroup_command(rec.pid)).stdout).path
    except PdopsError as exc:
        cgroup = f"unreadable: {exc.message}"
    ports = sorted({lst.port for lst in listeners if rec.pid in lst.pids})
    return {"host": host, "pid": rec.pid, "start_ticks": rec.start_ticks, "boot_id": rec.boot_id,
            "cmdline": " ".join(rec.cmdline)[:200] or rec.comm, "cgroup": cgroup, "ports": ports}


def describe_survivor(r: dict) -> str:
    return (f"PID {r['pid']} ({r['cmdline']}) on {r['host']}, cgroup {r['cgroup']}, "
            f"ports {r['ports'] or 'none'}")


def verify_stopped(pool: HostPool, ident: RankIdentity, ports: list[int], addr: str) -> StopEvidence:
    """After the stop: the unit's cgroup is empty, no recorded process (PID + start time) lives,
    no port of the instance listens, no GPU compute process of it (skipped without nvidia-smi)."""
    st = pool.unit_states(ident.host, [ident.unit])[ident.unit]
    empty = True
    if ident.control_group:
        procs = cg_facts.parse_procs(pool.run(ident.host, cg_facts.procs_command(ident.layout, ident.control_group)).stdout)
        empty = procs.empty
    now = proc_facts.parse(pool.run(ident.host, proc_facts.command(sorted(ident.tree))).stdout) if ident.tree else {}
    listeners = port_facts.parse(pool.run(ident.host, port_facts.command()).stdout)
    alive = [rec for pid, rec in sorted(ident.tree.items()) if proc_facts.identity_status(rec, now) == proc_facts.ALIVE]
    records = [_survivor_record(pool, ident.host, rec, listeners) for rec in alive]
    survivors = [describe_survivor(r) for r in records]
    open_ports = [p for p in ports if port_facts.is_listening(listeners, addr, p)]
    gpu_out = pool.run(ident.host, nv_facts.apps_command()).stdout
    sk = skipped_in(gpu_out)
    if sk is not None:  # Skipped is falsy by design
        gpu = f"skipped: {sk.reason}"
    else:
        apps = nv_facts.parse_apps(gpu_out)
        mine = [] if isinstance(apps, Skipped) else [a for a in apps if a.pid in ident.tree]
        gpu = "no compute process of it" if not mine else f"still on GPU: {[a.pid for a in mine]}"
        if mine:
            survivors += [f"GPU process PID {a.pid}" for a in mine]
    return StopEvidence(ident.unit, ident.host, st.result, st.result in ("timeout", "signal") or
                        "SIGKILL" in pool.journal_tail(ident.host, ident.unit, 15),
                        empty, survivors, open_ports, gpu, records)


def leave_gateway(client: GatewayClient, inst: Instance, worker_id: str | None, deadline_s: float = 30) -> list[str]:
    """Remove the instance's worker(s) from the gateway by id (or, failing that, by URL) and wait
    until each takes no new request: smg lists it ``draining`` at once (observed: none of 434
    requests sent then reached it) and drops it after its settle time; the drain's own empty
    checks, by request ID, decide when it is empty. Returns the ids removed ([] when already out)."""
    listed = [w for w in client.list_workers() if (worker_id and w.id == worker_id) or w.url == inst.url]
    removed = []
    for w in listed:
        if w.status != gw_facts.DRAINING:
            client.remove_worker(w.id)
            removed.append(w.id)
        client.wait_worker_out(w.id, deadline_in(deadline_s))
    return removed


@dataclass
class StopResult:
    idents: dict  # unit -> RankIdentity recorded before the stop
    evidence: list  # StopEvidence per rank
    strays: list[str]
    seconds: float

    @property
    def sigkill(self) -> bool:
        return any(e.sigkill for e in self.evidence)

    @property
    def verified(self) -> bool:
        return all(e.verified for e in self.evidence)

    @property
    def survivor_records(self) -> list[dict]:
        return [r for e in self.evidence for r in e.survivor_records]

    def journal(self) -> dict:
        return {"seconds": self.seconds, "strays": self.strays,
                "identity": {u: {"main_pid": i.main_pid, "cgroup": i.control_group,
                                 "pids": {p: {"start": r.start_ticks, "cmd": list(r.cmdline)}
                                          for p, r in i.tree.items()}} for u, i in self.idents.items()},
                "evidence": {e.unit: {k: v for k, v in vars(e).items() if k != "survivor_records"}
                             for e in self.evidence}}


def record_identities(pool: HostPool, inst: Instance) -> dict:
    """Every rank's MainPID, cgroup and process tree (start times), before a stop."""
    return {u: record_identity(pool, h, u) for h, u in inst.units}


def stop_units(pool: HostPool, inst: Instance, stop_timeout_s: float, say: Say | None = None) -> float:
    """systemctl stop every rank's unit, rank 0 first (ranks >= 1 exit with it), then disable them.
    Returns the seconds the stop took."""
    t0 = time.monotonic()
    head_host, head_unit = inst.units[0]
    if say:
        say(f"  stopping {head_unit} on {head_host} (SIGTERM to the main process; SIGKILL to the cgroup "
            f"after {stop_timeout_s:g}s)")
    for h, u in inst.units:
        pool.run(h, f"systemctl stop {q(u)}", timeout=stop_timeout_s + 60)
    for h, u in inst.units:
        pool.run(h, f"systemctl disable {q(u)}; systemctl reset-failed {q(u)} 2>/dev/null || true")
    return round(time.monotonic() - t0, 2)


def verify_units_stopped(pool: HostPool, inst: Instance, idents: dict, seconds: float, *, check_ports: bool = True,
                         say: Say | None = None) -> StopResult:
    """Prove the stop from what the hosts report now (see :func:`verify_stopped`)."""
    head_unit = inst.units[0][1]
    strays = [f"{i.host}:{i.unit} {s}" for i in idents.values() for s in i.strays]
    ports = [p for p in (inst.http_port, inst.bootstrap_port) if p] if check_ports else []
    evidence = [verify_stopped(pool, idents[u], ports if u == head_unit else [], inst.head.data_addr)
                for h, u in inst.units]
    result = StopResult(idents, evidence, strays, seconds)
    if say:
        if strays:
            say(f"  found in the cgroup but outside MainPID's tree (stopped with the cgroup): {'; '.join(strays)}")
        for e in evidence:
            say(f"  {e.host}:{e.unit}: result {e.result}; cgroup {'empty' if e.cgroup_empty else 'NOT EMPTY'};"
                f" {'no survivor' if not e.survivors else 'SURVIVORS ' + ', '.join(e.survivors)}; "
                f"ports {'closed' if not e.ports_open else 'OPEN ' + str(e.ports_open)}; GPU: {e.gpu}")
            if e.sigkill:
                say(f"  note: {e.unit} did not exit on SIGTERM; systemd's SIGKILL after TimeoutStopSec "
                    "emptied the cgroup")
    if not result.verified:
        raise StopUnverified(inst, result)
    return result


class StopUnverified(Unverified):
    """A stop whose outcome is not proven; carries the StopResult (identity and evidence)."""

    def __init__(self, inst: Instance, result: StopResult):
        bad = [e for e in result.evidence if not e.verified]
        lines = []
        for e in bad:
            lines.append(f"{e.host}:{e.unit}: cgroup {'empty' if e.cgroup_empty else 'NOT EMPTY'}; "
                         f"ports still listening: {e.ports_open or 'none'}")
            lines += [f"  survivor: {s}" for s in e.survivors]
        super().__init__(f"{inst.id}: the stop is NOT verified: "
                         + ("recorded process(es) still alive" if result.survivor_records else "evidence below"),
                         evidence="\n".join(lines),
                         fix=f"nothing was killed by name and {inst.id} stays out of the gateway; inspect the "
                             f"processes listed, then `inv stop --instance {inst.id} --kill-survivors` ends exactly "
                             "those PIDs (checked by start time) and verifies again (docs/runbooks/stop-survivors.md)")
        self.result = result
        self.journal_evidence = stop_evidence(inst, result)


def stop_evidence(inst: Instance, result: StopResult) -> dict:
    """The stop's identity and evidence for the journal, with the instance and its survivors by
    PID and start time (what `inv stop --kill-survivors` reads)."""
    return {"instance": inst.id, "verified": result.verified, "survivors": result.survivor_records,
            **result.journal()}


# ---------------------------------------------------------------- survivors of a stop

# Runs on the host with the system python3: SIGKILL each PID only if it is still the recorded
# process. pidfd_open pins the process first, so the start-time check and the signal are about
# the same process even if the PID is reused in between.
_KILL_SCRIPT = r'''
import json, os, signal, sys
out = []
boot = open("/proc/sys/kernel/random/boot_id").read().strip()
for arg in sys.argv[1:]:
    pid, start, want_boot = arg.split(":")
    pid, start = int(pid), int(start)
    if want_boot and want_boot != boot:
        out.append({"pid": pid, "status": "reused", "why": "host rebooted"}); continue
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        out.append({"pid": pid, "status": "gone"}); continue
    try:
        data = open("/proc/%d/stat" % pid, "rb").read().decode("utf-8", "replace")
        now = int(data[data.rindex(")") + 2:].split()[19])
        if now != start:
            out.append({"pid": pid, "status": "reused", "why": "start time %d, recorded %d" % (now, start)})
            continue
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        out.append({"pid": pid, "status": "killed"})
    except (ProcessLookupError, FileNotFoundError):
        out.append({"pid": pid, "status": "gone"})
    finally:
        os.close(fd)
print(json.dumps(out))
'''


def kill_command(records: list[dict]) -> str:
    """SIGKILL exactly these recorded processes (PID + start time + boot id), never by name."""
    args = " ".join(q(f"{int(r['pid'])}:{int(r['start_ticks'])}:{r.get('boot_id') or ''}") for r in records)
    return f"python3 -c {q(_KILL_SCRIPT)} {args}"


def last_stop_record(j, instance: str, *, failed_only: bool = False) -> dict | None:
    """The journal's latest stop-verification record of `instance` (drain, stop, scale or
    kill-survivors); with `failed_only`, the latest one that was not verified."""
    for r in reversed(j.records()):
        ev = r.get("evidence") or {}
        if ev.get("instance") == instance and isinstance(ev.get("survivors"), list):
            if not failed_only or r.get("status") == "failed":
                return r
    return None


def alive_survivors(pool: HostPool, records: list[dict]) -> list[dict]:
    """The recorded survivors that still run now (same PID, start time and boot)."""
    out = []
    for host in sorted({r["host"] for r in records}):
        mine = [r for r in records if r["host"] == host]
        now = proc_facts.parse(pool.run(host, proc_facts.command([r["pid"] for r in mine])).stdout)
        for r in mine:
            rec = proc_facts.ProcIdentity(int(r["pid"]), int(r["start_ticks"]), r.get("boot_id") or "")
            if proc_facts.identity_status(rec, now) == proc_facts.ALIVE:
                out.append(r)
    return out


@dataclass
class KillPlan:
    inv: Inventory
    rev: Revision
    instance: Instance
    survivors: list[dict]
    from_op: str
    steps: list[Step]

    @property
    def plan(self) -> Plan:
        return Plan("stop", f"plan: end the processes that survived the stop of {self.instance.id} (recorded by "
                    f"{self.from_op}), under the cluster lock", self.steps,
                    ["only these PIDs, each only while its start time is the recorded one; nothing by name"],
                    head={"instance": self.instance.id, "kill_survivors": True, "from_op": self.from_op})

    def render(self) -> str:
        return self.plan.render()


def plan_kill_survivors(inv: Inventory, state: StateDir, instance_id: str) -> KillPlan:
    """What `inv stop --kill-survivors` will do: the survivors the last stop of the instance
    recorded, or Refused when none is recorded. Reads only the state dir."""
    rev = state.current_revision()
    if rev is None:
        raise Refused(f"{inv.cluster} has no current revision", fix="nothing was deployed by pdops here")
    inst = Placement.from_dict(rev.placement).get(instance_id)
    rec = last_stop_record(state.journal(), inst.id)
    survivors = (rec or {}).get("evidence", {}).get("survivors") or []
    if not survivors:
        raise Refused(f"no stop of {inst.id} with surviving processes is recorded: nothing to end",
                      fix=f"`inv stop --instance {inst.id}` stops and verifies; it lists any survivor")
    p = {"instance": inst.id}
    steps = [Step("check-units", inst.head.host, f"every unit of {inst.id} is inactive (refuse if it runs again)",
                  30, kind="check-units", params=p)]
    for host in sorted({r["host"] for r in survivors}):
        mine = [r for r in survivors if r["host"] == host]
        steps.append(Step(f"kill-survivors {host}", host, "; ".join(
            f"SIGKILL PID {r['pid']} only if its start time is still {r['start_ticks']}: {r['cmdline']} "
            f"(cgroup {r['cgroup']}, ports {r['ports'] or 'none'})" for r in mine), 30, kind="kill-survivors",
            params={**p, "records": mine}))
    steps.append(Step("verify-stop", inst.head.host, "every recorded PID gone or reused, the instance's ports closed, "
                      "no GPU compute process of it (skipped where nvidia-smi is absent)", 30, kind="verify-gone",
                      params={**p, "records": survivors}))
    return KillPlan(inv, rev, inst, survivors, rec["op_id"], steps)


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


def execute_kill_survivors(plan: KillPlan, state: StateDir, say: Say = print, *, pool: HostPool,
                           gateway: GatewayClient) -> dict:
    """End the recorded survivors by PID and start time, then verify the stop again (with the runner)."""
    op = new_op_id("stop")
    with state.lock("stop", op_id=op):
        state.check_basis(plan.rev.number)
        ctx = RunContext(plan.inv, state, op, say, pool, gateway, {"placement": Placement.from_dict(plan.rev.placement)})
        try:
            verdict = walk(plan.plan, ctx)
        except PdopsError as exc:
            ctx.journal.step(op, "verdict", "failed", {"error": exc.render()})
            raise
        verdict["instance"] = plan.instance.id
        verdict["notes"].append(f"{plan.instance.id} is still in revision {plan.rev.number}: `inv drain --instance "
                                f"{plan.instance.id}` resumes the drain and records it")
        state.journal().step(op, "verdict", "ok", verdict)
    return verdict


# ---------------------------------------------------------------- doing: one executor per step kind

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
    key = ("drain", inst.id)
    if key not in ctx.data:
        states = {u: ctx.pool.unit_states(h, [u])[u] for h, u in inst.units}
        stopped = all(st.active_state in ("inactive", "failed") and st.sub_state != "auto-restart"
                      for st in states.values())
        ctx.data[key] = {"already_stopped": stopped and step.params.get("resume", True)}
    return ctx.data[key]


def _instance(ctx: RunContext, step: Step) -> Instance:
    """The instance a drain step names; for a replacement (`old`), its running process's placement."""
    if step.params.get("old"):
        return ctx.data["old_placement"].get(step.instance)
    return ctx.data["placement"].get(step.instance)


def do_leave_gateway(ctx: RunContext, step: Step) -> Outcome:
    inst = _instance(ctx, step)
    _drain_state(ctx, inst, step)
    if step.params.get("in_change"):  # out of service from now on: a halted change's rescue reads this
        left_ = ctx.data.setdefault("left_gateway", [])
        if inst.id not in left_:
            left_.append(inst.id)
    # out of the gateway's start-up list first: a gateway restart from now on does not bring it back
    left = membership.update(ctx.pool, ctx.inv, remove=[inst.id])
    removed = leave_gateway(ctx.gateway, inst, step.params.get("worker_id"), deadline_s=step.deadline)
    if not removed:
        return Outcome("noop", {"already_removed": step.params.get("worker_id"),
                                "gateway_list": membership.listed_ids(left)},
                       verified=[f"{inst.id} is not in the gateway's /workers"],
                       reason=f"{inst.id} is not in the gateway's /workers (already removed)")
    ctx.say(f"  {inst.id} left the gateway: worker {', '.join(removed)} removed, draining (no new request routed to it)")
    return Outcome(evidence={"removed": removed, "gateway_list": membership.listed_ids(left)},
                   verified=[f"{inst.id} out of the gateway's start-up list and draining in the gateway (no new "
                             "request routed to it)"])


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
                ctx.data[("accepted_loss", inst.id)] = list(r.open_rids)
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
    """When every request the prefill holds is an orphaned half (pdops.orphans), end them by rid."""
    try:
        found = orphans.read(ctx.pool, ctx.data["placement"], ctx.inv, prefills=[inst.id]).orphans.get(inst.id, [])
    except PdopsError as exc:  # a reading, not the drain: the wait goes on and its own deadline decides
        ctx.say(f"  {inst.id}: orphaned halves not read: {exc.message}")
        return []
    if not found or {o.rid for o in found} != set(open_rids):
        return []
    done, left = orphans.end(inst, found, set(open_rids))
    ctx.say(f"  {inst.id}: all it still holds are orphaned halves (no decode holds them): ended {', '.join(done)}"
            + (f"; not ended: {'; '.join(left)}" if left else ""))
    return done


def do_empty_check(ctx: RunContext, step: Step) -> Outcome:
    inst = _instance(ctx, step)
    resumed = _resumed_without_checks(ctx, step, inst)
    if resumed:
        return resumed
    n, pause = step.params["n"], step.params["pause"]
    if ("accepted_loss", inst.id) in ctx.data:
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
    st["idents"] = record_identities(ctx.pool, inst)
    return Outcome(evidence={u: {"main_pid": i.main_pid, "cgroup": i.control_group, "pids": sorted(i.tree)}
                             for u, i in st["idents"].items()})


def do_stop(ctx: RunContext, step: Step) -> Outcome:
    inst = _instance(ctx, step)
    st = _drain_state(ctx, inst, step)
    if st["already_stopped"]:
        return Outcome.noop(f"{inst.id}'s units are already inactive")
    st["seconds"] = stop_units(ctx.pool, inst, ctx.inv.stop_timeout_s, ctx.say)
    return Outcome(evidence={"seconds": st["seconds"], "units": [u for _, u in inst.units]})


def do_verify_stop(ctx: RunContext, step: Step) -> Outcome:
    inst = _instance(ctx, step)
    st = _drain_state(ctx, inst, step)
    if st["already_stopped"]:
        out = _verify_resumed_stop(ctx, inst)
    else:
        res = verify_units_stopped(ctx.pool, inst, st["idents"], st["seconds"],
                                   check_ports=step.params.get("check_ports", True), say=ctx.say)
        verified = [f"cgroup empty, every recorded PID gone or reused, ports closed ({inst.id})"]
        if res.strays:
            verified.append(f"stray process(es) found in the cgroup and stopped with it: {'; '.join(res.strays)}")
        if res.sigkill:
            verified.append("needed systemd's SIGKILL after TimeoutStopSec")
        out = Outcome(evidence=stop_evidence(inst, res), verified=verified,
                      unverified=sorted({f"GPU processes: {e.gpu}" for e in res.evidence if e.gpu.startswith("skipped")}))
    wid = step.params.get("gateway_worker")
    if wid and ctx.gateway is not None:
        # right after the stop smg may still list the removed worker as draining: the drain ends when
        # the gateway's view is the revision's (an `inv status` at once then counts what runs)
        try:
            ctx.gateway.wait_worker_gone(wid, deadline_in(GONE_WAIT_S))
            out.verified.append(f"the gateway no longer lists worker {wid} ({inst.id})")
        except PdopsError as exc:
            out.unverified.append(f"the gateway still lists worker {wid} of {inst.id}: {exc.message}")
    if step.params.get("in_change"):
        ctx.data.setdefault("replaced_out" if step.params.get("old") else "drained", []).append(inst.id)
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


def do_record_drain(ctx: RunContext, step: Step) -> Outcome:
    plan: DrainPlan = ctx.data["drain_plan"]
    inst = plan.instance
    new_pl = Placement(plan.placement.topology.__class__(
        len([i for i in plan.placement.instances if i.role == "prefill" and i.id != inst.id]),
        len([i for i in plan.placement.instances if i.role == "decode" and i.id != inst.id])),
        tuple(i for i in plan.placement.instances if i.id != inst.id))
    instances = {k: v for k, v in plan.rev.instances.items() if k != inst.id}
    hosts_files = {h: {p: m for p, m in files.items() if f"pdops-{inst.id}" not in p}
                   for h, files in plan.rev.manifest.items()}
    # a host left with nothing of the revision but pdops.slice is no host of it (render agrees:
    # a deploy of the new topology renders no file there, so the manifests compare equal)
    slice_path = f"{UNIT_DIR}/{SLICE_UNIT}"
    hosts_files = {h: f for h, f in hosts_files.items() if set(f) - {slice_path}}
    removed_files = {h: {p: m for p, m in files.items() if f"pdops-{inst.id}" in p}
                     for h, files in plan.rev.manifest.items()}
    rollback = {"restore": inst.id, "from_revision": plan.rev.number,
                "how": "start its units, wait healthy, re-register with the gateway, canary its pairs",
                "holds_while": "its hosts and rendered files are unchanged",
                "files": {h: f for h, f in removed_files.items() if f},
                "placement": [i for i in plan.placement.to_dict()["instances"] if i["id"] == inst.id]}
    from pdops.placement import last_bootstrap_ports
    from pdops.render import snapshot_subset

    units = {f"{h}:{u}" for h, u in inst.units}
    carried = {"configs": {k: v for k, v in (plan.rev.extra.get("configs") or {}).items() if k not in units},
               "cordoned": list(plan.rev.extra.get("cordoned") or []),
               # the slot remembers its last prefill's bootstrap port: a re-add takes the other one
               "last_bootstrap": last_bootstrap_ports(plan.rev.extra.get("last_bootstrap") or {}, plan.placement)}
    rev = ctx.state.write_revision(topology=str(new_pl.topology), inventory_hash=plan.rev.inventory_hash,
                                   placement=new_pl.to_dict(), manifest=hosts_files, instances=instances,
                                   outcome="deployed", op_id=ctx.op,
                                   extra={"drained": inst.id, "rollback": rollback,
                                          "gateway": plan.rev.extra.get("gateway"), **carried},
                                   snapshot=snapshot_subset(ctx.state.revision_snapshot(plan.rev.number), hosts_files))
    ctx.state.set_current(rev.number)
    return Outcome(evidence={"revision": rev.number, "rollback": rollback},
                   verified=[f"revision {rev.number} ({new_pl.topology}) is current"])


register_executors({"leave-gateway": do_leave_gateway, "wait-empty": do_wait_empty, "empty-check": do_empty_check,
          "record-identity": do_record_identity, "stop": do_stop, "verify-stop": do_verify_stop,
          "record-drain": do_record_drain, "check-units": do_check_units, "kill-survivors": do_kill_survivors,
          "verify-gone": do_verify_gone})


def execute_drain(plan: DrainPlan, state: StateDir, say: Say = print, *, pool: HostPool,
                  gateway: GatewayClient) -> dict:
    """Walk a drain (or stop) plan with the runner. An interruption (SSH lost, engine unreachable,
    a check failing) ends with a journalled verdict naming the last completed step; the instance
    is never recorded as stopped unless the stop was verified. Re-running the same drain resumes:
    a worker already removed is a no-op, an instance already stopped is only accepted when an
    earlier drain of it passed both empty checks."""
    op = new_op_id(plan.plan.operation)
    with state.lock(plan.plan.operation, op_id=op):
        state.check_basis(plan.rev.number)
        ctx = RunContext(plan.inv, state, op, say, pool, gateway, {"placement": plan.placement, "drain_plan": plan})
        try:
            verdict = walk(plan.plan, ctx)
        except PdopsError as exc:
            last = ctx.done[-1] if ctx.done else "none"
            current = state.current()
            ctx.journal.step(op, "verdict", "interrupted", {"error": exc.render(), "last_completed_step": last,
                                                           "current": current})
            exc.message += (f"\n  {plan.instance.id} is NOT recorded as stopped; last completed step: {last}; "
                            f"current revision: {current}. Re-run the same command to resume "
                            "(each step re-checks what is already done).")
            raise
        verdict["instance"] = plan.instance.id
        ctx.journal.step(op, "verdict", "ok", verdict)
        return verdict
