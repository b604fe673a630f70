"""`inv bench`: load with a per-request ledger, and the figures the field reports use.

Read / plan / do:
- read: the current revision (number, topology, placement) and a mark of the state dir
  that changes whenever a revision is written or `current` moves (`revision_mark`);
- do: `run_bench` drives the gateway with `pdops.load` at a fixed concurrency, one
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
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from pdops.errors import InvalidInput, Refused
from pdops.load import LedgerRow

LEDGER_CSV = "ledger.csv"
LEDGER_JSONL = "ledger.jsonl"
MANIFEST = "manifest.json"

CSV_COLUMNS = ("rid", "prefill_instance", "decode_instance", "start", "first_token", "end", "ttft_s", "e2e_s",
               "prompt_tokens", "completion_tokens", "status", "http_status", "finish_reason", "stream", "chunks",
               "error")

# ---------------------------------------------------------------- workload and parameters

_WORKLOAD = re.compile(r"^\s*(\d+)\s*([kK]?)\s*/\s*(\d+)\s*([kK]?)\s*$")
_WORKLOAD_FIX = ("write it as <input tokens>/<output tokens>, e.g. 160k/1300, 80K/600 or 2000/64 "
                 "(k = 1,000 tokens)")
MAX_TOKENS = 10_000_000


@dataclass(frozen=True)
class Workload:
    """A synthetic workload: every request has `input_tokens` in and `output_tokens` out."""

    input_tokens: int
    output_tokens: int

    def __str__(self) -> str:
        def short(n: int) -> str:
            return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)

        return f"{short(self.input_tokens)}/{short(self.output_tokens)}"


def parse_workload(spec: object, field_name: str = "--workload") -> Workload:
    """Parse `160k/1300` (k = 1,000, any case) into a Workload; junk raises InvalidInput."""
    if spec is None or not str(spec).strip():
        raise InvalidInput(field_name, "missing", fix=_WORKLOAD_FIX)
    m = _WORKLOAD.match(str(spec))
    if not m:
        raise InvalidInput(field_name, f"{spec!r} is not a workload", fix=_WORKLOAD_FIX)
    inp = int(m.group(1)) * (1000 if m.group(2) else 1)
    out = int(m.group(3)) * (1000 if m.group(4) else 1)
    for what, n in (("input", inp), ("output", out)):
        if n < 1:
            raise InvalidInput(field_name, f"{spec!r} asks for {n} {what} tokens", fix="both lengths must be at least 1 token, e.g. 160k/1300")
        if n > MAX_TOKENS:
            raise InvalidInput(field_name, f"{spec!r} asks for {n:,} {what} tokens, beyond any context length",
                               fix=_WORKLOAD_FIX)
    return Workload(inp, out)


def parse_positive_int(value: object, field_name: str, what: str = "value") -> int:
    """A whole number >= 1 (from int or str); InvalidInput otherwise."""
    if isinstance(value, bool):
        raise InvalidInput(field_name, f"{value!r} is not a whole number", fix=f"give the {what} as a whole number >= 1")
    try:
        n = int(str(value).strip())
    except (TypeError, ValueError):
        raise InvalidInput(field_name, f"{value!r} is not a whole number", fix=f"give the {what} as a whole number >= 1") from None
    if n < 1:
        raise InvalidInput(field_name, f"{what} must be at least 1, got {n}", fix=f"give the {what} as a whole number >= 1")
    return n


def parse_concurrency(value: object, field_name: str = "--concurrency") -> int:
    """Concurrent requests in flight: a whole number >= 1."""
    return parse_positive_int(value, field_name, "concurrency")


def _stop_condition(requests: object, duration: object) -> tuple[int | None, float | None]:
    if (requests is None) == (duration is None):
        raise InvalidInput("--requests/--duration", "give exactly one of them",
                           fix="--requests N sends N requests; --duration S sends for S seconds")
    if requests is not None:
        return parse_positive_int(requests, "--requests", "number of requests"), None
    try:
        d = float(duration)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidInput("--duration", f"{duration!r} is not a number of seconds", fix="e.g. --duration 300") from None
    if not d > 0 or math.isinf(d):
        raise InvalidInput("--duration", f"{duration!r} must be a positive number of seconds", fix="e.g. --duration 300")
    return None, d


# ---------------------------------------------------------------- figures (one function each)

def _get(row: object, name: str):
    return row.get(name) if isinstance(row, Mapping) else getattr(row, name, None)


def _ok(row: object) -> bool:
    ok = _get(row, "ok")
    if ok is None:
        return _get(row, "status") == "ok"
    return bool(ok)


def wall_clock(rows: Sequence) -> float:
    """Seconds from the first request's start to the last request's end (every request sent)."""
    starts = [_get(r, "start") for r in rows if _get(r, "start") is not None]
    ends = [_get(r, "end") for r in rows if _get(r, "end") is not None]
    if not starts or not ends:
        return 0.0
    return max(ends) - min(starts)


def _check_wall(wall_s: float) -> None:
    if not wall_s or wall_s <= 0:
        raise ValueError(f"wall clock must be positive, got {wall_s!r}")


def success_count(rows: Sequence) -> tuple[int, int]:
    """(successful requests, requests sent)."""
    return sum(1 for r in rows if _ok(r)), len(rows)


def total_tpm(rows: Sequence, wall_s: float) -> float:
    """60 x (prompt + completion tokens of successful requests) / wall clock in seconds."""
    _check_wall(wall_s)
    tokens = sum((_get(r, "prompt_tokens") or 0) + (_get(r, "completion_tokens") or 0) for r in rows if _ok(r))
    return 60.0 * tokens / wall_s


def output_tpm(rows: Sequence, wall_s: float) -> float:
    """60 x (completion tokens of successful requests) / wall clock in seconds."""
    _check_wall(wall_s)
    return 60.0 * sum((_get(r, "completion_tokens") or 0) for r in rows if _ok(r)) / wall_s


def tpm_per_gpu(tpm: float, gpus: int) -> float:
    """A TPM figure divided by the GPUs of the topology that produced it."""
    if not gpus or gpus < 1:
        raise ValueError(f"GPU count must be at least 1, got {gpus!r}")
    return tpm / gpus


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear interpolation between order statistics
    (numpy's default, which SGLang's bench_serving uses). None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in 0..100, got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ttfts(rows: Sequence) -> list[float]:
    """Time to first token of each successful request, seconds."""
    return [_get(r, "first_token") - _get(r, "start") for r in rows
            if _ok(r) and _get(r, "first_token") is not None and _get(r, "start") is not None]


def tpots(rows: Sequence) -> list[float]:
    """Time per output token after the first, per successful request with >1 token, seconds."""
    out = []
    for r in rows:
        n = _get(r, "completion_tokens") or 0
        if _ok(r) and n > 1 and _get(r, "first_token") is not None and _get(r, "end") is not None:
            out.append((_get(r, "end") - _get(r, "first_token")) / (n - 1))
    return out


def itls(rows: Sequence) -> list[float]:
    """Gaps between consecutive stream chunks of every successful request, seconds."""
    out: list[float] = []
    for r in rows:
        if _ok(r):
            out.extend(_get(r, "itl") or ())
    return out


def failure_counts(rows: Sequence) -> dict[str, int]:
    """{status: count} of every request that did not succeed (http_503, timeout, aborted, error...)."""
    out: dict[str, int] = {}
    for r in rows:
        if not _ok(r):
            s = str(_get(r, "status") or "unknown")
            out[s] = out.get(s, 0) + 1
    return dict(sorted(out.items()))


def describe_failures(counts: Mapping[str, int]) -> str:
    """`HTTP 503 x3, timeout x1` from failure counts."""
    parts = []
    for status, n in counts.items():
        label = f"HTTP {status[5:]}" if status.startswith("http_") else status
        parts.append(f"{label} x{n}")
    return ", ".join(parts)


@dataclass
class Figures:
    """The figures of one run, all computed from its ledger by the functions above."""

    sent: int
    ok: int
    failures: dict
    wall_s: float
    total_tpm: float | None
    output_tpm: float | None
    gpus: int | None
    tpm_per_gpu: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    invalid: str | None = None

    @property
    def failed_requests(self) -> int:
        return self.sent - self.ok

    @property
    def any_failure(self) -> bool:
        return self.ok < self.sent

    @property
    def mark(self) -> str:
        """Empty for a clean run; otherwise what every table must show next to its figures."""
        marks = []
        if self.invalid:
            marks.append(f"INVALID: {self.invalid}")
        if self.any_failure:
            marks.append(f"FAILURES {self.failed_requests}/{self.sent}: {describe_failures(self.failures)}")
        return "; ".join(marks)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mark"] = self.mark
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "Figures":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def compute_figures(rows: Sequence, *, gpus: int | None = None, wall_s: float | None = None,
                    invalid: str | None = None) -> Figures:
    """Every figure of a run from its ledger rows (wall clock from the ledger unless given)."""
    ok, sent = success_count(rows)
    wall = wall_clock(rows) if wall_s is None else wall_s
    tot = total_tpm(rows, wall) if wall > 0 else None
    out = output_tpm(rows, wall) if wall > 0 else None
    tt, tp, il = ttfts(rows), tpots(rows), itls(rows)
    return Figures(
        sent=sent, ok=ok, failures=failure_counts(rows), wall_s=wall, total_tpm=tot, output_tpm=out, gpus=gpus,
        tpm_per_gpu=tpm_per_gpu(tot, gpus) if (tot is not None and gpus) else None,
        ttft_p50=percentile(tt, 50), ttft_p99=percentile(tt, 99),
        tpot_p50=percentile(tp, 50), tpot_p99=percentile(tp, 99),
        itl_p50=percentile(il, 50), itl_p99=percentile(il, 99), invalid=invalid,
    )


# ---------------------------------------------------------------- tables

def fmt_int(x: float | None) -> str:
    return "N/A" if x is None else f"{x:,.0f}"


def fmt_s(x: float | None) -> str:
    if x is None:
        return "N/A"
    return f"{x:.2f} s" if x >= 1 else f"{x * 1000:.1f} ms"


def text_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in body)])


def format_table(entries: Sequence[tuple[str, Figures]]) -> str:
    """One line per run: label, success, TPMs, TPM/GPU, TTFT/TPOT/ITL p50 and p99, and its mark."""
    header = ("run", "ok/sent", "total TPM", "output TPM", "TPM/GPU", "TTFT p50", "TTFT p99",
              "TPOT p50", "TPOT p99", "ITL p50", "ITL p99", "wall", "note")
    body = []
    for label, f in entries:
        body.append((label, f"{f.ok}/{f.sent}", fmt_int(f.total_tpm), fmt_int(f.output_tpm), fmt_int(f.tpm_per_gpu),
                     fmt_s(f.ttft_p50), fmt_s(f.ttft_p99), fmt_s(f.tpot_p50), fmt_s(f.tpot_p99),
                     fmt_s(f.itl_p50), fmt_s(f.itl_p99), fmt_s(f.wall_s), f.mark or "all ok"))
    return text_table(header, body)


# ---------------------------------------------------------------- the ledger on disk

def _csv_row(row: LedgerRow) -> dict:
    d = row.to_dict()
    d["ttft_s"] = (row.first_token - row.start) if row.first_token is not None else None
    d["e2e_s"] = (row.end - row.start) if row.end is not None else None
    return {k: ("" if d.get(k) is None else d.get(k)) for k in CSV_COLUMNS}


def write_ledger(run_dir: str | os.PathLike, rows: Sequence[LedgerRow], manifest: Mapping) -> dict[str, Path]:
    """Write ledger.csv, ledger.jsonl (full rows, chunk gaps included) and manifest.json."""
    from pdops.state import atomic_write

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


# ---------------------------------------------------------------- revision guard

@dataclass(frozen=True)
class RevisionMark:
    """What must not change during a run: the current pointer (and when it was last
    written) and the newest revision number."""

    current: int | None
    latest: int | None
    current_mtime_ns: int | None
    current_inode: int | None = None  # atomic_write replaces the file: a new inode on every write

    def describe(self) -> str:
        return f"current={self.current} latest={self.latest}"


def revision_mark(state) -> RevisionMark:
    """Read the mark of a record: the shared one is read again from its state host; a local
    StateDir also gives its `current` file's mtime and inode (no host is contacted)."""
    if hasattr(state, "refresh"):
        state.refresh()
        mtime = ino = None
    else:
        try:
            st = state.current_file.stat()
            mtime, ino = st.st_mtime_ns, st.st_ino
        except FileNotFoundError:
            mtime = ino = None
    nums = state.revision_numbers()
    return RevisionMark(state.current(), nums[-1] if nums else None, mtime, ino)


