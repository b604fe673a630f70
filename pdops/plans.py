"""Plans as values: a :class:`Step` (id, kind, target, deadline, parameters, what it verifies,
parallel group, condition), the :class:`Plan` of an operation (its steps, the rescue that answers a
failed step, the steps that always run last) and how ``--dry-run`` prints it, and the :class:`Outcome`
of one step. Made by the pure planners; carried out only by pdops.runner.walk."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdops.errors import PdopsError
from pdops import kinds
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
    # truthy (True) or not (False; also when no step gave it); (output name, True/False, key): only if
    # that output (a set, list or dict) holds `key` (True) or not (False). Otherwise it is journalled
    # as a no-op naming the condition. Printed with the step ("only if probe_keep", "only if p03 in undo").
    when: tuple[str, bool] | tuple[str, bool, str] | None = None

    @property
    def gives(self) -> tuple[str, ...]:
        k = kinds.KINDS.get(self.kind)
        return k.gives if k else ()

    @property
    def needs(self) -> tuple[str, ...]:
        k = kinds.KINDS.get(self.kind)
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
        return f"{self.name} — {where}{self.description}{budget}{par}{self.condition()}"

    def condition(self) -> str:
        """The step's `when`, as a plan prints it and a skipped step's journal record names it."""
        if self.when is None:
            return ""
        name, want, *key = self.when
        if key:
            return f" (only if {key[0]} {'in' if want else 'not in'} {name})"
        return f" (only if {'' if want else 'not '}{name})"

    def holds(self, value) -> bool:
        """Whether the output `value` meets the step's `when` (a step with none always runs)."""
        if self.when is None:
            return True
        _, want, *key = self.when
        have = key[0] in (value or ()) if key else bool(value)
        return have == want


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
    # what a failed walk adds to its error after its rescue and always steps, written from what the walk
    # did (a name in pdops.kinds.FAILURE_LINES: a halted change's verdict line, a deploy's, a drain's);
    # None: the error alone
    failure_line: str | None = None

    def step_ids(self) -> list[str]:
        return [s.name for s in self.steps]

    def all_steps(self):
        """Every step the plan may run: its steps, rescue and always, and those nested in them (a
        walk-plan step's plan)."""
        for s in self.steps + self.rescue + self.always:
            yield s
            if s.kind == "walk-plan":
                yield from s.params["plan"].all_steps()

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
        if self.failure_line is not None and self.failure_line not in kinds.FAILURE_LINES:
            errors.append(f"the plan's failure line {self.failure_line!r} is not in pdops.kinds.FAILURE_LINES")
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

        reported = kinds.FAILURE_LINES.get(self.failure_line or "", ("", ""))[1]
        for num, s in self._numbered():
            if num == "R1":
                lines.append("  if a step fails, then (rescue), and the failure is reported"
                             + (f" with {reported}" if reported else "") + ":")
            if num == "A1":
                if reported and not self.rescue:
                    lines.append(f"  if a step fails, the failure is reported with {reported}")
                lines.append("  whatever the outcome, last (always):")
            lines.append((f"  {num:>2}. " if num[0] not in "RA" else f"  {num}. ") + s.line() + self.suffix.get(s.name, ""))
            lines += uses(num, s)
            if s.params.get("plan") is not None:  # the plan it walks (a walk-plan step, a sweep's row), in full
                lines += ["      " + ln for ln in s.params["plan"].render().splitlines()[1:]]
        if reported and not self.rescue and not self.always:
            lines.append(f"  if a step fails, the failure is reported with {reported}")
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
