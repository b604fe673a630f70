"""DO layer: the one runner that walks plans (pdops.plans: Step, Plan, Outcome; fan-out and remote
commands: pdops.fanout).

:func:`walk` is the only code that carries a plan out: it runs each step's executor (one function per
step kind, named in the one table pdops.kinds.KINDS and imported when first needed: :func:`executor`),
fans out consecutive steps of one parallel group and collects every outcome before deciding, bounds
each step by its own deadline, journals every step by its id with its target and evidence, records
work already done as a no-op with its reason, stops at the first failed step, and builds the verdict
only from what the steps verified. What ``--dry-run`` prints is :meth:`Plan.render` of the same list.
"""

from __future__ import annotations

import importlib
import resource
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pdops.errors import PdopsError, Unverified
from pdops.fanout import run_parallel
from pdops import kinds
from pdops.outputs import OUTPUTS, REPORTED
from pdops.plans import Outcome, Plan, Step


# Where an operation's progress lines go: print, or a test's list.append. The one definition.
Say = Callable[[str], None]


@dataclass
class RunContext:
    """What every executor gets, typed: the inventory, the record (state dir and journal), the
    operation id, the connections opened once by the caller (host pool, gateway client), where to
    print, the placement the operation acts on (for a change: every instance it names, a replaced
    one as it will run) and the one it starts from (`old_placement`, with the ids being replaced),
    and the outputs earlier steps gave (read and given only as each step declares: get, give)."""

    inv: Any
    record: Any
    op: str
    say: Say
    pool: Any = None
    gateways: Any = None  # pdops.remote.gateway.Gateways: every gateway of the cluster
    placement: Any = None
    old_placement: Any = None
    replacing: frozenset = frozenset()
    done: list[str] = field(default_factory=list)  # ids of the steps that completed (ok or noop)
    timing: list = field(default_factory=list)  # the runner's own time per batch (bench/runner_overhead.py)
    after_failed: list[str] = field(default_factory=list)  # rescue/always steps failed or cut short: "<id>: <why>"
    always_outcome: dict = field(default_factory=dict)  # what the plan's `always` steps verified and could not
    _outputs: dict = field(default_factory=dict, repr=False)
    _deadlines: dict = field(default_factory=dict, repr=False)
    _took: dict = field(default_factory=dict, repr=False)
    _lock: Any = field(default_factory=threading.Lock, repr=False)

    @property
    def journal(self):
        return self.record.journal()

    def deadline(self, step: Step) -> float | None:
        """The absolute time.monotonic() deadline of `step`, set when the runner started it."""
        return self._deadlines.get(step.name)

    def get(self, step: Step, name: str, default: Any = None) -> Any:
        """The output `name` earlier steps gave (`default` when none did); `step` must declare it."""
        if name not in step.needs and name + "?" not in step.needs:
            raise PdopsError(f"step {step.name} ({step.kind}) reads {name!r} without declaring it",
                             fix="a pdops bug to report")
        with self._lock:
            return self._outputs.get(name, default)

    def give(self, step: Step, name: str, value: Any) -> None:
        """Give the output `name` to the steps after this one; `step` must declare it. A dict is merged
        into what earlier steps gave, a set or list added to it; anything else replaces it."""
        if name not in step.gives:
            raise PdopsError(f"step {step.name} ({step.kind}) gives {name!r} without declaring it",
                             fix="a pdops bug to report")
        with self._lock:
            have = self._outputs.get(name)
            if isinstance(have, dict) and isinstance(value, dict):
                have.update(value)
            elif isinstance(have, set):
                have |= set(value)
            elif isinstance(have, list):
                have.extend(v for v in value if v not in have)
            else:
                self._outputs[name] = value

    def output(self, name: str, default: Any = None) -> Any:
        """For the operation's own verdict once the walk is over (never for an executor)."""
        with self._lock:
            return self._outputs.get(name, default)


