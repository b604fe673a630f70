"""The sweep's matrix: the knee of each ratio, the table, the CSV and the plots."""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

from pdops.ops.bench import fmt_int, fmt_s, text_table
from pdops.errors import InvalidInput

from pdops.ops.sweep.plan import Cell, DEFAULT_MIN_GAIN, FAILED, MEASURED, NOT_TRIED, PLANNED, STATE_LABEL, SweepPlan
from pdops.record.local import atomic_write


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
