"""The lab: a cluster of real systemd + sshd test hosts on this one machine (docs/design/lab.md).

Each lab host N is real systemd as PID 1 of its own PID + mount + cgroup + UTS
namespace, with a real sshd listening on 127.0.10.N. Fabric, Ansible and testinfra
reach it over real SSH; units run in real cgroups.

Safety is part of the boot, not a convention: every host gets a read-only view of the
shared root, private tmpfs /tmp, /var/tmp, /run, /var/lib/systemd, /var/log, masks for
the units that must not run against a shared kernel and filesystem, and its own cgroup
namespace. The inner boot script verifies each of these just before it execs systemd;
a host whose safety steps fail is never booted and the error names the failed step.

Layout: pure parts (paths, config/unit/script/inventory text, findmnt and /proc
parsers, status formatting) first; the doing parts (`up`, `down`, `status`) after.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import fcntl
import json
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import yaml

from pdops.errors import InvalidInput, Refused, Unreachable

# --------------------------------------------------------------------------- constants

DEFAULT_LAB_DIR = Path("/srv/pdops-lab")
LAB_DIR_ENV = "PDOPS_LAB_DIR"
MAX_HOSTS = 64
ADDRESS_PREFIX = "127.0.10."
SSH_PORT = 22
CGROUP_GROUP = "pdops-lab"  # the cgroup directory under every cgroup mount
# Several labs side by side on one machine (pytest-xdist workers): lab slot K > 0 has its own
# addresses 127.0.(10+K).N, its own cgroup group pdops-labK and its own default dir
# /srv/pdops-labK, so booting, stopping or cleaning one never touches another.
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
# Units that must not run against a shared kernel and filesystem (docs/design/lab.md step 2),
# plus a few of the same kind (tmpfiles-clean.service, udev triggers, firstboot).
MASKS = (
    "systemd-tmpfiles-setup.service",
    "systemd-tmpfiles-setup-dev.service",
    "systemd-tmpfiles-clean.timer",
    "systemd-tmpfiles-clean.service",
    "systemd-sysctl.service",
    "systemd-modules-load.service",
    "systemd-binfmt.service",
    "proc-sys-fs-binfmt_misc.automount",
    "systemd-remount-fs.service",
    "systemd-sysusers.service",
    "systemd-udevd.service",
    "systemd-udevd-control.socket",
    "systemd-udevd-kernel.socket",
    "systemd-udev-trigger.service",
    "systemd-udev-settle.service",
    "systemd-journal-flush.service",
    "systemd-update-utmp.service",
    "systemd-logind.service",
    "systemd-firstboot.service",
    "systemd-machine-id-commit.service",
    "getty.target",
    "console-getty.service",
    # Kernel-wide or pointless in a lab host, and each costs boot CPU on a shared machine:
    # module loading, kernel pseudo-filesystems, TPM/partition/hwdb/ldconfig jobs.
    "modprobe@.service",
    "kmod-static-nodes.service",
    "sys-kernel-config.mount",
    "sys-kernel-debug.mount",
    "sys-kernel-tracing.mount",
    "sys-fs-fuse-connections.mount",
    "dev-hugepages.mount",
    "systemd-pcrphase-sysinit.service",
    "systemd-pcrphase.service",
    "systemd-repart.service",
    "systemd-hwdb-update.service",
    "ldconfig.service",
    "systemd-random-seed.service",
)
# Deliberately outside `pdops-*`: deploy and its tests stop and sweep `pdops-*` units.
SSHD_UNIT = "lab-sshd.service"
LAB_TARGET = "lab.target"
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
BOOT_DEADLINE_S = 90.0
STOP_DEADLINE_S = 20.0
SSH_OPTIONS = (
    "-o", "StrictHostKeyChecking=no",
    "-o", "UserKnownHostsFile=/dev/null",
    "-o", "BatchMode=yes",
    "-o", "LogLevel=ERROR",
    "-o", "ConnectTimeout=5",
)


# --------------------------------------------------------------------------- pure parts


@dataclasses.dataclass
class HostStatus:
    """One lab host as seen now: identity, liveness and what the last action did."""

    index: int
    name: str
    address: str
    up: bool
    pid: int | None = None
    systemd: str = "-"
    sshd: bool = False
    note: str = ""


class UpResult(list):
    """`up`'s list of HostStatus, plus what it changed (so a re-run can say "nothing")."""

    def __init__(self, statuses, *, booted=(), cleaned=(), inventory_changed=False):
        super().__init__(statuses)
        self.booted = list(booted)
        self.cleaned = list(cleaned)
        self.inventory_changed = inventory_changed

    @property
    def changed(self) -> bool:
        return bool(self.booted or self.cleaned or self.inventory_changed)


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


