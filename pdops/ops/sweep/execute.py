"""Carrying a sweep out: the executors of its step kinds, and the walk of its one plan under the lock.

The plan (:attr:`pdops.ops.sweep.plan.SweepPlan.plan`) is `open-matrix`, then per row a
`sweep-scale <topology>` step and one `sweep-run <topology> C<c> r<k>` step per concurrency x
repeat, and the `always` step `write-matrix`. What passes between the steps is two declared
outputs: `sweep_matrix` (the Matrix being filled) and `sweep_failed_rows` (ratio -> why its
scale failed). The cluster is reached through the seams of :class:`SweepContext` (`scale_to`,
`run_cell`, `verify`): the live ones (:func:`scale_live`, :func:`bench_cells`, both given by
:func:`operate_sweep`) or a test's fakes.

Which failures stop the walk: none of a row's scale or of a run. A scale that fails (raises any
Exception, a row planned again that is not the printed one included: pdops.ops.sweep.rows.replan)
is recorded as the state of the row's cells, with the reason, and listed as not verified; the
row's runs are journalled as not run. The rows after it were planned from the revision it was to
record, which never came: each is journalled as not run, its cells not tried, with the reason (the
matrix keeps what the rows before measured). A run that fails is recorded in its cell. What stops
the walk is what is no measurement failure: Ctrl-C (the `always` step still writes the matrix and the
plots), a step the runner itself refuses (a pdops bug: the plan's check, an unknown kind), and
a matrix that cannot be written (`open-matrix`; a later write raises from its step: a sweep
whose figures cannot be kept is not worth going on with).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pdops.ops.bench import Figures, describe_failures, fmt_int, fmt_s, run_bench
from pdops.errors import PdopsError
from pdops.model.topology import Topology, parse_topology
from pdops.record.local import new_op_id
from pdops.plans import Outcome, Step
from pdops.runner import RunContext, Say
from pdops.ops.operate import run_operation

from pdops.ops.sweep.plan import FAILED, MEASURED, NOT_TRIED, PLANNED, SweepPlan, parse_min_gain
from pdops.ops.sweep.matrix import Matrix, write_matrix
from pdops.ops.sweep.rows import DEPLOY, NOTHING, Row, replan
from pdops.ops import deploy as dep, scale as scale_mod
from pdops.remote.hosts import connections
from pdops.reads.observation import Seen
from pdops.reads.observe import observe


@dataclass(frozen=True)
class CellRun:
    """One bench run as its `sweep-run` step decided it: what the `run_cell` seam is given.
    `repeat` counts from 1; `requests` is None when the run lasts `duration` seconds."""

    ratio: str
    topology: Topology
    concurrency: int
    repeat: int
    run_dir: Path
    workload: str
    requests: int | None = None
    duration: float | None = None
    ignore_eos: bool = False
    timeout_s: float | None = None
    op: str | None = None  # the bench's operation id, named in the sweep-run step however the run ends


# brings the cluster to a topology (verified) as the row printed (None: planned without the record),
# or raises; may return what it walked (evidence)
ScaleTo = Callable[[Topology, "Row | None"], "dict | None"]
# one bench run: Figures, or a BenchResult (with .figures and .run_dir)
RunCell = Callable[[CellRun], object]


@dataclass
class SweepContext(RunContext):
    """The runner's context with the sweep's seams to the cluster: the executors call them, never
    the cluster directly, so a unit test replaces the cluster by giving others."""

    scale_to: ScaleTo | None = None
    run_cell: RunCell | None = None
    verify: Callable[[Topology], None] | None = None


def _figures_of(result) -> tuple[Figures, str | None]:
    if isinstance(result, Figures):
        return result, None
    figs = getattr(result, "figures", None)
    if not isinstance(figs, Figures):
        raise TypeError(f"run_cell returned {type(result).__name__}, not Figures or a result with .figures")
    rd = getattr(result, "run_dir", None)
    return figs, None if rd is None else str(rd)


def _run_failure(f: Figures) -> str | None:
    if f.invalid:
        return f"invalid run: {f.invalid}"
    if f.ok == 0:
        return f"{describe_failures(f.failures) or 'no request sent'} (0/{f.sent} ok)"
    return None


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, PdopsError):
        return f"{exc.kind}: {exc.message}"
    return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- the executors, one per step kind

def do_open_matrix(ctx: SweepContext, step: Step) -> Outcome:
    """The matrix of every cell as planned (not-tried ones with their reason), written at once."""
    m = Matrix.from_dict(copy.deepcopy(step.params["matrix"]))  # the plan's own params stay as planned
    out = Path(step.params["out_dir"])
    write_matrix(m, out, plots=False)
    ctx.give(step, "sweep_matrix", m)
    todo = sum(c.state == PLANNED for c in m.cells)
    return Outcome(evidence={"out_dir": str(out), "cells": len(m.cells), "to_run": todo,
                             "not_tried": sum(c.state == NOT_TRIED for c in m.cells)},
                   verified=[f"matrix of {len(m.cells)} cells written to {out / 'matrix.json'}"])


def do_sweep_scale(ctx: SweepContext, step: Step) -> Outcome:
    """Bring the cluster to the row's topology through the `scale_to` seam (and `verify`, if given).
    A failure is the row's outcome, not the walk's: its cells are recorded failed with the reason,
    the failure is listed as not verified, and the ratio is given in `sweep_failed_rows`. A row
    planned from a forecast revision is not run once an earlier row failed (that revision never
    came): its cells are recorded not tried, with the reason, and its ratio given too."""
    m: Matrix = ctx.get(step, "sweep_matrix")
    ratio, topo = step.params["ratio"], parse_topology(step.params["topology"])
    row, failed = step.params.get("plan"), ctx.get(step, "sweep_failed_rows") or {}
    if failed and row is not None and row.forecast:
        return _row_not_measured(ctx, step, m, NOT_TRIED, (
            f"not run: its {row.how} was planned from revision {row.basis}, which the rows before it were to "
            f"record, and row {', '.join(failed)} failed; run the sweep again for the rows left"))
    ctx.say(f"[{ratio}] scaling to {topo}")
    try:
        walked = ctx.scale_to(topo, row) or {}
        if ctx.verify is not None:
            ctx.verify(topo)
    except Exception as exc:  # noqa: BLE001 - the row failed: recorded, and the sweep goes on (module docstring)
        return _row_not_measured(ctx, step, m, FAILED, f"scale to {topo} failed: {_error_text(exc)}")
    return Outcome(evidence={"topology": str(topo), "scaled": True, **walked},
                   verified=[f"the cluster runs {topo}" + (f" ({walked['how']})" if walked.get("how") else "")])


def _row_not_measured(ctx: SweepContext, step: Step, m: Matrix, state: str, why: str) -> Outcome:
    """The row's planned cells recorded `state` (FAILED: its scale failed; NOT_TRIED: not run) with
    `why`, its ratio given in `sweep_failed_rows` (its runs are then not made), matrix.json written."""
    ratio, topo = step.params["ratio"], step.params["topology"]
    ctx.say(f"[{ratio}] {why}")
    cells = [c for c in m.cells if c.ratio == ratio and c.state == PLANNED]
    for c in cells:
        c.state, c.reason = state, why
    ctx.give(step, "sweep_failed_rows", {ratio: why})
    write_matrix(m, Path(step.params["out_dir"]), plots=False)
    named = [f"{c.ratio}/C{c.concurrency}" for c in cells]
    if state == FAILED:
        return Outcome("failed", evidence={"topology": topo, "scaled": False, "error": why, "cells_failed": named},
                       unverified=[f"{ratio} ({topo}) not measured: {why}"])
    return Outcome("noop", evidence={"topology": topo, "scaled": False, "reason": why, "cells_not_tried": named},
                   unverified=[f"{ratio} ({topo}) not measured: {why}"], reason=why)


def do_sweep_run(ctx: SweepContext, step: Step) -> Outcome:
    """One bench run through the `run_cell` seam; its figures (or its failure) into its cell, and
    matrix.json written again. Not run (a no-op naming why) when its row's scale failed."""
    m: Matrix = ctx.get(step, "sweep_matrix")
    p = step.params
    failed_rows = ctx.get(step, "sweep_failed_rows") or {}
    if p["ratio"] in failed_rows:
        return Outcome.noop(f"not run: {failed_rows[p['ratio']]}")
    c = m.cell(p["ratio"], p["concurrency"])
    topo = parse_topology(p["topology"])
    run_dir = Path(p["run_dir"])
    ctx.say(f"[{p['ratio']}] {topo} C{p['concurrency']} repeat {p['repeat']}/{p['repeats']}")
    run = CellRun(p["ratio"], topo, p["concurrency"], p["repeat"], run_dir, p["workload"], p.get("requests"),
                  p.get("duration"), bool(p.get("ignore_eos")), p.get("timeout_s"), op=new_op_id("bench"))
    # its bench is an operation of its own in the journal, named here whether it ends well or not
    ev = {"ratio": p["ratio"], "topology": str(topo), "concurrency": p["concurrency"], "repeat": p["repeat"],
          "op": run.op}
    try:
        figs, rd = _figures_of(ctx.run_cell(run))
    except Exception as exc:  # noqa: BLE001 - the run failed: recorded in its cell, the sweep goes on
        entry = {"error": _error_text(exc), "run_dir": str(run_dir)}
        ctx.say(f"    failed: {entry['error']}")
    else:
        entry = figs.to_dict()
        entry["run_dir"] = rd or str(run_dir)
        bad = _run_failure(figs)
        if bad:
            entry["error"] = bad
        ctx.say(f"    {fmt_int(figs.total_tpm)} total TPM, TTFT p99 {fmt_s(figs.ttft_p99)}, "
                f"{figs.ok}/{figs.sent} ok" + (f" [{figs.mark}]" if figs.mark else ""))
    c.runs.append(entry)
    if c.measured_runs():
        c.state, c.reason = MEASURED, None
    elif p["repeat"] >= p["repeats"]:  # every repeat ran and none measured
        c.state = FAILED
        c.reason = "; ".join(dict.fromkeys(r["error"] for r in c.runs if r.get("error")))
    write_matrix(m, Path(p["out_dir"]), plots=False)
    ev.update(run_dir=entry["run_dir"], cell_state=c.state,
              **{k: entry.get(k) for k in ("sent", "ok", "total_tpm", "ttft_p99", "error", "mark") if entry.get(k)})
    name = f"{p['ratio']}/C{p['concurrency']} repeat {p['repeat']}"
    if entry.get("error"):
        return Outcome(evidence=ev, unverified=[f"{name}: {entry['error']}"])
    return Outcome(evidence=ev, verified=[f"{name}: {entry['ok']}/{entry['sent']} requests ok, in its ledger"],
                   unverified=[f"{name}: {entry['mark']}"] if entry.get("mark") else [])


