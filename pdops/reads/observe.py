"""What the cluster runs now, read from systemd on every host, the gateway's /workers and its
start-up list, and compared with what the current revision says should run. Read-only.

`inv deploy` of the live topology and `inv verify` decide from this, never from the record
alone: a unit down, a worker missing or not ready in the gateway, a MainPID that is not the
recorded one (systemd restarted the engine) are findings, each with its evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdops.model import membership
from pdops.errors import PdopsError
from pdops.facts.gateway import DRAINING, Worker
from pdops.facts.systemd import UnitState
from pdops.remote.gateway import GatewayClient
from pdops.remote.hosts import HostPool
from pdops.model.inventory import Inventory
from pdops.model.placement import Instance, Placement
from pdops.model.render import GATEWAY_UNIT
from pdops.fanout import run_parallel
from pdops.record.local import Revision


@dataclass
class InstanceObservation:
    instance: Instance
    units: dict[str, UnitState | str]  # "host:unit" -> its state, or why it could not be read
    recorded_pids: dict[str, int]  # "host:unit" -> MainPID recorded with the revision ({} for old records)
    worker: Worker | None
    in_list: bool | None  # in the gateway's start-up list; None: the list could not be read
    # "host:unit" -> the config id its MainPID carries (PDOPS_CONFIG in /proc/<pid>/environ; None:
    # none), and the one the revision rendered ({} for records older than config ids)
    running: dict[str, str | None] = field(default_factory=dict)
    expected: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.instance.id

    @property
    def down(self) -> list[str]:
        """Units not running (or unreadable)."""
        return [f"{k} {s.active_state}/{s.sub_state}" if isinstance(s, UnitState) else f"{k}: {s}"
                for k, s in self.units.items() if not (isinstance(s, UnitState) and s.active_state == "active")]

    @property
    def restarted(self) -> list[str]:
        """Running units whose MainPID is not the recorded one: systemd started the engine again."""
        out = []
        for k, s in self.units.items():
            rec = self.recorded_pids.get(k)
            if isinstance(s, UnitState) and s.active_state == "active" and rec and s.main_pid != rec:
                out.append(f"{k} MainPID {s.main_pid}, recorded {rec} (restarts: {s.n_restarts})")
        return out

    @property
    def stale(self) -> list[str]:
        """Running units whose process was started from other files than the revision's."""
        return [f"{k} runs files {self.running[k] or 'without a config id'}, the revision's are {want} "
                "(the files changed on disk; the process was not restarted)"
                for k, want in self.expected.items() if k in self.running and self.running[k] != want]

    @property
    def main_pids(self) -> dict[str, int | None]:
        return {k: s.main_pid for k, s in self.units.items() if isinstance(s, UnitState)}

    @property
    def gateway_problem(self) -> str | None:
        if self.worker is None:
            return "not in the gateway's /workers"
        if not self.worker.routable:
            return f"in the gateway but {self.worker.status or 'unknown'}, {'healthy' if self.worker.is_healthy else 'unhealthy'}"
        return None

    def findings(self) -> list[str]:
        out = [f"unit {d}" for d in self.down] + self.restarted + self.stale
        if self.gateway_problem:
            out.append(self.gateway_problem)
        if not self.in_list and self.in_list is not None:
            out.append("not in the gateway's start-up list")
        return out


