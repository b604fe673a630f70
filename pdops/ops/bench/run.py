"""Running a bench against a cluster: the revision marks around it, the prompts, the ledgered client."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from pdops.errors import InvalidInput, Refused
from pdops.remote.loadgen import LedgerRow, send

from pdops.ops.bench.figures import Figures, compute_figures, format_table
from pdops.ops.bench.ledger import LEDGER_CSV, LEDGER_JSONL, MANIFEST, write_ledger
from pdops.ops.bench.workload import Workload, parse_concurrency, parse_workload, stop_condition
from pdops.model.prompts import make_prompt
from pdops import __version__
from pdops.model.versions import SGLANG_VERSION, SIM_VERSION, SMG_VERSION
from pdops.model.topology import parse_topology
from pdops.record.journal import now_iso
from pdops.record.local import new_op_id
from pdops.ops.report.runs import Span, runs_page
from pdops.ops.operate import run_operation
from pdops.plans import Outcome, Plan, Step


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


def revision_mark(record) -> RevisionMark:
    """Read the mark of a record: the shared one is read again from its state host; a local
    StateDir also gives its `current` file's mtime and inode (no host is contacted)."""
    if hasattr(record, "refresh"):
        record.refresh()
        mtime = ino = None
    else:
        try:
            st = record.current_file.stat()
            mtime, ino = st.st_mtime_ns, st.st_ino
        except FileNotFoundError:
            mtime = ino = None
    nums = record.revision_numbers()
    return RevisionMark(record.current(), nums[-1] if nums else None, mtime, ino)


def revision_change(before: RevisionMark, after: RevisionMark) -> str | None:
    """None if nothing changed, else why the run is invalid."""
    if before.current != after.current:
        return f"the current revision changed during the run ({before.current} -> {after.current})"
    if before.latest != after.latest:
        return f"revision {after.latest} was recorded during the run (current was {before.current})"
    if (before.current_mtime_ns, before.current_inode) != (after.current_mtime_ns, after.current_inode):
        return f"the current pointer was rewritten during the run (still {after.current}: a rollback or re-deploy)"
    return None


def prompt_maker(workload: Workload, seed: int = 0) -> Callable[[int], str]:
    """prompt_for(i): a prompt of exactly `workload.input_tokens` tokens as the sim counts them.

    A shared body plus a 4-token lead that differs per request, so the engine's prefix
    cache cannot serve one request from another's KV (the lead comes first).
    """
    n = workload.input_tokens
    lead = min(4, n)
    body = make_prompt(n - lead, seed)

    def prompt_for(i: int) -> str:
        head = make_prompt(lead, seed * 1_000_003 + i + 1)
        return f"{head} {body}" if body else head

    return prompt_for


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
    engine = {"engine": inv.engine, "sglang": SGLANG_VERSION}
    if inv.engine == "sim":
        engine = {"engine": "sim", "sim_of_sglang": SIM_VERSION}
    return {"pdops": __version__, **engine, "smg": SMG_VERSION}


def gpus_of_revision(rev, gpus_per_instance: int) -> int:
    """GPUs of a revision's topology: its instances x TP x PP."""
    instances = (rev.placement or {}).get("instances")
    if instances:
        return len(instances) * gpus_per_instance

    t = parse_topology(rev.topology)
    return (t.prefill + t.decode) * gpus_per_instance


