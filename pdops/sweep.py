"""`inv sweep`: P:D ratio x concurrency sweeps on a fixed GPU budget.

Plan (pure): the budget and the GPUs per instance (TP x PP of the profile) give a number
of instances; each ratio p:d takes the largest k with k*(p+d) instances, and must use the
whole budget (else its cells are "not tried", with the reason, unless partial use is
allowed: only reporting TPM per GPU keeps "more GPUs" from passing for "better ratio").
A topology that the inventory cannot place is "not tried" too. A budget that leaves no
cell to run is refused as invalid input.

Do (`execute_sweep`): per topology, scale to it (injected `scale_to`, and an optional
`verify`), then run each concurrency (injected `run_cell`), `repeats` times. Every cell
ends as one of:
- measured: figures of each repeat, the median and the range/median spread; a run with
  failed requests is still measured but carries its mark everywhere it is shown;
- tried and failed: the failure (scale failed, HTTP 503 on every request, run invalid...);
- not tried: the reason. Not-tried cells are never drawn in a plot.

The knee of a ratio is the last concurrency whose next step adds less than `min_gain`
(default 2%) total TPM: past it, added concurrency only adds latency.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from pdops.bench import Figures, Workload, describe_failures, fmt_int, fmt_s, parse_concurrency, parse_positive_int
from pdops.errors import InvalidInput, PdopsError
from pdops.topology import Topology

MEASURED = "measured"
FAILED = "failed"
NOT_TRIED = "not_tried"
PLANNED = "planned"
STATE_LABEL = {MEASURED: "measured", FAILED: "tried and failed", NOT_TRIED: "not tried", PLANNED: "planned"}
DEFAULT_MIN_GAIN = 0.02

_RATIO_FIX = "write ratios as P:D pairs separated by commas, e.g. 2:1,3:1,5:1"
_CONC_FIX = "write concurrencies as whole numbers >= 1 separated by commas, e.g. 8,16,32,64"


# ---------------------------------------------------------------- parsing

@dataclass(frozen=True, order=True)
class Ratio:
    prefill: int
    decode: int

    def __str__(self) -> str:
        return f"{self.prefill}:{self.decode}"

    @property
    def reduced(self) -> tuple[int, int]:
        from math import gcd

        g = gcd(self.prefill, self.decode)
        return self.prefill // g, self.decode // g


def _split(spec: object, field_name: str, fix: str) -> list[str]:
    if isinstance(spec, (list, tuple)):
        parts = [str(p) for p in spec]
    elif spec is None or not str(spec).strip():
        raise InvalidInput(field_name, "missing", fix=fix)
    else:
        parts = str(spec).split(",")
    parts = [p.strip() for p in parts]
    if any(not p for p in parts):
        raise InvalidInput(field_name, f"{spec!r} has an empty entry", fix=fix)
    return parts


def parse_ratios(spec: object, field_name: str = "--ratios") -> list[Ratio]:
    """`2:1,3:1,5:1` -> [Ratio(2,1), ...]; duplicates (also 4:2 next to 2:1) and junk are refused."""
    out: list[Ratio] = []
    seen: dict[tuple[int, int], str] = {}
    for p in _split(spec, field_name, _RATIO_FIX):
        a, sep, b = p.partition(":")
        if not sep or not a.strip().isdigit() or not b.strip().isdigit():
            raise InvalidInput(field_name, f"{p!r} is not a P:D ratio", fix=_RATIO_FIX)
        r = Ratio(int(a), int(b))
        if r.prefill < 1 or r.decode < 1:
            raise InvalidInput(field_name, f"{p!r}: a PD topology needs at least one prefill and one decode",
                               fix=_RATIO_FIX)
        if r.reduced in seen:
            raise InvalidInput(field_name, f"{p!r} is the same ratio as {seen[r.reduced]!r}", fix="list each ratio once")
        seen[r.reduced] = p
        out.append(r)
    return out


def parse_concurrencies(spec: object, field_name: str = "--concurrency") -> list[int]:
    """`8,16,32,64` -> [8, 16, 32, 64] (sorted, each >= 1, no duplicates)."""
    vals = [parse_concurrency(p, field_name) for p in _split(spec, field_name, _CONC_FIX)]
    if len(set(vals)) != len(vals):
        raise InvalidInput(field_name, f"{spec!r} lists a concurrency twice", fix=_CONC_FIX)
    return sorted(vals)


def parse_min_gain(value: object, field_name: str = "--min-gain") -> float:
    """The knee threshold: a fraction in (0, 1), e.g. 0.02 for 2% total TPM per step."""
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidInput(field_name, f"{value!r} is not a number", fix="e.g. --min-gain 0.02 (2%)") from None
    if not 0 < v < 1:
        raise InvalidInput(field_name, f"{value!r} must be a fraction between 0 and 1", fix="e.g. --min-gain 0.02 (2%)")
    return v


# ---------------------------------------------------------------- planning

@dataclass
class Cell:
    ratio: str
    topology: str | None
    concurrency: int
    state: str = PLANNED
    reason: str | None = None  # why not tried, or what failed
    runs: list = field(default_factory=list)  # per repeat: Figures.to_dict() + run_dir, or {"error": ...}
    gpus: int | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.ratio, self.concurrency)

    # -- repeats
    def measured_runs(self) -> list[dict]:
        return [r for r in self.runs if not r.get("error") and r.get("total_tpm") is not None]

    def median(self, name: str) -> float | None:
        vals = [r[name] for r in self.measured_runs() if r.get(name) is not None]
        return statistics.median(vals) if vals else None

    def spread(self, name: str = "total_tpm") -> float | None:
        """(max - min) / median over the measured repeats; None with fewer than two."""
        vals = [r[name] for r in self.measured_runs() if r.get(name) is not None]
        if len(vals) < 2:
            return None
        med = statistics.median(vals)
        return (max(vals) - min(vals)) / med if med else None

    @property
    def mark(self) -> str:
        """Failures of any repeat, as every table must show them."""
        marks = [r["mark"] for r in self.runs if r.get("mark")]
        marks += [f"repeat {i + 1}: {r['error']}" for i, r in enumerate(self.runs) if r.get("error")]
        return "; ".join(marks)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Cell":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class SweepPlan:
    budget: int
    gpus_per_instance: int
    workload: str
    ratios: list[str]
    concurrencies: list[int]
    repeats: int
    cells: list[Cell]
    topologies: dict  # ratio -> topology string or None
    notes: list[str] = field(default_factory=list)

    def runnable(self) -> list[Cell]:
        return [c for c in self.cells if c.state == PLANNED]

    def render(self) -> str:
        n = self.budget // self.gpus_per_instance
        lines = [f"plan: sweep {self.workload} on a fixed budget of {self.budget} GPUs "
                 f"({n} instances of {self.gpus_per_instance} GPUs), {len(self.runnable())} of {len(self.cells)} cells "
                 f"to run, {self.repeats} repeat(s) each"]
        for r in self.ratios:
            topo = self.topologies.get(r)
            cells = [c for c in self.cells if c.ratio == r]
            if topo is None:
                lines.append(f"  {r}: not tried: {cells[0].reason}")
                continue
            todo = [f"C{c.concurrency}" for c in cells if c.state == PLANNED]
            skip = [f"C{c.concurrency} ({c.reason})" for c in cells if c.state == NOT_TRIED]
            lines.append(f"  {r} -> {topo} ({cells[0].gpus} GPUs): scale, verify, run {', '.join(todo) or 'nothing'}"
                         + (f"; not tried: {', '.join(skip)}" if skip else ""))
        lines += [f"  note: {x}" for x in self.notes]
        return "\n".join(lines)


def topology_for_ratio(budget: int, gpus_per_instance: int, ratio: Ratio, *, allow_partial: bool = False
                       ) -> tuple[Topology | None, str | None]:
    """(topology, None) for the largest k*(p:d) within the budget, or (None, why not)."""
    instances = budget // gpus_per_instance
    k = instances // (ratio.prefill + ratio.decode)
    if k < 1:
        return None, (f"{ratio} needs at least {ratio.prefill + ratio.decode} instances "
                      f"({(ratio.prefill + ratio.decode) * gpus_per_instance} GPUs), the budget holds {instances}")
    topo = Topology(k * ratio.prefill, k * ratio.decode)
    used = (topo.prefill + topo.decode) * gpus_per_instance
    if used != budget and not allow_partial:
        return None, (f"{ratio} cannot use the whole budget: {topo} takes {used} of {budget} GPUs "
                      "(allow partial use to run it anyway; compare it by TPM per GPU)")
    return topo, None


def plan_sweep(budget: int | str, ratios: Sequence[Ratio] | str, concurrencies: Sequence[int] | str,
               workload: Workload | str, *, gpus_per_instance: int, inv=None, repeats: int | str = 1,
               allow_partial: bool = False) -> SweepPlan:
    """Every (ratio, concurrency) cell, planned or not tried with its reason. Pure but for
    the inventory's placement check. Raises InvalidInput if no cell can run."""
    from pdops.bench import parse_workload

    budget = parse_positive_int(budget, "--budget", "GPU budget")
    repeats = parse_positive_int(repeats, "--repeats", "number of repeats")
    rs = parse_ratios(ratios) if isinstance(ratios, str) else list(ratios)
    cs = parse_concurrencies(concurrencies) if isinstance(concurrencies, str) else sorted(concurrencies)
    wl = workload if isinstance(workload, Workload) else parse_workload(workload)
    g = gpus_per_instance
    if budget % g:
        raise InvalidInput("--budget", f"{budget} GPUs is not a whole number of {g}-GPU instances (TP x PP of the profile)",
                           fix=f"use a multiple of {g}, e.g. {max(g, budget - budget % g)}")
    notes = []
    if inv is not None and budget > inv.total_gpus:
        notes.append(f"the budget ({budget} GPUs) exceeds the inventory ({inv.total_gpus} GPUs)")
    cells: list[Cell] = []
    topologies: dict[str, str | None] = {}
    for r in rs:
        topo, why = topology_for_ratio(budget, g, r, allow_partial=allow_partial)
        if topo is not None and inv is not None:
            from pdops.placement import place

            try:
                place(inv, topo)
            except InvalidInput as e:
                topo, why = None, f"{topo} does not fit the inventory: {e.message}"
        topologies[str(r)] = None if topo is None else str(topo)
        gpus = None if topo is None else (topo.prefill + topo.decode) * g
        for c in cs:
            cells.append(Cell(str(r), None if topo is None else str(topo), c,
                              PLANNED if topo is not None else NOT_TRIED, why, gpus=gpus))
    plan = SweepPlan(budget, g, str(wl), [str(r) for r in rs], cs, repeats, cells, topologies, notes)
    if not plan.runnable():
        reasons = "; ".join(f"{r}: {next(c.reason for c in cells if c.ratio == r)}" for r in plan.ratios)
        raise InvalidInput("--budget", f"a budget of {budget} GPUs fits no topology of the requested ratios ({reasons})",
                           fix="choose a budget that holds a whole number of every ratio's instances and fits the "
                               "inventory, e.g. 96 GPUs for 2:1, 3:1 and 5:1 with 8-GPU instances")
    return plan


