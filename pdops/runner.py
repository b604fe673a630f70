"""DO layer: plans as data and the one runner that walks them (fan-out and remote commands:
pdops.fanout).

A plan is a list of typed :class:`Step` s (id, kind, target, deadline, parameters, what it
verifies, parallel group), made by a pure planner. :func:`walk` is the only code that
carries a plan out: it runs each step's executor (one function per step kind, named in the one
table pdops.kinds.KINDS and imported when first needed: :func:`executor`), fans out consecutive steps of one parallel group and
collects every outcome before deciding, bounds each step by its own deadline, journals
every step by its id with its target and evidence, records work already done as a no-op
with its reason, stops at the first failed step, and builds the verdict only from what the
steps verified. What ``--dry-run`` prints is :meth:`Plan.render` of the same list.
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
from pdops.kinds import KINDS
from pdops.outputs import OUTPUTS


@dataclass(eq=False)
class Step:
    """One step of a plan. ``name`` is its id, unique within the operation (it carries the
    instance id where there is one: ``start p01``, ``drain d02: empty-check-1``); ``kind``
    picks its executor in the one table (pdops.kinds.KINDS), and is always given, never read
    from the id; ``deadline`` is the budget in seconds that bounds the step (None: no limit);
    steps with the same ``group`` that follow each other run in parallel. What a step gives the
    steps after it and reads from them (names in :data:`OUTPUTS`) is declared by its kind in the
    table (``gives``, ``needs``; a need ending in "?" is read only if an earlier step gave it);
    checked when a plan is walked (:meth:`Plan.check`) and at run time (:meth:`RunContext.get`,
    :meth:`RunContext.give`)."""

    name: str
    host: str | None
    description: str
    deadline: float | None = None
    kind: str = ""
    params: dict = field(default_factory=dict)
    group: str | None = None
    verifies: str = ""
    # (output name, True/False): the step runs only if that output, given by an earlier step, is
    # truthy (True) or not (False; also when no step gave it); otherwise it is journalled as a no-op
    # naming the condition. Printed with the step ("only if probe_keep").
    when: tuple[str, bool] | None = None

    @property
    def gives(self) -> tuple[str, ...]:
        k = KINDS.get(self.kind)
        return k.gives if k else ()

    @property
    def needs(self) -> tuple[str, ...]:
        k = KINDS.get(self.kind)
        return k.needs if k else ()

    def __post_init__(self) -> None:
        if not self.kind:
            raise ValueError(f"step {self.name!r} has no kind: a step names the kind of its executor")

    @property
    def instance(self) -> str | None:
        return self.params.get("instance")

    def __str__(self) -> str:
        where = f"[{self.host}] " if self.host else ""
        budget = f" (within {self.deadline:g}s)" if self.deadline else ""
        return f"{where}{self.name}: {self.description}{budget}"

    def line(self) -> str:
        """How a plan prints the step: ``<id> — [host] description (within Ns)``."""
        where = f"[{self.host}] " if self.host else ""
        budget = f" (within {self.deadline:g}s)" if self.deadline else ""
        par = " (in parallel with the rest of its group)" if self.group else ""
        cond = "" if self.when is None else f" (only if {'' if self.when[1] else 'not '}{self.when[0]})"
        return f"{self.name} — {where}{self.description}{budget}{par}{cond}"


@dataclass
class Outcome:
    """What one step did: ``ok`` or ``noop`` (already done, with the reason), its evidence, and
    what it verified or could not verify. Only ``verified`` items ever reach the verdict as verified."""

    status: str = "ok"
    evidence: dict = field(default_factory=dict)
    verified: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)
    reason: str = ""

    @classmethod
    def noop(cls, reason: str, **evidence) -> "Outcome":
        return cls("noop", {"reason": reason, **evidence}, reason=reason)


@dataclass
class Plan:
    """A printable, walkable operation: its kind, a headline, the steps, notes, and the evidence
    the journal's ``plan`` record carries."""

    operation: str
    title: str
    steps: list[Step]
    notes: list[str] = field(default_factory=list)
    head: dict = field(default_factory=dict)
    footer: list[str] = field(default_factory=list)
    # what runs when a step fails, in order, before the failure is raised: each rescue step reads
    # what the walk did (the context), is journalled by its id, and never hides the failure
    rescue: list[Step] = field(default_factory=list)
    # what runs last whatever the outcome (after the steps or the rescue), e.g. publishing the
    # Prometheus targets of what is current; one that fails is said and journalled, never hides the
    # walk's failure nor fails a walk that passed. The cluster lock is not a step: the caller's
    # `with` holds it around the walk and the verdict (the shared record journals through it).
    always: list[Step] = field(default_factory=list)
    # run the `always` steps after an interrupt too (a probe's way back: a candidate is never left
    # behind); other plans stop at once on Ctrl-C
    always_on_interrupt: bool = False
    suffix: dict = field(default_factory=dict)  # step id -> text printed after its line (a change's capacity)

    def step_ids(self) -> list[str]:
        return [s.name for s in self.steps]

    def all_steps(self):
        """Every step the plan may run: its steps, rescue and always, and those nested in them (a
        walk-plan step's plan, a step's may-run steps)."""
        for s in self.steps + self.rescue + self.always:
            yield s
            if s.kind == "walk-plan":
                yield from s.params["plan"].all_steps()
            yield from s.params.get("may_run", ())

    def _numbered(self) -> list[tuple[str, Step]]:
        return ([(f"{n}", s) for n, s in enumerate(self.steps, 1)] + [(f"R{n}", s) for n, s in enumerate(self.rescue, 1)]
                + [(f"A{n}", s) for n, s in enumerate(self.always, 1)])

    def producers(self) -> dict[str, list[str]]:
        """Output name -> the numbers (as printed: 3, R1, A1) of the steps that give it."""
        out: dict[str, list[str]] = {}
        for num, s in self._numbered():
            for g in s.gives:
                out.setdefault(g, []).append(num)
        return out

    def check(self) -> None:
        """Every output a step reads is a known one, and one it requires is given by a step that runs
        before it (for a rescue or always step: by any step of the plan or an earlier rescue/always
        step, since which of them ran is known only then); every output given is a known one.
        PdopsError (a pdops bug) otherwise: nothing is run."""
        given: set[str] = set()
        errors = []
        main = {g for s in self.steps for g in s.gives}
        for num, s in self._numbered():
            for name in s.gives:
                if name not in OUTPUTS:
                    errors.append(f"step {num} ({s.name}) gives {name!r}, which is no declared output")
            before = given | (main if num[0] in "RA" else set())
            if s.when is not None and s.when[0] not in OUTPUTS:
                errors.append(f"step {num} ({s.name}) runs only if {s.when[0]!r}, which is no declared output")
            if s.kind == "walk-plan":
                s.params["plan"].check()
            for need in s.needs:
                name = need.rstrip("?")
                if name not in OUTPUTS:
                    errors.append(f"step {num} ({s.name}) reads {name!r}, which is no declared output")
                elif not need.endswith("?") and name not in before:
                    errors.append(f"step {num} ({s.name}) needs {name!r} ({OUTPUTS[name]}), which no step before it gives")
            given |= set(s.gives)
        if errors:
            raise PdopsError(f"the {self.operation} plan's steps do not fit together: " + "; ".join(errors)
                             + ": nothing was run", fix="a pdops bug to report")

    def render(self) -> str:
        lines = [self.title]
        made = self.producers()

        order = [num for num, _ in self._numbered()]

        def uses(num: str, s: Step) -> list[str]:
            # what the step requires from earlier steps (a need ending in "?" is "if any": not printed)
            before = set(order[:order.index(num)])
            have = [f"{n} (step {', '.join(m for m in made.get(n, []) if m in before)})" for n in s.needs
                    if not n.endswith("?") and any(m in before for m in made.get(n, []))]
            return [f"        uses: {'; '.join(have)}"] if have else []

        for num, s in self._numbered():
            if num == "R1":
                lines.append("  if a step fails, then (rescue), and the failure is reported:")
            if num == "A1":
                lines.append("  whatever the outcome, last (always):")
            lines.append((f"  {num:>2}. " if num[0] not in "RA" else f"  {num}. ") + s.line() + self.suffix.get(s.name, ""))
            lines += uses(num, s)
            if s.kind == "walk-plan":  # the plan it walks, step by step
                lines += ["      " + ln for ln in s.params["plan"].render().splitlines()[1:]]
            elif s.params.get("may_run"):  # the steps it may run, as it decides (each journalled by id)
                lines.append("        may run, as the step decides:")
                lines += [f"      {k:2d}. {sub.line()}" for k, sub in enumerate(s.params["may_run"], 1)]
        lines += self.footer
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def batches(self) -> list[list[Step]]:
        """Consecutive steps of one parallel group together; every other step alone."""
        out: list[list[Step]] = []
        for s in self.steps:
            if s.group and out and out[-1][0].group == s.group:
                out[-1].append(s)
            else:
                out.append([s])
        return out


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
    state: Any
    op: str
    say: Say
    pool: Any = None
    gateways: Any = None  # pdops.remote.gateway.Gateways: every gateway of the cluster
    placement: Any = None
    old_placement: Any = None
    replacing: frozenset = frozenset()
    done: list[str] = field(default_factory=list)  # ids of the steps that completed (ok or noop)
    failure: Exception | None = None  # the step failure a plan's rescue steps answer (set by `walk`)
    verdict: dict = field(default_factory=dict)  # what the record step adds to the verdict (the revision)
    timing: list = field(default_factory=list)  # the runner's own time per batch (bench/runner_overhead.py)
    after_failed: list[str] = field(default_factory=list)  # rescue/always steps that failed: "<id>: <error>"
    always_outcome: dict = field(default_factory=dict)  # what the plan's `always` steps verified and could not
    _outputs: dict = field(default_factory=dict, repr=False)
    _deadlines: dict = field(default_factory=dict, repr=False)
    _took: dict = field(default_factory=dict, repr=False)
    _lock: Any = field(default_factory=threading.Lock, repr=False)

    @property
    def journal(self):
        return self.state.journal()

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


