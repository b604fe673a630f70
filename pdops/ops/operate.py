"""How an operation on a live cluster runs, in one place (the CLI parses, calls this, prints the verdict):
planned first from the record alone, so that bad input and a rule's refusal come before any connection;
then, with the hosts, systemd and the gateways read (pdops.reads.observe), planned again from what
serves now: that plan is the one printed and walked (a refusal of the first plan stands only if this one
refuses too: a floor counts what serves now); walked on the connections opened once for it."""

from __future__ import annotations

from typing import Any, Callable

from pdops.errors import Refused
from pdops.reads.observation import Seen
from pdops.reads.observe import observe
from pdops.remote.hosts import connections
from pdops.runner import Say


def operate(inv, state, make_plan: Callable[[Seen | None], Any], walk: Callable[[Any, dict], dict], *,
            dry_run: bool, observe_first: bool = True, units_of: Callable | None = None, first=None,
            say: Say = print) -> tuple[Any, dict | None]:
    """`make_plan(seen)` -> a plan (`seen`: None, planned from the record alone); `walk(plan, conns)` -> its
    verdict. `observe_first=False`: the record alone (an operation that starts and stops nothing);
    `units_of(revision)`: the instances whose units are read (an operation on one instance reads a few,
    not the fleet); `first`: the record-only plan when the caller made it already. Returns (the plan
    printed, its verdict), the verdict None when nothing was walked (--dry-run, or nothing to do)."""
    refused = None
    if first is None:
        try:
            first = make_plan(None)
        except Refused as exc:
            refused = exc
    rev = state.current_revision()
    if not observe_first or rev is None:
        if refused:
            raise refused
        say(first.render())
        if dry_run or getattr(first, "noop", None):
            return first, None
        with connections(inv) as conns:
            return first, walk(first, conns)
    with connections(inv) as conns:
        seen = Seen.of(observe(inv, rev, **conns, **({"units_of": units_of(rev)} if units_of else {})))
        plan = make_plan(seen)
        say(plan.render())
        if dry_run or getattr(plan, "noop", None):
            return plan, None
        return plan, walk(plan, conns)