# ---------------------------------------------------------------- the matrix

@dataclass
class Knee:
    ratio: str
    topology: str | None
    concurrency: int
    next_concurrency: int
    tpm_gain: float
    ttft_change: float | None

    def describe(self) -> str:
        ttft = "" if self.ttft_change is None else f" while TTFT p99 changes {self.ttft_change:+.0%}"
        return (f"{self.topology} ({self.ratio}): knee at C{self.concurrency}: C{self.concurrency} -> "
                f"C{self.next_concurrency} adds {self.tpm_gain:+.2%} total TPM{ttft}")


def find_knee(points: Sequence[tuple[int, float, float | None]], min_gain: float = DEFAULT_MIN_GAIN
              ) -> tuple[int, int, float, float | None] | None:
    """points: (concurrency, total TPM, TTFT p99) of measured cells. The first concurrency
    whose step to the next measured one adds less than `min_gain` throughput:
    (concurrency, next concurrency, gain, TTFT change), or None (no plateau seen)."""
    pts = sorted(points)
    for (c0, t0, l0), (c1, t1, l1) in zip(pts, pts[1:]):
        if not t0:
            continue
        gain = (t1 - t0) / t0
        if gain < min_gain:
            ttft = (l1 - l0) / l0 if (l0 and l1 is not None) else None
            return c0, c1, gain, ttft
    return None


