"""What an observation of the cluster holds, as values: each instance's units, gateway rows and
start-up list entries (InstanceObservation), each gateway's (GatewayObservation), the whole reading
(Observation), and what a change plans from (Seen). Made by pdops.reads.observe; judged by
pdops.reads.status; pure data (a plan case writes a Seen)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdops.facts.gateway import DRAINING, READY, UNREAD, Worker
from pdops.facts.systemd import UnitState
from pdops.model import membership
from pdops.model.placement import Instance
from pdops.model.render import GATEWAY_UNIT
from pdops.reads.identity import RankIdentity


def other_start(st: UnitState, recorded: list | None) -> bool:
    """The unit's main process has the recorded PID but not its recorded start: another process."""
    if not recorded or len(recorded) != 2 or not st.exec_main_start_monotonic_us:
        return False
    pid, start = recorded
    return st.main_pid == pid and st.exec_main_start_monotonic_us != start


@dataclass
class InstanceObservation:
    instance: Instance
    units: dict[str, UnitState | str]  # "host:unit" -> its state, or why it could not be read
    recorded_pids: dict[str, int]  # "host:unit" -> MainPID recorded with the revision ({} for old records)
    # gateway host -> its worker at the instance's URL (None: not listed); only gateways that answered
    workers: dict[str, Worker | None]
    # gateway host -> in that gateway's start-up list (None: the list could not be read)
    listed: dict[str, bool | None]
    # "host:unit" -> the config id its MainPID carries (PDOPS_CONFIG in /proc/<pid>/environ; None:
    # none), and the one the revision rendered ({} for records older than config ids)
    running: dict[str, str | None] = field(default_factory=dict)
    expected: dict[str, str] = field(default_factory=dict)
    # "host:unit" -> [MainPID, its start (µs, monotonic)] recorded with the revision ({}: older records)
    recorded_starts: dict[str, list] = field(default_factory=dict)
    # its own files (unit, launch script, env file) that are not as the revision rendered them on the
    # host now: "<host>:<path> <how>" (edited there, or missing); [] when they are, or were not read
    edited: list[str] = field(default_factory=list)

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
            elif isinstance(s, UnitState) and s.active_state == "active" and other_start(s, self.recorded_starts.get(k)):
                out.append(f"{k} MainPID {s.main_pid} is the recorded PID of another process (it started at "
                           f"another time: a reboot, or PIDs came round)")
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
    def worker(self) -> Worker | None:
        """Its worker in the first gateway that lists it (for display)."""
        return next((w for w in self.workers.values() if w is not None), None)

    @property
    def in_list(self) -> bool | None:
        """In every readable gateway's start-up list (None: no list could be read)."""
        known = [v for v in self.listed.values() if v is not None]
        return None if not known else all(known)

    def gateway_problems(self) -> dict[str, str]:
        """{gateway host: why it does not route to this instance} for each gateway that answered."""
        out = {}
        for host, w in self.workers.items():
            if w is None:
                out[host] = "not in its /workers"
            elif not w.routable:
                out[host] = (f"listed {w.status or 'unknown'}, {'healthy' if w.is_healthy else 'unhealthy'}"
                             if not (w.is_healthy and w.status == READY) else f"{w.breaker_problem} on gateway {host}")
        return out

    @property
    def breaker_only(self) -> bool:
        """What keeps a gateway from routing to it is only an open (or unread) circuit breaker: its
        engine answers health checks; registering it again closes the breaker, no restart needed."""
        ws = [w for w in self.workers.values() if w is not None and not w.routable]
        return bool(ws) and len(ws) == len(self.gateway_problems()) and all(
            w.is_healthy and w.status == READY and w.breaker_problem for w in ws)

    @property
    def gateway_problem(self) -> str | None:
        probs = self.gateway_problems()
        if not probs:
            return None
        if len(self.workers) == 1:
            why = next(iter(probs.values()))
            if self.breaker_only:
                return why.rsplit(" on gateway ", 1)[0] + " in the gateway (it routes nothing to it)"
            return {"not in its /workers": "not in the gateway's /workers"}.get(
                why, "in the gateway but " + why.removeprefix("listed "))
        return "; ".join(f"gateway {h}: {why}" for h, why in sorted(probs.items()))

    @property
    def runs_edited(self) -> bool:
        """Its files were changed on the host and its process may run them, or will at its next start: a
        unit down, or a MainPID that is not the recorded one (which was shown to run the revision's files)."""
        return bool(self.edited) and bool(self.down or self.restarted or not self.recorded_pids)

    def findings(self) -> list[str]:
        out = [f"unit {d}" for d in self.down] + self.restarted + self.stale + self.edited
        if self.gateway_problem:
            out.append(self.gateway_problem)
        if self.list_problem():
            out.append(self.list_problem())
        return out

    def list_problem(self, *, consequence: bool = False) -> str | None:
        """Which gateways' start-up lists lack it (None: every list has it); `consequence`: with what a
        restart of that gateway would do (`inv status` says it)."""
        missing = sorted(h for h, v in self.listed.items() if v is False)
        if not missing:
            return None
        if len(self.listed) == 1:
            return "not in the gateway's start-up list" + (" (a gateway restart would drop it)" if consequence else "")
        return f"not in the start-up list of gateway {', '.join(missing)}" + (" (its restart would drop it)"
                                                                             if consequence else "")


