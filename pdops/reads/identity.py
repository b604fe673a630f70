"""A unit's identity as systemd and the kernel report it now: MainPID, control group, the
cgroup's processes and MainPID's descendants with their start times. Read before a stop (so
the stop can be verified against it) and by `inv status` (processes that escaped MainPID)."""

from __future__ import annotations

from dataclasses import dataclass

from pdops.facts import cgroup as cg_facts
from pdops.facts import procs as proc_facts
from pdops.remote.hosts import HostPool


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


def record_identities(pool: HostPool, host: str, units: list[str]) -> dict[str, RankIdentity]:
    """:func:`record_identity` of several units of one host in two SSH round trips, not four per unit:
    the units' states with the mount table, then every running unit's cgroup processes with the
    process table (`inv status` reads each host's engines this way)."""
    from pdops.errors import Unverified
    from pdops.facts import systemd as systemd_facts

    if not units:
        return {}
    first = pool.read_sections(host, {"units": systemd_facts.command(*units), "mountinfo": cg_facts.MOUNTINFO_COMMAND})
    for name, (rc, text) in first.items():
        if rc != 0:
            raise Unverified(f"{host}: reading {name} exited {rc}", evidence=text[-800:])
    if set(first) != {"units", "mountinfo"}:
        raise Unverified(f"{host}: the read of units and mounts stopped early", evidence=str(first)[-800:])
    states = systemd_facts.parse_by_id(first["units"][1])
    layout = cg_facts.detect_layout(cg_facts.parse_mountinfo(first["mountinfo"][1]))
    groups = {u: states[u].control_group for u in units if u in states and states[u].control_group}
    second = pool.read_sections(host, {**{f"procs {u}": cg_facts.procs_command(layout, cg) for u, cg in groups.items()},
                                       "tree": proc_facts.command()})
    if second.get("tree", (1, ""))[0] != 0:
        raise Unverified(f"{host}: the process table could not be read", evidence=str(second.get("tree"))[-800:])
    tree = proc_facts.parse(second["tree"][1])
    out = {}
    for u in units:
        st = states.get(u)
        if st is None:
            raise Unverified(f"{host}: systemd did not report {u}")
        pids = sorted(cg_facts.parse_procs(second[f"procs {u}"][1]).pids) if u in groups else []
        keep = set(pids)
        if st.main_pid:
            keep.add(st.main_pid)
            keep |= {p.pid for p in proc_facts.descendants(tree, st.main_pid)}
        out[u] = RankIdentity(host, u, st.main_pid, st.control_group, layout, pids,
                              {pid: tree[pid] for pid in keep if pid in tree})
    return out