def host_name(index: int) -> str:
    return f"lab{index:02d}"


def host_address(index: int) -> str:
    return f"{address_prefix()}{index}"


def repo_root() -> Path:
    """The checkout this pdops runs from (derived from the package location)."""
    return Path(__file__).resolve().parents[1]


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


def own_record(doc: dict, where: Path) -> dict:
    """Make a derived lab inventory (the dict of its hosts.yml) a cluster of its own: this machine's
    dir `where/state`, and a state dir of its own on the state host (docs/state.md), so that it
    does not see, nor lock, the record of another test, bench or demo on the same lab hosts."""
    import hashlib

    slug = f"{where.name}-{hashlib.sha256(str(Path(where).resolve()).encode()).hexdigest()[:10]}"
    doc["all"]["vars"]["pdops_state_dir"] = str(Path(where) / "state")
    doc["all"]["vars"]["pdops_state"] = {"dir": f"/var/lib/pdops/state/{slug}"}
    return doc


def inventory_path(lab_dir=None) -> Path:
    """Where `up` writes the lab's Ansible inventory."""
    return resolve_lab_dir(lab_dir) / "inventory" / "hosts.yml"


def ssh_key_path(lab_dir=None) -> Path:
    """The lab's client SSH private key (root on every lab host accepts it)."""
    return resolve_lab_dir(lab_dir) / "ssh" / "lab_ed25519"


def host_dir(lab_dir: Path, index: int) -> Path:
    return lab_dir / f"h{index}"


def needs_staging(repo: Path) -> bool:
    """True when the checkout lives under a dir each host hides with a tmpfs (CI under /tmp)."""
    return any(_is_under(repo, d) for d in PRIVATE_TMPFS)


def parse_findmnt_pairs(text: str) -> list[CgroupMount]:
    """Parse `findmnt -t cgroup,cgroup2 -n -P -o TARGET,FSTYPE,OPTIONS` output."""
    mounts = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = dict(tok.split("=", 1) for tok in shlex.split(line))
        mounts.append(CgroupMount(fields["TARGET"], fields["FSTYPE"], fields.get("OPTIONS", "")))
    return mounts


def parse_listeners(proc_net_tcp: str) -> list[tuple[str, int]]:
    """(address, port) of every LISTEN socket in a /proc/net/tcp text (IPv4, little-endian hex)."""
    out = []
    for line in proc_net_tcp.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 4 or parts[3] != "0A":  # 0A = TCP_LISTEN
            continue
        hexaddr, hexport = parts[1].split(":")
        raw = bytes.fromhex(hexaddr)[::-1]
        out.append((socket.inet_ntoa(raw), int(hexport, 16)))
    return out