@dataclass
class Matrix:
    budget: int
    gpus_per_instance: int
    workload: str
    ratios: list[str]
    concurrencies: list[int]
    cells: list[Cell]
    topologies: dict
    repeats: int = 1
    min_gain: float = DEFAULT_MIN_GAIN

    @classmethod
    def from_plan(cls, plan: SweepPlan) -> "Matrix":
        return cls(plan.budget, plan.gpus_per_instance, plan.workload, list(plan.ratios), list(plan.concurrencies),
                   [Cell.from_dict(c.to_dict()) for c in plan.cells], dict(plan.topologies), plan.repeats)

    def cell(self, ratio: str, concurrency: int) -> Cell:
        for c in self.cells:
            if c.key == (ratio, concurrency):
                return c
        raise KeyError((ratio, concurrency))

    def knees(self) -> list[Knee]:
        out = []
        for r in self.ratios:
            pts = [(c.concurrency, c.median("total_tpm"), c.median("ttft_p99"))
                   for c in self.cells if c.ratio == r and c.state == MEASURED]
            k = find_knee(pts, self.min_gain)
            if k:
                out.append(Knee(r, self.topologies.get(r), *k))
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["knees"] = [asdict(k) for k in self.knees()]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "Matrix":
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        kw["cells"] = [Cell.from_dict(c) for c in d["cells"]]
        return cls(**kw)


