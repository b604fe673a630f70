"""What the cluster runs now, read from systemd on every host, the gateway's /workers and its
start-up list, and compared with what the current revision says should run. Read-only.

`inv deploy` of the live topology and `inv verify` decide from this, never from the record
alone: a unit down, a worker missing or not ready in the gateway, a MainPID that is not the
recorded one (systemd restarted the engine) are findings, each with its evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdops.model import membership
from pdops.errors import PdopsError, Unverified
from pdops.facts import cgroup as cg_facts, files as file_facts, procs as proc_facts, q, systemd as systemd_facts
from pdops.facts.gateway import DRAINING, READY, UNREAD, Worker
from pdops.facts.systemd import UnitState
from pdops.remote.gateway import Gateways
from pdops.remote.hosts import HostPool
from pdops.model.inventory import Inventory
from pdops.model.placement import Instance, Placement
from pdops.model.admission import KEEPALIVED_UNIT, UNIT as ADMISSION_UNIT
from pdops.model.etcd_member import UNIT as ETCD_UNIT
from pdops.model.render import GATEWAY_UNIT, RUN_DIR, runtime_dir
from pdops.fanout import run_parallel
from pdops.record.local import Revision
from pdops.reads.identity import RankIdentity
from pdops.remote.haproxy import front_door_problems


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
        missing = sorted(h for h, v in self.listed.items() if v is False)
        if missing:
            out.append("not in the gateway's start-up list" if len(self.listed) == 1
                       else f"not in the start-up list of gateway {', '.join(missing)}")
        return out


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


def observe(inv: Inventory, rev: Revision, pool: HostPool, gateways: Gateways, *,
            units_of: frozenset[str] | None = None, cgroups: bool = False) -> Observation:
    """Read systemd on every host of the revision, each gateway's /workers and start-up list.

    `units_of`: read systemd only for these instances' units (and the gateways'): what one instance's
    operation needs (a drain: its own units; the others of its role serve when a gateway that answers
    routes to them, which its health check proved within its interval), so that its cost does not grow
    with the fleet. The others' units are then absent (`InstanceObservation.units` empty): never down.
    `cgroups`: also each unit's cgroup processes in the same round trip (`Observation.identities`)."""
    pl = Placement.from_dict(rev.placement)
    by_host: dict[str, list[str]] = {h: [GATEWAY_UNIT] for h in inv.gateway.hosts}
    adm_hosts = list(inv.admission.hosts) if inv.admission is not None else []
    # the front door's units (HAProxy; keepalived where a virtual address is rendered), read in the
    # same round trip as the host's others
    adm_units = [ADMISSION_UNIT] + ([KEEPALIVED_UNIT] if inv.admission is not None and inv.admission.vip else [])
    for h in adm_hosts:
        by_host.setdefault(h, []).extend(adm_units)
    members = etcd_members_run(inv)  # the record's store, where pdops runs it: read in the same round trip
    for h in members:
        by_host.setdefault(h, []).append(ETCD_UNIT)
    for inst in pl.instances:
        if units_of is not None and inst.id not in units_of:
            continue
        for h, u in inst.units:
            by_host.setdefault(h, []).append(u)
    own_files = {h: {u: unit_files(rev.manifest, h, u) for u in units} for h, units in by_host.items()}
    host_res = run_parallel(list(by_host), lambda h: read_host(
        pool, h, by_host[h], cgroups=cgroups, files=sorted(p for fs in own_files[h].values() for p in fs)))
    unit_res = {h: r if isinstance(r, Exception) else (r.states, r.configs) for h, r in host_res.items()}

    def edited_of(host: str, units) -> list[str]:
        r = host_res.get(host)
        if isinstance(r, Exception) or r.files is None:
            return []
        return [f"{host}:{path} {how}" for u in units for path, want in own_files[host].get(u, {}).items()
                if (how := file_drift(r.files.get(path), want, rev.number))]

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
    extra = rev.extra or {}
    # records before several gateways kept one MainPID: the first gateway's
    recorded = extra.get("gateway_main_pids") or (
        {inv.gateway.hosts[0]: extra["gateway_main_pid"]} if extra.get("gateway_main_pid") else {})
    starts = extra.get("main_starts") or {}

    def read_gateway(host: str) -> GatewayObservation:
        try:
            workers, error = gateways.client(host).list_workers(), None
        except PdopsError as exc:
            workers, error = [], exc.message
        try:
            start_list, list_error = membership.listed_ids(membership.read(pool, host)), None
        except PdopsError as exc:
            start_list, list_error = None, exc.message
        key = f"{host}:{GATEWAY_UNIT}"
        return GatewayObservation(host, state_of(host, GATEWAY_UNIT), error, workers, start_list, list_error,
                                  running=running_of(host, [GATEWAY_UNIT]).get(key), expected=expected.get(key),
                                  recorded_pid=recorded.get(host), several=len(inv.gateway.hosts) > 1,
                                  recorded_start=starts.get(key))

    gw_res = run_parallel(list(inv.gateway.hosts), read_gateway)
    gws = [gw_res[h] if not isinstance(gw_res[h], Exception) else
           GatewayObservation(h, state_of(h, GATEWAY_UNIT), str(gw_res[h]), [], None, str(gw_res[h]),
                              several=len(inv.gateway.hosts) > 1)
           for h in inv.gateway.hosts]
    admission_down = {h: "; ".join(f"{u} {why}" for u in adm_units if (why := _unit_down(state_of(h, u))))
                      for h in adm_hosts}
    admission_down = {h: why for h, why in admission_down.items() if why}
    store_down = {h: f"{ETCD_UNIT} {why}" for h in members if (why := _unit_down(state_of(h, ETCD_UNIT)))}
    obs = Observation(rev.number, gws, front_door=_front_door(inv, pool, admission_down), units_read=units_of,
                      admission_down=admission_down, store_down=store_down)
    for h, r in host_res.items() if cgroups else ():
        if isinstance(r, Exception):
            obs.identity_errors[h] = getattr(r, "message", str(r))
        elif r.cgroups_error:
            obs.identity_errors[h] = r.cgroups_error
        else:
            obs.identities.update({f"{h}:{u}": ident for u, ident in r.identities.items()})
    answered = [g for g in gws if g.error is None]
    for inst in pl.instances:
        rec = (rev.instances.get(inst.id) or {}).get("main_pids") or {}
        url = inst.url.rstrip("/")
        read = units_of is None or inst.id in units_of
        obs.instances.append(InstanceObservation(
            inst, {f"{h}:{u}": state_of(h, u) for h, u in inst.units} if read else {},
            {k: int(v) for k, v in rec.items() if v},
            {g.host: next((w for w in g.workers if w.url.rstrip("/") == url), None) for g in answered},
            {g.host: None if g.start_list is None else inst.id in g.start_list for g in gws},
            running={k: v for h in inst.hosts for k, v in running_of(h, [u for hh, u in inst.units if hh == h]).items()}
            if read else {},
            expected={f"{h}:{u}": expected[f"{h}:{u}"] for h, u in inst.units if f"{h}:{u}" in expected},
            recorded_starts={f"{h}:{u}": starts[f"{h}:{u}"] for h, u in inst.units if f"{h}:{u}" in starts},
            edited=[e for h in dict.fromkeys(inst.hosts) for e in edited_of(h, [u for hh, u in inst.units if hh == h])]
            if read else []))
    return obs