def address_conflicts(address: str, listeners: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Listeners that hold `address` (any port) or its SSH port through a wildcard bind."""
    return [
        (a, p) for a, p in listeners if a == address or (a == "0.0.0.0" and p == SSH_PORT)
    ]


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


def sshd_config_text(index: int, host_key: Path, authorized_keys: Path) -> str:
    return "\n".join(
        [
            f"# pdops lab host {host_name(index)}: generated by pdops.lab, rewritten on every boot.",
            f"ListenAddress {host_address(index)}",
            f"Port {SSH_PORT}",
            f"HostKey {host_key}",
            f"AuthorizedKeysFile {authorized_keys}",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "UseDNS no",
            "PrintMotd no",
            "PidFile /run/sshd.pid",
            # Root's home is on the read-only shared root; give sessions a writable HOME.
            "SetEnv HOME=/tmp/root",
            # Ansible and testinfra open many sessions at once.
            "MaxStartups 200:30:400",
            "MaxSessions 200",
            "Subsystem sftp /usr/lib/openssh/sftp-server",
            "",
        ]
    )


def unit_texts(index: int, sshd_config: Path) -> dict[str, str]:
    """The lab's own units for host `index`: lab.target and the sshd service."""
    name = host_name(index)
    return {
        LAB_TARGET: (
            f"# pdops lab host {name}: the boot target (generated by pdops.lab).\n"
            "[Unit]\n"
            f"Description=pdops lab host {name}\n"
            f"Wants={SSHD_UNIT}\n"
            f"After={SSHD_UNIT}\n"
            "AllowIsolate=yes\n"
        ),
        SSHD_UNIT: (
            f"# pdops lab host {name}: sshd on {host_address(index)} (generated by pdops.lab).\n"
            "[Unit]\n"
            f"Description=OpenSSH server of lab host {name}\n"
            "\n"
            "[Service]\n"
            "ExecStartPre=/bin/mkdir -p /run/sshd /tmp/root\n"
            f"ExecStart=/usr/sbin/sshd -D -e -f {sshd_config}\n"
            "ExecReload=/bin/kill -HUP $MAINPID\n"
            "KillMode=process\n"
            "Restart=on-failure\n"
            "RestartSec=1\n"
        ),
    }


def outer_script(index: int, hdir: Path, cgroup_procs: list[str], inner: Path) -> str:
    """docs/design/lab.md step 3: join the host's cgroups, then exec into the new namespaces."""
    q = shlex.quote
    status = hdir / "boot.status"
    lines = [
        "#!/bin/bash",
        f"# pdops lab host {host_name(index)}: outer boot step (generated by pdops.lab).",
        "set -euo pipefail",
        f"exec 9>>{q(str(status))}",  # opened here, on the machine's mount: writable after ro
        "CURRENT=start",
        'step() { CURRENT="$1"; echo "step $1" >&9; }',
        "trap 'rc=$?; [ $rc -ne 0 ] && echo \"failed $CURRENT rc=$rc\" >&9' EXIT",
        f"echo $$ > {q(str(hdir / 'launcher.pid'))}",
        "step join-cgroups",
    ]
    lines += [f"echo $$ > {q(p)}" for p in cgroup_procs]
    lines += [
        "step namespaces",
        "export PDOPS_LAB_OUTER_CGNS=\"$(readlink /proc/self/ns/cgroup)\"",
        "exec /usr/bin/unshare --cgroup --pid --fork --kill-child --mount --uts --mount-proc "
        f"/bin/bash {q(str(inner))}",
        "",
    ]
    return "\n".join(lines)


def inner_script(index: int, hdir: Path, repo: Path) -> str:
    """docs/design/lab.md step 4, then a check of every safety property before systemd is exec'd."""
    q = shlex.quote
    stage = hdir / "stage"
    staged = needs_staging(repo)
    lines = [
        "#!/bin/bash",
        f"# pdops lab host {host_name(index)}: inner boot step (generated by pdops.lab).",
        "# Runs in the host's new namespaces; every step must pass or systemd never starts.",
        "set -euo pipefail",
        "CURRENT=inner",
        'step() { CURRENT="$1"; echo "step $1" >&9; }',
        'fail() { echo "check: $1" >&2; exit 1; }',
        "trap 'rc=$?; [ $rc -ne 0 ] && echo \"failed $CURRENT rc=$rc\" >&9' EXIT",
        "step private-mounts",
        "mount --make-rprivate /",
    ]
    if staged:
        lines += [
            "step stage-checkout",
            f"mount --bind {q(str(repo))} {q(str(stage))}",
        ]
    lines.append("step writable-binds")
    for src, dst in WRITABLE_BINDS.items():
        lines.append(f"mount --bind {q(str(hdir / src))} {q(dst)}")
    lines += [
        "step read-only-root",
        "mount --bind / /",
        "mount -o remount,bind,ro /",
    ]
    for dst in WRITABLE_BINDS.values():
        lines.append(f"mount -o remount,bind,rw {q(dst)}")
    lines.append("step private-tmpfs")
    for d in PRIVATE_TMPFS:
        mode = "1777" if d in ("/tmp", "/var/tmp") else "755"
        lines.append(f"mount -t tmpfs -o mode={mode},nosuid,nodev tmpfs {q(d)}")
    # A fresh private /tmp is empty (checked before the checkout may be put back into it).
    lines.append("[ -z \"$(ls -A /tmp)\" ] || fail '/tmp is not empty: not private'")
    if staged:
        lines += [
            "step restore-checkout",
            f"mkdir -p {q(str(repo))}",
            f"mount --bind {q(str(stage))} {q(str(repo))}",
            f"mount -o remount,bind,ro {q(str(repo))}",
        ]
    lines += [
        "step cgroup-view",
        "umount -R /sys/fs/cgroup",
        "step hostname",
        f"hostname {host_name(index)}",
        "step verify-read-only-root",
        "[ ! -w / ] || fail '/ is writable'",
        "[ ! -w /etc ] || fail '/etc is writable'",
        "[ ! -w /usr ] || fail '/usr is writable'",
        "step verify-private-tmp",
    ]
    for d in PRIVATE_TMPFS:
        lines.append(
            f"[ \"$(findmnt -n -o FSTYPE --mountpoint {q(d)} | tail -n1)\" = tmpfs ] "
            f"|| fail '{d} is not a private tmpfs'"
        )
    lines.append("step verify-masks")
    for m in MASKS:
        lines.append(
            f"[ \"$(readlink /etc/systemd/system/{m})\" = /dev/null ] || fail 'unit {m} is not masked'"
        )
    lines += [
        "step verify-cgroup-namespace",
        '[ -n "${PDOPS_LAB_OUTER_CGNS:-}" ] || fail "outer cgroup namespace unknown"',
        '[ "$(readlink /proc/self/ns/cgroup)" != "$PDOPS_LAB_OUTER_CGNS" ] '
        "|| fail 'no cgroup namespace of its own'",
        "grep -q '^0::/$' /proc/self/cgroup || fail 'cgroup namespace is not rooted at the host'",
        "step verify-no-generators",
        f"[ -z \"$(ls -A {q(str(hdir / 'generators'))})\" ] || fail 'generator dir is not empty'",
        "step verify-checkout",
        f"[ -d {q(str(repo / 'pdops'))} ] || fail 'checkout {repo} not visible'",
        "step boot-systemd",
        "unset PDOPS_LAB_OUTER_CGNS",
        "trap - EXIT",
        "exec 9>&-",
        "export container=pdops-lab",
        # No generators: the machine's fstab, gpt-auto, sysv and package generators are not
        # this host's business (and skipping them halves the boot's CPU time).
        f"export SYSTEMD_GENERATOR_PATH={q(str(hdir / 'generators'))}",
        f"exec /lib/systemd/systemd --system --unit={LAB_TARGET} "
        f"systemd.hostname={host_name(index)}",
        "",
    ]
    return "\n".join(lines)


def inventory_doc(shipped: dict, n: int, key: Path, lab_dir: Path) -> dict:
    """The lab inventory for hosts 1..n, each in exactly the shipped lab01's shape."""
    doc = copy.deepcopy(shipped)
    all_ = doc["all"]
    template = all_["children"]["gpu_hosts"]["hosts"]["lab01"]
    hosts = {}
    for i in range(1, n + 1):
        h = copy.deepcopy(template)
        h["ansible_host"] = host_address(i)
        h["pdops_data_addr"] = host_address(i)
        hosts[host_name(i)] = h
    all_["children"]["gpu_hosts"]["hosts"] = hosts
    all_["vars"]["ansible_ssh_private_key_file"] = str(key)
    all_["vars"]["ansible_ssh_common_args"] = (
        "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"
    )
    all_["vars"]["pdops_lab_dir"] = str(lab_dir)
    return doc


def inventory_text(doc: dict, n: int) -> str:
    """The inventory as one file (every setting in hosts.yml)."""
    header = (
        f"# Lab inventory written by `inv lab.up --hosts {n}` (pdops.lab): {n} hosts on "
        f"{address_prefix()}1..{n}, 8 virtual GPUs each.\n"
    )
    return header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def inventory_files(doc: dict, n: int) -> dict[str, str]:
    """The inventory in Ansible's usual shape, {relative path: text}: hosts.yml with the hosts and
    their addresses, group_vars/all.yml with the cluster's settings, group_vars/gpu_hosts.yml with
    the GPUs and NICs every lab host has (they are all lab01's shape)."""
    hosts = doc["all"]["children"]["gpu_hosts"]["hosts"]
    first = next(iter(hosts.values()))
    per_host = {h: {k: v[k] for k in ("ansible_host", "pdops_data_addr")} for h, v in hosts.items()}
    shared = {k: v for k, v in first.items() if k not in ("ansible_host", "pdops_data_addr")}
    head = f"# Lab inventory written by `inv lab.up --hosts {n}` (pdops.lab): "
    dump = lambda d: yaml.safe_dump(d, sort_keys=False, default_flow_style=False)  # noqa: E731
    return {
        "hosts.yml": head + f"{n} hosts on {address_prefix()}1..{n}; settings in group_vars/.\n"
                     + dump({"all": {"children": {"gpu_hosts": {"hosts": per_host}}}}),
        "group_vars/all.yml": head + "the cluster's settings.\n" + dump(doc["all"]["vars"]),
        "group_vars/gpu_hosts.yml": head + "8 virtual GPUs and two NICs per host.\n" + dump(shared),
    }


def format_status(statuses: list[HostStatus]) -> list[str]:
    """One readable line per host."""
    lines = []
    for s in statuses:
        state = "up" if s.up else "down"
        pid = str(s.pid) if s.pid else "-"
        sshd = "answering" if s.sshd else "-"
        line = (
            f"{s.name}  {s.address:<13} {state:<5} pid {pid:<8} systemd {s.systemd:<12} "
            f"sshd {sshd:<9}"
        )
        if s.note:
            line += f"  {s.note}"
        lines.append(line.rstrip())
    return lines


def summary_line(statuses: list[HostStatus], action: str = "") -> str:
    up = sum(1 for s in statuses if s.up)
    down = len(statuses) - up
    text = f"{len(statuses)} lab host(s): {up} up, {down} down"
    return f"{text}; {action}" if action else text


# --------------------------------------------------------------------------- doing parts


def _run(argv: list[str], timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
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


def cgroup_mounts() -> list[CgroupMount]:
    out = _run(["findmnt", "-t", "cgroup,cgroup2", "-n", "-P", "-o", "TARGET,FSTYPE,OPTIONS"], check=False)
    return parse_findmnt_pairs(out.stdout)


def _preflight() -> list[CgroupMount]:
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
def _locked(lab_dir: Path):
    lab_dir.mkdir(parents=True, exist_ok=True)
    with open(lab_dir / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Refused(f"another lab operation holds {lab_dir / '.lock'}", fix="wait for it") from None
        yield


def _proc_start(pid: int) -> int | None:
    """Start time (clock ticks since boot) of pid, or None if gone / a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _read_record(hdir: Path) -> dict | None:
    try:
        return json.loads((hdir / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _record_alive(rec: dict | None) -> bool:
    return bool(rec) and _proc_start(rec["init_pid"]) == rec["init_start"]


def _recorded_indexes(lab_dir: Path) -> list[int]:
    out = []
    if lab_dir.is_dir():
        for p in lab_dir.iterdir():
            if p.is_dir() and p.name.startswith("h") and p.name[1:].isdigit():
                out.append(int(p.name[1:]))
    return sorted(out)


def _cgroup_indexes(mounts: list[CgroupMount]) -> set[int]:
    out = set()
    for m in mounts:
        base = Path(m.target) / cgroup_group()
        if base.is_dir():
            out |= {int(p.name[1:]) for p in base.iterdir() if p.is_dir() and p.name[1:].isdigit()}
    return out


def _make_host_cgroups(mounts: list[CgroupMount], index: int) -> list[str]:
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


def _remove_host_cgroups(mounts: list[CgroupMount], index: int, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    left = []
    for m in mounts:
        left += _remove_cgroup_tree(Path(m.target) / cgroup_group() / f"h{index}", deadline)
    return left


def _remove_group_if_empty(mounts: list[CgroupMount]) -> None:
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
        if any(is_lab_cgroup(path) for path in groups.values()) and _proc_start(int(p.name)):
            out.append(int(p.name))
    return out


def lab_cgroup_dirs(mounts: list[CgroupMount] | None = None) -> list[str]:
    """Every `pdops-lab` cgroup directory under a cgroup mount."""
    mounts = cgroup_mounts() if mounts is None else mounts
    return [str(Path(m.target) / cgroup_group()) for m in mounts if (Path(m.target) / cgroup_group()).exists()]


def _ensure_key(lab_dir: Path) -> Path:
    key = ssh_key_path(lab_dir)
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "pdops-lab", "-f", str(key)])
    key.chmod(0o600)
    return key


def _ssh(address: str, key: Path, command: str, timeout: float = 15.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ssh", *SSH_OPTIONS, "-i", str(key), f"root@{address}", command],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


def _sshd_answers(address: str, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((address, SSH_PORT), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def _systemd_state(address: str, key: Path) -> str:
    try:
        r = _ssh(address, key, "systemctl is-system-running", timeout=10)
    except subprocess.TimeoutExpired:
        return "no-answer"
    return (r.stdout.strip().splitlines() or ["unknown"])[-1]


def _listeners() -> list[tuple[str, int]]:
    try:
        return parse_listeners(Path("/proc/net/tcp").read_text())
    except OSError:
        return []


def _prepare_host(lab_dir: Path, index: int, key: Path, repo: Path) -> tuple[Path, Path]:
    """Write host N's dir: host key, sshd_config, units + masks, writable dirs, scripts."""
    hdir = host_dir(lab_dir, index)
    hdir.mkdir(parents=True, exist_ok=True)
    host_key = hdir / "ssh_host_ed25519_key"
    if not host_key.exists():
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host_name(index), "-f", str(host_key)])
    host_key.chmod(0o600)
    for d in list(WRITABLE_BINDS) + ["stage", "generators"]:
        (hdir / d).mkdir(exist_ok=True)
    sshd_config = hdir / "sshd_config"
    sshd_config.write_text(sshd_config_text(index, host_key, key.with_suffix(".pub")))
    units = hdir / "units"
    for name, text in unit_texts(index, sshd_config).items():
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


def _boot_host(lab_dir: Path, index: int, key: Path, repo: Path, mounts: list[CgroupMount]) -> HostStatus:
    """Boot lab host N and wait (with a deadline) until its sshd answers and systemd runs."""
    started = time.monotonic()
    name, address = host_name(index), host_address(index)
    hdir, inner = _prepare_host(lab_dir, index, key, repo)
    procs = _make_host_cgroups(mounts, index)
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
                    "launcher_pid": launcher, "launcher_start": _proc_start(launcher),
                    "init_pid": init, "init_start": _proc_start(init), "booted_at": time.time(),
                }
                (hdir / "state.json").write_text(json.dumps(rec, indent=1))
            elif launcher and _proc_start(launcher) is None:
                break
        elif not _record_alive(rec):
            break
        elif _sshd_answers(address, timeout=0.5):
            break
        time.sleep(0.1)
    step, log_tail = _status_tail(hdir)
    if rec is None or not _record_alive(rec) or step.startswith("failed "):
        _kill_record(rec)
        _remove_host_cgroups(mounts, index)
        what = step.replace("failed ", "safety step ", 1) if step.startswith("failed ") else f"last step: {step}"
        raise Refused(f"{name} ({address}) was not booted: {what}", evidence=log_tail or None)
    # sshd answers: now systemd's own verdict, waiting for the boot job queue to drain.
    state = "no-answer"
    while time.monotonic() < deadline:
        try:
            r = _ssh(address, key, "systemctl is-system-running --wait", timeout=max(1.0, deadline - time.monotonic()))
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