Executor = Callable[[RunContext, Step], "Outcome | None"]
# An executor may finish what it was doing when its own deadline passed: a wait's last reading, then
# the journal tail its error carries; each is one remote call, bounded by its connect (10 s) and
# command (60 s: the pool's) timeouts. Only a step that overran by more than two of them has a wait
# its deadline does not bound. 5 s, "one SSH round trip" on an idle machine, failed a halted change
# in the soak with four lab workers and a real engine starting on two cores (exit 5 in place of 9).
DEADLINE_GRACE_S = 2 * (10 + 60.0)


class DeadlineExceeded(Unverified):
    """A step ran past the deadline its plan printed."""


_RESOLVED: dict[str, Callable] = {}


def _resolve(target: Any) -> Callable:
    """A function named in one of pdops.kinds' tables as "module:function" (a test may bind the function
    itself), imported the first time it is needed."""
    if callable(target):
        return target
    fn = _RESOLVED.get(target)
    if fn is None:
        module, name = target.split(":")
        fn = _RESOLVED[target] = getattr(importlib.import_module(module), name)
    return fn


def executor(kind: str) -> Executor | None:
    """The function that carries out steps of `kind` (pdops.kinds.KINDS, the one table), imported the
    first time a walk needs it; None for a kind that is not in the table."""
    k = kinds.KINDS.get(kind)
    return None if k is None else _resolve(k.executor)


def failure_line(name: str) -> Callable[[RunContext, Plan], str]:
    """The function that writes the line a failed walk adds to its error (pdops.kinds.FAILURE_LINES),
    imported the first time a walk needs it."""
    return _resolve(kinds.FAILURE_LINES[name][0])