def revision_change(before: RevisionMark, after: RevisionMark) -> str | None:
    """None if nothing changed, else why the run is invalid."""
    if before.current != after.current:
        return f"the current revision changed during the run ({before.current} -> {after.current})"
    if before.latest != after.latest:
        return f"revision {after.latest} was recorded during the run (current was {before.current})"
    if (before.current_mtime_ns, before.current_inode) != (after.current_mtime_ns, after.current_inode):
        return f"the current pointer was rewritten during the run (still {after.current}: a rollback or re-deploy)"
    return None


# ---------------------------------------------------------------- prompts

def prompt_maker(workload: Workload, seed: int = 0) -> Callable[[int], str]:
    """prompt_for(i): a prompt of exactly `workload.input_tokens` tokens as the sim counts them.

    A shared body plus a 4-token lead that differs per request, so the engine's prefix
    cache cannot serve one request from another's KV (the lead comes first).
    """
    from pdops.sim.tokens import make_prompt

    n = workload.input_tokens
    lead = min(4, n)
    body = make_prompt(n - lead, seed)

    def prompt_for(i: int) -> str:
        head = make_prompt(lead, seed * 1_000_003 + i + 1)
        return f"{head} {body}" if body else head

    return prompt_for


# ---------------------------------------------------------------- run

