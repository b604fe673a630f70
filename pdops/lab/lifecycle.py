"""The lab's verbs: `up` boots hosts 1..n in parallel (only those not up) and writes the
inventory, `down` powers every host off, `status` reports each; every host's result or error is
collected before one is raised (docs/design/style.md item 5).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from pathlib import Path

import yaml

from pdops.errors import InvalidInput, Refused
from pdops.lab.cgroups import cgroup_indexes, cgroup_mounts, remove_group_if_empty
from pdops.lab.host import boot_host, cleanup_stale, stop_host
from pdops.lab.hostfiles import BOOT_MODES
from pdops.lab.inventory import write_inventory
from pdops.lab.machine import check_binaries, check_inotify, ensure_mount_points, locked, preflight
from pdops.lab.paths import (host_address, host_dir, host_name, inventory_path, repo_root, resolve_lab_dir,
                             ssh_key_path, validate_host_count)
from pdops.lab.records import read_record, record_alive, recorded_indexes
from pdops.lab.report import HostStatus, UpResult
from pdops.lab.ssh import address_conflicts, current_listeners, ensure_key, sshd_answers, systemd_state


# Hosts booting at once. Each boot is a burst of work (systemd's start-up, journald, sshd's key
# load); 64 at once on this machine's 2 cores left 35 past the boot deadline, so `up` boots in
# waves of this many, each host's deadline counted from its own start (bench/lab_boot.py).
BOOT_PARALLEL = 16


def _fan_out(fn, items, max_workers: int | None = None) -> tuple[list, list[tuple[int, Exception]]]:
    """Run fn over items in threads (at most max_workers at once); collect every result and error."""
    results, errors = [], []
    if not items:
        return results, errors
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(items), max_workers or len(items))) as pool:
        futures = {pool.submit(fn, i): i for i in items}
        for fut in concurrent.futures.as_completed(futures):
            try:
                results.append(fut.result())
            except Exception as exc:  # noqa: BLE001 - reported together below
                errors.append((futures[fut], exc))
    results.sort(key=lambda s: s.index)
    errors.sort(key=lambda e: e[0])
    return results, errors


def _raise_collected(errors: list[tuple[int, Exception]], done: str) -> None:
    if not errors:
        return
    if len(errors) == 1:
        exc = errors[0][1]
        if done and hasattr(exc, "message"):
            exc.message = f"{exc.message} ({done})"
            exc.args = (exc.message,)
        raise exc
    lines = [f"{host_name(i)}: {getattr(e, 'message', str(e))}" for i, e in errors]
    evidence = "\n".join(lines + [getattr(e, "evidence", None) or "" for _, e in errors[:1]])
    raise Refused(f"{len(errors)} lab hosts failed ({done})", evidence=evidence)


def host_status(lab_dir: Path, index: int, key: Path) -> HostStatus:
    """Host N as seen now: its record alive or not, sshd answering, systemd's state."""
    name, address = host_name(index), host_address(index)
    rec = read_record(host_dir(lab_dir, index))
    if not record_alive(rec):
        return HostStatus(index, name, address, False, note="stale record: process gone" if rec else "")
    sshd = sshd_answers(address)
    state = systemd_state(address, key) if sshd else "-"
    return HostStatus(index, name, address, True, rec["init_pid"], state, sshd)


def status(lab_dir=None) -> list[HostStatus]:
    """Every lab host known in the lab dir: up or down, PID, systemd state, sshd answering."""
    lab = resolve_lab_dir(lab_dir)
    key = ssh_key_path(lab)
    indexes = [i for i in recorded_indexes(lab) if read_record(host_dir(lab, i))]
    inv = inventory_path(lab)
    if inv.exists():
        with contextlib.suppress(Exception):
            n = len(yaml.safe_load(inv.read_text())["all"]["children"]["gpu_hosts"]["hosts"])
            indexes = sorted(set(indexes) | set(range(1, n + 1)))
    results, errors = _fan_out(lambda i: host_status(lab, i, key), indexes)
    _raise_collected(errors, "status")
    return results


