"""The sweep's plan (pure but for reading the record): ratios x concurrencies on a fixed GPU budget,
each cell planned, measured, failed or not tried with its reason; each row's deploy or change
(pdops.ops.sweep.rows: the first from the record, each later one from the revision the row before
it is to record); and the one runner plan that carries it out (:attr:`SweepPlan.plan`):
`open-matrix`, then per row a `sweep-scale` step (its deploy or change printed under it in full) and
one `sweep-run` step per concurrency x repeat, and last, whatever happened, `write-matrix`."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

from pdops.ops.bench.workload import Workload, parse_concurrency, parse_positive_int, parse_workload, stop_condition
from pdops.errors import InvalidInput, Refused
from pdops.model.topology import Topology, parse_topology
from pdops.plans import Plan, Step
from pdops.model.placement import place
from pdops.ops.sweep.rows import forecast_rows


MEASURED = "measured"


FAILED = "failed"


NOT_TRIED = "not_tried"


PLANNED = "planned"


STATE_LABEL = {MEASURED: "measured", FAILED: "tried and failed", NOT_TRIED: "not tried", PLANNED: "planned"}


DEFAULT_MIN_GAIN = 0.02


_RATIO_FIX = "write ratios as P:D pairs separated by commas, e.g. 2:1,3:1,5:1"


_CONC_FIX = "write concurrencies as whole numbers >= 1 separated by commas, e.g. 8,16,32,64"


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


# what `--out` is called in a plan made without its folder (a plan printed, never walked)
NO_FOLDER = "<sweep folder>"


@dataclass
class SweepPlan:
    """The cells (planned, or not tried with the reason) and how each run is made. `plan` is the
    runner plan of it, built from these fields alone: what `--dry-run` prints is what is walked."""

    budget: int
    gpus_per_instance: int
    workload: str
    ratios: list[str]
    concurrencies: list[int]
    repeats: int
    cells: list[Cell]
    topologies: dict  # ratio -> topology string or None
    notes: list[str] = field(default_factory=list)
    out_dir: str | None = None  # the sweep folder (matrix files, runs/<cell>/)
    min_gain: float = DEFAULT_MIN_GAIN
    requests: int | None = None  # per run; None: 4 x the concurrency (unless `duration`)
    duration: float | None = None  # seconds per run instead of a number of requests
    ignore_eos: bool = False
    timeout_s: float | None = None  # per request (None: the bench's default)
    plots: bool = True
    # ratio -> its row's deploy or change (pdops.ops.sweep.rows.Row), planned before the sweep starts;
    # empty when planned without the inventory and the record (a walk with stand-in seams, in tests)
    rows: dict = field(default_factory=dict)

    def runnable(self) -> list[Cell]:
        return [c for c in self.cells if c.state == PLANNED]

    def requests_for(self, concurrency: int) -> int | None:
        return None if self.duration is not None else (self.requests or 4 * concurrency)

    @property
    def folder(self) -> str:
        return self.out_dir or NO_FOLDER

    def run_dir(self, topology: str, concurrency: int, repeat: int) -> str:
        """`repeat` counts from 1."""
        return f"{self.folder}/runs/{topology}-c{concurrency}-r{repeat}"

    @property
    def plan(self) -> Plan:
        """The sweep as one runner plan: each row's `sweep-scale` step carries its deploy or change
        (printed under it), which the step plans again when it starts and walks only as printed."""
        out = self.folder
        skip = len(self.cells) - len(self.runnable())
        steps = [Step("open-matrix", None, f"the matrix of {len(self.cells)} cells ({len(self.runnable())} to run"
                      + (f", {skip} not tried with the reason" if skip else "") + "), in matrix.json now and again "
                      "after every run (an interrupted sweep keeps what it measured)",
                      kind="open-matrix", params={"out_dir": out, "matrix": self._matrix_doc()})]
        todo = [r for r in self.ratios if self.topologies.get(r) is not None
                and any(c.ratio == r and c.state == PLANNED for c in self.cells)]
        for ratio in todo:
            topo = self.topologies[ratio]
            cells = [c for c in self.cells if c.ratio == ratio and c.state == PLANNED]
            runs = len(cells) * self.repeats
            later = ratio != todo[-1] and bool(self.rows)
            row = self.rows.get(ratio)
            how = (f"{row.summary()}: the steps below, planned again from the record when this step starts and "
                   "walked only if they are the ones printed (else none of them runs)" if row is not None
                   else f"deploy or change to {topo} (not planned: the sweep was planned without the record)")
            steps.append(Step(
                f"sweep-scale {topo}", None,
                f"{ratio}: {how}; if it fails, the row's {runs} run(s) are not made and its cells are recorded failed "
                "with the reason" + ("; the rows after it, planned from the revision it was to record, are then not "
                                     "run (their cells not tried, with the reason)" if later else ""),
                kind="sweep-scale", params={"ratio": ratio, "topology": topo, "out_dir": out,
                                            **({"plan": row} if row is not None else {})},
                verifies=f"the cluster runs {topo}"))
            for c in cells:
                n = self.requests_for(c.concurrency)
                load = f"{n} requests" if n is not None else f"for {self.duration:g}s"
                for rep in range(1, self.repeats + 1):
                    run_dir = self.run_dir(topo, c.concurrency, rep)
                    steps.append(Step(
                        f"sweep-run {topo} C{c.concurrency} r{rep}", None,
                        f"bench {self.workload} at concurrency {c.concurrency}, {load}"
                        + (", --ignore-eos" if self.ignore_eos else "")
                        + (f", each request within {self.timeout_s:g}s" if self.timeout_s else "")
                        + f" -> runs/{topo}-c{c.concurrency}-r{rep} (repeat {rep} of {self.repeats}; its figures, "
                          f"or its failure, into cell {ratio}/C{c.concurrency})",
                        kind="sweep-run",
                        params={"ratio": ratio, "topology": topo, "concurrency": c.concurrency, "repeat": rep,
                                "repeats": self.repeats, "run_dir": run_dir, "workload": self.workload,
                                "requests": n, "duration": self.duration, "ignore_eos": self.ignore_eos,
                                "timeout_s": self.timeout_s, "out_dir": out}))
        always = [Step("write-matrix", None,
                       f"matrix.json, matrix.csv, matrix.txt{' and the plots' if self.plots else ''} of whatever was "
                       f"measured, with each ratio's knee (the first step adding under {self.min_gain:.0%} total TPM)",
                       kind="write-matrix", params={"out_dir": out, "plots": self.plots})]
        n = self.budget // self.gpus_per_instance
        notes = list(self.notes) + [
            "each row's deploy or change is walked inside its step, under the sweep's lock, as an operation of its "
            "own in the journal (its own plan record, steps and verdict), allowed to dip capacity: the sweep owns the "
            "cluster"] + ([
            "a row planned from a forecast revision names each worker by its URL (its id is known once the row before "
            "it has registered it); its revision numbers are the next after the record's last (the record may give "
            "others)"] if any(r.forecast for r in self.rows.values()) else [])
        return Plan("sweep", f"plan: sweep {self.workload} on a fixed budget of {self.budget} GPUs under the cluster "
                    "lock", steps, notes=notes, always=always, always_on_interrupt=True,
                    head={"budget": self.budget, "instances": n, "workload": self.workload, "ratios": self.ratios,
                          "topologies": self.topologies, "concurrencies": self.concurrencies,
                          "repeats": self.repeats, "out_dir": out})

    def _matrix_doc(self) -> dict:
        """The matrix the `open-matrix` step starts from (the fields of `matrix.Matrix`)."""
        return {"budget": self.budget, "gpus_per_instance": self.gpus_per_instance, "workload": self.workload,
                "ratios": list(self.ratios), "concurrencies": list(self.concurrencies),
                "cells": [c.to_dict() for c in self.cells], "topologies": dict(self.topologies),
                "repeats": self.repeats, "min_gain": self.min_gain}

    def render(self) -> str:
        """What `--dry-run` prints: the cells per ratio, then the whole plan the runner walks."""
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
        lines.append(f"  steps, under the cluster lock, into {self.folder}:")
        lines += self.plan.render().splitlines()[1:]
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
               allow_partial: bool = False, out_dir=None, min_gain: float = DEFAULT_MIN_GAIN,
               requests: int | str | None = None, duration: float | str | None = None, ignore_eos: bool = False,
               timeout_s: float | None = None, plots: bool = True, record=None) -> SweepPlan:
    """Every (ratio, concurrency) cell, planned or not tried with its reason, and how each run is
    made (`requests` per run, default 4 x C, or `duration` seconds; not both). With the inventory and
    the `record`, each row's deploy or change too (pdops.ops.sweep.rows.forecast_rows: a row that
    cannot be planned is not tried, with the reason). Pure but for the inventory's placement check and
    reading the record. Raises InvalidInput if no cell can run."""
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

            try:
                place(inv, topo)
            except InvalidInput as e:
                topo, why = None, f"{topo} does not fit the inventory: {e.message}"
        topologies[str(r)] = None if topo is None else str(topo)
        gpus = None if topo is None else (topo.prefill + topo.decode) * g
        for c in cs:
            cells.append(Cell(str(r), None if topo is None else str(topo), c,
                              PLANNED if topo is not None else NOT_TRIED, why, gpus=gpus))
    n_req, dur = (None, None) if requests is None and duration is None else stop_condition(requests, duration)
    plan = SweepPlan(budget, g, str(wl), [str(r) for r in rs], cs, repeats, cells, topologies, notes,
                     out_dir=None if out_dir is None else str(out_dir), min_gain=parse_min_gain(min_gain),
                     requests=n_req, duration=dur, ignore_eos=bool(ignore_eos), timeout_s=timeout_s, plots=plots)
    if not plan.runnable():
        reasons = "; ".join(f"{r}: {next(c.reason for c in cells if c.ratio == r)}" for r in plan.ratios)
        raise InvalidInput("--budget", f"a budget of {budget} GPUs fits no topology of the requested ratios ({reasons})",
                           fix="choose a budget that holds a whole number of every ratio's instances and fits the "
                               "inventory, e.g. 96 GPUs for 2:1, 3:1 and 5:1 with 8-GPU instances")
    if inv is None or record is None:
        return plan
    # every input is valid: only now is the record read (a row's plan starts from it)
    rows, refused = forecast_rows(inv, [(r, parse_topology(plan.topologies[r])) for r in plan.ratios
                                        if any(c.ratio == r for c in plan.runnable())], record)
    for c in cells:
        if c.ratio in refused:
            c.state, c.reason = NOT_TRIED, refused[c.ratio]
    if not plan.runnable():
        raise Refused("no row of the sweep can be planned from the record: "
                      + "; ".join(f"{r}: {why}" for r, why in refused.items()) + "; nothing was run",
                      fix="`inv status` shows what runs; a sweep deploys or changes to each row's topology in turn")
    return dataclasses.replace(plan, rows=rows)