@dataclass
class BenchResult:
    run_dir: Path
    manifest: dict
    rows: list[LedgerRow]
    figures: Figures

    @property
    def valid(self) -> bool:
        return not self.manifest.get("invalid")


def _read_key(path: str | None) -> dict:
    if not path:
        return {}
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise InvalidInput("pdops_gateway.api_key_file", f"cannot read {path}: {e.strerror}",
                           fix="make the key file readable for the operator running the bench") from None
    return {"Authorization": f"Bearer {key}"} if key else {}


def _versions(inv) -> dict:
    from pdops import __version__
    from pdops.versions import SGLANG_VERSION, SMG_VERSION

    engine = {"engine": inv.engine, "sglang": SGLANG_VERSION}
    if inv.engine == "sim":
        from pdops.sim import SIM_VERSION

        engine = {"engine": "sim", "sim_of_sglang": SIM_VERSION}
    return {"pdops": __version__, **engine, "smg": SMG_VERSION}


def gpus_of_revision(rev, gpus_per_instance: int) -> int:
    """GPUs of a revision's topology: its instances x TP x PP."""
    instances = (rev.placement or {}).get("instances")
    if instances:
        return len(instances) * gpus_per_instance
    from pdops.topology import parse_topology

    t = parse_topology(rev.topology)
    return (t.prefill + t.decode) * gpus_per_instance


