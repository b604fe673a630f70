"""cgroups of a systemd unit, on pure cgroup2 and hybrid (v1 name=systemd + cgroup2) hosts.

The layout is decided from the mount table (proc(5) ``/proc/self/mountinfo``), never by
globbing /sys/fs/cgroup (leftover empty directories there are not mounts). A unit's
``ControlGroup`` (from ``systemctl show``) is a path relative to the hierarchy root:

- unified (pure cgroup2): ``/sys/fs/cgroup<cg>``;
- hybrid: cgroup2 at ``/sys/fs/cgroup/unified<cg>`` and the v1 ``name=systemd``
  hierarchy at ``/sys/fs/cgroup/systemd<cg>``; pdops reads both and takes the union;
- legacy (v1 only): ``/sys/fs/cgroup/systemd<cg>``.

After a clean ``systemctl stop`` systemd removes the unit's cgroup directory: the procs
reader reports such a directory as gone, which counts as empty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pdops.errors import Unverified
from pdops.facts import q

MOUNTINFO_COMMAND = "cat /proc/self/mountinfo"

UNIFIED, HYBRID, LEGACY = "unified", "hybrid", "legacy"


@dataclass(frozen=True)
class Mount:
    mount_point: str
    root: str
    fstype: str
    source: str
    options: tuple[str, ...]
    super_options: tuple[str, ...]


def _unescape(path: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def parse_mountinfo(output: str) -> list[Mount]:
    """Parse ``/proc/<pid>/mountinfo`` (proc(5)): fields, optional fields, ``-``, fstype, source, super options."""
    mounts = []
    for line in output.splitlines():
        if not line.strip():
            continue
        left, sep, right = line.partition(" - ")
        if not sep:
            raise Unverified(f"mountinfo line without ' - ' separator: {line!r}")
        lf = left.split()
        rf = right.split()
        if len(lf) < 6 or len(rf) < 2:
            raise Unverified(f"short mountinfo line: {line!r}")
        mounts.append(
            Mount(
                mount_point=_unescape(lf[4]),
                root=_unescape(lf[3]),
                fstype=rf[0],
                source=rf[1],
                options=tuple(lf[5].split(",")),
                super_options=tuple(rf[2].split(",")) if len(rf) > 2 else (),
            )
        )
    return mounts


@dataclass(frozen=True)
class CgroupLayout:
    """Where a ControlGroup path lives on this host."""

    kind: str  # unified | hybrid | legacy
    unified_root: str | None  # cgroup2 mount point
    systemd_root: str | None  # v1 name=systemd mount point (hybrid/legacy)

    def dirs(self, control_group: str) -> list[str]:
        """Directories of ``control_group`` in every hierarchy pdops reads."""
        if not control_group.startswith("/"):
            raise Unverified(f"ControlGroup {control_group!r} is not an absolute path")
        if control_group == "/" or ".." in control_group.split("/"):
            raise Unverified(f"refusing to read cgroup {control_group!r}: not a unit's own cgroup")
        roots = [r for r in (self.unified_root, self.systemd_root) if r]
        return [root.rstrip("/") + control_group for root in roots]

    def procs_paths(self, control_group: str) -> list[str]:
        """``cgroup.procs`` files of ``control_group`` (top level only; see :func:`procs_command`)."""
        return [d + "/cgroup.procs" for d in self.dirs(control_group)]

    def events_path(self, control_group: str) -> str | None:
        """``cgroup.events`` exists only on cgroup2."""
        if not self.unified_root:
            return None
        return self.unified_root.rstrip("/") + control_group + "/cgroup.events"


def detect_layout(mounts: list[Mount]) -> CgroupLayout:
    """Decide unified / hybrid / legacy from the mount table."""
    cg2 = [m for m in mounts if m.fstype == "cgroup2"]
    named = [
        m for m in mounts
        if m.fstype == "cgroup" and "name=systemd" in (m.super_options + m.options)
    ]
    unified = next((m.mount_point for m in cg2 if m.mount_point == "/sys/fs/cgroup"), None)
    if unified and not named:
        return CgroupLayout(UNIFIED, unified, None)
    if named:
        systemd_root = named[0].mount_point
        # prefer the conventional hybrid location; else any cgroup2 mount
        unified = next(
            (m.mount_point for m in cg2 if m.mount_point == "/sys/fs/cgroup/unified"),
            cg2[0].mount_point if cg2 else None,
        )
        return CgroupLayout(HYBRID if unified else LEGACY, unified, systemd_root)
    if cg2:
        return CgroupLayout(UNIFIED, cg2[0].mount_point, None)
    raise Unverified("no cgroup2 or name=systemd cgroup mount in the mount table")


# --- /proc/<pid>/cgroup ------------------------------------------------------------------

@dataclass(frozen=True)
class ProcCgroup:
    """A process's cgroup membership (cgroups(7), /proc/<pid>/cgroup)."""

    unified: str | None  # the "0::/path" line
    systemd: str | None  # the "N:name=systemd:/path" line
    controllers: dict = field(default_factory=dict)  # v1 controller -> path

    @property
    def path(self) -> str | None:
        """The path systemd manages: the name=systemd one on hybrid, else the cgroup2 one."""
        return self.systemd or self.unified


