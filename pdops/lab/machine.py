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