def up(n: int = 4, lab_dir=None, boot: str = "lab") -> list[HostStatus]:
    """Boot lab hosts 1..n in parallel (only those not already up) and write the inventory. `boot`:
    "lab" (nothing pdops installed starts: the lab's default) or "enabled" (every unit enabled in
    multi-user.target.wants starts, as a real host's boot does: pdops.lab.hostfiles)."""
    n = validate_host_count(n)
    if boot not in BOOT_MODES:
        raise InvalidInput("boot", f"{boot!r} is not one of {', '.join(BOOT_MODES)}")
    lab = resolve_lab_dir(lab_dir)
    mounts = preflight()
    with locked(lab):
        cleaned = cleanup_stale(lab, mounts)
        remove_group_if_empty(mounts)
        running = {i for i in recorded_indexes(lab) if record_alive(read_record(host_dir(lab, i)))}
        missing = [i for i in range(1, n + 1) if i not in running]
        listeners = current_listeners()
        busy = {host_address(i): address_conflicts(host_address(i), listeners) for i in missing}
        busy = {a: c for a, c in busy.items() if c}
        if busy:
            detail = "; ".join(f"{a} (listening: {', '.join(f'{x}:{p}' for x, p in c)})" for a, c in busy.items())
            raise Refused(
                f"lab address(es) already bound by another process: {detail}; nothing booted",
                fix="stop that process, or boot fewer hosts (--hosts)",
            )
        check_inotify(len(missing))
        key = ensure_key(lab)
        ensure_mount_points()
        repo = repo_root()
        booted, errors = _fan_out(lambda i: boot_host(lab, i, key, repo, mounts, boot), missing, BOOT_PARALLEL)
        inv_changed = write_inventory(lab, n, key) if not errors or booted or running else False
        _raise_collected(errors, f"{len(booted)} other host(s) booted; run lab.up again or lab.down")
        by_index = {s.index: s for s in booted}
        result: list[HostStatus] = []
        for i in range(1, n + 1):
            if i in by_index:
                s = by_index[i]
                if i in cleaned:
                    s.note += " (was killed abruptly; cleaned up first)"
                result.append(s)
            else:
                s = host_status(lab, i, key)
                s.note = ("already up: nothing to do" if s.sshd
                          else "up, but sshd is not answering: lab.down then lab.up reboots it")
                result.append(s)
        extra = sorted(running - set(range(1, n + 1)))
        for i in extra:
            s = host_status(lab, i, key)
            s.note = "up, beyond --hosts: not in the inventory (lab.down stops it)"
            result.append(s)
        return UpResult(result, booted=[s.index for s in booted], cleaned=cleaned,
                        inventory_changed=inv_changed)


def down(lab_dir=None, hosts: list[int] | None = None) -> list[HostStatus]:
    """Power every lab host off (clean over SSH, else kill its recorded PID); remove its cgroups.
    `hosts`: only those (by number, lab0N): a host that dies while the others run."""
    lab = resolve_lab_dir(lab_dir)
    if not lab.is_dir():
        return []
    check_binaries({"/usr/bin/ssh": "openssh-client", "/usr/bin/findmnt": "util-linux"})
    mounts = cgroup_mounts()
    key = ssh_key_path(lab)
    with locked(lab):
        indexes = sorted(set(recorded_indexes(lab)) | cgroup_indexes(mounts))
        indexes = [i for i in indexes if read_record(host_dir(lab, i)) or i in cgroup_indexes(mounts)]
        if hosts is not None:
            indexes = [i for i in indexes if i in set(hosts)]
        results, errors = _fan_out(lambda i: stop_host(lab, i, key, mounts), indexes)
        remove_group_if_empty(mounts)
        _raise_collected(errors, f"{len(results)} other host(s) stopped")
        return results