def unit_files(manifest: dict, host: str, unit: str) -> dict[str, str]:
    """{path: sha256} of an engine unit's own files in a revision's manifest: its unit file, launch
    script and env file (each named for the unit). Empty for the gateway's and older records."""
    if unit == GATEWAY_UNIT:
        return {}
    stem = unit.removesuffix(".service")
    return {p: m["sha256"] for p, m in (manifest.get(host) or {}).items()
            if p.rsplit("/", 1)[-1].rsplit(".", 1)[0] == stem and isinstance(m, dict) and m.get("sha256")}


def file_drift(fact, want: str, revision: int) -> str | None:
    """How a file on the host is not revision `revision`'s (None: it is, or it was not read)."""
    if fact is None:
        return None
    if fact.mode is None:
        return f"is missing (revision {revision} rendered it)"
    if fact.sha256 != want:
        return (f"is not revision {revision}'s: sha256 {fact.sha256[:12]}, rendered {want[:12]} "
                "(edited on the host?)")
    return None


def etcd_members_run(inv: Inventory) -> list[str]:
    """The hosts of the etcd members pdops runs that hold the record now (`pdops_state.backend: etcd` with
    `members`); none where the record is elsewhere or on an etcd the site runs."""
    st = inv.state
    if st is None or st.backend != "etcd" or st.etcd is None:
        return []
    return list(st.etcd.members)


def _unit_down(st: UnitState | str) -> str | None:
    """Why a unit that must run does not (None: active, or not read: an unreadable host is not said to
    run nothing, and its front door is named by _front_door's read instead)."""
    if isinstance(st, str):
        return None
    if st.active_state == "active":
        return None
    return f"{st.active_state}/{st.sub_state}"


