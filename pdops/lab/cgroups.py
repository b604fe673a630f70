"""The lab's cgroups: the hierarchy mounts (findmnt), each host's `pdops-lab/hN` dir in every one
(docs/design/lab.md step 3), their removal, and the processes found in them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import subprocess
import time
from pathlib import Path

from pdops.lab.paths import cgroup_group
from pdops.lab.records import proc_start


@dataclasses.dataclass(frozen=True)
class CgroupMount:
    """One cgroup hierarchy mount as findmnt reports it."""

    target: str
    fstype: str
    options: str

    @property
    def is_cpuset(self) -> bool:
        return self.fstype == "cgroup" and "cpuset" in self.options.split(",")

    @property
    def is_systemd(self) -> bool:
        return "name=systemd" in self.options.split(",")


def parse_findmnt_pairs(text: str) -> list[CgroupMount]:
    """Parse `findmnt -t cgroup,cgroup2 -n -P -o TARGET,FSTYPE,OPTIONS` output."""
    mounts = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = dict(tok.split("=", 1) for tok in shlex.split(line))
        mounts.append(CgroupMount(fields["TARGET"], fields["FSTYPE"], fields.get("OPTIONS", "")))
    return mounts


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """/proc/<pid>/cgroup -> {hierarchy controllers (or "" for cgroup2): path}."""
    out = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out[parts[1]] = parts[2]
    return out


def is_lab_cgroup(path: str, index: int | None = None) -> bool:
    """True for a cgroup path inside the lab's tree (of host `index`, if given)."""
    base = f"/{cgroup_group()}" + (f"/h{index}" if index is not None else "")
    return path == base or path.startswith(base + "/")


def cgroup_mounts() -> list[CgroupMount]:
    """Every cgroup hierarchy mounted on this machine (findmnt: never a glob, docs/design/lab.md)."""
    out = subprocess.run(["findmnt", "-t", "cgroup,cgroup2", "-n", "-P", "-o", "TARGET,FSTYPE,OPTIONS"],
                         capture_output=True, text=True, timeout=30, check=False)
    return parse_findmnt_pairs(out.stdout)


def cgroup_indexes(mounts: list[CgroupMount]) -> set[int]:
    """The host numbers N that have a cgroup dir `pdops-lab/hN` under any of the mounts."""
    out = set()
    for m in mounts:
        base = Path(m.target) / cgroup_group()
        if base.is_dir():
            out |= {int(p.name[1:]) for p in base.iterdir() if p.is_dir() and p.name[1:].isdigit()}
    return out


def make_host_cgroups(mounts: list[CgroupMount], index: int) -> list[str]:
    """Create <mount>/pdops-lab/hN everywhere; return the cgroup.procs files to join."""
    procs = []
    for m in mounts:
        group = Path(m.target) / cgroup_group()
        leaf = group / f"h{index}"
        for d in (group, leaf):
            d.mkdir(exist_ok=True)
            if m.is_cpuset or (d / "cpuset.cpus").exists():
                # An empty cpuset makes writing a PID fail with ENOSPC (docs/design/lab.md).
                for f in ("cpuset.cpus", "cpuset.mems"):
                    own = d / f
                    if own.exists() and not own.read_text().strip():
                        own.write_text((d.parent / f).read_text().strip() or "\n")
        procs.append(str(leaf / "cgroup.procs"))
    return procs


def _remove_cgroup_tree(path: Path, deadline: float) -> list[str]:
    """rmdir a cgroup dir bottom-up; returns the dirs that could not be removed."""
    if not path.is_dir():
        return []
    for child in sorted((p for p in path.iterdir() if p.is_dir()), reverse=True):
        _remove_cgroup_tree(child, deadline)
    while True:
        try:
            path.rmdir()
            return []
        except FileNotFoundError:
            return []
        except OSError:
            if time.monotonic() > deadline:
                return [str(path)]
            time.sleep(0.05)


def remove_host_cgroups(mounts: list[CgroupMount], index: int, timeout: float = 10.0) -> list[str]:
    """Remove host N's cgroup dirs everywhere (deepest first); returns those still busy."""
    deadline = time.monotonic() + timeout
    left = []
    for m in mounts:
        left += _remove_cgroup_tree(Path(m.target) / cgroup_group() / f"h{index}", deadline)
    return left


def remove_group_if_empty(mounts: list[CgroupMount]) -> None:
    """Remove the slot's `pdops-lab` dir under each mount once no host dir is left in it."""
    for m in mounts:
        group = Path(m.target) / cgroup_group()
        if group.is_dir() and not any(p.is_dir() for p in group.iterdir()):
            with contextlib.suppress(OSError):
                group.rmdir()


def host_cgroup_pids(index: int, mounts: list[CgroupMount] | None = None) -> list[int]:
    """Every PID in host `index`'s cgroup subtree (name=systemd hierarchy, else cgroup2)."""
    mounts = cgroup_mounts() if mounts is None else mounts
    ordered = sorted(mounts, key=lambda m: (not m.is_systemd, m.fstype != "cgroup2"))
    if not ordered:
        return []
    root = Path(ordered[0].target) / cgroup_group() / f"h{index}"
    pids = []
    if root.is_dir():
        for dirpath, _dirs, files in os.walk(root):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError):
                    pids += [int(x) for x in Path(dirpath, "cgroup.procs").read_text().split()]
    return pids


def lab_processes() -> list[int]:
    """PIDs of every live process on this machine whose cgroup is in the lab's tree."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            groups = parse_proc_cgroup((p / "cgroup").read_text())
        except OSError:
            continue
        if any(is_lab_cgroup(path) for path in groups.values()) and proc_start(int(p.name)):
            out.append(int(p.name))
    return out


def lab_cgroup_dirs(mounts: list[CgroupMount] | None = None) -> list[str]:
    """Every `pdops-lab` cgroup directory under a cgroup mount."""
    mounts = cgroup_mounts() if mounts is None else mounts
    return [str(Path(m.target) / cgroup_group()) for m in mounts if (Path(m.target) / cgroup_group()).exists()]