@dataclass
class GatewayObservation:
    """One gateway as read now: its unit, its /workers and its start-up list."""

    host: str
    unit: UnitState | str
    error: str | None  # why /workers could not be read, else None
    workers: list[Worker]
    start_list: list[str] | None  # instance ids in its start-up list; None: unreadable
    start_list_error: str | None = None
    running: str | None = None  # the process's config id
    expected: str | None = None
    recorded_pid: int | None = None  # its MainPID when the revision was recorded (None: older records)
    several: bool = False  # one of several gateways: its host is named in what is said of it
    recorded_start: list | None = None  # [MainPID, start µs] recorded with the revision (None: older records)

    @property
    def down(self) -> bool:
        u = self.unit
        return self.error is not None or not (isinstance(u, UnitState) and u.active_state == "active")

    @property
    def restarted(self) -> str | None:
        """It runs, but not as the process the revision recorded: systemd (or someone) started it
        again. Its registrations came back from the start-up list; the requests it was carrying did
        not, and their prefill halves wait out the bootstrap timeout (pdops.reads.orphans)."""
        u = self.unit
        if self.down or not self.recorded_pid or not isinstance(u, UnitState):
            return None
        if u.main_pid == self.recorded_pid:
            if other_start(u, self.recorded_start):
                return (f"{self.label} restarted: MainPID {u.main_pid} is the recorded PID of another process (it "
                        f"started at another time: a reboot, or PIDs came round)")
            return None
        return (f"{self.label} restarted: MainPID {u.main_pid}, recorded {self.recorded_pid} "
                f"(restarts by systemd: {u.n_restarts})")

    @property
    def stale(self) -> str | None:
        if self.expected is None or self.down or self.running == self.expected:
            return None
        return (f"{self.label} runs files {self.running or 'without a config id'}, the revision's "
                f"are {self.expected} (not restarted since its files changed)")

    @property
    def label(self) -> str:
        return f"gateway {GATEWAY_UNIT}" + (f" on {self.host}" if self.several else "")

    @property
    def state(self) -> str:
        u = self.unit
        return f"{u.active_state}/{u.sub_state}" if isinstance(u, UnitState) else u

    def why_down(self) -> str:
        return f"{self.label}: {self.state}" + (f"; {self.error}" if self.error else "")

    def unknown_workers(self, instances) -> list[Worker]:
        """Workers it routes to that the revision does not know. A worker the gateway is draining
        takes no new request: right after a drain smg keeps the removed worker listed as draining
        for a few seconds (docs/design/sglang.md), which is not a difference to repair."""
        urls = {o.instance.url.rstrip("/") for o in instances}
        return [w for w in self.workers if w.url.rstrip("/") not in urls and w.status != DRAINING]

    def findings(self, revision: int, instances) -> list[str]:
        out = [self.why_down()] if self.down else []
        out += [x for x in (self.stale, self.restarted) if x]
        if self.start_list_error:
            out.append(f"the gateway's start-up list {membership.PATH}" + (f" on {self.host}" if self.several else "")
                       + f" unreadable: {self.start_list_error}")
        unread = sorted({w.breaker_unknown for w in self.workers if w.breaker is not None and w.breaker.state == UNREAD})
        if unread and not self.down:
            out.append(f"{self.label}: {unread[0].removeprefix('its ')}: whether it routes to its workers is not known "
                       "(their breakers are neither taken as open nor said to be closed)")
        out += [f"{'gateway' if not self.several else self.label} routes to {w.describe()}, which revision "
                f"{revision} does not know"
                for w in self.unknown_workers(instances)]
        return out


