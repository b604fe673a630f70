"""Reading an instance and stopping it by identity: the emptiness of its queues, the verified stop
(unit -> MainPID -> cgroup, process tree with start times), and the survivors of a stop (ended
only by PID and start time, never by name)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdops.errors import PdopsError, Unreachable, Unverified
from pdops.facts import cgroup as cg_facts
from pdops.facts import engine as engine_facts
from pdops.facts import gateway as gw_facts
from pdops.facts import nvidia as nv_facts
from pdops.facts import ports as port_facts
from pdops.facts import procs as proc_facts
from pdops.facts import Skipped, q, requestlog, skipped_in
from pdops.remote.gateway import GatewayClient, deadline_in
from pdops.remote.hosts import HostPool, http_json
from pdops.facts import shm as shm_facts
from pdops.reads.identity import RankIdentity, record_identity
from pdops.model.placement import Instance
from pdops.model.commands import RUN_DIR, runtime_dir
from pdops.runner import Say


# ---------------------------------------------------------------- reading the instance

@dataclass
class EmptyReading:
    open_rids: list[str]
    loads_busy: dict
    metrics_busy: dict
    metrics_missing: list[str]
    errors: list[str]
    # /v1/loads answered with every queue of every rank (busy or not)
    loads_read: bool = False

    @property
    def empty(self) -> bool:
        # Real SGLang 0.5.23 exports its queue gauges only once its scheduler has run a batch: a decode
        # that served nothing since its start (PD mode: its /health runs no generation) has none, for
        # as long as it stays idle (docs/sim.md). /v1/loads, the engine's own answer, has every queue
        # from the start: absent gauges count only when it did not answer.
        missing = self.metrics_missing and not self.loads_read
        return not (self.open_rids or self.loads_busy or self.metrics_busy or missing or self.errors)

    @property
    def engine_idle(self) -> bool:
        """/v1/loads answered every queue empty and /metrics shows nothing busy: the scheduler holds nothing."""
        return self.loads_read and not self.loads_busy and not self.metrics_busy and not self.errors

    def describe(self) -> str:
        parts = []
        if self.open_rids:
            shown = ", ".join(self.open_rids[:5]) + (" ..." if len(self.open_rids) > 5 else "")
            parts.append(f"{len(self.open_rids)} open request(s) [{shown}]")
            if self.engine_idle:
                # SGLang 0.5.23 logs a request received before it validates it: one refused there (400,
                # e.g. longer than the context) is never logged finished, and no rid ties its error line
                # to it. pdops cannot tell it from one still being tokenized: it waits, and says so.
                parts.append("the engine reports nothing running or queued: open in its request log only (a "
                             "request refused before the scheduler, e.g. 400 over-context, stays logged as "
                             "received; its error line names no request ID); --force-after stops at the deadline")
        if self.loads_busy:
            parts.append(f"/v1/loads busy {self.loads_busy}")
        if self.metrics_busy:
            parts.append(f"/metrics busy {self.metrics_busy}")
        if self.metrics_missing:
            parts.append(f"/metrics lacks {self.metrics_missing}"
                         + (" (no batch run since its start; /v1/loads answered every queue)" if self.loads_read else ""))
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
    loads_read = False
    try:
        status, doc = http_json("GET", f"{inst.url}{engine_facts.LOADS_PATH}", timeout=5)
        if status != 200:
            errors.append(f"/v1/loads answered {status}")
        else:
            loads = engine_facts.parse_loads(doc)
            loads_busy, loads_read = loads.busy(), True
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
    return EmptyReading(open_rids, loads_busy, metrics_busy, missing, errors, loads_read)


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
    # the unit's RuntimeDirectory (its notes, the engine's TMPDIR): "removed by systemd", or what is left
    runtime_dir: str = ""

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
                        empty, survivors, open_ports, gpu, records, runtime_dir_left(pool, ident.host, ident.unit))


def runtime_dir_left(pool: HostPool, host: str, unit: str) -> str:
    """Whether systemd removed the stopped unit's RuntimeDirectory (with the engine's TMPDIR: SGLang's
    IPC sockets and scratch files), read on the host."""
    path = f"{RUN_DIR}/{runtime_dir(unit)}"
    try:
        out = pool.run(host, f"if [ -e {q(path)} ]; then echo left $(find {q(path)} -mindepth 1 | wc -l); "
                             "else echo removed; fi").stdout.split()
    except PdopsError as exc:
        return f"{path} unreadable: {exc.message}"
    if out[:1] == ["removed"]:
        return f"{path} removed by systemd"
    return f"{path} still there ({out[1] if len(out) > 1 else '?'} entries)"


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
    # what the stopped processes left in /dev/shm and pdops removed ("<path> (<n> bytes)"), and what it
    # kept ("<path>: <why>")
    shm_removed: list[str] = field(default_factory=list)
    shm_kept: list[str] = field(default_factory=list)

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
        return {"seconds": self.seconds, "strays": self.strays, "shm_removed": self.shm_removed,
                "shm_kept": self.shm_kept,
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


def instance_ports(inst: Instance) -> list[int]:
    """The ports the instance's head rank serves on (HTTP, and a prefill's bootstrap server)."""
    return [p for p in (inst.http_port, inst.bootstrap_port) if p]


def held_ports(pool: HostPool, inst: Instance, idents: dict) -> list[int]:
    """Of the instance's ports, those its head rank's own processes (the recorded tree) listen on now
    (`ss -Hltnp`): what its verified stop must find closed when it may never have listened (an
    instance a halted change started: its port may be another process's, the reason it failed)."""
    head_host, head_unit = inst.units[0]
    mine = set(idents[head_unit].tree)
    listeners = port_facts.parse(pool.run(head_host, port_facts.command()).stdout)
    return sorted({ln.port for ln in listeners if ln.port in instance_ports(inst) and mine & set(ln.pids)})


def verify_units_stopped(pool: HostPool, inst: Instance, idents: dict, seconds: float, *,
                         ports: list[int] | None = None, say: Say | None = None) -> StopResult:
    """Prove the stop from what the hosts report now (see :func:`verify_stopped`); `ports`: those that
    must be closed (default: every port of the instance)."""
    head_unit = inst.units[0][1]
    strays = [f"{i.host}:{i.unit} {s}" for i in idents.values() for s in i.strays]
    ports = instance_ports(inst) if ports is None else ports
    evidence = [verify_stopped(pool, idents[u], ports if u == head_unit else [], inst.head.data_addr)
                for h, u in inst.units]
    result = StopResult(idents, evidence, strays, seconds)
    if say:
        if strays:
            say(f"  found in the cgroup but outside MainPID's tree (stopped with the cgroup): {'; '.join(strays)}")
        for e in evidence:
            say(f"  {e.host}:{e.unit}: result {e.result}; cgroup {'empty' if e.cgroup_empty else 'NOT EMPTY'};"
                f" {'no survivor' if not e.survivors else 'SURVIVORS ' + ', '.join(e.survivors)}; "
                f"ports {'closed' if not e.ports_open else 'OPEN ' + str(e.ports_open)}; GPU: {e.gpu}"
                + (f"; {e.runtime_dir}" if e.runtime_dir else ""))
            if e.sigkill:
                say(f"  note: {e.unit} did not exit on SIGTERM; systemd's SIGKILL after TimeoutStopSec "
                    "emptied the cgroup")
    if not result.verified:
        raise StopUnverified(inst, result)
    clean_shm(pool, result, say)
    return result


def clean_shm(pool: HostPool, result: StopResult, say: Say | None = None) -> None:
    """After a verified stop: the /dev/shm files the stopped processes mapped (read before the stop),
    removed by exact path where no process maps them now (real SGLang leaves its load snapshot file at
    every stop: pdops.facts.shm). A host that cannot be read or written keeps them, and says so."""
    for ident in result.idents.values():
        if not ident.shm:
            continue
        try:
            removed, kept = shm_facts.parse_removed(pool.run(ident.host, shm_facts.remove_command(ident.shm)).stdout)
        except PdopsError as exc:
            removed, kept = [], [f"{p}: not removed ({exc.message})" for p in ident.shm]
        result.shm_removed += [f"{ident.host}:{r}" for r in removed]
        result.shm_kept += [f"{ident.host}:{k}" for k in kept]
    if say and (result.shm_removed or result.shm_kept):
        say("  left in /dev/shm by the stopped processes: "
            + "; ".join([f"removed {r}" for r in result.shm_removed] + [f"kept {k}" for k in result.shm_kept]))


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
    for r in reversed(j.tagged(f"stop:{instance}")):
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
