"""Orphaned halves: a prefill's open requests whose decode side is gone.

In PD serving the gateway sends each request to one prefill and one decode with the same body: the
same `rid` and bootstrap room (docs/design/sglang.md). The prefill holds its half until the decode
side's metadata arrives, then pushes the KV, or until SGLang's bootstrap timeout
(`SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`, 300 s by default). When the decode process that took
the other half ended (SIGKILL, a crash, a restart) or failed that request, nothing tells the prefill:
its half waits out the timeout, counted in its queues, holding a drain at its budget, unseen.

pdops reads each engine's open request IDs from its request log (the current process's systemd
invocation) and the engine host's clock in the same command. A request open on a prefill for at
least GRACE_S (the decode logs its half within milliseconds of the prefill) and open on no decode
process now is an orphaned half. It is ended on the prefill by `POST /abort_request` with its rid,
and named: never sent again. SGLang matches an aborted rid by prefix, so an orphan whose rid is the
prefix of another open request on that prefill is named but not aborted (pdops.steps.orphans, the step
that ends them: this module only reads).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime

from pdops.facts import q, requestlog
from pdops.model.placement import Instance, Placement
from pdops.fanout import run_parallel

GRACE_S = 5.0
DEFAULT_BOOTSTRAP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Orphan:
    prefill: str
    rid: str
    age_s: float | None  # how long the prefill has held it (its host's clock); None: unreadable stamp
    ends_by: float | None  # epoch seconds at which the engine's bootstrap timeout ends it by itself

    def describe(self) -> str:
        end = time.strftime("%H:%M:%S", time.localtime(self.ends_by)) if self.ends_by else "?"
        age = f"{self.age_s:.0f}s" if self.age_s is not None else "?"
        return f"{self.rid} (held {age}, ends by timeout at {end})"


@dataclass
class Reading:
    """Each prefill's orphaned halves, or why it could not be concluded."""

    orphans: dict[str, list[Orphan]] = field(default_factory=dict)  # prefill id -> its orphans
    unknown: list[str] = field(default_factory=list)  # sources that could not be read: nothing concluded
    # seconds until every prefill half that no decode holds but that is younger than GRACE_S is old
    # enough to conclude on (0: none): right after a fault the halves it cut are that young
    unsettled_s: float = 0.0

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.orphans.values())


def bootstrap_timeout_s(inv) -> float:
    try:
        return float(inv.profile.env.get("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", DEFAULT_BOOTSTRAP_TIMEOUT_S))
    except (TypeError, ValueError, AttributeError):
        return DEFAULT_BOOTSTRAP_TIMEOUT_S


def _age(host_now: str, stamp: str) -> float | None:
    """Seconds between two naive local ISO times of one host (SGLang's log_json `timestamp`)."""
    try:
        return (datetime.fromisoformat(host_now) - datetime.fromisoformat(stamp)).total_seconds()
    except (TypeError, ValueError):
        return None


def open_command(unit: str, window_s: float) -> str:
    """One SSH command: the host's clock, then the unit's request log of its current process for
    the last `window_s` seconds (a half older than the bootstrap timeout has ended by itself; the
    decode side of a half was received at the same moment), so the read stays small on a busy engine."""
    return (f"u={q(unit)}; i=$(systemctl show -p InvocationID --value \"$u\"); date '+%Y-%m-%dT%H:%M:%S.%6N'; "
            f"journalctl -u \"$u\" ${{i:+_SYSTEMD_INVOCATION_ID=$i}} --since {q(f'-{int(window_s)}s')} -o cat --no-pager")


def open_requests(pool, inst: Instance, window_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S + 60) -> dict[str, float | None]:
    """rid -> age in seconds of each request the instance's current process (rank 0) holds open,
    among those it received in the last `window_s` seconds."""
    host, unit = inst.units[0]
    out = pool.run(host, open_command(unit, window_s), timeout=60).stdout
    first, _, rest = out.partition("\n")
    log = requestlog.parse(rest)
    return {rid: _age(first.strip(), log.received[rid]) for rid in log.open}


def classify(prefills: dict[str, dict[str, float | None]], decode_open: set[str], *, now: float,
             timeout_s: float, grace_s: float = GRACE_S) -> dict[str, list[Orphan]]:
    """Pure: each prefill's open requests (rid -> age) that no decode holds open, held at least
    `grace_s` (a request with no readable stamp is not concluded on)."""
    out: dict[str, list[Orphan]] = {}
    for pid, rids in prefills.items():
        found = [Orphan(pid, rid, age, now + max(timeout_s - age, 0.0))
                 for rid, age in rids.items() if rid not in decode_open and age is not None and age >= grace_s]
        if found:
            out[pid] = found
    return out


def unsettled(prefills: dict[str, dict[str, float | None]], decode_open: set[str], *,
              grace_s: float = GRACE_S) -> float:
    """Pure: how long until the youngest prefill half that no decode holds is `grace_s` old (0: none)."""
    ages = [age for rids in prefills.values() for rid, age in rids.items()
            if rid not in decode_open and age is not None and age < grace_s]
    return max((grace_s - a for a in ages), default=0.0)


def read(pool, pl: Placement, inv, *, prefills: list[str] | None = None) -> Reading:
    """The orphaned halves on `prefills` (default: every prefill of `pl`), against every decode of
    `pl`. A decode whose request log cannot be read leaves nothing concluded (its halves may be there)."""
    ps = [i for i in pl.role("prefill") if prefills is None or i.id in prefills]
    ds = list(pl.role("decode"))
    if not ps:
        return Reading({}, [])
    window = bootstrap_timeout_s(inv) + 60
    res = run_parallel(ps + ds, lambda i: open_requests(pool, i, window))
    unknown = [f"{i.id}: request log unreadable: {getattr(r, 'message', r)}" for i, r in res.items()
               if isinstance(r, Exception)]
    if any(isinstance(res[d], Exception) for d in ds):
        return Reading({}, unknown)
    decode_open = {rid for d in ds for rid in res[d]}
    held = {p.id: res[p] for p in ps if not isinstance(res[p], Exception)}
    found = classify(held, decode_open, now=time.time(), timeout_s=bootstrap_timeout_s(inv))
    return Reading(found, unknown, unsettled(held, decode_open))
