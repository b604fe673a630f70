"""Process tree with start times, for identity checks that survive PID reuse.

The host runs a small ``python3 -c`` that reads ``/proc/<pid>/stat`` (proc(5): field 4
ppid, field 22 starttime in clock ticks since boot) and ``/proc/<pid>/cmdline``, and
prints one JSON object per line after a header with boot time, clock ticks per second
and boot id. A PID whose start time differs from the recorded one is a different process.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pdops.errors import Unverified
from pdops.facts import q

# Runs on the host with the system python3 and stdlib only.
_SCRIPT = r'''
import json, os, sys
want = set(sys.argv[1:])
def stat_fields(pid):
    with open("/proc/%s/stat" % pid, "rb") as f:
        data = f.read().decode("utf-8", "replace")
    lp, rp = data.index("("), data.rindex(")")
    return data[lp + 1:rp], data[rp + 2:].split()
btime = 0
with open("/proc/stat") as f:
    for line in f:
        if line.startswith("btime "):
            btime = int(line.split()[1])
try:
    boot_id = open("/proc/sys/kernel/random/boot_id").read().strip()
except OSError:
    boot_id = ""
print(json.dumps({"header": 1, "btime": btime, "clk_tck": os.sysconf("SC_CLK_TCK"), "boot_id": boot_id}))
for name in os.listdir("/proc"):
    if not name.isdigit() or (want and name not in want):
        continue
    try:
        comm, rest = stat_fields(name)
        with open("/proc/%s/cmdline" % name, "rb") as f:
            argv = [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except (OSError, ValueError):
        continue  # exited while we looked
    print(json.dumps({"pid": int(name), "ppid": int(rest[1]), "start": int(rest[19]), "comm": comm, "argv": argv}))
'''


@dataclass(frozen=True)
class ProcIdentity:
    """What to record about a process so that a later check can tell reuse from survival."""

    pid: int
    start_ticks: int
    boot_id: str = ""


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    start_ticks: int  # since boot, in clock ticks (exact, use for identity)
    start_time: float  # seconds since the epoch (btime + ticks / CLK_TCK), for humans
    comm: str
    cmdline: tuple[str, ...]
    boot_id: str = ""

    @property
    def identity(self) -> ProcIdentity:
        return ProcIdentity(self.pid, self.start_ticks, self.boot_id)


ProcessTree = dict  # {pid: Proc}


def command(pids: list[int] | None = None) -> str:
    """Print the whole process table, or only ``pids`` when given."""
    args = " ".join(q(int(p)) for p in (pids or []))
    return f"python3 -c {q(_SCRIPT)} {args}".rstrip()


def parse(output: str) -> dict[int, Proc]:
    """Parse :func:`command` output into ``{pid: Proc}``."""
    header = None
    tree: dict[int, Proc] = {}
    for line in output.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise Unverified(f"process table line is not JSON: {line[:200]!r}") from e
        if rec.get("header"):
            header = rec
            continue
        if header is None:
            raise Unverified("process table without header line")
        start = header["btime"] + rec["start"] / float(header["clk_tck"])
        tree[rec["pid"]] = Proc(
            pid=rec["pid"], ppid=rec["ppid"], start_ticks=rec["start"], start_time=start,
            comm=rec["comm"], cmdline=tuple(rec["argv"]), boot_id=header.get("boot_id", ""),
        )
    if header is None:
        raise Unverified("process table without header line", evidence=output[-2000:])
    return tree


def descendants(tree: dict[int, Proc], pid: int) -> list[Proc]:
    """Every process below ``pid`` (not ``pid`` itself), parents before children."""
    children: dict[int, list[int]] = {}
    for p in tree.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out, queue, seen = [], [pid], {pid}
    while queue:
        for c in sorted(children.get(queue.pop(0), [])):
            if c not in seen:
                seen.add(c)
                out.append(tree[c])
                queue.append(c)
    return out


ALIVE, GONE, REUSED = "alive", "gone", "reused"


def identity_status(recorded: ProcIdentity | Proc, now: dict[int, Proc]) -> str:
    """``alive`` (same process), ``gone`` (no such PID) or ``reused`` (PID now another process)."""
    rec = recorded.identity if isinstance(recorded, Proc) else recorded
    cur = now.get(rec.pid)
    if cur is None:
        return GONE
    if cur.start_ticks != rec.start_ticks or (rec.boot_id and cur.boot_id and rec.boot_id != cur.boot_id):
        return REUSED
    return ALIVE


def same_process(recorded: ProcIdentity | Proc, now: dict[int, Proc] | Proc | None) -> bool:
    """True only if the recorded process still runs (same PID and same start time)."""
    if now is None:
        return False
    if isinstance(now, Proc):
        now = {now.pid: now}
    return identity_status(recorded, now) == ALIVE


def read_local(pid: int, proc_root: str = "/proc") -> Proc | None:
    """Read one process of THIS machine directly (used by the cluster lock); None if gone."""
    try:
        with open(f"{proc_root}/{int(pid)}/stat", "rb") as f:
            data = f.read().decode("utf-8", "replace")
        with open(f"{proc_root}/{int(pid)}/cmdline", "rb") as f:
            argv = tuple(a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a)
    except (OSError, ValueError):
        return None
    lp, rp = data.index("("), data.rindex(")")
    rest = data[rp + 2:].split()
    btime = 0
    with open(f"{proc_root}/stat") as f:
        for line in f:
            if line.startswith("btime "):
                btime = int(line.split()[1])
    try:
        with open(f"{proc_root}/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    ticks = int(rest[19])
    return Proc(int(pid), int(rest[1]), ticks, btime + ticks / os.sysconf("SC_CLK_TCK"),
                data[lp + 1:rp], argv, boot_id)
