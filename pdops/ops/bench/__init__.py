"""`inv bench`: load with a per-request ledger, and the figures the field reports use.

Read / plan / do:
- read: the current revision (number, topology, placement) and a mark of the state dir
  that changes whenever a revision is written or `current` moves (`revision_mark`);
- do: `run_bench` drives the gateway with `pdops.remote.loadgen` at a fixed concurrency, one
  ledger row per request, never retrying a failed or unknown-state request;
- record: the ledger as CSV and JSONL next to `manifest.json` (revision, topology,
  profile, parameters, versions, the revision check and the figures).

Every figure is one function of the ledger rows, used by every table:

    total TPM   = 60 x (prompt + completion tokens of successful requests) / wall clock
    output TPM  = 60 x (completion tokens of successful requests) / wall clock
    TPM per GPU = total TPM / GPUs of the topology
    wall clock  = last end - first start over every request sent (failed ones included)

Token counts are the ones the engine reported (`meta_info`), never the requested ones.
A run with any failed request is marked as such wherever its figures are shown, and a
run during which the revision changed is marked invalid.

Routing per request: the gateway passes `x-request-id` to both engines, which log it
(the sim always, SGLang with `--log-requests`). `run_bench(resolve_routing=...)` is the
hook that fills `prefill_instance` / `decode_instance` from those logs; until it is
wired they stay None (the gateway does not report its choice in the response).

The package, by concern (each module imports only those listed before it):
- ``workload``: the workload, parsed and checked;
- ``figures``: the figures of a run, from its ledger rows only;
- ``ledger``: the ledger files and the run's manifest;
- ``run``: running a bench against a cluster.
"""

from pdops.ops.bench.figures import (Figures, compute_figures, describe_failures, fmt_int, fmt_s, format_table, itls,
                                 output_tpm, percentile, text_table, total_tpm, tpm_per_gpu, tpots, ttfts, wall_clock)
from pdops.ops.bench.ledger import CSV_COLUMNS, LEDGER_CSV, figures_of_run, read_ledger, write_ledger
from pdops.ops.bench.run import format_result, prompt_maker, revision_change, revision_mark, run_bench
from pdops.ops.bench.workload import Workload, parse_concurrency, parse_positive_int, parse_workload

__all__ = ["CSV_COLUMNS", "LEDGER_CSV", "Figures", "Workload", "compute_figures", "describe_failures", "figures_of_run",
           "fmt_int", "fmt_s", "format_result", "format_table", "itls", "output_tpm", "parse_concurrency",
           "parse_positive_int", "parse_workload", "percentile", "prompt_maker", "read_ledger", "revision_change",
           "revision_mark", "run_bench", "text_table", "total_tpm", "tpm_per_gpu", "tpots", "ttfts", "wall_clock",
           "write_ledger"]