@dataclass
class Observation:
    revision: int
    gateway_unit: UnitState | str
    gateway_error: str | None  # why /workers could not be read, else None
    workers: list[Worker]
    start_list: list[str] | None  # instance ids in the gateway's start-up list; None: unreadable
    instances: list[InstanceObservation] = field(default_factory=list)
    start_list_error: str | None = None
    gateway_running: str | None = None  # the gateway process's config id
    gateway_expected: str | None = None
    gateway_recorded_pid: int | None = None  # its MainPID when the revision was recorded (None: older records)

    @property
    def gateway_restarted(self) -> str | None:
        """The gateway runs, but not as the process the revision recorded: systemd (or someone) started
        it again. Its registrations came back from the start-up list; the requests it was carrying did
        not, and their prefill halves wait out the bootstrap timeout (pdops.reads.orphans)."""
        u = self.gateway_unit
        if self.gateway_down or not self.gateway_recorded_pid or not isinstance(u, UnitState) \
                or u.main_pid == self.gateway_recorded_pid:
            return None
        return (f"gateway {GATEWAY_UNIT} restarted: MainPID {u.main_pid}, recorded {self.gateway_recorded_pid} "
                f"(restarts by systemd: {u.n_restarts})")

    @property
    def gateway_stale(self) -> str | None:
        if self.gateway_expected is None or self.gateway_down or self.gateway_running == self.gateway_expected:
            return None
        return (f"gateway {GATEWAY_UNIT} runs files {self.gateway_running or 'without a config id'}, the revision's "
                f"are {self.gateway_expected} (not restarted since its files changed)")

    @property
    def gateway_down(self) -> bool:
        u = self.gateway_unit
        return self.gateway_error is not None or not (isinstance(u, UnitState) and u.active_state == "active")

    @property
    def unknown_workers(self) -> list[Worker]:
        """Workers the gateway routes to that the revision does not know. A worker the gateway is
        draining takes no new request: right after a drain smg keeps the removed worker listed as
        draining for a few seconds (docs/design/sglang.md), which is not a difference to repair."""
        urls = {o.instance.url.rstrip("/") for o in self.instances}
        return [w for w in self.workers if w.url.rstrip("/") not in urls and w.status != DRAINING]

    def findings(self) -> list[str]:
        out = []
        if self.gateway_down:
            u = self.gateway_unit
            state = f"{u.active_state}/{u.sub_state}" if isinstance(u, UnitState) else u
            out.append(f"gateway {GATEWAY_UNIT}: {state}" + (f"; {self.gateway_error}" if self.gateway_error else ""))
        if self.gateway_stale:
            out.append(self.gateway_stale)
        if self.gateway_restarted:
            out.append(self.gateway_restarted)
        if self.start_list_error:
            out.append(f"the gateway's start-up list {membership.PATH} unreadable: {self.start_list_error}")
        for o in self.instances:
            out += [f"{o.id}: {f}" for f in o.findings()]
        out += [f"gateway routes to {w.describe()}, which revision {self.revision} does not know"
                for w in self.unknown_workers]
        return out

    def summary(self) -> str:
        """One line of what was seen, for a verdict that says "no change"."""
        n = len(self.instances)
        units = sum(len(o.units) for o in self.instances)
        return (f"observed: {units} unit(s) of {n} instance(s) active with their recorded MainPIDs"
                + (", each process started from this revision's files" if any(o.expected for o in self.instances)
                   else "") + f", {n} worker(s) "
                f"healthy and ready in the gateway, none unknown, the gateway's start-up list = revision "
                f"{self.revision}'s instances")


@dataclass(frozen=True)
class Seen:
    """What a change plans from (pdops.ops.scale.plan_change), read from an Observation: which instances
    of the revision serve now, and whether the gateway answers. Pure data: a plan case writes one."""

    not_serving: dict[str, str] = field(default_factory=dict)  # instance id -> why it does not serve now
    down: frozenset[str] = frozenset()  # of those, the ones whose units are not active: nothing to drain
    gateway: str | None = None  # why the gateway does not answer; None: it answers
    gateway_active: bool = True  # its unit is active (hung, not stopped): restarted rather than started

    @classmethod
    def of(cls, obs: Observation) -> "Seen":
        """An instance serves when its units are active and the gateway routes to it (with the gateway
        down: when it is in the start-up list the gateway registers again after its start)."""
        not_serving: dict[str, str] = {}
        down = set()
        for o in obs.instances:
            if o.down:
                not_serving[o.id] = "units not running: " + "; ".join(o.down)
                down.add(o.id)
            elif obs.gateway_down:
                if o.in_list is False:
                    not_serving[o.id] = "not in the gateway's start-up list"
            elif o.gateway_problem:
                not_serving[o.id] = o.gateway_problem
        gateway = None
        if obs.gateway_down:
            u = obs.gateway_unit
            gateway = (f"{GATEWAY_UNIT} {u.active_state}/{u.sub_state}" if isinstance(u, UnitState) else
                       f"{GATEWAY_UNIT}: {u}") + (f"; {obs.gateway_error}" if obs.gateway_error else "")
        active = isinstance(obs.gateway_unit, UnitState) and obs.gateway_unit.active_state == "active"
        return cls(not_serving, frozenset(down), gateway, active)

    @property
    def all_serving(self) -> bool:
        return not self.not_serving and self.gateway is None


