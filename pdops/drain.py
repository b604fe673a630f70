"""`inv drain --instance p07` and `inv stop --instance p07` (rule 4 of ARCHITECTURE.md).

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
from typing import Callable

from pdops.errors import InvalidInput, PdopsError, Refused, Unreachable, Unverified
from pdops.facts import cgroup as cg_facts
from pdops.facts import engine as engine_facts
from pdops.facts import nvidia as nv_facts
from pdops.facts import ports as port_facts
from pdops.facts import procs as proc_facts
from pdops.facts import Skipped, q, requestlog, skipped_in
from pdops.gateway import GatewayClient, deadline_in
from pdops.hosts import HostPool, http_json
from pdops.inventory import Inventory
from pdops.placement import Instance, Placement
from pdops.runner import Step
from pdops.state import Revision, StateDir, new_op_id

Say = Callable[[str], None]


class DrainFailed(PdopsError):
    exit_code = 8
    kind = "drain stopped"


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

    def render(self) -> str:
        i = self.instance
        verb = "drain" if not self.skip_gateway else "stop"
        lines = [f"plan: {verb} {i.id} ({i.role}, {', '.join(f'{h}:{u}' for h, u in i.units)}) from revision "
                 f"{self.rev.number} ({self.rev.topology})"]
        lines += [f"  {n:2d}. {s}" for n, s in enumerate(self.steps, 1)]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def plan_drain(inv: Inventory, state: StateDir, instance_id: str, *, force: bool = False,
               wait_s: float | None = None, interval_s: float | None = None, force_after: bool = False,
               skip_gateway: bool = False) -> DrainPlan:
    """What a drain of `instance_id` will do, or why it is refused. Reads only the state dir."""
    rev = state.current_revision()
    if rev is None:
        raise Refused(f"{inv.cluster} has no current revision: nothing to drain", fix="deploy first (inv deploy)")
    if rev.inventory_hash != inv.digest:
        raise Refused(f"the inventory changed since revision {rev.number} was deployed",
                      fix="use the inventory of the running revision")
    pl = Placement.from_dict(rev.placement)
    inst = pl.get(instance_id)
    same_role = pl.role(inst.role)
    if len(same_role) == 1 and not force and not skip_gateway:
        raise Refused(f"{inst.id} is the last {inst.role} instance of {inv.cluster}: draining it leaves no {inst.role}",
                      fix="scale up first, or pass --force if serving must stop")
    wait_s = float(wait_s if wait_s is not None else inv.drain_budget_s)
    interval_s = float(interval_s if interval_s is not None else inv.vars.get("pdops_empty_check_interval_s", 5))
    if wait_s <= 0 or interval_s < 0:
        raise InvalidInput("--wait/--interval", "must be positive seconds", fix="e.g. --wait 600 --interval 5")
    worker = (rev.instances.get(inst.id) or {}).get("worker_id")
    steps = [Step("lock", None, f"take the {inv.cluster} cluster lock for the whole operation")]
    if not skip_gateway:
        steps += [
            Step("leave-gateway", inv.gateway.host, f"DELETE /workers/{worker}; verify it is gone from /workers; "
                 "requests already routed to it keep running", 30),
            Step("wait-empty", inst.head.host, "until no request ID is open in its request log and every queue "
                 "(running, waiting, prefill bootstrap and in-flight KV, decode prealloc and transfer) is 0 on "
                 "/v1/loads and /metrics; progress shown; at the deadline stop WITHOUT stopping the instance"
                 + (" (--force-after: stop anyway, loss recorded)" if force_after else ""), wait_s),
            Step("empty-check-1", None, "read every source again: request log, /v1/loads, /metrics"),
            Step("empty-check-2", None, f"after {interval_s:g}s, read every source again"),
        ]
    steps += [
        Step("record-identity", None, "MainPID, ControlGroup, the cgroup's processes and the process tree "
             "with start times, on every rank"),
        Step("stop", None, "systemctl stop, rank 0 first, then verify the other ranks exit and stop their units", 
             inv.stop_timeout_s),
        Step("verify-stop", None, "cgroup empty (or removed), every recorded PID gone or reused, ports closed, "
             "no GPU compute process of it (skipped where nvidia-smi is absent)"),
    ]
    notes = []
    if not skip_gateway:
        steps.append(Step("record", None, f"new revision without {inst.id} becomes current; rollback record kept"))
        if inst.role == "prefill":
            notes.append("a drained prefill's prefix cache is lost: cold inputs will be slower for a while")
    else:
        notes.append("stop only: the instance stays in the current revision (shown as stopped by `inv status`)")
    return DrainPlan(inv, rev, pl, inst, steps, wait_s, interval_s, force_after, skip_gateway,
                     persist=not skip_gateway, notes=notes)


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
class RankIdentity:
    host: str
    unit: str
    main_pid: int | None
    control_group: str | None
    layout: object
    cgroup_pids: list[int]
    tree: dict  # pid -> Proc (the cgroup's processes and MainPID's descendants)

    @property
    def strays(self) -> list[str]:
        """Processes in the unit's cgroup that are not MainPID or its descendants (e.g. a
        double-forked grandchild): stopped with the cgroup, reported by PID and command line."""
        family = {self.main_pid} if self.main_pid else set()
        if self.main_pid:
            family |= {p.pid for p in proc_facts.descendants(self.tree, self.main_pid)}
        return [f"PID {pid} ({' '.join(self.tree[pid].cmdline)[:120] if pid in self.tree else '?'})"
                for pid in self.cgroup_pids if pid not in family]


def record_identity(pool: HostPool, host: str, unit: str) -> RankIdentity:
    st = pool.unit_states(host, [unit])[unit]
    layout = cg_facts.detect_layout(cg_facts.parse_mountinfo(pool.run(host, cg_facts.MOUNTINFO_COMMAND).stdout))
    pids: list[int] = []
    if st.control_group:
        pids = sorted(cg_facts.parse_procs(pool.run(host, cg_facts.procs_command(layout, st.control_group)).stdout).pids)
    tree = proc_facts.parse(pool.run(host, proc_facts.command()).stdout)
    keep = set(pids)
    if st.main_pid:
        keep.add(st.main_pid)
        keep |= {p.pid for p in proc_facts.descendants(tree, st.main_pid)}
    return RankIdentity(host, unit, st.main_pid, st.control_group, layout, pids,
                        {pid: tree[pid] for pid in keep if pid in tree})


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


def leave_gateway(client: GatewayClient, inst: Instance, worker_id: str | None) -> list[str]:
    """Remove the instance's worker(s) from the gateway by id (or, failing that, by URL) and
    wait until /workers no longer lists them. Returns the ids removed ([] when already gone)."""
    listed = [w for w in client.list_workers() if (worker_id and w.id == worker_id) or w.url == inst.url]
    for w in listed:
        client.remove_worker(w.id)
        client.wait_worker_gone(w.id, deadline_in(30))
    return [w.id for w in listed]


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


def stop_and_verify(pool: HostPool, inst: Instance, *, stop_timeout_s: float, check_ports: bool = True,
                    say: Say | None = None) -> StopResult:
    """Stop an instance by identity and prove it: record every rank's MainPID, cgroup and process
    tree (start times) first; stop rank 0, then the other ranks; disable the units; then verify
    the cgroups are empty, every recorded PID is gone or reused and the ports are closed.
    Raises Unverified, naming what survived; nothing is ever killed by name.
    `check_ports=False` for an instance that never listened (its port may be someone else's)."""
    idents = {u: record_identity(pool, h, u) for h, u in inst.units}
    t0 = time.monotonic()
    head_host, head_unit = inst.units[0]
    if say:
        say(f"  stopping {head_unit} on {head_host} (SIGTERM to the main process; SIGKILL to the cgroup "
            f"after {stop_timeout_s:g}s)")
    for h, u in inst.units:  # rank 0 first: ranks >= 1 exit with it
        pool.run(h, f"systemctl stop {q(u)}", timeout=stop_timeout_s + 60)
    for h, u in inst.units:
        pool.run(h, f"systemctl disable {q(u)}; systemctl reset-failed {q(u)} 2>/dev/null || true")
    seconds = round(time.monotonic() - t0, 2)
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


def journal_stop(j, op: str, step: str, inst: Instance, result: StopResult) -> None:
    """The stop's identity and evidence in the journal, with the instance and its survivors by
    PID and start time (what `inv stop --kill-survivors` reads)."""
    j.step(op, step, "ok" if result.verified else "failed",
           {"instance": inst.id, "verified": result.verified, "survivors": result.survivor_records,
            **result.journal()})


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


def last_stop_record(j, instance: str) -> dict | None:
    """The journal's latest verified-stop record of `instance` (drain, stop, scale or kill-survivors)."""
    for r in reversed(j.records()):
        ev = r.get("evidence") or {}
        if ev.get("instance") == instance and isinstance(ev.get("survivors"), list):
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

    def render(self) -> str:
        lines = [f"plan: end the processes that survived the stop of {self.instance.id} (recorded by {self.from_op})"]
        lines += [f"  {n:2d}. {s}" for n, s in enumerate(self.steps, 1)]
        lines.append("  note: only these PIDs, each only while its start time is the recorded one; nothing by name")
        return "\n".join(lines)


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
    steps = [Step("lock", None, f"take the {inv.cluster} cluster lock"),
             Step("check-units", inst.head.host, f"every unit of {inst.id} is inactive (refuse if it runs again)")]
    steps += [Step("kill-survivor", r["host"], f"SIGKILL PID {r['pid']} only if its start time is still "
                   f"{r['start_ticks']}: {r['cmdline']} (cgroup {r['cgroup']}, ports {r['ports'] or 'none'})", 10)
              for r in survivors]
    steps.append(Step("verify-stop", None, "every recorded PID gone or reused, the instance's ports closed, no GPU "
                      "compute process of it (skipped where nvidia-smi is absent)", 10))
    return KillPlan(inv, rev, inst, survivors, rec["op_id"], steps)


def execute_kill_survivors(plan: KillPlan, state: StateDir, say: Say = print) -> dict:
    """End the recorded survivors by PID and start time, then verify the stop again."""
    inst = plan.instance
    op = new_op_id("stop")
    j = state.journal()
    with state.lock("stop", op_id=op):
        j.step(op, "plan", "ok", {"instance": inst.id, "kill_survivors": True, "from_op": plan.from_op,
                                  "steps": [str(s) for s in plan.steps]})
        try:
            with HostPool(plan.inv) as pool:
                for h, u in inst.units:
                    st = pool.unit_states(h, [u])[u]
                    if st.is_active:
                        raise Refused(f"{u} on {h} is {st.active_state} again: its processes are not survivors now",
                                      fix=f"`inv stop --instance {inst.id}` first")
                j.step(op, "check-units", "ok", {"units": [u for _, u in inst.units]})
                results = []
                for host in sorted({r["host"] for r in plan.survivors}):
                    mine = [r for r in plan.survivors if r["host"] == host]
                    out = pool.run(host, kill_command(mine)).stdout
                    for res in json.loads(out.strip().splitlines()[-1]):
                        res["host"] = host
                        results.append(res)
                        say(f"  {host} PID {res['pid']}: {res['status']}" + (f" ({res['why']})" if res.get("why") else ""))
                j.step(op, "kill-survivor", "ok", {"results": results})
                deadline = time.monotonic() + 10
                while True:
                    left = alive_survivors(pool, plan.survivors)
                    if not left or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                listeners = port_facts.parse(pool.run(inst.head.host, port_facts.command()).stdout)
                ports = [p for p in (inst.http_port, inst.bootstrap_port)
                         if p and port_facts.is_listening(listeners, inst.head.data_addr, p)]
                gpu_out = pool.run(inst.head.host, nv_facts.apps_command()).stdout
                sk = skipped_in(gpu_out)
                ok = not left and not ports
                j.step(op, "verify-stop", "ok" if ok else "failed",
                       {"instance": inst.id, "verified": ok, "survivors": left, "ports_open": ports,
                        "gpu": f"skipped: {sk.reason}" if sk is not None else "read"})
                if not ok:
                    raise Unverified(f"{inst.id}: the stop is still NOT verified",
                                     evidence="\n".join([f"survivor: {describe_survivor(r)}" for r in left]
                                                        + ([f"ports still listening: {ports}"] if ports else [])),
                                     fix="inspect these by hand; pdops kills only recorded processes")
        except PdopsError as exc:
            j.step(op, "verdict", "failed", {"error": exc.render()})
            raise
    killed = [f"PID {r['pid']}" for r in results if r["status"] == "killed"]
    verdict = {"instance": inst.id,
               "verified": [f"ended {', '.join(killed) or 'nothing (already gone)'} by PID and start time",
                            "every recorded PID gone or reused",
                            f"ports {', '.join(str(p) for p in (inst.http_port, inst.bootstrap_port) if p)} closed"],
               "unverified": [f"GPU processes: skipped: {sk.reason}"] if sk is not None else [],
               "notes": [f"{inst.id} is still in revision {plan.rev.number}: `inv drain --instance {inst.id}` "
                         "resumes the drain and records it"]}
    j.step(op, "verdict", "ok", verdict)
    return verdict


# ---------------------------------------------------------------- doing

def _last_op_reached(state: StateDir, instance: str, step: str) -> bool:
    """Did the last drain of `instance` pass `step`? (for resuming; stop-only operations are not drains)"""
    j = state.journal()
    for op in reversed(j.operations()):
        if not op.startswith("drain-"):
            continue
        recs = j.read(op)
        if not recs or recs[0].get("step") != "plan" or (recs[0].get("evidence") or {}).get("instance") != instance:
            continue
        return any(r["step"] == step and r["status"] == "ok" for r in recs)
    return False


def execute_drain(plan: DrainPlan, state: StateDir, say: Say = print) -> dict:
    """Carry out a drain (or stop) plan. An interruption (SSH lost, engine unreachable, a
    check failing) ends with a journalled verdict naming the last completed step; the
    instance is never recorded as stopped unless the stop was verified. Re-running the
    same drain resumes: a worker already removed is noted, an instance already stopped is
    only accepted when an earlier drain passed both empty checks."""
    op = new_op_id("drain" if not plan.skip_gateway else "stop")
    j = state.journal()
    with state.lock("drain" if not plan.skip_gateway else "stop", op_id=op):
        j.step(op, "plan", "ok", {"instance": plan.instance.id, "steps": [str(s) for s in plan.steps]})
        try:
            return _execute_drain(plan, state, op, j, say)
        except PdopsError as exc:
            done = [r["step"] for r in j.read(op) if r["status"] in ("ok", "noted")]
            last = done[-1] if done else "none"
            current = state.current()
            j.step(op, "verdict", "interrupted", {"error": exc.render(), "last_completed_step": last,
                                                 "current": current})
            exc.message += (f"\n  {plan.instance.id} is NOT recorded as stopped; last completed step: {last}; "
                            f"current revision: {current}. Re-run the same command to resume "
                            "(each step re-checks what is already done).")
            raise


def _execute_drain(plan: DrainPlan, state: StateDir, op: str, j, say: Say) -> dict:
    inv, inst = plan.inv, plan.instance
    verified: list[str] = []
    unverified: list[str] = []
    with HostPool(inv) as pool:
        states = {u: pool.unit_states(h, [u])[u] for h, u in inst.units}
        already_stopped = all(not s.is_active for s in states.values())
        if not plan.skip_gateway:
            client = GatewayClient(inv.gateway.url, api_key_file=inv.gateway.api_key_file)
            wid = (plan.rev.instances.get(inst.id) or {}).get("worker_id")
            removed = leave_gateway(client, inst, wid)
            if removed:
                say(f"  left the gateway: worker {', '.join(removed)} removed, gone from /workers")
                j.step(op, "leave-gateway", "ok", {"removed": removed})
            else:
                say(f"  {inst.id} is not in the gateway's /workers (already removed): nothing to do")
                j.step(op, "leave-gateway", "ok", {"already_removed": wid})
            verified.append("removed from the gateway and gone from /workers")

            if already_stopped:
                if not _last_op_reached(state, inst.id, "empty-check-2"):
                    raise DrainFailed(f"{inst.id}'s units are already stopped but no drain of it passed the "
                                      "empty checks: its in-flight work cannot be accounted for",
                                      fix="read the journal; use `inv stop` to verify the stop and record it")
                say(f"  {inst.id} already stopped by an earlier drain that passed both empty checks: verifying")
            else:
                _wait_empty(plan, pool, j, op, say)
                verified.append(f"no open request ID and all queues 0, twice, {plan.interval_s:g}s apart")

        if not already_stopped:
            try:
                res = stop_and_verify(pool, inst, stop_timeout_s=inv.stop_timeout_s, say=say)
            except StopUnverified as exc:
                journal_stop(j, op, "verify-stop", inst, exc.result)
                raise
            journal_stop(j, op, "verify-stop", inst, res)
            verified.append("cgroup empty, every recorded PID gone or reused, ports closed")
            if res.strays:
                verified.append(f"stray process(es) found in the cgroup and stopped with it: {'; '.join(res.strays)}")
            if res.sigkill:
                verified.append("needed systemd's SIGKILL after TimeoutStopSec")
            unverified += sorted({f"GPU processes: {e.gpu}" for e in res.evidence if e.gpu.startswith("skipped")})
        else:
            # resumed: the stop happened in an earlier run; verify what can still be read
            for h, u in inst.units:
                st = pool.unit_states(h, [u])[u]
                if st.is_active:
                    raise Unverified(f"{u} on {h} is active again")
            listeners = port_facts.parse(pool.run(inst.head.host, port_facts.command()).stdout)
            open_ports = [p for p in (inst.http_port, inst.bootstrap_port)
                          if p and port_facts.is_listening(listeners, inst.head.data_addr, p)]
            if open_ports:
                raise Unverified(f"{inst.id} is stopped but ports {open_ports} are listening",
                                 fix=f"`inv stop --instance {inst.id} --kill-survivors` if the last stop listed survivors")
            last = last_stop_record(j, inst.id)
            recorded = (last or {}).get("evidence", {}).get("survivors") or []
            left = alive_survivors(pool, recorded) if recorded else []
            if left:
                raise Unverified(f"{inst.id} is stopped but processes recorded by its last stop still run",
                                 evidence="\n".join(describe_survivor(r) for r in left),
                                 fix=f"`inv stop --instance {inst.id} --kill-survivors`")
            verified.append("units inactive and ports closed (PIDs were recorded by the earlier run)"
                            + (f"; the {len(recorded)} survivor(s) the last stop recorded are gone" if recorded else ""))

    if plan.persist:
        new_pl = Placement(plan.placement.topology.__class__(
            len([i for i in plan.placement.instances if i.role == "prefill" and i.id != inst.id]),
            len([i for i in plan.placement.instances if i.role == "decode" and i.id != inst.id])),
            tuple(i for i in plan.placement.instances if i.id != inst.id))
        instances = {k: v for k, v in plan.rev.instances.items() if k != inst.id}
        hosts_files = {h: {p: m for p, m in files.items() if f"pdops-{inst.id}" not in p}
                       for h, files in plan.rev.manifest.items()}
        removed_files = {h: {p: m for p, m in files.items() if f"pdops-{inst.id}" in p}
                         for h, files in plan.rev.manifest.items()}
        rollback = {"restore": inst.id, "from_revision": plan.rev.number,
                    "how": "start its units, wait healthy, re-register with the gateway, canary its pairs",
                    "holds_while": "its hosts and rendered files are unchanged",
                    "files": {h: f for h, f in removed_files.items() if f},
                    "placement": [i for i in plan.placement.to_dict()["instances"] if i["id"] == inst.id]}
        rev = state.write_revision(topology=str(new_pl.topology), inventory_hash=plan.rev.inventory_hash,
                                   placement=new_pl.to_dict(), manifest=hosts_files, instances=instances,
                                   outcome="deployed", op_id=op, extra={"drained": inst.id, "rollback": rollback,
                                                                        "gateway": plan.rev.extra.get("gateway")})
        state.set_current(rev.number)
        j.step(op, "record", "ok", {"revision": rev.number, "rollback": rollback})
        verified.append(f"revision {rev.number} ({new_pl.topology}) is current")
    verdict = {"instance": inst.id, "verified": verified, "unverified": unverified, "notes": plan.notes}
    j.step(op, "verdict", "ok", verdict)
    return verdict


def _wait_empty(plan: DrainPlan, pool: HostPool, j, op: str, say: Say, prefix: str = "") -> None:
    """Wait until every source says empty, then the two empty checks, each a fresh reading of
    every source, `interval_s` apart. `prefix` names the instance in the step ids when a drain
    is one of several in an operation (`drain d02: empty-check-1`)."""
    inst = plan.instance
    deadline = time.monotonic() + plan.wait_s
    last = ""
    t0 = time.monotonic()
    while True:
        r = read_emptiness(pool, inst)
        if r.empty:
            break
        desc = r.describe()
        if desc != last:
            say(f"  waiting ({time.monotonic() - t0:.0f}s): {desc}")
            last = desc
        if time.monotonic() > deadline:
            j.step(op, f"{prefix}wait-empty", "deadline", {"open_rids": r.open_rids, "reading": desc})
            if plan.force_after:
                say(f"  deadline passed; --force-after: stopping with {len(r.open_rids)} request(s) open "
                    "(recorded in the journal as accepted loss)")
                j.step(op, f"{prefix}force-after", "accepted-loss", {"open_rids": r.open_rids})
                return
            raise DrainFailed(f"{inst.id} still has work after {plan.wait_s:g}s; the instance was NOT stopped "
                              f"(it is out of the gateway; re-add it with `inv rollback` or retry the drain)",
                              evidence="open request IDs: " + (", ".join(r.open_rids) or "none") + f"\n{desc}",
                              fix="wait and run the drain again, or --force-after to accept the loss")
        time.sleep(0.5)
    j.step(op, f"{prefix}wait-empty", "ok", {"seconds": round(time.monotonic() - t0, 2)})
    for n, pause in ((1, 0.0), (2, plan.interval_s)):
        time.sleep(pause)
        r = read_emptiness(pool, inst)
        if not r.empty:
            j.step(op, f"{prefix}empty-check-{n}", "failed", {"reading": r.describe(), "open_rids": r.open_rids})
            raise DrainFailed(f"{inst.id}: empty check {n}" + (f" ({plan.interval_s:g}s after check 1)" if n == 2 else "")
                              + f" found work: {r.describe()}; the instance was NOT stopped and stays out of "
                              "the gateway",
                              fix="something still sends it requests directly (not through the gateway); find it, "
                                  "then run the drain again")
        j.step(op, f"{prefix}empty-check-{n}", "ok", {"reading": "empty", "interval_s": pause})
        say(f"  empty-check {n} passed" + (f" ({pause:g}s later)" if n == 2 else ""))
