"""`inv sweep`: P:D ratio x concurrency sweeps on a fixed GPU budget.

Plan (pure): the budget and the GPUs per instance (TP x PP of the profile) give a number
of instances; each ratio p:d takes the largest k with k*(p+d) instances, and must use the
whole budget (else its cells are "not tried", with the reason, unless partial use is
allowed: only reporting TPM per GPU keeps "more GPUs" from passing for "better ratio").
A topology that the inventory cannot place is "not tried" too. A budget that leaves no
cell to run is refused as invalid input.

Each row's way to its topology is planned with the sweep and printed in full under its step
(``rows``): a deploy if nothing is live, else the change planner's change, the first row from the
record, each later one from the revision the row before it is to record (a forecast). When the row
starts, it is planned again from the record and walked only if it is the printed one.

Do (`execute_sweep`): one runner plan (`SweepPlan.plan`, what `--dry-run` prints), walked under
the cluster lock: `open-matrix`; per topology a `sweep-scale` step (through the injected
`scale_to`, given the row as printed, and an optional `verify`) and one `sweep-run` step per
concurrency x repeat (the injected `run_cell`); last, whatever happened, `write-matrix`. Every cell ends as one of:
- measured: figures of each repeat, the median and the range/median spread; a run with
  failed requests is still measured but carries its mark everywhere it is shown;
- tried and failed: the failure (scale failed, HTTP 503 on every request, run invalid...);
- not tried: the reason. Not-tried cells are never drawn in a plot.

The knee of a ratio is the last concurrency whose next step adds less than `min_gain`
(default 2%) total TPM: past it, added concurrency only adds latency.

The package, by concern (each module imports only those listed before it):
- ``rows``: each row's deploy or change, forecast from the revision the row before is to record, and
  planned again (and compared) when it starts;
- ``plan``: parsing, the cells, the plan (pure but for reading the record);
- ``matrix``: the knee, the table, the CSV, the plots;
- ``execute``: the executors of the plan's step kinds, the seams to the cluster, the walk.
"""

from pdops.ops.sweep.execute import CellRun, SweepContext, bench_cells, execute_sweep, operate_sweep, scale_live
from pdops.ops.sweep.matrix import (Knee, Matrix, cell_text, find_knee, load_matrix, matrix_csv_rows, plot_matrix,
                                render_matrix, write_matrix)
from pdops.ops.sweep.plan import (DEFAULT_MIN_GAIN, FAILED, MEASURED, NOT_TRIED, PLANNED, Cell, Ratio, SweepPlan,
                              parse_concurrencies, parse_min_gain, parse_ratios, plan_sweep, topology_for_ratio)

__all__ = [
    "Ratio", "parse_ratios", "parse_concurrencies", "parse_min_gain", "Cell", "SweepPlan", "topology_for_ratio", "plan_sweep",
    "Knee", "find_knee", "Matrix", "cell_text", "render_matrix", "matrix_csv_rows", "write_matrix", "load_matrix",
    "plot_matrix", "execute_sweep", "operate_sweep", "bench_cells", "scale_live", "CellRun", "SweepContext", "MEASURED", "FAILED", "NOT_TRIED",
    "PLANNED", "DEFAULT_MIN_GAIN",
]
