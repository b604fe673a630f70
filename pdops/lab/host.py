"""One lab host's boot and stop: write its dir (host key, sshd_config, units and masks, scripts),
boot it detached and wait for systemd's verdict; power it off, else kill its recorded PID; clean
a host whose process died (docs/design/lab.md steps 1-6).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from pdops.errors import Refused, Unreachable
from pdops.lab.cgroups import CgroupMount, cgroup_indexes, make_host_cgroups, remove_host_cgroups
from pdops.lab.hostfiles import MASKS, inner_script, outer_script, sshd_config_text, unit_texts
from pdops.lab.machine import run_local
from pdops.lab.paths import WRITABLE_BINDS, host_address, host_dir, host_name
from pdops.lab.records import kill_record, proc_start, read_record, record_alive, recorded_indexes, wait_gone
from pdops.lab.report import HostStatus
from pdops.lab.ssh import run_ssh, sshd_answers

BOOT_DEADLINE_S = 90.0
STOP_DEADLINE_S = 20.0


def prepare_host(lab_dir: Path, index: int, key: Path, repo: Path, boot: str = "lab") -> tuple[Path, Path]:
    """Write host N's dir: host key, sshd_config, units + masks, writable dirs, scripts."""
    hdir = host_dir(lab_dir, index)
    hdir.mkdir(parents=True, exist_ok=True)
    host_key = hdir / "ssh_host_ed25519_key"
    if not host_key.exists():
        run_local(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host_name(index), "-f", str(host_key)])
    host_key.chmod(0o600)
    for d in list(WRITABLE_BINDS) + ["stage", "generators"]:
        (hdir / d).mkdir(exist_ok=True)
    sshd_config = hdir / "sshd_config"
    sshd_config.write_text(sshd_config_text(index, host_key, key.with_suffix(".pub")))
    units = hdir / "units"
    for name, text in unit_texts(index, sshd_config, boot).items():
        (units / name).write_text(text)
    for m in MASKS:
        link = units / m
        if link.is_symlink() and os.readlink(link) == "/dev/null":
            continue
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to("/dev/null")
    # Verified here and again inside the host, just before systemd is exec'd.
    bad = [m for m in MASKS if os.readlink(units / m) != "/dev/null"]
    if bad:
        raise Refused(f"{host_name(index)}: safety step masks failed for {bad}; host not booted")
    inner = hdir / "inner.sh"
    inner.write_text(inner_script(index, hdir, repo))
    for f in ("boot.status", "launcher.pid", "state.json"):
        with contextlib.suppress(FileNotFoundError):
            (hdir / f).unlink()
    return hdir, inner


def _status_tail(hdir: Path) -> tuple[str, str]:
    """(last step reached or failed, boot.log tail)."""
    try:
        lines = (hdir / "boot.status").read_text().splitlines()
    except FileNotFoundError:
        lines = []
    failed = [ln for ln in lines if ln.startswith("failed ")]
    step = failed[-1] if failed else (lines[-1] if lines else "not started")
    try:
        log = (hdir / "boot.log").read_text(errors="replace")
    except FileNotFoundError:
        log = ""
    return step, "\n".join(log.splitlines()[-15:])