def _kill_record(rec: dict | None) -> bool:
    """SIGKILL the recorded init PID (only if it is still the same process)."""
    if not rec:
        return False
    killed = False
    for pid_key, start_key in (("init_pid", "init_start"), ("launcher_pid", "launcher_start")):
        pid = rec.get(pid_key)
        if pid and _proc_start(pid) == rec.get(start_key):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed = True
    return killed


def _wait_gone(rec: dict, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _proc_start(rec["init_pid"]) != rec["init_start"]:
            return True
        time.sleep(0.1)
    return _proc_start(rec["init_pid"]) != rec["init_start"]


def _stop_host(lab_dir: Path, index: int, key: Path, mounts: list[CgroupMount]) -> HostStatus:
    """Power host N off over SSH; kill its recorded PID only if it does not stop in time."""
    name, address = host_name(index), host_address(index)
    hdir = host_dir(lab_dir, index)
    rec = _read_record(hdir)
    if _record_alive(rec):
        with contextlib.suppress(subprocess.TimeoutExpired):
            _ssh(address, key, "systemctl poweroff --no-block", timeout=10)
        if _wait_gone(rec, STOP_DEADLINE_S):
            note = "powered off cleanly"
        else:
            _kill_record(rec)
            _wait_gone(rec, 5)
            note = f"did not stop in {STOP_DEADLINE_S:.0f}s: killed its recorded PID {rec['init_pid']}"
    elif rec:
        note = "was already gone (killed abruptly?): cleaned up"
    else:
        note = "was not running"
    # A launcher left behind (its child gone) is ours too: end it by its recorded PID.
    if rec and rec.get("launcher_pid") and _proc_start(rec["launcher_pid"]) == rec.get("launcher_start"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec["launcher_pid"], signal.SIGKILL)
    left = _remove_host_cgroups(mounts, index)
    if left:
        raise Refused(f"{name}: cgroup dirs still busy after stop: {left}",
                      fix="see which processes remain in them (cat <dir>/cgroup.procs)")
    with contextlib.suppress(FileNotFoundError):
        (hdir / "state.json").unlink()
    return HostStatus(index, name, address, False, rec["init_pid"] if rec else None, "-", False, note)


def _fan_out(fn, items) -> tuple[list, list[tuple[int, Exception]]]:
    """Run fn over items in threads; collect every result and every error."""
    results, errors = [], []
    if not items:
        return results, errors
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(items)) as pool:
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