def run_bench(inv, state, workload: Workload | str, concurrency: int | str, requests: int | str | None = None,
              duration: float | str | None = None, ignore_eos: bool = True, out_dir: str | os.PathLike | None = None,
              *, timeout: float = 3600.0, load: Callable | None = None, prompt_for: Callable[[int], str] | None = None,
              resolve_routing: Callable[[list[LedgerRow]], None] | None = None,
              say: Callable[[str], None] = print) -> BenchResult:
    """Drive the gateway of the current revision at a fixed concurrency; write ledger + manifest.

    `load(base_url, **kw) -> rows` defaults to `pdops.load.send`. The run is marked
    invalid when the revision changed between its start and its end.
    """
    from pdops.load import send
    from pdops.state import new_op_id, now_iso

    wl = workload if isinstance(workload, Workload) else parse_workload(workload)
    conc = parse_concurrency(concurrency)
    n_req, dur = _stop_condition(requests, duration)
    before = revision_mark(state)
    rev = state.current_revision()
    if rev is None:
        raise Refused(f"{inv.cluster} has no current revision: nothing to benchmark",
                      fix="deploy first (`inv deploy --topology 1p1d`)")
    gpus = gpus_of_revision(rev, inv.profile.gpus_per_instance)
    run_id = new_op_id("bench")
    run_dir = Path(out_dir) if out_dir is not None else state.path / "bench" / run_id
    manifest = {
        "run_id": run_id, "cluster": inv.cluster, "kind": "bench",
        "revision": {"number": rev.number, "topology": rev.topology, "inventory_hash": rev.inventory_hash,
                     "op_id": rev.op_id},
        "topology": rev.topology, "gpus": gpus, "gpus_per_instance": inv.profile.gpus_per_instance,
        "profile": {"name": inv.profile.name, "model_path": inv.profile.model_path,
                    "bundle": inv.profile.bundle, "parallel": {"tp": inv.profile.tp, "ep": inv.profile.ep,
                                                               "pp": inv.profile.pp}},
        "parameters": {"workload": str(wl), "input_tokens": wl.input_tokens, "output_tokens": wl.output_tokens,
                       "concurrency": conc, "requests": n_req, "duration_s": dur, "ignore_eos": ignore_eos,
                       "stream": True, "timeout_s": timeout, "retries": 0},
        "gateway": inv.gateway.url, "versions": _versions(inv), "load_client": "pdops.load",
        "inventory_digest": inv.digest,
        "inventory_matches_revision": inv.digest == rev.inventory_hash,
        "routing": "not resolved (hook resolve_routing not wired)" if resolve_routing is None else "resolved",
    }
    what = f"{n_req} requests" if n_req is not None else f"{dur:g} s"
    say(f"bench: {wl} at C{conc}, {what}, against {inv.gateway.url} (revision {rev.number}, {rev.topology}, "
        f"{gpus} GPUs); ledger -> {run_dir}")
    kw = dict(requests=n_req, duration=dur, concurrency=conc, max_new_tokens=wl.output_tokens, stream_every=1,
              timeout=timeout, rid_prefix=run_id, ignore_eos=ignore_eos, headers=_read_key(inv.gateway.api_key_file),
              prompt_for=prompt_for or prompt_maker(wl))
    manifest["started"] = now_iso()
    t0 = time.monotonic()
    rows = (load or send)(inv.gateway.url, **kw)
    manifest["ended"] = now_iso()
    manifest["client_elapsed_s"] = round(time.monotonic() - t0, 3)
    after = revision_mark(state)
    invalid = revision_change(before, after)
    manifest["revision_check"] = {"before": asdict(before), "after": asdict(after), "changed": invalid}
    manifest["invalid"] = invalid
    if resolve_routing is not None:
        resolve_routing(rows)
    mismatched = sum(1 for r in rows if r.ok and r.prompt_tokens != wl.input_tokens)
    manifest["prompt_tokens_mismatch"] = mismatched
    figs = compute_figures(rows, gpus=gpus, invalid=invalid)
    manifest["figures"] = figs.to_dict()
    write_ledger(run_dir, rows, manifest)
    return BenchResult(run_dir, manifest, rows, figs)