def _find_init(launcher: int) -> int | None:
    try:
        kids = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    except OSError:
        return None
    return int(kids[0]) if kids else None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def boot_host(lab_dir: Path, index: int, key: Path, repo: Path, mounts: list[CgroupMount],
              boot: str = "lab") -> HostStatus:
    """Boot lab host N and wait (with a deadline) until its sshd answers and systemd runs. `boot`:
    "lab" (nothing pdops installed starts) or "enabled" (what is enabled starts, as on a real host)."""
    started = time.monotonic()
    name, address = host_name(index), host_address(index)
    hdir, inner = prepare_host(lab_dir, index, key, repo, boot)
    procs = make_host_cgroups(mounts, index)
    outer = hdir / "outer.sh"
    outer.write_text(outer_script(index, hdir, procs, inner))
    with open(hdir / "boot.log", "w") as log:
        # setsid -f: the host is nobody's child here, so it outlives this process.
        subprocess.run(
            ["setsid", "-f", "/bin/bash", str(outer)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=True, timeout=10,
        )
    deadline = started + BOOT_DEADLINE_S
    rec = None
    while time.monotonic() < deadline:
        step, _ = _status_tail(hdir)
        if step.startswith("failed "):
            break
        if rec is None:
            try:
                launcher = int((hdir / "launcher.pid").read_text())
            except (FileNotFoundError, ValueError):
                launcher = None
            init = _find_init(launcher) if launcher else None
            if init and _comm(init) == "systemd":
                rec = {
                    "index": index, "name": name, "address": address,
                    "launcher_pid": launcher, "launcher_start": proc_start(launcher),
                    "init_pid": init, "init_start": proc_start(init), "booted_at": time.time(),
                }
                (hdir / "state.json").write_text(json.dumps(rec, indent=1))
            elif launcher and proc_start(launcher) is None:
                break
        elif not record_alive(rec):
            break
        elif sshd_answers(address, timeout=0.5):
            break
        time.sleep(0.1)
    step, log_tail = _status_tail(hdir)
    if rec is None or not record_alive(rec) or step.startswith("failed "):
        kill_record(rec)
        remove_host_cgroups(mounts, index)
        what = step.replace("failed ", "safety step ", 1) if step.startswith("failed ") else f"last step: {step}"
        raise Refused(f"{name} ({address}) was not booted: {what}", evidence=log_tail or None)
    # sshd answers: now systemd's own verdict, waiting for the boot job queue to drain.
    state = "no-answer"
    while time.monotonic() < deadline:
        try:
            r = run_ssh(address, key, "systemctl is-system-running --wait", timeout=max(1.0, deadline - time.monotonic()))
            state = (r.stdout.strip().splitlines() or ["unknown"])[-1]
        except subprocess.TimeoutExpired:
            state = "no-answer"
        if state not in ("no-answer", "unknown", "starting", "initializing"):
            break
        time.sleep(0.2)
    if state not in ("running", "degraded"):
        raise Unreachable(f"{name} ({address}) booted but systemd says {state!r}", evidence=_status_tail(hdir)[1] or None)
    return HostStatus(index, name, address, True, rec["init_pid"], state, True,
                      note=f"booted in {time.monotonic() - started:.1f}s")


def stop_host(lab_dir: Path, index: int, key: Path, mounts: list[CgroupMount]) -> HostStatus:
    """Power host N off over SSH; kill its recorded PID only if it does not stop in time."""
    name, address = host_name(index), host_address(index)
    hdir = host_dir(lab_dir, index)
    rec = read_record(hdir)
    if record_alive(rec):
        with contextlib.suppress(subprocess.TimeoutExpired):
            run_ssh(address, key, "systemctl poweroff --no-block", timeout=10)
        if wait_gone(rec, STOP_DEADLINE_S):
            note = "powered off cleanly"
        else:
            kill_record(rec)
            wait_gone(rec, 5)
            note = f"did not stop in {STOP_DEADLINE_S:.0f}s: killed its recorded PID {rec['init_pid']}"
    elif rec:
        note = "was already gone (killed abruptly?): cleaned up"
    else:
        note = "was not running"
    # A launcher left behind (its child gone) is ours too: end it by its recorded PID.
    if rec and rec.get("launcher_pid") and proc_start(rec["launcher_pid"]) == rec.get("launcher_start"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec["launcher_pid"], signal.SIGKILL)
    left = remove_host_cgroups(mounts, index)
    if left:
        raise Refused(f"{name}: cgroup dirs still busy after stop: {left}",
                      fix="see which processes remain in them (cat <dir>/cgroup.procs)")
    with contextlib.suppress(FileNotFoundError):
        (hdir / "state.json").unlink()
    return HostStatus(index, name, address, False, rec["init_pid"] if rec else None, "-", False, note)


def cleanup_stale(lab_dir: Path, mounts: list[CgroupMount]) -> list[int]:
    """Clean hosts whose recorded process died (killed abruptly) and orphaned cgroup dirs."""
    cleaned = []
    for i in sorted(set(recorded_indexes(lab_dir)) | cgroup_indexes(mounts)):
        rec = read_record(host_dir(lab_dir, i))
        if record_alive(rec):
            continue
        had_cgroups = i in cgroup_indexes(mounts)
        if rec or had_cgroups:
            if rec and rec.get("launcher_pid") and proc_start(rec["launcher_pid"]) == rec.get("launcher_start"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rec["launcher_pid"], signal.SIGKILL)
            left = remove_host_cgroups(mounts, i, timeout=5)
            if left:
                raise Refused(
                    f"{host_name(i)}: not recorded as running, but its cgroup dirs hold processes: {left}",
                    fix="inspect cgroup.procs there; the lab does not kill processes it did not record",
                )
            with contextlib.suppress(FileNotFoundError):
                (host_dir(lab_dir, i) / "state.json").unlink()
            cleaned.append(i)
    return cleaned
