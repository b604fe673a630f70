"""What the cluster runs now, read from systemd on every host, the gateway's /workers and its
start-up list, and compared with what the current revision says should run. Read-only.

`inv deploy` of the live topology and `inv verify` decide from this, never from the record
alone: a unit down, a worker missing or not ready in the gateway, a MainPID that is not the
recorded one (systemd restarted the engine) are findings, each with its evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdops import membership
from pdops.errors import PdopsError
from pdops.facts.gateway import Worker
from pdops.facts.systemd import UnitState
from pdops.gateway import GatewayClient
from pdops.hosts import HostPool
from pdops.inventory import Inventory
from pdops.placement import Instance, Placement
from pdops.render import GATEWAY_UNIT
from pdops.runner import run_parallel
from pdops.state import Revision


@dataclass
class InstanceObservation:
    instance: Instance
    units: dict[str, UnitState | str]  # "host:unit" -> its state, or why it could not be read
    recorded_pids: dict[str, int]  # "host:unit" -> MainPID recorded with the revision ({} for old records)
    worker: Worker | None
    in_list: bool | None  # in the gateway's start-up list; None: the list could not be read

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
        out = [f"unit {d}" for d in self.down] + self.restarted
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

    @property
    def gateway_down(self) -> bool:
        u = self.gateway_unit
        return self.gateway_error is not None or not (isinstance(u, UnitState) and u.active_state == "active")

    @property
    def unknown_workers(self) -> list[Worker]:
        """Workers the gateway routes to that the revision does not know."""
        urls = {o.instance.url.rstrip("/") for o in self.instances}
        return [w for w in self.workers if w.url.rstrip("/") not in urls]

    def findings(self) -> list[str]:
        out = []
        if self.gateway_down:
            u = self.gateway_unit
            state = f"{u.active_state}/{u.sub_state}" if isinstance(u, UnitState) else u
            out.append(f"gateway {GATEWAY_UNIT}: {state}" + (f"; {self.gateway_error}" if self.gateway_error else ""))
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
        return (f"observed: {units} unit(s) of {n} instance(s) active with their recorded MainPIDs, {n} worker(s) "
                f"healthy and ready in the gateway, none unknown, the gateway's start-up list = revision "
                f"{self.revision}'s instances")


def observe(inv: Inventory, rev: Revision, pool: HostPool, gateway: GatewayClient) -> Observation:
    """Read systemd on every host of the revision, the gateway's /workers and its start-up list."""
    pl = Placement.from_dict(rev.placement)
    by_host: dict[str, list[str]] = {inv.gateway.host: [GATEWAY_UNIT]}
    for inst in pl.instances:
        for h, u in inst.units:
            by_host.setdefault(h, []).append(u)
    unit_res = run_parallel(list(by_host), lambda h: pool.unit_states(h, by_host[h]))

    def state_of(host: str, unit: str) -> UnitState | str:
        r = unit_res.get(host)
        if isinstance(r, Exception):
            return f"unreadable: {getattr(r, 'message', r)}"
        return r.get(unit) or "not reported by systemd"

    try:
        workers, gw_error = gateway.list_workers(), None
    except PdopsError as exc:
        workers, gw_error = [], exc.message
    try:
        start_list, list_error = membership.listed_ids(membership.read(pool, inv)), None
    except PdopsError as exc:
        start_list, list_error = None, exc.message
    by_url = {w.url.rstrip("/"): w for w in workers}
    obs = Observation(rev.number, state_of(inv.gateway.host, GATEWAY_UNIT), gw_error, workers, start_list,
                      start_list_error=list_error)
    for inst in pl.instances:
        recorded = (rev.instances.get(inst.id) or {}).get("main_pids") or {}
        obs.instances.append(InstanceObservation(
            inst, {f"{h}:{u}": state_of(h, u) for h, u in inst.units}, {k: int(v) for k, v in recorded.items() if v},
            by_url.get(inst.url.rstrip("/")), None if start_list is None else inst.id in start_list))
    return obs