def cell_text(c: Cell) -> str:
    """What one cell shows in the matrix."""
    if c.state == NOT_TRIED:
        return "not tried"
    if c.state == PLANNED:
        return "planned"
    if c.state == FAILED:
        reason = c.reason or "?"
        return f"FAILED: {reason}" if len(reason) <= 32 else f"FAILED: {reason[:29]}..."
    n = len(c.measured_runs())
    sp = c.spread()
    text = fmt_int(c.median("total_tpm")) + (f" (n={n}, spread {sp:.2%})" if sp is not None else f" (n={n})")
    return text + (" !" if c.mark else "")


def render_matrix(m: Matrix) -> str:
    """The matrix (ratio x concurrency, median total TPM), then one detail row per cell, the knees and a legend."""
    header = ["ratio", "topology", *[f"C{c}" for c in m.concurrencies]]
    body = []
    for r in m.ratios:
        body.append([r, m.topologies.get(r) or "-", *[cell_text(m.cell(r, c)) for c in m.concurrencies]])
    from pdops.bench import text_table

    parts = [f"sweep {m.workload}, fixed budget {m.budget} GPUs ({m.gpus_per_instance} per instance); "
             "cells: median total TPM", text_table(header, body), ""]
    dh = ("ratio", "topology", "C", "state", "runs", "total TPM", "spread", "output TPM", "TPM/GPU",
          "TTFT p50", "TTFT p99", "TPOT p99", "ITL p99", "note")
    rows = []
    for c in m.cells:
        sp = c.spread()
        note = c.reason if c.state in (FAILED, NOT_TRIED) else (c.mark or "all ok")
        rows.append((c.ratio, c.topology or "-", c.concurrency, STATE_LABEL[c.state],
                     len(c.measured_runs()) if c.state == MEASURED else len(c.runs),
                     fmt_int(c.median("total_tpm")), "-" if sp is None else f"{sp:.2%}",
                     fmt_int(c.median("output_tpm")), fmt_int(c.median("tpm_per_gpu")),
                     fmt_s(c.median("ttft_p50")), fmt_s(c.median("ttft_p99")), fmt_s(c.median("tpot_p99")),
                     fmt_s(c.median("itl_p99")), note or ""))
    parts.append(text_table(dh, rows))
    knees = m.knees()
    parts.append("")
    parts += [f"knee: {k.describe()}" for k in knees] or [f"knee: none within the measured concurrencies "
                                                         f"(every step added >= {m.min_gain:.0%} total TPM)"]
    parts.append("legend: '!' = a run with failed requests (see note); 'FAILED' = tried and failed; "
                 "'not tried' = never run (never plotted). Spread = (max - min) / median of the repeats.")
    return "\n".join(parts)


CSV_FIELDS = ("ratio", "topology", "gpus", "concurrency", "state", "runs", "total_tpm", "total_tpm_spread",
              "output_tpm", "tpm_per_gpu", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50", "itl_p99",
              "ok", "sent", "reason", "mark", "run_dirs")


def matrix_csv_rows(m: Matrix) -> list[dict]:
    out = []
    for c in m.cells:
        runs = c.measured_runs()
        row = {"ratio": c.ratio, "topology": c.topology or "", "gpus": c.gpus or "", "concurrency": c.concurrency,
               "state": STATE_LABEL[c.state], "runs": len(runs), "total_tpm_spread": c.spread(),
               "ok": sum(r.get("ok", 0) for r in runs), "sent": sum(r.get("sent", 0) for r in runs),
               "reason": c.reason or "", "mark": c.mark,
               "run_dirs": " ".join(str(r.get("run_dir")) for r in c.runs if r.get("run_dir"))}
        for name in ("total_tpm", "output_tpm", "tpm_per_gpu", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99",
                     "itl_p50", "itl_p99"):
            row[name] = c.median(name)
        out.append({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_FIELDS})
    return out


