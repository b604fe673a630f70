"""A unit's identity as systemd and the kernel report it now: MainPID, control group, the
cgroup's processes and MainPID's descendants with their start times, and the /dev/shm files they map.
Read before a stop (so the stop can be verified against it, and what the engine leaves cleaned) and by
`inv status` (processes that escaped MainPID)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdops.facts import cgroup as cg_facts
from pdops.facts import procs as proc_facts
from pdops.facts import shm as shm_facts
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
    # /dev/shm files those processes map (pdops.facts.shm): what the engine may leave behind at its stop
    shm: tuple[str, ...] = ()

    @classmethod
    def of(cls, host: str, state, cgroup_pids: list[int], tree: dict, layout=None) -> "RankIdentity":
        """From a unit's state, its cgroup's PIDs and a process table holding at least those (`layout`
        None: a read that found the cgroup on the host itself)."""
        keep = set(cgroup_pids)
        if state.main_pid:
            keep.add(state.main_pid)
            keep |= {p.pid for p in proc_facts.descendants(tree, state.main_pid)}
        return cls(host, state.id, state.main_pid, state.control_group, layout, cgroup_pids,
                   {pid: tree[pid] for pid in keep if pid in tree})

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
    ident = RankIdentity.of(host, st, pids, tree, layout)
    mapped = shm_facts.parse_paths(pool.run(host, shm_facts.maps_command(ident.tree)).stdout) if ident.tree else ()
    return dataclasses.replace(ident, shm=mapped)
