"""Listening TCP sockets from ``ss -Hltnp`` (ss(8), iproute2).

Columns: State Recv-Q Send-Q Local-Address:Port Peer-Address:Port [Process]. The process
column (``users:(("name",pid=N,fd=M),...)``) appears only when run as root or as the
owner. Local addresses look like ``0.0.0.0:80``, ``127.0.0.1%lo:53``, ``[::]:22``,
``[::ffff:127.0.0.1]:8080``, ``*:22``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdops.errors import Unverified

COMMAND = "ss -Hltnp"

WILDCARDS_V4 = {"0.0.0.0", "*"}
WILDCARDS_V6 = {"::", "*"}

_USER = re.compile(r'\("((?:[^"\\]|\\.)*)",pid=(\d+),fd=(\d+)\)')


@dataclass(frozen=True)
class Listener:
    addr: str  # without brackets or %interface
    port: int
    interface: str | None
    pids: tuple[int, ...]
    names: tuple[str, ...]

    @property
    def is_wildcard(self) -> bool:
        return self.addr in WILDCARDS_V4 | WILDCARDS_V6

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.addr

    def covers(self, addr: str) -> bool:
        """True if a connection to ``addr`` on this port reaches this socket."""
        if self.addr == addr or self.addr == "*":
            return True
        if self.addr == "0.0.0.0":
            return ":" not in addr
        if self.addr == "::":  # dual-stack unless IPV6_V6ONLY; ss cannot tell, assume it covers
            return True
        return self.addr == f"::ffff:{addr}"


def command() -> str:
    return COMMAND


def _split_local(local: str) -> tuple[str, int, str | None]:
    host, sep, port = local.rpartition(":")
    if not sep or not port.isdigit():
        raise Unverified(f"cannot read address:port from {local!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    iface = None
    if "%" in host:
        host, iface = host.split("%", 1)
    return host, int(port), iface


def parse(output: str) -> list[Listener]:
    """Parse ``ss -Hltnp`` into listeners (header-less; a header line is tolerated)."""
    out = []
    for line in output.splitlines():
        if not line.strip() or line.startswith("State"):
            continue
        fields = line.split(None, 5)
        if len(fields) < 5:
            raise Unverified(f"unexpected ss line: {line!r}")
        addr, port, iface = _split_local(fields[3])
        users = _USER.findall(fields[5]) if len(fields) > 5 else []
        out.append(Listener(
            addr, port, iface,
            tuple(int(pid) for _, pid, _ in users),
            tuple(name for name, _, _ in users),
        ))
    return out


def listening_on_port(listeners: list[Listener], port: int) -> list[Listener]:
    return [lst for lst in listeners if lst.port == int(port)]


def is_listening(listeners: list[Listener], addr: str, port: int) -> bool:
    """Would a connection to ``addr:port`` find a listener (exact address or a wildcard)?"""
    return any(lst.covers(addr) for lst in listening_on_port(listeners, port))


def wildcard_listeners(listeners: list[Listener]) -> list[Listener]:
    """Sockets bound to 0.0.0.0, [::] or * (reachable on every address of the host)."""
    return [lst for lst in listeners if lst.is_wildcard]


def pids_on_port(listeners: list[Listener], port: int) -> set[int]:
    return {pid for lst in listening_on_port(listeners, port) for pid in lst.pids}