def proc_cgroup_command(pid: int) -> str:
    return f"cat {q(f'/proc/{int(pid)}/cgroup')}"


def parse_proc_cgroup(output: str) -> ProcCgroup:
    """Parse ``/proc/<pid>/cgroup``: ``0::/p`` (cgroup2) and ``N:ctrl[,ctrl]:/p`` (v1) lines."""
    unified = systemd = None
    controllers: dict[str, str] = {}
    for line in output.splitlines():
        if not line.strip():
            continue
        parts = line.split(":", 2)
        if len(parts) != 3:
            raise Unverified(f"unexpected /proc/<pid>/cgroup line: {line!r}")
        hid, ctrls, path = parts
        if hid == "0" and ctrls == "":
            unified = path
            continue
        for c in ctrls.split(","):
            if c == "name=systemd":
                systemd = path
            elif c:
                controllers[c] = path
    return ProcCgroup(unified, systemd, controllers)


# --- cgroup.events -----------------------------------------------------------------------

@dataclass(frozen=True)
class CgroupEvents:
    populated: bool
    frozen: bool | None


def parse_events(output: str) -> CgroupEvents:
    """Parse cgroup2 ``cgroup.events`` (``populated 0|1``, ``frozen 0|1``)."""
    values = {}
    for line in output.splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            values[key] = value.strip()
    if "populated" not in values:
        raise Unverified("cgroup.events has no 'populated' line", evidence=output)
    frozen = values.get("frozen")
    return CgroupEvents(values["populated"] == "1", None if frozen is None else frozen == "1")


# --- procs of a unit's subtree ---------------------------------------------------------

_DIR_TAG = "PDOPS-CGROUP"


def procs_command(layout: CgroupLayout, control_group: str) -> str:
    """Print every PID in the subtree of ``control_group``, per hierarchy, marking gone dirs.

    Output: for each directory a header ``PDOPS-CGROUP present|gone <dir>``, then PIDs one per
    line. Files vanishing while being read (the unit is stopping) are ignored.
    """
    parts = []
    for d in layout.dirs(control_group):
        qd = q(d)
        parts.append(
            f"if [ -d {qd} ]; then echo {_DIR_TAG} present {qd}; "
            f"find {qd} -name cgroup.procs -type f -exec cat {{}} + 2>/dev/null; "
            f"else echo {_DIR_TAG} gone {qd}; fi"
        )
    return "; ".join(parts) + "; true"