def run_bench(inv, record, workload: Workload | str, concurrency: int | str, requests: int | str | None = None,
              duration: float | str | None = None, ignore_eos: bool = True, out_dir: str | os.PathLike | None = None,
              *, timeout: float = 3600.0, load: Callable | None = None, prompt_for: Callable[[int], str] | None = None,
              resolve_routing: Callable[[list[LedgerRow]], None] | None = None,
              say: Callable[[str], None] = print, lock_held: bool = False, op: str | None = None,
              dry_run: bool = False) -> BenchResult | None:
    """Drive the gateway of the current revision at a fixed concurrency; write ledger + manifest.

    An operation as every other (pdops.ops.operate.run_operation): its plan (mark, load, check, write),
    under the cluster lock (`lock_held`: the caller holds it, `inv sweep` between its cells), from the
    revision it was planned from, each step and one verdict in the journal. The lock keeps every change
    off the cluster while it is measured; a change made anyway (the record written around the lock) marks
    the run invalid. `load(base_url, **kw) -> rows` defaults to `pdops.remote.loadgen.send`; `op`: the
    run's id (default a new one), which a sweep names before the run. `dry_run`: print the plan, send
    nothing, take no lock, write nothing; None."""

    wl = workload if isinstance(workload, Workload) else parse_workload(workload)
    conc = parse_concurrency(concurrency)
    n_req, dur = stop_condition(requests, duration)
    rev = record.current_revision()
    if rev is None:
        raise Refused(f"{inv.cluster} has no current revision: nothing to benchmark",
                      fix="deploy first (`inv deploy --topology 1p1d`)")
    gpus = gpus_of_revision(rev, inv.profile.gpus_per_instance)
    run_id = op or new_op_id("bench")
    run_dir = Path(out_dir) if out_dir is not None else record.path / "bench" / run_id
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
        "gateway": inv.gateway.first.url, "versions": _versions(inv), "load_client": "pdops.remote.loadgen",
        "inventory_digest": inv.digest,
        "inventory_matches_revision": inv.matches(rev.inventory_hash),
        "routing": "not resolved (hook resolve_routing not wired)" if resolve_routing is None else "resolved",
    }
    what = f"{n_req} requests" if n_req is not None else f"{dur:g} s"
    kw = dict(requests=n_req, duration=dur, concurrency=conc, max_new_tokens=wl.output_tokens, stream_every=1,
              timeout=timeout, rid_prefix=run_id, ignore_eos=ignore_eos, headers=_read_key(inv.gateway.api_key_file),
              prompt_for=prompt_for or prompt_maker(wl))
    plan = bench_plan(inv.cluster, rev.number, run_dir, manifest, load or send, kw, resolve_routing, what)
    say(plan.render())
    if dry_run:
        return None
    got: dict = {}
    run_operation(plan, inv, record, say, pool=None, gateways=None, op=run_id, lock_held=lock_held,
                  basis=rev.number, finish=lambda ctx, verdict: got.update(result=ctx.output("bench_result")) or
                  verdict.update(run_dir=str(run_dir), invalid=got["result"].manifest["invalid"]))
    return got["result"]


def bench_plan(cluster: str, revision: int, run_dir: Path, manifest: dict, load: Callable, kw: dict,
               resolve_routing: Callable | None, what: str) -> Plan:
    """The bench's four steps: the record's mark read, the load sent, the mark read again, the files written."""
    p = manifest["parameters"]
    url = manifest["gateway"]
    steps = [
        Step("bench-mark", None, "read the record's mark: the current revision, the newest one, the pointer's "
             "write (nothing may change them during the run)", kind="bench-mark"),
        Step("bench-load", None, f"{what} of {p['workload']} at C{p['concurrency']} to {url}, streamed; each "
             "request sent once, never retried (a failure is a row); one ledger row each, written at once (the "
             "manifest says unchecked until bench-write)", kind="bench-load",
             params={"load": load, "url": url, "kw": kw, "run_dir": run_dir, "manifest": manifest}),
        Step("bench-check", None, "read the mark again: a revision recorded or the pointer moved or rewritten "
             "makes the run INVALID (its figures are kept, marked)", kind="bench-check"),
        Step("bench-write", None, f"ledger (csv, jsonl), manifest, figures and page into {run_dir}",
             kind="bench-write", params={"run_dir": run_dir, "manifest": manifest, "resolve_routing": resolve_routing}),
    ]
    return Plan("bench", f"plan: bench {cluster}: {p['workload']} at C{p['concurrency']}, {what}, against {url} "
                f"(revision {revision}, {manifest['topology']}, {manifest['gpus']} GPUs); under the cluster lock, "
                "the steps:", steps,
                head={"revision": revision, "run_dir": str(run_dir), "parameters": p})


def do_bench_mark(ctx, step: Step) -> Outcome:
    mark = revision_mark(ctx.record)
    ctx.give(step, "bench_mark", mark)
    return Outcome(evidence={"mark": asdict(mark)}, verified=[f"the record's mark before the run: {mark.describe()}"])