def _front_door(inv: Inventory, pool: HostPool, down: dict[str, str]) -> list[str]:
    """HAProxy's runtime state of each gateway, on each admission host (none without the layer); an
    admission host whose unit is not running (`down`: host -> its state) is not read."""

    out: list[str] = []
    for a in inv.admission.hosts if inv.admission is not None else ():
        if a in down:  # no runtime API to read: named by Observation.admission_findings
            continue
        try:
            out += front_door_problems(pool, a, inv.gateway.hosts)
        except PdopsError as exc:
            out.append(f"HAProxy on {a}: its runtime API could not be read: {exc.message}")
    return out


@dataclass
class HostRead:
    """One host's reads in one SSH round trip: its units' states, the config id each running one's
    MainPID carries, and with `cgroups` each unit's identity (its cgroup's processes)."""

    states: dict[str, UnitState]
    configs: dict[str, str | None]
    identities: dict[str, RankIdentity] = field(default_factory=dict)
    cgroups_error: str | None = None
    # with `files`: path -> mode, owner, sha256 as on the host (None: not asked, or unreadable)
    files: dict | None = None


def read_host(pool: HostPool, host: str, units: list[str], *, cgroups: bool = False, files=()) -> HostRead:
    """Units' states and, for each running one, the config id its MainPID carries: one SSH round trip
    for every unit of the host (the config notes are read beside `systemctl show`, and count only where
    their PID is the MainPID that show reports); `cgroups`: each unit's cgroup processes and their
    process-table entries in the same round trip (strays: pdops.reads.identity)."""
    if not units:
        return HostRead({}, {})
    sections = {"units": systemd_facts.command(*units), "configs": config_notes_command(units)}
    if cgroups:
        sections["cgroups"] = cg_facts.units_procs_command(units, proc_facts.command())
    if files:
        sections["files"] = file_facts.command(files)
    raw = pool.read_sections(host, sections)
    rc, text = raw.get("units", (-1, ""))
    if rc != 0:
        raise Unverified(f"{host}: `systemctl show` of {', '.join(units)} exited {rc}", evidence=text[-800:])
    states = systemd_facts.parse_by_id(text)
    pids = {u: s.main_pid for u, s in states.items() if s.active_state == "active" and s.main_pid}
    if "configs" not in raw:  # the batch stopped early: no config id is "none", it is unread
        raise Unverified(f"{host}: the read of the config notes did not run", evidence=str(raw)[-800:])
    out = HostRead(states, parse_config_notes(raw["configs"][1], pids))
    if files and raw.get("files", (-1, ""))[0] == 0:
        out.files = file_facts.parse(raw["files"][1])
    if cgroups:
        rc, text = raw.get("cgroups", (-1, ""))
        try:
            if rc != 0:
                raise Unverified(f"the cgroup reader exited {rc}", evidence=text[-800:])
            by_unit, tree_text = cg_facts.parse_units_procs(text)
            tree = proc_facts.parse(tree_text)
            out.identities = {u: RankIdentity.of(host, states[u], sorted(p.pids), tree)
                              for u, p in by_unit.items() if u in states}
        except PdopsError as exc:
            out.cgroups_error = exc.message
    return out


def with_configs(pool: HostPool, host: str, units: list[str]) -> tuple[dict[str, UnitState], dict[str, str | None]]:
    """:func:`read_host`'s unit states and config ids."""
    r = read_host(pool, host, units)
    return r.states, r.configs


def config_notes_command(units: list[str]) -> str:
    """Each unit's config note: "<unit> <PID> <PDOPS_CONFIG>", or "<unit> -" when it has none. The launch
    script writes "<PID> <PDOPS_CONFIG>" into the unit's RuntimeDirectory before it execs (the PID survives
    the exec). Read from this note, not /proc/<pid>/environ: a process that sets its title (smg does)
    overwrites its environ area."""
    return "; ".join(f"printf '%s ' {q(u)}; head -n1 {q(f'{RUN_DIR}/{runtime_dir(u)}/config')} 2>/dev/null || echo -"
                     for u in units)


def parse_config_notes(out: str, pids: dict[str, int]) -> dict[str, str | None]:
    """{unit: the config id its MainPID was started with, or None} for the units in `pids` (the running
    ones, by MainPID): a note counts only when its PID is the unit's MainPID now."""
    seen: dict[str, str | None] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] in pids and parts[1].isdigit() and int(parts[1]) == pids[parts[0]]:
            seen[parts[0]] = parts[2]
        elif parts and parts[0] in pids:
            seen.setdefault(parts[0], None)
    return {u: seen.get(u) for u in pids}