def _cleanup_stale(lab_dir: Path, mounts: list[CgroupMount]) -> list[int]:
    """Clean hosts whose recorded process died (killed abruptly) and orphaned cgroup dirs."""
    cleaned = []
    for i in sorted(set(_recorded_indexes(lab_dir)) | _cgroup_indexes(mounts)):
        rec = _read_record(host_dir(lab_dir, i))
        if _record_alive(rec):
            continue
        had_cgroups = i in _cgroup_indexes(mounts)
        if rec or had_cgroups:
            if rec and rec.get("launcher_pid") and _proc_start(rec["launcher_pid"]) == rec.get("launcher_start"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rec["launcher_pid"], signal.SIGKILL)
            left = _remove_host_cgroups(mounts, i, timeout=5)
            if left:
                raise Refused(
                    f"{host_name(i)}: not recorded as running, but its cgroup dirs hold processes: {left}",
                    fix="inspect cgroup.procs there; the lab does not kill processes it did not record",
                )
            with contextlib.suppress(FileNotFoundError):
                (host_dir(lab_dir, i) / "state.json").unlink()
            cleaned.append(i)
    return cleaned


def _ensure_mount_points() -> None:
    # The per-host binds need mount points on the shared (then read-only) root.
    for dst in WRITABLE_BINDS.values():
        Path(dst).mkdir(parents=True, exist_ok=True)


