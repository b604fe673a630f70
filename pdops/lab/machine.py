"""What the lab needs of this machine: root, the binaries (named by Debian package), the cgroup
hierarchies, the per-host mount points; and the lab dir's lock, one lab operation at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
from pathlib import Path

from pdops.errors import Refused
from pdops.lab.cgroups import CgroupMount, cgroup_mounts
from pdops.lab.paths import WRITABLE_BINDS

# Binaries the lab needs, with the Debian package that provides each.
REQUIRED_BINARIES = {
    "/usr/sbin/sshd": "openssh-server",
    "/usr/lib/openssh/sftp-server": "openssh-sftp-server",
    "/usr/bin/ssh": "openssh-client",
    "/usr/bin/ssh-keygen": "openssh-client",
    "/lib/systemd/systemd": "systemd",
    "/usr/bin/unshare": "util-linux",
    "/usr/bin/findmnt": "util-linux",
    "/usr/bin/setsid": "util-linux",
}


def run_local(argv: list[str], timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
    """A command on this machine, its output captured as text."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=check)


def check_binaries(binaries: dict[str, str] | None = None) -> None:
    """Refuse (naming the Debian package) when a binary the lab needs is missing."""
    binaries = REQUIRED_BINARIES if binaries is None else binaries
    missing = {b: pkg for b, pkg in binaries.items() if not os.access(b, os.X_OK)}
    if missing:
        pkgs = sorted(set(missing.values()))
        raise Refused(
            "lab needs " + ", ".join(f"{b} (Debian package {p})" for b, p in missing.items()),
            fix=f"apt-get install -y {' '.join(pkgs)}  (or: bash scripts/setup-system.sh as root)",
        )


# Each lab host's systemd holds 4 inotify instances (counted on a running lab); the kernel's
# per-user limit, fs.inotify.max_user_instances, is 128 on Debian: 32 hosts at most, and a host
# past it hangs in its boot until the deadline. scripts/setup-system.sh raises it to INOTIFY_WANTED.
INOTIFY_PER_HOST = 4
INOTIFY_LIMIT = Path("/proc/sys/fs/inotify/max_user_instances")
INOTIFY_WANTED = 1024


def inotify_in_use() -> int:
    """inotify instances open on this machine now (every process's fds; the lab runs as root)."""
    n = 0
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in os.scandir(fd_dir):
                try:
                    n += os.readlink(fd.path) == "anon_inode:inotify"
                except OSError:
                    pass
        except OSError:
            pass
    return n


def check_inotify(hosts_to_boot: int, limit: int | None = None, in_use: int | None = None) -> None:
    """Refuse before booting when the hosts' systemd would run out of inotify instances."""
    if hosts_to_boot <= 0:
        return
    limit = int(INOTIFY_LIMIT.read_text()) if limit is None else limit
    in_use = inotify_in_use() if in_use is None else in_use
    need = hosts_to_boot * INOTIFY_PER_HOST
    if in_use + need > limit:
        raise Refused(
            f"{hosts_to_boot} more lab host(s) need {need} inotify instances ({INOTIFY_PER_HOST} each, for "
            f"systemd); {in_use} of this machine's {limit} (fs.inotify.max_user_instances) are in use, so "
            f"{max(0, (limit - in_use) // INOTIFY_PER_HOST)} more host(s) fit; nothing booted",
            fix=f"sysctl -w fs.inotify.max_user_instances={INOTIFY_WANTED}  (scripts/setup-system.sh sets it), "
                "or boot fewer hosts",
        )


def preflight() -> list[CgroupMount]:
    """Refuse unless root, with every binary and a name=systemd or cgroup2 hierarchy; the mounts."""
    if os.geteuid() != 0:
        raise Refused("the lab boots systemd in namespaces and needs root", fix="run as root")
    check_binaries()
    mounts = cgroup_mounts()
    if not any(m.is_systemd or m.fstype == "cgroup2" for m in mounts):
        raise Refused(
            "no name=systemd or cgroup2 hierarchy is mounted (findmnt -t cgroup,cgroup2)",
            fix="mount the cgroup hierarchies (a Debian 12 machine has them under /sys/fs/cgroup)",
        )
    return mounts


@contextlib.contextmanager
def locked(lab_dir: Path):
    """Hold the lab dir's lock for one lab operation; refuse when another holds it."""
    lab_dir.mkdir(parents=True, exist_ok=True)
    with open(lab_dir / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Refused(f"another lab operation holds {lab_dir / '.lock'}", fix="wait for it") from None
        yield


def ensure_mount_points() -> None:
    """The per-host binds need mount points on the shared (then read-only) root."""
    for dst in WRITABLE_BINDS.values():
        Path(dst).mkdir(parents=True, exist_ok=True)