@dataclass
class Observation:
    revision: int
    gateways: list[GatewayObservation]
    instances: list[InstanceObservation] = field(default_factory=list)
    # what HAProxy (each admission host) does not do as deployed: a gateway not UP or not at its weight
    front_door: list[str] = field(default_factory=list)
    # admission host -> why its front-door units (HAProxy; keepalived with a virtual address) are not running
    admission_down: dict[str, str] = field(default_factory=dict)
    # the record's etcd members pdops runs (`pdops_state.etcd.members`, the record on them): member host ->
    # why its unit is not running (the record holds while a majority runs)
    store_down: dict[str, str] = field(default_factory=dict)
    # with `cgroups=True` (inv status): "host:unit" -> its identity now (MainPID, its cgroup's processes
    # with their process-table entries), and host -> why its cgroups could not be read
    identities: dict[str, RankIdentity] = field(default_factory=dict)
    identity_errors: dict[str, str] = field(default_factory=dict)
    # the instances whose units were read (`units_of`); None: every instance's
    units_read: frozenset[str] | None = None

    @property
    def gateway_down(self) -> bool:
        """Some gateway is down (or its /workers unreadable)."""
        return any(g.down for g in self.gateways)

    @property
    def gateway_restarted(self) -> str | None:
        return "; ".join(x for x in (g.restarted for g in self.gateways) if x) or None

    @property
    def serving_gateways(self) -> list[GatewayObservation]:
        return [g for g in self.gateways if not g.down]

    def admission_findings(self) -> list[str]:
        return [f"the admission layer on {h} is not running ({why}): the front door there turns every request away"
                for h, why in sorted(self.admission_down.items())]

    def store_findings(self) -> list[str]:
        return [f"the record's etcd member on {h} is not running ({why}): the record holds while a majority of the "
                "members runs" for h, why in sorted(self.store_down.items())]

    def findings(self) -> list[str]:
        out = [f for g in self.gateways for f in g.findings(self.revision, self.instances)] + list(self.front_door)
        out += self.admission_findings() + self.store_findings()
        for o in self.instances:
            out += [f"{o.id}: {f}" for f in o.findings()]
        return out

    def summary(self) -> str:
        """One line of what was seen, for a verdict that says "no change"."""
        n = len(self.instances)
        units = sum(len(o.units) for o in self.instances)
        where = "the gateway" if len(self.gateways) == 1 else f"each of the {len(self.gateways)} gateways"
        return (f"observed: {units} unit(s) of {n} instance(s) active with their recorded MainPIDs"
                + (", each process started from this revision's files" if any(o.expected for o in self.instances)
                   else "") + f", {n} worker(s) "
                f"healthy and ready in {where}, none unknown, {where}'s start-up list = revision "
                f"{self.revision}'s instances")


@dataclass(frozen=True)
class Seen:
    """What a change plans from (pdops.ops.scale.plan_change), read from an Observation: which instances
    of the revision serve now, and which gateways do not answer. Pure data: a plan case writes one."""

    not_serving: dict[str, str] = field(default_factory=dict)  # instance id -> why it does not serve now
    down: frozenset[str] = frozenset()  # of those, the ones whose units are not active: nothing to drain
    gateways_down: dict[str, str] = field(default_factory=dict)  # gateway host -> why it does not answer
    gateways_active: frozenset[str] = frozenset()  # of those, the ones whose unit is active (hung): restarted
    basis: str = ""  # what it was read from, when not every instance's units were read (a plan prints it)

    @classmethod
    def of(cls, obs: Observation) -> "Seen":
        """An instance serves when its units are active and a gateway that answers routes to it (with
        every gateway down: when it is in a start-up list the gateway registers again after its start).
        A gateway that answers but does not route to it is a finding to repair, not a lost instance."""
        not_serving: dict[str, str] = {}
        down = set()
        up = obs.serving_gateways
        for o in obs.instances:
            if o.down:
                not_serving[o.id] = "units not running: " + "; ".join(o.down)
                down.add(o.id)
            elif not up:
                if o.in_list is False:
                    not_serving[o.id] = "not in the gateway's start-up list"
            elif all(g.host in o.gateway_problems() for g in up):
                not_serving[o.id] = o.gateway_problem
        gdown = {g.host: f"{GATEWAY_UNIT} {g.state}" + (f"; {g.error}" if g.error else "")
                 for g in obs.gateways if g.down}
        active = frozenset(g.host for g in obs.gateways if g.down and isinstance(g.unit, UnitState)
                           and g.unit.active_state == "active")
        basis = ""
        if obs.units_read is not None:
            basis = (f"systemd read for {', '.join(sorted(obs.units_read))}; each other instance counted as serving "
                     "where a gateway that answers routes to it (its units not read: the gateway's health check "
                     "stands for them)")
        return cls(not_serving, frozenset(down), gdown, active, basis)

    @property
    def gateway(self) -> str | None:
        """Why gateways do not answer, in one line; None: every gateway answers."""
        if not self.gateways_down:
            return None
        if len(self.gateways_down) == 1:
            return next(iter(self.gateways_down.values()))
        return "; ".join(f"{h}: {why}" for h, why in sorted(self.gateways_down.items()))

    @property
    def all_serving(self) -> bool:
        return not self.not_serving and not self.gateways_down