def operator_cpu_s() -> float:
    """CPU seconds spent by this machine for the operation so far: this process (every thread) and
    the children it has waited for (ansible-playbook with its forks, ssh). Journalled per batch of
    steps (`operator_cpu_s`; `batch_operator_cpu_s` on each step of a parallel batch), so a slow
    command shows where the operator's own CPU went (bench/fleet_cost.py)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def _run_step(ctx: RunContext, step: Step) -> Outcome:
    fn = executor(step.kind)
    if fn is None:
        raise PdopsError(f"no executor for step kind {step.kind!r} ({step.name})")
    if step.when is not None and not step.holds(ctx.output(step.when[0])):
        name = step.when[0]
        return Outcome.noop(f"not run: {step.condition().strip()[1:-1]} ({name}: {OUTPUTS.get(name, name)}), "
                            "and that does not hold")
    t0 = time.monotonic()
    if step.deadline:
        ctx._deadlines[step.name] = t0 + step.deadline
    try:
        out = fn(ctx, step) or Outcome()
    finally:
        ctx._took[step.name] = took = time.monotonic() - t0
    out.evidence.setdefault("seconds", round(took, 2))
    if step.deadline and took > step.deadline + max(DEADLINE_GRACE_S, 0.1 * step.deadline):
        raise DeadlineExceeded(f"{step.name} took {took:.1f}s, past its deadline of {step.deadline:g}s",
                               fix="the step's own wait is not bounded by its deadline: a pdops bug to report")
    return out


def walk(plan: Plan, ctx: RunContext) -> dict:
    """Carry out `plan` step by step; returns the verdict. Journals ``plan``, then every step by its
    id (:func:`run_steps`). On a failed step it re-raises the first failure (with its command,
    host, exit status and output tail where it has them); the caller writes the failure verdict
    (it knows what to undo) and, on success, journals the verdict it returns."""
    unknown = sorted({s.kind for s in plan.all_steps()} - set(kinds.KINDS))
    if unknown:  # before anything runs: a kind not in pdops.kinds is a pdops bug
        raise PdopsError(f"no executor for step kind(s) {', '.join(map(repr, unknown))} of the {plan.operation} "
                         "plan: nothing was run", fix="a pdops bug to report")
    plan.check()
    walked = {s.name: s.params["plan"].step_ids() + [r.name for r in s.params["plan"].rescue + s.params["plan"].always]
              for s in plan.steps + plan.rescue + plan.always if s.kind == "walk-plan"}
    ctx.journal.step(ctx.op, "plan", "ok", {**plan.head, "operation": plan.operation, "steps": plan.step_ids(),
                                            **({"rescue": [s.name for s in plan.rescue]} if plan.rescue else {}),
                                            **({"always": [s.name for s in plan.always]} if plan.always else {}),
                                            **({"walks": walked} if walked else {})})
    verdict = walk_body(plan, ctx)
    verdict.update(operation=plan.operation, notes=list(plan.notes) + verdict.get("notes", []))
    return verdict


def walk_body(plan: Plan, ctx: RunContext) -> dict:
    """A plan's steps, then on a failure its rescue, then (either way) its always steps: the one walk
    of a plan, whether it is the operation's or a plan one of its steps walks (:func:`do_walk_plan`).
    Returns what the steps and the always steps verified and could not, and what the verdict reports
    (:func:`reported`); re-raises the first failure, carrying the line the plan's failure line wrote
    from what its rescue gave (`verdict_line`: a halted change's verdict line, :func:`failure_line`),
    which the caller adds to the message once it has journalled the failure itself."""
    try:
        verdict = run_steps(plan.steps, ctx)
    except KeyboardInterrupt:
        if plan.always_on_interrupt and plan.always:
            ctx.say("interrupted: running the plan's `always` steps before stopping")
            ctx.always_outcome = run_rescue(plan.always, ctx, label="always")
        raise
    except Exception as exc:
        if plan.rescue:
            run_rescue(plan.rescue, ctx)
        ctx.always_outcome = run_rescue(plan.always, ctx, label="always")
        if plan.failure_line is not None and isinstance(exc, PdopsError):
            try:
                exc.verdict_line = failure_line(plan.failure_line)(ctx, plan)
            except Exception as bug:  # noqa: BLE001 - the walk's own failure is what is raised, never hidden
                exc.verdict_line = (f"verdict: its line ({plan.failure_line}) could not be written "
                                    f"({type(bug).__name__}: {bug}): see the journal, `inv journal --op {ctx.op}`")
        raise
    last = ctx.always_outcome = run_rescue(plan.always, ctx, label="always")
    verdict["verified"] += last["verified"]
    verdict["unverified"] += last["unverified"]
    return {**verdict, **reported(ctx)}


def reported(ctx: RunContext) -> dict:
    """What the walk's verdict reports from its steps' outputs (pdops.outputs.REPORTED: the revision
    recorded, ...), as they gave them: no executor writes the verdict."""
    with ctx._lock:
        return {name: ctx._outputs[name] for name in REPORTED if name in ctx._outputs}


def run_rescue(steps: list[Step], ctx: RunContext, *, label: str = "rescue") -> dict:
    """A failed walk's rescue steps (or any walk's `always` steps), each journalled by its id (ok, noop
    or failed); one that fails is journalled and said, and the next one still runs: the walk's own
    failure is what the caller raises. Returns what they verified and could not."""
    out: dict[str, list[str]] = {"verified": [], "unverified": []}
    for n, step in enumerate(steps, 1):
        ctx.say(f"[{label} {n}/{len(steps)}] {step.name}")
        target = {"target": step.host, **({"instance": step.instance} if step.instance else {})}
        try:
            r = _run_step(ctx, step)
        except KeyboardInterrupt:
            ctx.journal.step(ctx.op, step.name, "interrupted", {**target, "error": "interrupted by the operator"})
            # a way back cut short did not complete: this step and the ones after it, which never ran
            ctx.after_failed += [f"{step.name}: interrupted by the operator"] + [
                f"{s.name}: not run (interrupted before it)" for s in steps[n:]]
            raise
        except Exception as exc:  # noqa: BLE001 - journalled; the original failure is raised
            err = exc.render() if isinstance(exc, PdopsError) else f"{type(exc).__name__}: {exc}"
            ctx.journal.step(ctx.op, step.name, "failed",
                             {**target, "error": err, **(getattr(exc, "journal_evidence", None) or {})})
            ctx.say(f"  {step.name} failed: {err.splitlines()[0]}")
            out["unverified"].append(f"{step.name} failed: {err.splitlines()[0]}")
            ctx.after_failed.append(f"{step.name}: {err}")
            continue
        ctx.journal.step(ctx.op, step.name, r.status, {**target, **r.evidence})
        out["verified"] += r.verified
        out["unverified"] += r.unverified
        if r.status == "noop":
            ctx.say(f"  {step.name}: nothing to do: {r.reason}")
    return out


def run_steps(steps: list[Step], ctx: RunContext, *, progress: bool = True) -> dict:
    """Walk `steps` (consecutive steps of one parallel group together, every outcome of a batch
    collected and journalled before deciding); returns what they verified and could not."""
    j = ctx.journal
    verified: list[str] = []
    unverified: list[str] = []
    noops: list[str] = []
    n, total = 0, len(steps)
    for batch in Plan("", "", steps).batches():
        n += len(batch)
        if progress:
            ctx.say(f"[{n}/{total}] " + (batch[0].name if len(batch) == 1 else
                                         f"{', '.join(s.name for s in batch)} (in parallel)"))
        t_batch, cpu_batch = time.monotonic(), operator_cpu_s()
        if len(batch) == 1:
            try:
                results: dict = {batch[0]: _run_step(ctx, batch[0])}
            except Exception as exc:  # noqa: BLE001 - journalled, then re-raised
                results = {batch[0]: exc}
        else:
            results = run_parallel(batch, lambda s: _run_step(ctx, s))
        inside = max((ctx._took.pop(s.name, 0.0) for s in batch), default=0.0)
        cpu = {"operator_cpu_s" if len(batch) == 1 else "batch_operator_cpu_s": round(operator_cpu_s() - cpu_batch, 3)}
        first: Exception | None = None
        failed = [s.name for s, r in results.items() if isinstance(r, Exception)]
        for step, r in results.items():
            target = {"target": step.host, **({"instance": step.instance} if step.instance else {})}
            if isinstance(r, Exception):
                err = r.render() if isinstance(r, PdopsError) else f"{type(r).__name__}: {r}"
                ev = {**target, "error": err, **(getattr(r, "journal_evidence", None) or {})}
                j.step(ctx.op, step.name, "failed", ev)
                first = first or r
                continue
            j.step(ctx.op, step.name, r.status, {**target, **r.evidence, **cpu})
            ctx.done.append(step.name)
            verified += r.verified
            unverified += r.unverified
            if r.status == "noop":
                noops.append(f"{step.name}: {r.reason}")
                ctx.say(f"  {step.name}: nothing to do: {r.reason}")
        # the runner's own time for this batch: fan-out, journal writes, progress (bench/runner_overhead.py)
        ctx.timing.append({"steps": [s.name for s in batch], "wall_s": time.monotonic() - t_batch, "inside_s": inside})
        if first is not None:
            if len(failed) > 1 and isinstance(first, PdopsError):
                first.message = f"{len(failed)} of {len(batch)} steps failed ({', '.join(failed)}); first: " \
                                + first.message
            raise first
    return {"verified": verified, "unverified": unverified, "noops": noops}


def do_walk_plan(ctx: RunContext, step: Step) -> Outcome:
    """A step that walks a whole plan declared in its params (printed under it by the dry run and
    listed in the journal's `plan` record): its steps, its rescue on a failure, its always steps,
    in a context of its own (`inv`, `placement`, `old_placement`, `replacing` from the params;
    outputs of its own), under the lock and journal of the operation. A failure is raised with the
    walked plan's verdict line added (:func:`walk_body`), so that the step's journalled error has it.
    Gives its verdict in `plan_verdicts`."""
    sub: Plan = step.params["plan"]
    child = RunContext(step.params.get("inv", ctx.inv), ctx.record, ctx.op, ctx.say, ctx.pool, ctx.gateways,
                       placement=step.params.get("placement", ctx.placement),
                       old_placement=step.params.get("old_placement", ctx.old_placement),
                       replacing=frozenset(step.params.get("replacing", ())))
    try:
        got = walk_body(sub, child)
    except PdopsError as exc:
        exc.add_verdict_line()
        raise
    ctx.give(step, "plan_verdicts", {step.name: reported(child)})
    return Outcome(evidence={"walked": sub.operation, "steps": len(sub.steps), **reported(child)},
                   verified=got["verified"], unverified=got["unverified"])


