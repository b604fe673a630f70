"""Shared-memory files an engine's processes map, and removing the ones a stopped engine left.

Real SGLang 0.5.23 maps `/dev/shm/sglang_loads_<name>_<hash>.shm` (16 KiB, its load snapshot:
srt/managers/load_snapshot.py) and never unlinks it: every stop leaves one behind (observed in the
lab, docs/lab.md). Which file is whose is read before the stop, from `/proc/<pid>/maps` of the unit's
processes. After the stop is verified, pdops removes exactly those paths, each only if no process on
the host still maps it, and says what it removed. Nothing is removed by a pattern.
"""

from __future__ import annotations

import re

from pdops.facts import q

SHM_DIR = "/dev/shm/"


def maps_command(pids) -> str:
    """The /dev/shm paths that any of `pids` maps, one per line (a PID gone meanwhile prints nothing)."""
    files = " ".join(f"/proc/{int(p)}/maps" for p in sorted(pids))
    return f"cat {files} 2>/dev/null | grep -o ' {SHM_DIR}[^ ]*$' | sort -u || true" if files else "true"


def parse_paths(output: str) -> tuple[str, ...]:
    """Paths under /dev/shm/ from `maps_command`'s output (one level below it: no traversal)."""
    out = []
    for line in output.splitlines():
        path = line.strip().removesuffix(" (deleted)")
        name = path[len(SHM_DIR):]
        if path.startswith(SHM_DIR) and name and "/" not in name and name not in (".", ".."):
            out.append(path)
    return tuple(sorted(set(out)))


def remove_command(paths) -> str:
    """For each path: removed only if it is still a regular file and no process on the host maps it.
    Prints `removed <bytes> <path>` or `kept <path>: <why>` per path."""
    lines = []
    for p in paths:
        qp = q(p)
        lines.append(
            f"if [ ! -f {qp} ]; then echo kept {qp}: gone; "
            f"elif grep -qsE {q(' ' + re.escape(p) + '( [(]deleted[)])?$')} /proc/[0-9]*/maps; "
            f"then echo kept {qp}: still mapped; "
            f"else s=$(stat -c %s {qp}) && rm -f -- {qp} && echo removed $s {qp}; fi")
    return "; ".join(lines) or "true"


def parse_removed(output: str) -> tuple[list[str], list[str]]:
    """([removed: "<path> (<bytes> bytes)"], [kept: "<path>: <why>"]) from `remove_command`'s output."""
    removed, kept = [], []
    for line in output.splitlines():
        parts = line.split(" ", 2)
        if parts[0] == "removed" and len(parts) == 3:
            removed.append(f"{parts[2]} ({parts[1]} bytes)")
        elif parts[0] == "kept" and len(parts) >= 2:
            kept.append(line[len("kept "):])
    return removed, kept