def do_write_matrix(ctx: SweepContext, step: Step) -> Outcome:
    """matrix.json/csv/txt and the plots of whatever the sweep measured (an `always` step)."""
    m: Matrix | None = ctx.get(step, "sweep_matrix")
    if m is None:
        return Outcome.noop("no matrix: the sweep stopped before its first step")
    res = write_matrix(m, Path(step.params["out_dir"]), plots=step.params.get("plots", True))
    if res["plots_skipped"]:
        ctx.say(f"plots: {res['plots_skipped']}")
    counts = {s: sum(c.state == s for c in m.cells) for s in (MEASURED, FAILED, NOT_TRIED, PLANNED)}
    return Outcome(evidence={"paths": [str(x) for x in res["paths"]], "plots_skipped": res["plots_skipped"],
                             "cells": counts, "knees": [k.describe() for k in m.knees()]},
                   verified=[f"matrix files written: {', '.join(Path(x).name for x in res['paths'])}"])


# ---------------------------------------------------------------- the walk

def execute_sweep(plan: SweepPlan, *, scale_to: ScaleTo, run_cell: RunCell, record,
                  out_dir: str | os.PathLike | None = None, verify: Callable[[Topology], None] | None = None,
                  say: Say = print, plots: bool | None = None, min_gain: float | None = None,
                  op: str | None = None, inv=None) -> Matrix:
    """Walk the sweep's one plan (:attr:`SweepPlan.plan`) with the runner, under the cluster lock
    of `record` (its lock, its journal), and return the matrix it filled. `out_dir`,
    `plots` and `min_gain` given here replace the plan's own before its steps are made.

    The seams: `scale_to(topology, row)` brings the cluster to a topology as the row printed it
    (verified) or raises, and may return what it walked; `verify(topology)` proves it;
    `run_cell(CellRun)` returns Figures or a BenchResult. They run inside the steps, under this lock,
    so they must not take it themselves (:func:`scale_live` does not).

    The lock is held for the whole walk, not per row: a bench run measures the cluster the sweep
    scaled, so no other operator's change may land between a row's scale and its last run, nor
    between rows (the next row was planned from the revision the previous one is to record). The
    shared record also journals only through the lock's session: every step of the walk needs it held."""
    changes: dict = {}
    if out_dir is not None:
        changes["out_dir"] = str(out_dir)
    if plots is not None:
        changes["plots"] = bool(plots)
    if min_gain is not None:
        changes["min_gain"] = parse_min_gain(min_gain)
    if changes:
        plan = dataclasses.replace(plan, **changes)
    if plan.out_dir is None:
        raise PdopsError("a sweep plan without its folder: nothing was run", fix="a pdops bug to report")
    got: dict = {}

    def finish(ctx: SweepContext, verdict: dict) -> None:
        m: Matrix = ctx.output("sweep_matrix")
        got["matrix"] = m
        verdict.update(out_dir=plan.out_dir, cells={s: sum(c.state == s for c in m.cells)
                                                    for s in (MEASURED, FAILED, NOT_TRIED, PLANNED)})

    # the interrupted verdict comes after the `always` step wrote the matrix and the plots of what was measured
    run_operation(plan.plan, inv, record, say, pool=None, gateways=None, kind="sweep", finish=finish, op=op,
                  context={"scale_to": scale_to, "run_cell": run_cell, "verify": verify}, context_type=SweepContext)
    return got["matrix"]


