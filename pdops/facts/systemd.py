"""systemd unit identity: ``systemctl show`` and the journal tail.

``systemctl show -p A,B unit1 unit2`` prints one ``Key=Value`` block per unit, blocks
separated by a blank line, in the order the units were named (systemctl(1), "show").
Properties come in systemd's own order, not the order of ``-p``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdops.errors import Unverified
from pdops.facts import q

PROPERTIES = (
    "Id",
    "LoadState",
    "ActiveState",
    "SubState",
    "MainPID",
    "ControlGroup",
    "ExecMainStartTimestampMonotonic",
    "NRestarts",
    "Result",
    "UnitFileState",
    "FragmentPath",
    "LimitMEMLOCK",
)

# systemctl prints RLIM_INFINITY as "infinity".
INFINITY = None


@dataclass(frozen=True)
class UnitState:
    """One unit as systemd sees it. ``main_pid`` is None when systemd reports 0."""

    id: str
    load_state: str
    active_state: str
    sub_state: str
    main_pid: int | None
    control_group: str | None
    exec_main_start_monotonic_us: int
    n_restarts: int
    result: str
    unit_file_state: str
    fragment_path: str | None
    limit_memlock: int | None  # None means "infinity"
    raw: dict

    @property
    def exists(self) -> bool:
        """False for a unit systemd has no file for (LoadState=not-found)."""
        return self.load_state not in ("not-found", "")

    @property
    def is_active(self) -> bool:
        return self.active_state == "active"

    @property
    def is_stopped(self) -> bool:
        """Inactive or failed, with no main process left."""
        return self.active_state in ("inactive", "failed") and self.main_pid is None

    @property
    def memlock_unlimited(self) -> bool:
        return self.limit_memlock is INFINITY


def command(*units: str) -> str:
    """``systemctl show`` for the given units, with the properties pdops reads."""
    if not units:
        raise ValueError("command() needs at least one unit")
    names = " ".join(q(u) for u in units)
    return f"systemctl show -p {','.join(PROPERTIES)} --no-pager {names}"


def _int(value: str, default: int = 0) -> int:
    value = value.strip()
    if value in ("", "[not set]"):
        return default
    return int(value)


def _limit(value: str) -> int | None:
    return INFINITY if value.strip() == "infinity" else _int(value)


def _unit(props: dict) -> UnitState:
    if "Id" not in props:
        raise Unverified("systemctl show block without Id=", evidence=repr(props))
    main_pid = _int(props.get("MainPID", "0"))
    return UnitState(
        id=props["Id"],
        load_state=props.get("LoadState", ""),
        active_state=props.get("ActiveState", ""),
        sub_state=props.get("SubState", ""),
        main_pid=main_pid or None,
        control_group=props.get("ControlGroup") or None,
        exec_main_start_monotonic_us=_int(props.get("ExecMainStartTimestampMonotonic", "0")),
        n_restarts=_int(props.get("NRestarts", "0")),
        result=props.get("Result", ""),
        unit_file_state=props.get("UnitFileState", ""),
        fragment_path=props.get("FragmentPath") or None,
        limit_memlock=_limit(props.get("LimitMEMLOCK", "0")),
        raw=dict(props),
    )


def parse(output: str) -> list[UnitState]:
    """Parse ``systemctl show`` output for one or more units, in the order printed."""
    units: list[UnitState] = []
    block: dict[str, str] = {}
    for line in output.splitlines() + [""]:
        if not line.strip():
            if block:
                units.append(_unit(block))
                block = {}
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise Unverified(f"unexpected line in systemctl show output: {line!r}")
        block[key] = value
    return units


def parse_by_id(output: str) -> dict[str, UnitState]:
    """Same as :func:`parse`, keyed by unit Id."""
    return {u.id: u for u in parse(output)}


# --- journal ---------------------------------------------------------------------------

NO_ENTRIES = "-- No entries --"


@dataclass(frozen=True)
class JournalTail:
    unit: str
    lines: tuple[str, ...]

    @property
    def empty(self) -> bool:
        return not self.lines

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def journal_command(unit: str, lines: int = 40) -> str:
    """The last ``lines`` journal lines of ``unit``."""
    return f"journalctl -u {q(unit)} -n {int(lines)} --no-pager"


def parse_journal(output: str, unit: str = "") -> JournalTail:
    """Journal tail as text lines; journalctl's "-- No entries --" and boot separators dropped."""
    kept = [
        ln.rstrip("\n")
        for ln in output.splitlines()
        if ln.strip() and ln.strip() != NO_ENTRIES and not ln.startswith("-- Boot ")
        and not ln.startswith("-- Journal begins") and not ln.startswith("-- Logs begin")
    ]
    return JournalTail(unit=unit, lines=tuple(kept))
