"""The ledger of a run: every request as a row (CSV and JSONL) with the run's manifest."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Mapping, Sequence

from pdops.errors import InvalidInput
from pdops.remote.loadgen import LedgerRow

from pdops.ops.bench.figures import Figures, compute_figures
from pdops.record.local import atomic_write


LEDGER_CSV = "ledger.csv"


LEDGER_JSONL = "ledger.jsonl"


MANIFEST = "manifest.json"


CSV_COLUMNS = ("rid", "prefill_instance", "decode_instance", "start", "first_token", "end", "ttft_s", "e2e_s",
               "prompt_tokens", "completion_tokens", "status", "http_status", "finish_reason", "stream", "chunks",
               "error")


def _csv_row(row: LedgerRow) -> dict:
    d = row.to_dict()
    d["ttft_s"] = (row.first_token - row.start) if row.first_token is not None else None
    d["e2e_s"] = (row.end - row.start) if row.end is not None else None
    return {k: ("" if d.get(k) is None else d.get(k)) for k in CSV_COLUMNS}


def write_ledger(run_dir: str | os.PathLike, rows: Sequence[LedgerRow], manifest: Mapping) -> dict[str, Path]:
    """Write ledger.csv, ledger.jsonl (full rows, chunk gaps included) and manifest.json."""

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": run_dir / LEDGER_CSV, "jsonl": run_dir / LEDGER_JSONL, "manifest": run_dir / MANIFEST}
    with open(paths["csv"], "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow(_csv_row(r))
    with open(paths["jsonl"], "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r.to_dict(), sort_keys=True, default=str) + "\n")
    atomic_write(paths["manifest"], json.dumps(dict(manifest), indent=2, sort_keys=True, default=str) + "\n")
    return paths


def read_ledger(run_dir: str | os.PathLike) -> tuple[list[LedgerRow], dict]:
    """(rows, manifest) of a run folder; rows from ledger.jsonl."""
    run_dir = Path(run_dir)
    try:
        manifest = json.loads((run_dir / MANIFEST).read_text(encoding="utf-8"))
        lines = (run_dir / LEDGER_JSONL).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as e:
        raise InvalidInput("run folder", f"{run_dir} has no {Path(e.filename).name}",
                           fix="point at a folder written by `inv bench` (ledger.jsonl + manifest.json)") from None
    except json.JSONDecodeError as e:
        raise InvalidInput("run folder", f"{run_dir / MANIFEST} is not valid JSON: {e}", fix="re-run the bench") from None
    rows = [LedgerRow.from_dict(json.loads(ln)) for ln in lines if ln.strip()]
    return rows, manifest


def figures_of_run(run_dir: str | os.PathLike) -> Figures:
    """Recompute a recorded run's figures from its ledger alone (GPUs and validity from its manifest)."""
    rows, manifest = read_ledger(run_dir)
    return compute_figures(rows, gpus=manifest.get("gpus"), invalid=manifest.get("invalid"))
