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
from pdops.facts.systemd import UnitState
from pdops.remote.gateway import Gateways
from pdops.remote.hosts import HostPool
from pdops.model.inventory import Inventory
from pdops.model.placement import Placement
from pdops.model.admission import KEEPALIVED_UNIT, UNIT as ADMISSION_UNIT
from pdops.model.etcd_member import UNIT as ETCD_UNIT
from pdops.model.commands import RUN_DIR, runtime_dir
from pdops.model.render import GATEWAY_UNIT
from pdops.fanout import run_parallel
from pdops.record.local import Revision
from pdops.reads.identity import RankIdentity
from pdops.reads.observation import GatewayObservation, InstanceObservation, Observation
from pdops.remote.haproxy import front_door_problems


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
