"""A lab host's record (state.json): the PIDs of its launcher and its systemd, each with its start
time, so that the lab only ever signals the processes it started, and knows when they are gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

from pdops.sim.testing import poll


def proc_start(pid: int) -> int | None:
    """Start time (clock ticks since boot) of pid, or None if gone / a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def read_record(hdir: Path) -> dict | None:
    """Host dir's state.json, or None when there is none (never booted, or stopped)."""
    try:
        return json.loads((hdir / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def record_alive(rec: dict | None) -> bool:
    """True while the recorded systemd is still the same process (PID and start time)."""
    return bool(rec) and proc_start(rec["init_pid"]) == rec["init_start"]


def recorded_indexes(lab_dir: Path) -> list[int]:
    """The host numbers N that have a dir hN in the lab dir."""
    out = []
    if lab_dir.is_dir():
        for p in lab_dir.iterdir():
            if p.is_dir() and p.name.startswith("h") and p.name[1:].isdigit():
                out.append(int(p.name[1:]))
    return sorted(out)


def kill_record(rec: dict | None) -> bool:
    """SIGKILL the recorded init PID (only if it is still the same process)."""
    if not rec:
        return False
    killed = False
    for pid_key, start_key in (("init_pid", "init_start"), ("launcher_pid", "launcher_start")):
        pid = rec.get(pid_key)
        if pid and proc_start(pid) == rec.get(start_key):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed = True
    return killed


def wait_gone(rec: dict, timeout: float) -> bool:
    """Wait up to `timeout` for the recorded systemd to be gone; True when it is."""
    return poll(lambda: proc_start(rec["init_pid"]) != rec["init_start"], timeout)
