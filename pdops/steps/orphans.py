"""Ending orphaned halves (pdops.reads.orphans reads them): each one aborted on its prefill by its rid with
`POST /abort_request`, named, never sent again, and read again to prove it ended. The `end-orphans`
step (after a decode or a gateway restarted, and `inv end-orphans`) and a drain's wait use it."""

from __future__ import annotations

import time

from pdops.errors import PdopsError
from pdops.model.placement import Instance, Placement
from pdops.reads.orphans import GRACE_S, Orphan, bootstrap_timeout_s, open_requests, read
from pdops.remote.hosts import http_json
from pdops.plans import Outcome, Step
from pdops.runner import RunContext


def abort_orphans(inst: Instance, orphans: list[Orphan], still_open: set[str]) -> tuple[list[str], list[str]]:
    """Abort each orphan on its prefill by rid (never replayed); ([ended], [not ended, why])."""
    ended, left = [], []
    for o in orphans:
        if any(r != o.rid and r.startswith(o.rid) for r in still_open):
            left.append(f"{o.rid}: not aborted (SGLang aborts by prefix and another open request starts with it)")
            continue
        try:
            status, _ = http_json("POST", f"{inst.url}/abort_request", {"rid": o.rid}, timeout=10)
        except PdopsError as exc:
            left.append(f"{o.rid}: {exc.message}")
            continue
        (ended if status == 200 else left).append(o.rid if status == 200 else f"{o.rid}: HTTP {status}")
    return ended, left


def do_end_orphans(ctx: RunContext, step: Step) -> Outcome:
    pl: Placement = ctx.placement
    reading = read(ctx.pool, pl, ctx.inv, prefills=step.params["prefills"])
    if reading.unsettled_s > 0:
        # a fault just now (a decode or the gateway restarted) cut halves younger than the grace: the
        # decode logs its half within milliseconds, so once they are GRACE_S old the reading concludes
        ctx.say(f"  a prefill half no decode holds is younger than {GRACE_S:g}s: reading again in "
                f"{reading.unsettled_s:.1f}s")
        time.sleep(reading.unsettled_s + 0.2)
        reading = read(ctx.pool, pl, ctx.inv, prefills=step.params["prefills"])
    if reading.unknown and not reading.orphans:
        return Outcome("noop", {"unknown": reading.unknown}, unverified=[f"orphaned halves not read: {u}"
                                                                         for u in reading.unknown],
                       reason="the request logs could not all be read: nothing concluded")
    if not reading.orphans:
        return Outcome.noop("no prefill holds a request that no decode holds", prefills=step.params["prefills"])
    ended, left = {}, {}
    for pid, orphans in reading.orphans.items():
        inst = pl.get(pid)
        e, lft = abort_orphans(inst, orphans, set(open_requests(ctx.pool, inst, bootstrap_timeout_s(ctx.inv) + 60)))
        ended[pid], left[pid] = e, lft
        ctx.say(f"  {pid}: ended {len(e)} orphaned half(s) whose decode side is gone: {', '.join(e) or 'none'}")
    # proof: what was aborted is no longer open on its prefill (the scheduler ends it within moments)
    deadline = time.monotonic() + 10
    while True:
        still = {pid: sorted(set(rids) & set(open_requests(ctx.pool, pl.get(pid), bootstrap_timeout_s(ctx.inv) + 60)))
                 for pid, rids in ended.items()}
        still = {k: v for k, v in still.items() if v}
        if not still or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    ev = {"orphans": {pid: [o.describe() for o in os] for pid, os in reading.orphans.items()},
          "ended": ended, "not_ended": left, "still_open": still}
    ctx.give(step, "orphans_ended", {pid: rids for pid, rids in ended.items() if rids})
    return Outcome(evidence=ev,
                   verified=[f"{pid}: {len(rids)} orphaned half(s) ended and no longer open (lost work, not "
                             f"replayed): {', '.join(rids)}" for pid, rids in ended.items() if rids and pid not in still],
                   unverified=[f"{pid}: still open after the abort: {', '.join(v)}" for pid, v in still.items()]
                   + [f"{pid}: {x}" for pid, xs in left.items() for x in xs])
