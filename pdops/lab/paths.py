"""Where a lab lives: its slot, host names and addresses, the lab dir and the files in it.

Several labs side by side on one machine (pytest-xdist workers): lab slot K > 0 has its own
addresses 127.0.(10+K).N, its own cgroup group pdops-labK and its own default dir
/srv/pdops-labK, so booting, stopping or cleaning one never touches another.
"""

from __future__ import annotations

import os
from pathlib import Path

from pdops.errors import InvalidInput


DEFAULT_LAB_DIR = Path("/srv/pdops-lab")
LAB_DIR_ENV = "PDOPS_LAB_DIR"
MAX_HOSTS = 64
ADDRESS_PREFIX = "127.0.10."
SSH_PORT = 22
CGROUP_GROUP = "pdops-lab"  # the cgroup directory under every cgroup mount
SLOT_ENV = "PDOPS_LAB_SLOT"
MAX_SLOTS = 8


def slot() -> int:
    """This process's lab slot: $PDOPS_LAB_SLOT, default 0 (the one lab of `inv lab.up`)."""
    raw = (os.environ.get(SLOT_ENV) or "0").strip()
    if not raw.isdigit() or int(raw) >= MAX_SLOTS:
        raise InvalidInput(SLOT_ENV, f"{raw!r} is not a lab slot", fix=f"set 0..{MAX_SLOTS - 1} or unset it")
    return int(raw)


def address_prefix() -> str:
    """The first three octets of this slot's host addresses, with the dot."""
    return f"127.0.{10 + slot()}." if slot() else ADDRESS_PREFIX


def cgroup_group() -> str:
    """This slot's cgroup directory under every cgroup mount."""
    return f"{CGROUP_GROUP}{slot()}" if slot() else CGROUP_GROUP


def default_lab_dir() -> Path:
    """/srv/pdops-lab, or the slot's /srv/pdops-labK."""
    return Path(f"{DEFAULT_LAB_DIR}{slot()}") if slot() else DEFAULT_LAB_DIR


# Directories each host gets as a private tmpfs: nothing a host writes there reaches
# the machine (docs/design/lab.md hazard: tmpfiles once emptied the machine's real /tmp).
PRIVATE_TMPFS = ("/run", "/tmp", "/var/tmp", "/var/lib/systemd", "/var/log")
# Per-host writable binds: host-dir name -> mount point inside the host.
WRITABLE_BINDS = {
    "units": "/etc/systemd/system",
    "etc-pdops": "/etc/pdops",
    "opt-pdops": "/opt/pdops",
    "var-lib-pdops": "/var/lib/pdops",
}


def host_name(index: int) -> str:
    """lab01, lab02, ...: host N's inventory name and hostname."""
    return f"lab{index:02d}"


def host_address(index: int) -> str:
    """Host N's loopback address in this slot: its sshd and every port it binds."""
    return f"{address_prefix()}{index}"


def repo_root() -> Path:
    """The checkout this pdops runs from (derived from the package location)."""
    return Path(__file__).resolve().parents[2]


def validate_host_count(n) -> int:
    """The number of lab hosts, 1..MAX_HOSTS, or InvalidInput naming the fix."""
    if isinstance(n, bool) or not (isinstance(n, int) or str(n).strip().lstrip("-").isdigit()):
        raise InvalidInput("--hosts", f"{n!r} is not a whole number", fix=f"give 1..{MAX_HOSTS}")
    value = int(str(n).strip()) if not isinstance(n, int) else n
    if not 1 <= value <= MAX_HOSTS:
        raise InvalidInput(
            "--hosts", f"{value} is out of range", fix=f"give 1..{MAX_HOSTS} (default 4)"
        )
    return value


def _is_under(path: Path, parent: str) -> bool:
    return path == Path(parent) or Path(parent) in path.parents


def resolve_lab_dir(lab_dir=None) -> Path:
    """The lab state dir: argument, else $PDOPS_LAB_DIR, else /srv/pdops-lab (the slot's:
    /srv/pdops-labK); never under /tmp."""
    raw = lab_dir if lab_dir is not None else os.environ.get(LAB_DIR_ENV) or default_lab_dir()
    path = Path(os.path.abspath(os.path.expanduser(str(raw))))
    for hidden in PRIVATE_TMPFS:
        if _is_under(path, hidden) or _is_under(Path(os.path.realpath(path)), hidden):
            raise InvalidInput(
                "lab dir",
                f"{path} is under {hidden}, which every lab host replaces with a private "
                "tmpfs (and /tmp is where a mis-booted host once deleted files)",
                fix=f"use a dir outside {', '.join(PRIVATE_TMPFS)}, e.g. {DEFAULT_LAB_DIR} "
                f"(set {LAB_DIR_ENV})",
            )
    if path == Path("/"):
        raise InvalidInput("lab dir", "/ is not a lab dir", fix=f"use e.g. {DEFAULT_LAB_DIR}")
    return path


def inventory_path(lab_dir=None) -> Path:
    """Where `up` writes the lab's Ansible inventory."""
    return resolve_lab_dir(lab_dir) / "inventory" / "hosts.yml"


def ssh_key_path(lab_dir=None) -> Path:
    """The lab's client SSH private key (root on every lab host accepts it)."""
    return resolve_lab_dir(lab_dir) / "ssh" / "lab_ed25519"


def host_dir(lab_dir: Path, index: int) -> Path:
    """Host N's own dir in the lab dir (docs/design/lab.md step 1)."""
    return lab_dir / f"h{index}"


def needs_staging(repo: Path) -> bool:
    """True when the checkout lives under a dir each host hides with a tmpfs (CI under /tmp)."""
    return any(_is_under(repo, d) for d in PRIVATE_TMPFS)