def observe(inv: Inventory, rev: Revision, pool: HostPool, gateway: GatewayClient) -> Observation:
    """Read systemd on every host of the revision, the gateway's /workers and its start-up list."""
    pl = Placement.from_dict(rev.placement)
    by_host: dict[str, list[str]] = {inv.gateway.host: [GATEWAY_UNIT]}
    for inst in pl.instances:
        for h, u in inst.units:
            by_host.setdefault(h, []).append(u)
    unit_res = run_parallel(list(by_host), lambda h: with_configs(pool, h, by_host[h]))

    def state_of(host: str, unit: str) -> UnitState | str:
        r = unit_res.get(host)
        if isinstance(r, Exception):
            return f"unreadable: {getattr(r, 'message', r)}"
        return r[0].get(unit) or "not reported by systemd"

    def running_of(host: str, units) -> dict[str, str | None]:
        r = unit_res.get(host)
        if isinstance(r, Exception):
            return {}
        return {f"{host}:{u}": r[1][u] for u in units if u in r[1]}

    expected = (rev.extra or {}).get("configs") or {}

    try:
        workers, gw_error = gateway.list_workers(), None
    except PdopsError as exc:
        workers, gw_error = [], exc.message
    try:
        start_list, list_error = membership.listed_ids(membership.read(pool, inv)), None
    except PdopsError as exc:
        start_list, list_error = None, exc.message
    by_url = {w.url.rstrip("/"): w for w in workers}
    gw_key = f"{inv.gateway.host}:{GATEWAY_UNIT}"
    obs = Observation(rev.number, state_of(inv.gateway.host, GATEWAY_UNIT), gw_error, workers, start_list,
                      start_list_error=list_error, gateway_expected=expected.get(gw_key),
                      gateway_running=running_of(inv.gateway.host, [GATEWAY_UNIT]).get(gw_key),
                      gateway_recorded_pid=(rev.extra or {}).get("gateway_main_pid"))
    for inst in pl.instances:
        recorded = (rev.instances.get(inst.id) or {}).get("main_pids") or {}
        obs.instances.append(InstanceObservation(
            inst, {f"{h}:{u}": state_of(h, u) for h, u in inst.units}, {k: int(v) for k, v in recorded.items() if v},
            by_url.get(inst.url.rstrip("/")), None if start_list is None else inst.id in start_list,
            running={k: v for h in inst.hosts for k, v in running_of(h, [u for hh, u in inst.units if hh == h]).items()},
            expected={f"{h}:{u}": expected[f"{h}:{u}"] for h, u in inst.units if f"{h}:{u}" in expected}))
    return obs


def with_configs(pool: HostPool, host: str, units: list[str]) -> tuple[dict[str, UnitState], dict[str, str | None]]:
    """Units' states and, for each running one, the config id its MainPID carries; one SSH round trip
    for the config ids of every unit on the host."""
    states = pool.unit_states(host, units)
    pids = {u: s.main_pid for u, s in states.items() if s.active_state == "active" and s.main_pid}
    return states, running_configs(pool, host, pids)


def running_configs(pool: HostPool, host: str, pids: dict[str, int]) -> dict[str, str | None]:
    """{unit: the config id its MainPID was started with, or None}: the launch script writes
    "<PID> <PDOPS_CONFIG>" into the unit's RuntimeDirectory before it execs (the PID survives the
    exec), so the note counts only when its PID is the unit's MainPID now. Read from this note, not
    /proc/<pid>/environ: a process that sets its title (smg does) overwrites its environ area."""
    from pdops.facts import q
    from pdops.model.render import RUN_DIR, runtime_dir

    if not pids:
        return {}
    script = "; ".join(f"printf '%s ' {q(u)}; head -n1 {q(f'{RUN_DIR}/{runtime_dir(u)}/config')} 2>/dev/null || echo -"
                       for u in pids)
    out = pool.run(host, script).stdout
    seen: dict[str, str | None] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] in pids and parts[1].isdigit() and int(parts[1]) == pids[parts[0]]:
            seen[parts[0]] = parts[2]
        elif parts and parts[0] in pids:
            seen.setdefault(parts[0], None)
    return {u: seen.get(u) for u in pids}