def do_bench_load(ctx, step: Step) -> Outcome:
    par = step.params
    started, t0 = now_iso(), time.monotonic()
    rows = par["load"](par["url"], **par["kw"])
    elapsed = round(time.monotonic() - t0, 3)
    # the rows are written before anything else can fail (a lock taken over, a journal that cannot be
    # written): a run is never lost, only left unchecked; bench-write writes the checked files over them
    write_ledger(par["run_dir"], rows, {**par["manifest"], "started": started, "client_elapsed_s": elapsed,
                                        "invalid": "unchecked: the run ended before its revision check (bench-check)"})
    ctx.give(step, "bench_rows", {"rows": rows, "started": started, "ended": now_iso(), "client_elapsed_s": elapsed})
    ok = sum(1 for r in rows if r.ok)
    return Outcome(evidence={"sent": len(rows), "ok": ok, "not_ok": len(rows) - ok, "client_elapsed_s": elapsed},
                   verified=[f"{len(rows)} request(s) sent, each once, each a ledger row: {ok} ok"])


def do_bench_check(ctx, step: Step) -> Outcome:
    before, after = ctx.get(step, "bench_mark"), revision_mark(ctx.record)
    invalid = revision_change(before, after)
    check = {"before": asdict(before), "after": asdict(after), "changed": invalid}
    ctx.give(step, "bench_check", check)
    if invalid:
        return Outcome(evidence=check, unverified=[f"INVALID run: {invalid}"])
    return Outcome(evidence=check, verified=[f"the record did not change during the run ({after.describe()})"])


def do_bench_write(ctx, step: Step) -> Outcome:
    par = step.params
    load, check = ctx.get(step, "bench_rows"), ctx.get(step, "bench_check")
    rows, invalid = load["rows"], check["changed"]
    manifest = {**par["manifest"], "started": load["started"], "ended": load["ended"],
                "client_elapsed_s": load["client_elapsed_s"], "revision_check": check, "invalid": invalid}
    if par["resolve_routing"] is not None:
        par["resolve_routing"](rows)
    wanted = manifest["parameters"]["input_tokens"]
    manifest["prompt_tokens_mismatch"] = sum(1 for r in rows if r.ok and r.prompt_tokens != wanted)
    figs = compute_figures(rows, gpus=manifest["gpus"], invalid=invalid)
    manifest["figures"] = figs.to_dict()
    run_dir = par["run_dir"]
    write_ledger(run_dir, rows, manifest)
    write_page(run_dir, rows, manifest)
    ctx.give(step, "bench_result", BenchResult(run_dir, manifest, rows, figs))
    return Outcome(evidence={"run_dir": str(run_dir), "figures": figs.to_dict()},
                   verified=[f"ledger, manifest and page written into {run_dir}"])


PAGE = "report.html"


def write_page(run_dir: Path, rows: list[LedgerRow], manifest: dict) -> Path:
    """The run as one page (pdops.ops.report.runs): its span on a timeline beside the requests that
    ended ok and not ok each second, the figures below."""

    ledger = [r.to_dict() for r in rows]
    starts = [r.start for r in rows] + [r.end for r in rows if r.end]
    spans = [Span(f"bench C{manifest['parameters']['concurrency']}", min(starts), max(starts),
                  ok=not manifest.get("invalid"), detail=f"{len(rows)} requests")] if starts else []
    page, _ = runs_page(f"bench {manifest.get('run_id', run_dir.name)} ({manifest.get('topology', '?')})", spans,
                        ledger, summary={"figures": manifest.get("figures"), "parameters": manifest.get("parameters")})
    path = run_dir / PAGE
    path.write_text(page, encoding="utf-8")
    return path


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
    lines.append(f"ledger: {res.run_dir / LEDGER_CSV}, {res.run_dir / LEDGER_JSONL}; manifest: {res.run_dir / MANIFEST}; "
                 f"page: {res.run_dir / PAGE}")
    if m.get("invalid"):
        lines.append(f"verdict: INVALID run: {m['invalid']}")
    elif res.figures.any_failure:
        lines.append(f"verdict: run with failures: {res.figures.mark}")
    else:
        lines.append(f"verdict: all {res.figures.sent} requests succeeded; revision unchanged during the run")
    return "\n".join(lines)