def write_matrix(m: Matrix, out_dir: str | os.PathLike, *, plots: bool = True) -> dict:
    """matrix.json, matrix.csv, matrix.txt and (if matplotlib is there) the PNG plots.
    Returns {"paths": [...], "plots_skipped": reason or None}."""
    from pdops.state import atomic_write

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "matrix.json", json.dumps(m.to_dict(), indent=2, sort_keys=True, default=str) + "\n")
    with open(out / "matrix.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(matrix_csv_rows(m))
    (out / "matrix.txt").write_text(render_matrix(m) + "\n", encoding="utf-8")
    paths = [out / "matrix.json", out / "matrix.csv", out / "matrix.txt"]
    skipped = None
    if plots:
        pngs, skipped = plot_matrix(m, out)
        paths += pngs
    return {"paths": paths, "plots_skipped": skipped}


def load_matrix(path: str | os.PathLike) -> Matrix:
    """Read matrix.json (or the folder holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "matrix.json"
    try:
        return Matrix.from_dict(json.loads(p.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise InvalidInput("sweep folder", f"{p} not found", fix="point at a folder written by `inv sweep`") from None


# ---------------------------------------------------------------- plots

def plot_matrix(m: Matrix, out_dir: str | os.PathLike) -> tuple[list[Path], str | None]:
    """Two PNGs: total TPM vs concurrency per ratio (knees circled), TTFT p99 vs concurrency.
    Measured cells are points (hollow when a run had failures); tried-and-failed cells are
    red crosses on the axis; not-tried cells are not drawn. Returns (paths, skipped reason)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "skipped: matplotlib is not installed (pip install matplotlib) -- the tables are complete without it"
    out = Path(out_dir)
    knees = {k.ratio: k for k in m.knees()}
    paths = []
    for fname, metric, ylabel, scale in (("tpm_vs_concurrency.png", "total_tpm", "total TPM (millions)", 1e-6),
                                         ("ttft_p99_vs_concurrency.png", "ttft_p99", "TTFT p99 (s)", 1.0)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        failed_label = False
        for r in m.ratios:
            cells = [c for c in m.cells if c.ratio == r and c.state == MEASURED and c.median(metric) is not None]
            label = f"{m.topologies.get(r)} ({r})"
            if cells:
                xs = [c.concurrency for c in cells]
                ys = [c.median(metric) * scale for c in cells]
                line, = ax.plot(xs, ys, "-", label=label)
                for c, x, y in zip(cells, xs, ys):
                    ax.plot([x], [y], "o", color=line.get_color(),
                            markerfacecolor="none" if c.mark else line.get_color())
                k = knees.get(r)
                if k and metric == "total_tpm":
                    kc = m.cell(r, k.concurrency)
                    ax.plot([k.concurrency], [kc.median(metric) * scale], "o", markersize=14,
                            markerfacecolor="none", color="black")
                    ax.annotate(f"knee C{k.concurrency}", (k.concurrency, kc.median(metric) * scale),
                                textcoords="offset points", xytext=(6, -14), fontsize=8)
            for c in m.cells:
                if c.ratio == r and c.state == FAILED:
                    ax.plot([c.concurrency], [0], "x", color="red", markersize=9,
                            label=None if failed_label else "tried and failed")
                    failed_label = True
        ax.set_xscale("log", base=2)
        ax.set_xticks(m.concurrencies)
        ax.set_xticklabels([str(c) for c in m.concurrencies])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{m.workload}, {m.budget} GPUs fixed budget")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths, None


# ---------------------------------------------------------------- doing

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
    from pdops.topology import parse_topology

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


__all__ = [
    "Ratio", "parse_ratios", "parse_concurrencies", "parse_min_gain", "Cell", "SweepPlan", "topology_for_ratio", "plan_sweep",
    "Knee", "find_knee", "Matrix", "cell_text", "render_matrix", "matrix_csv_rows", "write_matrix", "load_matrix",
    "plot_matrix", "execute_sweep", "MEASURED", "FAILED", "NOT_TRIED", "PLANNED",
]