def _write_inventory(lab_dir: Path, n: int, key: Path) -> bool:
    """Write <lab>/inventory/ (hosts.yml + group_vars/) for hosts 1..n; False when it was already so."""
    from pdops.model.inventory import single_file_doc

    shipped = single_file_doc(repo_root() / "inventory" / "lab")
    files = inventory_files(inventory_doc(shipped, n, key, lab_dir), n)
    root = inventory_path(lab_dir).parent
    changed = False
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.read_text() == text:
            continue
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
        changed = True
    return changed


def _host_status(lab_dir: Path, index: int, key: Path) -> HostStatus:
    name, address = host_name(index), host_address(index)
    rec = _read_record(host_dir(lab_dir, index))
    if not _record_alive(rec):
        return HostStatus(index, name, address, False, note="stale record: process gone" if rec else "")
    sshd = _sshd_answers(address)
    state = _systemd_state(address, key) if sshd else "-"
    return HostStatus(index, name, address, True, rec["init_pid"], state, sshd)


def status(lab_dir=None) -> list[HostStatus]:
    """Every lab host known in the lab dir: up or down, PID, systemd state, sshd answering."""
    lab = resolve_lab_dir(lab_dir)
    key = ssh_key_path(lab)
    indexes = [i for i in _recorded_indexes(lab) if _read_record(host_dir(lab, i))]
    inv = inventory_path(lab)
    if inv.exists():
        with contextlib.suppress(Exception):
            n = len(yaml.safe_load(inv.read_text())["all"]["children"]["gpu_hosts"]["hosts"])
            indexes = sorted(set(indexes) | set(range(1, n + 1)))
    results, errors = _fan_out(lambda i: _host_status(lab, i, key), indexes)
    _raise_collected(errors, "status")
    return results


