"""How an operation on a live cluster runs, in one place (the CLI parses, calls this, prints the verdict):
planned first from the record alone, so that bad input and a rule's refusal come before any connection;
then, with the hosts, systemd and the gateways read (pdops.reads.observe), planned again from what
serves now: that plan is the one printed and walked (a refusal of the first plan stands only if this one
refuses too: a floor counts what serves now); walked on the connections opened once for it. And how any plan is carried out (`run_operation`): under
the cluster lock, from the revision it was planned from, the walk, and one verdict in the journal."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from pdops.errors import PdopsError, Refused
from pdops.plans import Plan
from pdops.reads.observation import Seen
from pdops.reads.observe import observe
from pdops.remote.hosts import connections
from pdops.record.local import new_op_id
from pdops.runner import RunContext, Say, walk


def operate(inv, record, make_plan: Callable[[Seen | None], Any], walk: Callable[[Any, dict], dict], *,
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
    rev = record.current_revision()
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


# What an operation's failure hook returns: the verdict's status and its evidence (the error is added).
Failed = Callable[[RunContext, PdopsError], tuple[str, dict]]


def run_operation(plan: Plan, inv, record, say: Say = print, *, pool, gateways, kind: str | None = None,
                  basis: int | None = None, context: dict | None = None, failed: Failed | None = None,
                  finish: Callable[[RunContext, dict], str | None] | None = None, op: str | None = None,
                  lock_held: bool = False, context_type: type = RunContext,
                  head: Callable[[object], dict] | None = None,
                  closing: Callable[[RunContext, dict | None, BaseException | None], None] | None = None) -> dict:
    """The one way a plan is carried out: the cluster lock taken for it (`kind`, default the plan's
    operation; the operation's id `op`, default a new one; `lock_held`: the caller holds the lock for
    `op` already: `inv sweep` between its rows, a migration holding two records' locks), the record's `current` checked to still be `basis` (the revision it was planned from; None:
    not checked), a context for its steps (`context`: placement, old_placement, replacing), the walk
    (pdops.runner.walk: steps, rescue, always), then one verdict in the journal: `ok`, with what
    `finish(ctx, verdict)` adds (the status it returns instead, if any: a probe whose way back failed), or on a failure the status and evidence `failed(ctx, exc)` returns
    (default: `failed`, the error and the steps completed), the error raised on; on Ctrl-C, `interrupted`.
    `context_type`: a RunContext that carries more (a sweep's). Under the lock, for an operation that
    records more than its verdict: `head(journal)` gives fields added to the plan's head before the walk
    (a probe's number, read from the journal, so that two probes never share one), and
    `closing(ctx, verdict, exc)` runs after the verdict is journalled, whether the steps passed
    (`verdict`), one failed (`exc`, the PdopsError) or the operator pressed Ctrl-C (`exc`, the
    KeyboardInterrupt), which is raised on after it: a probe's result record.
    No executor writes a verdict."""
    kind = kind or plan.operation
    op = op or new_op_id(kind)
    if lock_held:
        return _run(plan, inv, record, say, op, pool, gateways, basis, context, failed, finish, context_type, head,
                    closing)
    with record.lock(kind, op_id=op):
        return _run(plan, inv, record, say, op, pool, gateways, basis, context, failed, finish, context_type, head,
                    closing)


def _run(plan, inv, record, say, op, pool, gateways, basis, context, failed, finish, context_type, head,
         closing) -> dict:
    if basis is not None:
        record.check_basis(basis)
    if head is not None:
        plan = dataclasses.replace(plan, head={**plan.head, **head(record.journal())})
    ctx = context_type(inv, record, op, say, pool, gateways, **(context or {}))
    try:
        verdict = walk(plan, ctx)
    except PdopsError as exc:
        error = exc.render()  # as the step failed: the plan's verdict line and the hook add to what the operator reads
        exc.add_verdict_line()
        status, evidence = failed(ctx, exc) if failed else ("failed", {"completed": ctx.done})
        ctx.journal.step(op, "verdict", status, {"error": error, **evidence})
        if closing is not None:
            closing(ctx, None, exc)
        raise
    except KeyboardInterrupt as exc:  # the plan's always steps ran first where it asks for them (always_on_interrupt)
        ctx.journal.step(op, "verdict", "interrupted", {"error": "interrupted by the operator", "completed": ctx.done})
        if closing is not None:
            closing(ctx, None, exc)
        raise
    status = finish(ctx, verdict) if finish is not None else None
    ctx.journal.step(op, "verdict", status or "ok", verdict)
    if closing is not None:
        closing(ctx, verdict, None)
    return verdict
