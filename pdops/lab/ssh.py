"""Reaching lab hosts over SSH: the lab's client key, commands over ssh, whether a host's sshd
answers, and which listeners already hold a lab address.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from pdops.lab.machine import run_local
from pdops.lab.paths import SSH_PORT, ssh_key_path

SSH_OPTIONS = (
    "-o", "StrictHostKeyChecking=no",
    "-o", "UserKnownHostsFile=/dev/null",
    "-o", "BatchMode=yes",
    "-o", "LogLevel=ERROR",
    "-o", "ConnectTimeout=5",
)


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


def ensure_key(lab_dir: Path) -> Path:
    """The lab's client key, made on first use."""
    key = ssh_key_path(lab_dir)
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        run_local(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "pdops-lab", "-f", str(key)])
    key.chmod(0o600)
    return key


def run_ssh(address: str, key: Path, command: str, timeout: float = 15.0) -> subprocess.CompletedProcess:
    """`command` as root on the lab host at `address`, with the lab key (exit status not checked)."""
    return subprocess.run(
        ["ssh", *SSH_OPTIONS, "-i", str(key), f"root@{address}", command],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


def sshd_answers(address: str, timeout: float = 1.0) -> bool:
    """True when an SSH banner comes back from `address`."""
    try:
        with socket.create_connection((address, SSH_PORT), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def systemd_state(address: str, key: Path) -> str:
    """`systemctl is-system-running` on the host, or "no-answer"."""
    try:
        r = run_ssh(address, key, "systemctl is-system-running", timeout=10)
    except subprocess.TimeoutExpired:
        return "no-answer"
    return (r.stdout.strip().splitlines() or ["unknown"])[-1]


def current_listeners() -> list[tuple[str, int]]:
    """Every IPv4 TCP listener on this machine (lab hosts share its network stack)."""
    try:
        return parse_listeners(Path("/proc/net/tcp").read_text())
    except OSError:
        return []