def up(n: int = 4, lab_dir=None) -> list[HostStatus]:
    """Boot lab hosts 1..n in parallel (only those not already up) and write the inventory."""
    n = validate_host_count(n)
    lab = resolve_lab_dir(lab_dir)
    mounts = _preflight()
    with _locked(lab):
        cleaned = _cleanup_stale(lab, mounts)
        _remove_group_if_empty(mounts)
        running = {i for i in _recorded_indexes(lab) if _record_alive(_read_record(host_dir(lab, i)))}
        missing = [i for i in range(1, n + 1) if i not in running]
        listeners = _listeners()
        busy = {host_address(i): address_conflicts(host_address(i), listeners) for i in missing}
        busy = {a: c for a, c in busy.items() if c}
        if busy:
            detail = "; ".join(f"{a} (listening: {', '.join(f'{x}:{p}' for x, p in c)})" for a, c in busy.items())
            raise Refused(
                f"lab address(es) already bound by another process: {detail}; nothing booted",
                fix="stop that process, or boot fewer hosts (--hosts)",
            )
        key = _ensure_key(lab)
        _ensure_mount_points()
        repo = repo_root()
        booted, errors = _fan_out(lambda i: _boot_host(lab, i, key, repo, mounts), missing)
        inv_changed = _write_inventory(lab, n, key) if not errors or booted or running else False
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
                s = _host_status(lab, i, key)
                s.note = ("already up: nothing to do" if s.sshd
                          else "up, but sshd is not answering: lab.down then lab.up reboots it")
                result.append(s)
        extra = sorted(running - set(range(1, n + 1)))
        for i in extra:
            s = _host_status(lab, i, key)
            s.note = "up, beyond --hosts: not in the inventory (lab.down stops it)"
            result.append(s)
        return UpResult(result, booted=[s.index for s in booted], cleaned=cleaned,
                        inventory_changed=inv_changed)


def down(lab_dir=None) -> list[HostStatus]:
    """Power every lab host off (clean over SSH, else kill its recorded PID); remove its cgroups."""
    lab = resolve_lab_dir(lab_dir)
    if not lab.is_dir():
        return []
    check_binaries({"/usr/bin/ssh": "openssh-client", "/usr/bin/findmnt": "util-linux"})
    mounts = cgroup_mounts()
    key = ssh_key_path(lab)
    with _locked(lab):
        indexes = sorted(set(_recorded_indexes(lab)) | _cgroup_indexes(mounts))
        indexes = [i for i in indexes if _read_record(host_dir(lab, i)) or i in _cgroup_indexes(mounts)]
        results, errors = _fan_out(lambda i: _stop_host(lab, i, key, mounts), indexes)
        _remove_group_if_empty(mounts)
        _raise_collected(errors, f"{len(results)} other host(s) stopped")
        return results


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    """Poll `predicate` until true or the deadline passes (no sleeps standing in for readiness)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


__all__ = [
    "HostStatus", "UpResult", "up", "down", "status", "inventory_path", "ssh_key_path",
    "format_status", "summary_line", "lab_processes", "lab_cgroup_dirs", "host_cgroup_pids",
]