_RESOLVED: dict[str, Executor] = {}


def executor(kind: str) -> Executor | None:
    """The function that carries out steps of `kind` (pdops.kinds.KINDS, the one table), imported the
    first time a walk needs it; None for a kind that is not in the table."""
    k = KINDS.get(kind)
    if k is None:
        return None
    if callable(k.executor):
        return k.executor
    fn = _RESOLVED.get(kind)
    if fn is None:
        module, name = k.executor.split(":")
        fn = _RESOLVED[kind] = getattr(importlib.import_module(module), name)
    return fn


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
    if step.when is not None:
        name, want = step.when
        have = bool(ctx.output(name))
        if have != want:
            return Outcome.noop(f"not run: only if {'' if want else 'not '}{name} ({OUTPUTS.get(name, name)}), "
                                f"and it is {'' if have else 'not '}so")
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
    unknown = sorted({s.kind for s in plan.all_steps()} - set(KINDS))
    if unknown:  # before anything runs: a kind not in pdops.kinds is a pdops bug
        raise PdopsError(f"no executor for step kind(s) {', '.join(map(repr, unknown))} of the {plan.operation} "
                         "plan: nothing was run", fix="a pdops bug to report")
    plan.check()
    walked = {s.name: s.params["plan"].step_ids() + [r.name for r in s.params["plan"].rescue + s.params["plan"].always]
              for s in plan.steps + plan.rescue + plan.always if s.kind == "walk-plan"}
    walked.update({s.name: [sub.name for sub in s.params["may_run"]] for s in plan.steps + plan.rescue + plan.always
                   if s.params.get("may_run")})
    ctx.journal.step(ctx.op, "plan", "ok", {**plan.head, "operation": plan.operation, "steps": plan.step_ids(),
                                            **({"rescue": [s.name for s in plan.rescue]} if plan.rescue else {}),
                                            **({"always": [s.name for s in plan.always]} if plan.always else {}),
                                            **({"walks": walked} if walked else {})})
    try:
        verdict = run_steps(plan.steps, ctx)
    except KeyboardInterrupt:
        if plan.always_on_interrupt and plan.always:
            ctx.say("interrupted: running the plan's `always` steps before stopping")
            ctx.always_outcome = run_rescue(plan.always, ctx, label="always")
        raise
    except Exception as exc:
        if plan.rescue:
            ctx.failure = exc
            run_rescue(plan.rescue, ctx)
        ctx.always_outcome = run_rescue(plan.always, ctx, label="always")
        raise
    last = ctx.always_outcome = run_rescue(plan.always, ctx, label="always")
    verdict["verified"] += last["verified"]
    verdict["unverified"] += last["unverified"]
    verdict.update(operation=plan.operation, notes=list(plan.notes) + verdict.get("notes", []))
    return verdict