def format_result(res: BenchResult) -> str:
    """The table of one run, plus the caveats that belong next to it."""
    m = res.manifest
    lines = [format_table([(f"{m['topology']} C{m['parameters']['concurrency']} {m['parameters']['workload']}",
                            res.figures)])]
    if m.get("prompt_tokens_mismatch"):
        lines.append(f"note: {m['prompt_tokens_mismatch']} requests reported a prompt length other than "
                     f"{m['parameters']['input_tokens']} tokens; the figures use the reported counts")
    if not m.get("inventory_matches_revision", True):
        lines.append("note: the inventory on disk differs from the one the revision was deployed with")
    lines.append(f"ledger: {res.run_dir / LEDGER_CSV}, {res.run_dir / LEDGER_JSONL}; manifest: {res.run_dir / MANIFEST}")
    if m.get("invalid"):
        lines.append(f"verdict: INVALID run: {m['invalid']}")
    elif res.figures.any_failure:
        lines.append(f"verdict: run with failures: {res.figures.mark}")
    else:
        lines.append(f"verdict: all {res.figures.sent} requests succeeded; revision unchanged during the run")
    return "\n".join(lines)


__all__ = [
    "Workload", "parse_workload", "parse_concurrency", "parse_positive_int", "wall_clock", "success_count",
    "total_tpm", "output_tpm", "tpm_per_gpu", "percentile", "ttfts", "tpots", "itls", "failure_counts",
    "describe_failures", "Figures", "compute_figures", "format_table", "write_ledger", "read_ledger",
    "figures_of_run", "RevisionMark", "revision_mark", "revision_change", "prompt_maker", "BenchResult",
    "run_bench", "format_result", "gpus_of_revision",
]
