"""What the lab reports: each host's status, `up`'s result, and their readable lines."""

from __future__ import annotations

import dataclasses


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
    """"N lab host(s): U up, D down", then the action if given."""
    up = sum(1 for s in statuses if s.up)
    down = len(statuses) - up
    text = f"{len(statuses)} lab host(s): {up} up, {down} down"
    return f"{text}; {action}" if action else text
