"""`inv probe`: try a candidate parameter bundle with a few long requests; keep the outcome and the
failure signature; never call a bundle best (field report 000, section 5).

A probe, under the cluster lock, on the runner:

- **--spare**: a new prefill x decode pair on free GPUs (the lowest free ids), started from the
  revision's files with the bundle's flags, health-gated, canaried, never registered with the
  gateway; the long requests go straight to the pair; then the pair's verified stop, its files
  removed, and every instance of the revision shown to run the revision's files (nothing of the
  revision was touched).
- **--instances p01,d01**: that pair leaves the gateway and drains (the drain sub-plan), restarts
  from the bundle's files, is canaried, probed, then restored by the change planner (the repair's
  path: verified stop, the revision's own files, canary with every pair, register, record); with
  `--keep` (every request ok) it restarts on the bundle's files instead and that is recorded as the
  new revision.

The requests come from the ledgered client (`pdops.remote.loadgen.run_pair`), one row per request, never
retried. Each request's outcome (ok / OOM / transfer failure / bootstrap failure / timeout / HTTP
status) is read from the answers of both sides and the engines' journals; the failure signatures
(exception, top frames, allocation size, transfer error line) are harvested from the journal of
every rank. The probe table lives in the cluster's journal (`probe-result`, `probe-note` records):
shared by every operator, append-only.

The package, by concern (each module imports only those listed before it):
- ``bundle``: the candidate bundle, read and checked before any connection;
- ``signatures``: what each request ended as, and the failure signatures from the journals;
- ``plan``: the probe's plan (spare pair, or a serving pair taken out and restored or kept);
- ``execute``: its executors and the walk under the lock;
- ``table``: the probe table and the operators' notes.
"""

from pdops.ops.probe.bundle import Bundle, check_flags, load_bundle, parse_workload
from pdops.ops.probe.execute import execute_probe, next_probe_id, probe_verdict
from pdops.ops.probe.plan import ProbePlan, change_after, check_options, plan_probe, restore_steps
from pdops.ops.probe.signatures import attribute_crash, classify, mixed_reasons, result_line, signatures
from pdops.ops.probe.table import add_note, check_note, probe_table, render_table, table_csv

__all__ = ["Bundle", "ProbePlan", "add_note", "attribute_crash", "change_after", "check_flags", "check_note",
           "check_options", "classify", "execute_probe", "load_bundle", "mixed_reasons", "next_probe_id",
           "parse_workload", "plan_probe", "probe_table", "probe_verdict", "render_table", "restore_steps", "result_line",
           "signatures", "table_csv"]