def walk_journalled(plan: Plan, ctx: RunContext) -> dict:
    """:func:`walk`, with a failure journalled as the operation's failed verdict before it is raised
    (the caller journals the verdict of a walk that passed, with what it adds)."""
    try:
        return walk(plan, ctx)
    except PdopsError as exc:
        ctx.journal.step(ctx.op, "verdict", "failed", {"error": exc.render()})
        raise


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
    return {"verified": verified, "unverified": unverified, "noops": noops, **ctx.verdict}


def do_walk_plan(ctx: RunContext, step: Step) -> Outcome:
    """A step that walks a whole plan declared in its params (printed under it by the dry run and
    listed in the journal's `plan` record): its steps, its rescue on a failure, its always steps,
    in a context of its own (`inv`, `placement`, `old_placement`, `replacing` from the params;
    outputs of its own), under the lock and journal of the operation. A failure is raised with
    the rescue's verdict line (`halt_verdict`) added. Gives its verdict in `plan_verdicts`."""
    sub: Plan = step.params["plan"]
    child = RunContext(step.params.get("inv", ctx.inv), ctx.state, ctx.op, ctx.say, ctx.pool, ctx.gateways,
                       placement=step.params.get("placement", ctx.placement),
                       old_placement=step.params.get("old_placement", ctx.old_placement),
                       replacing=frozenset(step.params.get("replacing", ())))
    try:
        got = run_steps(sub.steps, child)
    except Exception as exc:
        if sub.rescue:
            child.failure = exc
            run_rescue(sub.rescue, child)
        run_rescue(sub.always, child, label="always")
        note = child.output("halt_verdict")
        if note and isinstance(exc, PdopsError):
            exc.message += "\n" + note
        raise
    last = run_rescue(sub.always, child, label="always")
    ctx.give(step, "plan_verdicts", {step.name: dict(child.verdict)})
    return Outcome(evidence={"walked": sub.operation, "steps": len(sub.steps), **child.verdict},
                   verified=got["verified"] + last["verified"], unverified=got["unverified"] + last["unverified"])