# The cgroup2 and name=systemd mount points, read on the host (mountinfo: field 5 the mount point,
# the filesystem type and its options after the " - " separator).
_ROOTS_AWK = ("awk '{for (i = 7; i <= NF; i++) if ($i == \"-\") break; "
              "if ($(i+1) == \"cgroup2\" || ($(i+1) == \"cgroup\" && $(i+3) ~ /(^|,)name=systemd(,|$)/)) print $5}' "
              "/proc/self/mountinfo")
UNIT_TAG, TREE_TAG = "PDOPS-UNIT", "PDOPS-TREE"


def units_procs_command(units: list[str], tree_script: str) -> str:
    """One command for several units: per unit a `PDOPS-UNIT <unit>` line, then what :func:`procs_command`
    prints for its cgroup (found on the host: its ControlGroup from systemd, under every cgroup2 and
    name=systemd mount, so no layout is needed first; a ControlGroup that is not a unit's own is read
    as gone); then `PDOPS-TREE` and `tree_script` run with those PIDs as arguments (a process table of
    the units' cgroups, not the host's hundreds of processes). One SSH round trip with the unit states."""
    per_unit = []
    for u in units:
        per_unit.append(
            f"echo {q(UNIT_TAG + ' ' + u)}; cg=$(systemctl show -p ControlGroup --value {q(u)} 2>/dev/null); "
            'case "$cg" in /?*) ;; *) cg= ;; esac; case "$cg/" in */../*) cg= ;; esac; '
            f'if [ -z "$cg" ]; then echo "{_DIR_TAG} gone -"; else for r in $roots; do d="$r$cg"; '
            f'if [ -d "$d" ]; then echo "{_DIR_TAG} present $d"; find "$d" -name cgroup.procs -type f -exec cat {{}} + '
            f'2>/dev/null; else echo "{_DIR_TAG} gone $d"; fi; done; fi')
    return (f"roots=$({_ROOTS_AWK}); out=$({'; '.join(per_unit)}); printf '%s\\n' \"$out\"; echo {TREE_TAG}; "
            f"{tree_script} $(printf '%s\\n' \"$out\" | grep -E '^[0-9]+$') 0")


def parse_units_procs(output: str) -> tuple[dict[str, "CgroupProcs"], str]:
    """{unit: its cgroup's PIDs} and the process-table text after `PDOPS-TREE`, from
    :func:`units_procs_command` output."""
    head, sep, tree = output.partition(TREE_TAG + "\n")
    if not sep:
        raise Unverified("the cgroup reader stopped before the process table", evidence=output[-800:])
    out: dict[str, CgroupProcs] = {}
    unit, buf = None, []
    for line in head.splitlines() + [UNIT_TAG + " "]:
        if line.startswith(UNIT_TAG + " "):
            if unit is not None:
                out[unit] = parse_procs("\n".join(buf))
            unit, buf = line[len(UNIT_TAG) + 1:].strip() or None, []
        else:
            buf.append(line)
    return out, tree


@dataclass(frozen=True)
class CgroupProcs:
    pids: frozenset[int]
    present: tuple[str, ...]
    gone: tuple[str, ...]

    @property
    def empty(self) -> bool:
        """No process in any hierarchy (a removed directory counts as empty)."""
        return not self.pids


def parse_procs(output: str) -> CgroupProcs:
    """Parse :func:`procs_command` output."""
    pids: set[int] = set()
    present, gone = [], []
    seen_header = False
    for line in output.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith(_DIR_TAG + " "):
            _, state, path = line.split(" ", 2)
            (present if state == "present" else gone).append(path)
            seen_header = True
        elif line.isdigit():
            pids.add(int(line))
        else:
            raise Unverified(f"unexpected line reading cgroup procs: {line!r}", evidence=output)
    if not seen_header:
        raise Unverified("cgroup procs reader printed no directory header", evidence=output)
    return CgroupProcs(frozenset(pids), tuple(present), tuple(gone))