def serving_now(inv, rev, conns: dict) -> Seen:
    """Which instances of revision `rev` serve now and which gateways answer, read from the hosts and the
    gateways (pdops.reads.observe)."""
    return Seen.of(observe(inv, rev, **conns))


def scale_live(inv, record, say: Say = print) -> ScaleTo:
    """The live `scale_to` seam, for a sweep walked under `record`'s lock (which it does not take):
    the row's deploy (nothing live) or change (allowed to dip capacity: the sweep owns the cluster, no
    traffic to protect, and 3p1d -> 2p2d on four hosts must free a host before placing its new
    instance), planned again from the record and what serves now (:func:`serving_now`) and walked only
    if it is the printed one
    (pdops.ops.sweep.rows.replan; else Refused, nothing run), with `execute_deploy` or `execute_scale`
    as an operation of its own in the journal, on connections opened for it. Returns what it walked:
    {how, op, revision}."""

    def scale_to(topo: Topology, printed: Row | None) -> dict:
        with connections(inv) as conns:
            rev = record.current_revision()
            # what serves now, read from the hosts and the gateway: a row is "nothing to change" only when
            # every instance of the revision serves, and one that does not makes the row another change
            seen = None if rev is None else serving_now(inv, rev, conns)
            row = replan(inv, printed, topo, record, seen)
            if row.how == NOTHING:
                say(f"[{row.ratio}] nothing to change: {row.plan.noop}; every instance of revision {rev.number} "
                    "serves (read now)")
                return {"how": f"nothing to change: {row.plan.noop}; every instance serves (read now)", "op": None,
                        "revision": rev.number}
            op = new_op_id("deploy" if row.how == DEPLOY else row.plan.operation)
            say(f"[{row.ratio}] the {row.how} planned again from {row.origin()} is the one printed, step for step: "
                f"walked as {op}")
            if row.how == DEPLOY:
                v = dep.execute_deploy(row.plan, say, op=op, **conns)
            else:
                v = scale_mod.execute_scale(row.plan, record, say, op=op, **conns)
        how = "deployed" if row.how == DEPLOY else "changed"
        return {"how": f"{how} as {op}", "op": op, "revision": (v or {}).get("revision")}

    return scale_to


def bench_cells(inv, record) -> RunCell:
    """The live `run_cell` seam: each cell a bench run (pdops.ops.bench.run_bench) that is an operation
    of its own in the journal, under the lock the sweep holds (which it does not take again)."""

    def run_cell(run: CellRun):
        return run_bench(inv, record, run.workload, run.concurrency, run.requests, run.duration, run.ignore_eos,
                         run.run_dir, timeout=run.timeout_s, say=lambda s: None, lock_held=True, op=run.op)

    return run_cell


def operate_sweep(plan: SweepPlan, inv, record, *, op: str, say: Say = print) -> Matrix:
    """`inv sweep` on the live cluster: its one plan walked under the lock (`op`, the id its folder is
    named by), each row brought to its topology by a deploy or a change (:func:`scale_live`), each
    cell a bench run (:func:`bench_cells`). Returns the matrix it filled."""
    return execute_sweep(plan, scale_to=scale_live(inv, record, say), run_cell=bench_cells(inv, record),
                         record=record, op=op, inv=inv, say=say)

