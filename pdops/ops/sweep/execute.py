"""Carrying a sweep out: per topology, scale to it, then run each concurrency, `repeats` times."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from pdops.ops.bench import Figures, describe_failures, fmt_int, fmt_s
from pdops.errors import PdopsError
from pdops.model.topology import Topology

from pdops.ops.sweep.plan import DEFAULT_MIN_GAIN, FAILED, MEASURED, PLANNED, SweepPlan, parse_min_gain
from pdops.ops.sweep.matrix import Matrix, write_matrix


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


def execute_sweep(plan: SweepPlan, *, scale_to: Callable[[Topology], None],
                  run_cell: Callable[[Topology, int, int, Path], object], out_dir: str | os.PathLike,
                  verify: Callable[[Topology], None] | None = None, say: Callable[[str], None] = print,
                  plots: bool = True, min_gain: float = DEFAULT_MIN_GAIN) -> Matrix:
    """Carry out a sweep plan. `scale_to(topology)` brings the cluster to a topology (and
    raises if it cannot); `verify(topology)` proves it; `run_cell(topology, concurrency,
    repeat, run_dir)` returns Figures or a BenchResult. matrix.json is rewritten after
    every cell, so an interrupted sweep keeps what it measured."""
    from pdops.model.topology import parse_topology

    out = Path(out_dir)
    m = Matrix.from_plan(plan)
    m.min_gain = parse_min_gain(min_gain)
    write_matrix(m, out, plots=False)
    for ratio in m.ratios:
        topo_s = m.topologies.get(ratio)
        cells = [c for c in m.cells if c.ratio == ratio and c.state == PLANNED]
        if topo_s is None or not cells:
            continue
        topo = parse_topology(topo_s)
        say(f"[{ratio}] scaling to {topo}")
        try:
            scale_to(topo)
            if verify is not None:
                verify(topo)
        except Exception as exc:  # the whole row failed: record it, go on with the next ratio
            why = f"scale to {topo} failed: {_error_text(exc)}"
            say(f"[{ratio}] {why}")
            for c in cells:
                c.state, c.reason = FAILED, why
            write_matrix(m, out, plots=False)
            continue
        for c in cells:
            for rep in range(plan.repeats):
                run_dir = out / "runs" / f"{topo}-c{c.concurrency}-r{rep + 1}"
                say(f"[{ratio}] {topo} C{c.concurrency} repeat {rep + 1}/{plan.repeats}")
                try:
                    figs, rd = _figures_of(run_cell(topo, c.concurrency, rep, run_dir))
                except Exception as exc:
                    c.runs.append({"error": _error_text(exc), "run_dir": str(run_dir)})
                    say(f"    failed: {_error_text(exc)}")
                    continue
                entry = figs.to_dict()
                entry["run_dir"] = rd or str(run_dir)
                bad = _run_failure(figs)
                if bad:
                    entry["error"] = bad
                c.runs.append(entry)
                say(f"    {fmt_int(figs.total_tpm)} total TPM, TTFT p99 {fmt_s(figs.ttft_p99)}, "
                    f"{figs.ok}/{figs.sent} ok" + (f" [{figs.mark}]" if figs.mark else ""))
            if c.measured_runs():
                c.state = MEASURED
            else:
                c.state = FAILED
                c.reason = "; ".join(dict.fromkeys(r["error"] for r in c.runs if r.get("error")))
            write_matrix(m, out, plots=False)
    res = write_matrix(m, out, plots=plots)
    if res["plots_skipped"]:
        say(f"plots: {res['plots_skipped']}")
    return m
