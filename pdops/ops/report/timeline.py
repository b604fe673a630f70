"""One operation's journal as a timeline (pure): each journalled step with its start, end, outcome
and phase (a step of the plan, a rescue step, an always step, or the record's own: lock, plan,
verdict), the wave and instance it belongs to, and the verdict.

The journal keeps when a step ended (`ts`) and how long it ran (`evidence.seconds`, set by the
runner for every step it walks): its start is the difference. A record without a duration (the
lock, the plan, the verdict, a note) is a point in time."""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass, field

# the record's own lines, not steps of the plan
META_STEPS = ("lock.held", "lock.interrupted", "lock.lease-expired", "plan", "verdict")
INSTANCE_RE = re.compile(r"^[pd]\d{2,}$")


def parse_ts(ts: str | None) -> _dt.datetime | None:
    if not ts:
        return None
    try:
        t = _dt.datetime.fromisoformat(str(ts).replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=_dt.timezone.utc)


@dataclass
class Bar:
    """One journalled record on the timeline."""

    n: int  # its position in the journal (1-based)
    step: str
    status: str
    phase: str  # main, rescue, always, record
    start: _dt.datetime
    end: _dt.datetime
    seconds: float | None  # None: a point in time (no duration journalled)
    instance: str | None = None
    host: str | None = None
    wave: int | None = None
    evidence: dict = field(default_factory=dict)

    @property
    def point(self) -> bool:
        return self.seconds is None

    def to_dict(self) -> dict:
        return {"n": self.n, "step": self.step, "status": self.status, "phase": self.phase,
                "start": self.start.isoformat(), "end": self.end.isoformat(), "seconds": self.seconds,
                "instance": self.instance, "host": self.host, "wave": self.wave, "point": self.point}


@dataclass
class Wave:
    n: int
    instances: list[str]
    start: _dt.datetime | None = None
    end: _dt.datetime | None = None

    @property
    def label(self) -> str:
        return f"wave {self.n}: {', '.join(self.instances)}"

    def to_dict(self) -> dict:
        return {"n": self.n, "instances": self.instances, "label": self.label,
                "start": self.start.isoformat() if self.start else None,
                "end": self.end.isoformat() if self.end else None}


@dataclass
class Timeline:
    op: str
    operation: str
    bars: list[Bar]
    waves: list[Wave]
    plan: dict  # the journal's `plan` record's evidence ({} when there is none)
    verdict: dict | None  # the `verdict` record (status and evidence), None when the operation has none
    holder: dict  # the `lock.held` evidence: operator, machine
    start: _dt.datetime
    end: _dt.datetime

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()

    def outcome(self) -> str:
        """ok, failed, interrupted, or `no verdict` (the operation did not finish, or is running)."""
        return self.verdict["status"] if self.verdict else "no verdict"


def phases(plan: dict) -> dict[str, str]:
    """Step id -> main, rescue or always, from the plan record (the steps a walk-plan step walks take
    the phase of that step)."""
    out: dict[str, str] = {}
    for key, phase in (("steps", "main"), ("rescue", "rescue"), ("always", "always")):
        for s in plan.get(key) or ():
            out.setdefault(s, phase)
    for parent, subs in (plan.get("walks") or {}).items():
        for s in subs or ():
            out.setdefault(s, out.get(parent, "main"))
    return out


def instances_named(step: str, evidence: dict) -> list[str]:
    """The instance ids a step acts on: its evidence's `instance`, else the ids in its name
    (`replace p01: leave-gateway`, `canary p01+d01`)."""
    inst = evidence.get("instance") if isinstance(evidence, dict) else None
    if isinstance(inst, str) and inst:
        return [inst]
    return [t for t in re.split(r"[\s:+,]+", step) if INSTANCE_RE.match(t)]


def build(op: str, records: list[dict]) -> Timeline:
    """The timeline of one operation's journal records (in journal order)."""
    plan = next((r.get("evidence") or {} for r in records if r.get("step") == "plan"), {})
    phase_of = phases(plan)
    waves = [Wave(n, [str(i) for i in w]) for n, w in enumerate(plan.get("waves") or [], 1) if w]
    wave_of = {i: w.n for w in waves for i in w.instances}
    verdict = None
    holder: dict = {}
    bars: list[Bar] = []
    for n, r in enumerate(records, 1):
        end = parse_ts(r.get("ts"))
        if end is None:
            continue
        name = str(r.get("step"))
        ev = r.get("evidence") if isinstance(r.get("evidence"), dict) else {}
        secs = ev.get("seconds")
        secs = float(secs) if isinstance(secs, (int, float)) and not isinstance(secs, bool) and secs >= 0 else None
        phase = "record" if name in META_STEPS else phase_of.get(name, "main")
        if phase == "record":
            secs = None
        insts = instances_named(name, ev)
        wave = None
        if phase == "main":
            wave = next((wave_of[i] for i in insts if i in wave_of), None)
        host = ev.get("target") if isinstance(ev.get("target"), str) else None
        start = end - _dt.timedelta(seconds=secs) if secs is not None else end
        bars.append(Bar(n, name, str(r.get("status")), phase, start, end, secs, "+".join(insts) or None, host, wave, ev))
        if name == "verdict":
            verdict = {"status": str(r.get("status")), "evidence": ev, "ts": r.get("ts")}
        if name == "lock.held":
            holder = ev
    for w in waves:
        mine = [b for b in bars if b.wave == w.n]
        if mine:
            w.start, w.end = min(b.start for b in mine), max(b.end for b in mine)
    if bars:
        start, end = min(b.start for b in bars), max(b.end for b in bars)
    else:
        start = end = _dt.datetime.now(_dt.timezone.utc)
    operation = plan.get("operation") or holder.get("operation") or op.split("-")[0]
    return Timeline(op, str(operation), bars, waves, plan, verdict, holder, start, end)
