"""The operator's time zone: the local zone of the machine running pdops, `TZ` overriding it. Every
time on a report page is shown in it with UTC beside it."""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

UTC = _dt.timezone.utc


@dataclass(frozen=True)
class Zone:
    """A time zone and the words that say where it came from."""

    tz: _dt.tzinfo
    name: str  # Europe/Berlin, Etc/UTC, or the TZ string libc was given
    source: str  # "TZ" or "this machine's time zone (/etc/localtime)" ...

    def local(self, t: _dt.datetime) -> _dt.datetime:
        return t.astimezone(self.tz)

    def offset(self, t: _dt.datetime) -> str:
        """UTC+01:00 (the offset at `t`: a zone's offset moves with daylight saving time)."""
        off = self.local(t).utcoffset() or _dt.timedelta(0)
        sign = "-" if off < _dt.timedelta(0) else "+"
        minutes = abs(int(off.total_seconds())) // 60
        return f"UTC{sign}{minutes // 60:02d}:{minutes % 60:02d}"

    def abbr(self, t: _dt.datetime) -> str:
        return self.local(t).tzname() or self.offset(t)

    def line(self, t: _dt.datetime) -> str:
        """The sentence a page opens with."""
        return (f"Times are in {self.name} ({self.abbr(t)}, {self.offset(t)}), {self.source}, "
                f"with UTC beside each; set TZ to show another zone (e.g. TZ=Europe/Berlin).")

    def stamp(self, t: _dt.datetime, *, date: bool = True) -> str:
        """`2026-12-04 21:00:05 CET (20:00:05 UTC)`: local first, UTC beside it (with its date when
        that differs)."""
        loc, utc = self.local(t), t.astimezone(UTC)
        left = loc.strftime("%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S") + f" {self.abbr(t)}"
        right = utc.strftime("%H:%M:%S" if utc.date() == loc.date() or not date else "%Y-%m-%d %H:%M:%S")
        return f"{left} ({right} UTC)"


def _from_key(key: str, source: str) -> Zone | None:
    try:
        return Zone(ZoneInfo(key), key, source)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        return None


def _libc(name: str, source: str) -> Zone:
    """What libc made of the zone (a POSIX TZ string such as `CET-1CEST`): the offset it gives now."""
    return Zone(_dt.datetime.now().astimezone().tzinfo or UTC, name, source)


def operator_zone(env: dict | None = None) -> Zone:
    """`TZ` when set (a zone name such as Asia/Tokyo, a zoneinfo file, or what libc makes of a POSIX
    string), else this machine's zone (/etc/localtime, /etc/timezone), else UTC."""
    env = os.environ if env is None else env
    raw = env.get("TZ")
    if raw is not None:
        key = raw[1:] if raw.startswith(":") else raw
        if key in ("", "UTC", "UTC0"):
            return Zone(UTC, "UTC", "from TZ")
        if key.startswith("/"):
            _, _, rel = key.partition("/zoneinfo/")
            z = _from_key(rel, "from TZ") if rel else None
            if z:
                return z
        else:
            z = _from_key(key, "from TZ")
            if z:
                return z
        return _libc(raw, "from TZ (read by the C library)")
    try:
        link = os.readlink("/etc/localtime")
    except OSError:
        link = ""
    if "/zoneinfo/" in link:
        z = _from_key(link.split("/zoneinfo/", 1)[1], "this machine's time zone (/etc/localtime)")
        if z:
            return z
    try:
        with open("/etc/timezone") as f:
            z = _from_key(f.read().strip(), "this machine's time zone (/etc/timezone)")
        if z:
            return z
    except OSError:
        pass
    return _libc(_dt.datetime.now().astimezone().tzname() or "UTC", "this machine's time zone")
