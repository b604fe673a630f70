"""Benchmark of pdops's load generator (pdops.load): can one core drive >= 1,000 concurrent
streams without becoming the bottleneck, and does it agree with SGLang's own client?

Starts one sim engine (`python -m pdops.sim`, no PD, its own process) on 127.0.0.1,
drives it with `pdops.load.run_load` from this process at a fixed concurrency, and prints:
requests/s, total TPM (the ledger formula of pdops.bench), the peak number of streams
actually in flight (from the ledger), the client's CPU time (resource.getrusage of this
process only: the sim is another process) and whether the client saturated a core.

Then the same workload through `python -m sglang.bench_serving` (the peer client in
SGLANG.md) against the same sim, and the two total TPMs side by side (target: within 2%),
with both clients' CPU time. That needs `transformers` and a local tokenizer: a word-level
tokenizer over the sim's vocabulary is built with `tokenizers` so both sides count the same
tokens; without `transformers` the comparison prints "skipped: <reason>".

    .venv/bin/python bench/loadgen.py [--streams 1200] [--requests 3600] [--input 200] [--output 64]

Not a timed test: it prints figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdops import bench as b  # noqa: E402
from pdops.load import run_load  # noqa: E402
from pdops.sim.testing import start_sim  # noqa: E402

SATURATED = 0.90  # client CPU / wall above this: the client, not the server, may be the limit


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def peak_in_flight(rows) -> int:
    events = sorted([(r.start, 1) for r in rows] + [(r.end, -1) for r in rows if r.end is not None],
                    key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))


def run_pdops(url: str, args) -> dict:
    wl = b.Workload(args.input, args.output)
    c0, t0 = cpu_self(), time.monotonic()
    rows = asyncio.run(run_load(url, requests=args.requests, concurrency=args.streams, max_new_tokens=args.output,
                                stream_every=1, timeout=600, rid_prefix="loadgen", prompt_for=b.prompt_maker(wl)))
    wall, cpu = time.monotonic() - t0, cpu_self() - c0
    f = b.compute_figures(rows)
    return {"client": "pdops.load", "sent": f.sent, "ok": f.ok, "failures": f.failures, "wall_s": round(f.wall_s, 3),
            "requests_per_s": round(f.ok / f.wall_s, 1), "total_tpm": round(f.total_tpm or 0),
            "output_tpm": round(f.output_tpm or 0), "ttft_p99_s": f.ttft_p99, "peak_streams": peak_in_flight(rows),
            "client_cpu_s": round(cpu, 2), "client_cpu_per_wall": round(cpu / wall, 3),
            "saturated_a_core": cpu / wall > SATURATED}


def build_word_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer over the sim's vocabulary, saved as a HF folder (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    from pdops.sim.tokens import _VOCAB

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(_VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "unk_token": "[UNK]", "model_max_length": 1 << 20}))
    return folder


def run_sglang(url: str, args, tok_dir: Path) -> dict:
    """`python -m sglang.bench_serving` on the same workload; its CPU from RUSAGE_CHILDREN."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"client": "sglang.bench_serving", "skipped": "transformers is not installed (sglang.bench_serving "
                "loads its tokenizer with AutoTokenizer); install it to compare"}
    out = Path(tempfile.mkdtemp(prefix="pdops-loadgen-")) / "sglang.jsonl"
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
           "--dataset-name", "random", "--random-input-len", str(args.input), "--random-output-len", str(args.output),
           "--random-range-ratio", "1", "--num-prompts", str(args.requests), "--max-concurrency", str(args.streams),
           "--tokenizer", str(tok_dir), "--output-file", str(out), "--disable-tqdm"]
    c0, t0 = cpu_children(), time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wall, cpu = time.monotonic() - t0, cpu_children() - c0
    if proc.returncode != 0 or not out.exists():
        return {"client": "sglang.bench_serving", "skipped": f"exited {proc.returncode}: "
                f"{(proc.stderr or proc.stdout)[-400:]}"}
    doc = json.loads(out.read_text().splitlines()[-1])
    dur = doc["duration"]
    tokens = doc["total_input_tokens"] + doc["total_output_tokens"]
    return {"client": "sglang.bench_serving", "ok": doc.get("completed"), "wall_s": round(dur, 3),
            "requests_per_s": round(doc.get("completed", 0) / dur, 1), "total_tpm": round(60 * tokens / dur),
            "output_tpm": round(60 * doc["total_output_tokens"] / dur), "client_cpu_s": round(cpu, 2),
            "client_cpu_per_wall": round(cpu / wall, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=1200, help="concurrent streams (>= 1000 for the claim)")
    ap.add_argument("--requests", type=int, default=3600)
    ap.add_argument("--input", type=int, default=200, help="prompt tokens")
    ap.add_argument("--output", type=int, default=64, help="output tokens")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    raise_fd_limit(4 * args.streams + 256)
    env = {"PDOPS_SIM_DECODE_STEP_MS": "20", "PDOPS_SIM_DECODE_STEP_PER_REQ_MS": "0.001",
           "PDOPS_SIM_PREFILL_TOKENS_PER_S": "50000000"}
    with tempfile.TemporaryDirectory(prefix="pdops-loadgen-tok-") as td:
        tok_dir = build_word_tokenizer(Path(td) / "sim-words")
        sim = start_sim(["--model-path", str(tok_dir), "--max-running-requests", str(2 * args.streams)], env)
        try:
            mine = run_pdops(sim.url, args)
            peer = run_sglang(sim.url, args, tok_dir)
        finally:
            sim.stop()
    result = {"workload": f"{args.input}/{args.output}", "streams": args.streams, "pdops": mine, "sglang": peer}
    if "total_tpm" in peer and peer["total_tpm"]:
        result["tpm_difference"] = round(mine["total_tpm"] / peer["total_tpm"] - 1, 4)
        result["within_2_percent"] = abs(result["tpm_difference"]) <= 0.02
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"workload {result['workload']} at {args.streams} concurrent streams, {args.requests} requests, one sim on loopback")
    print(f"pdops.load: {mine['ok']}/{mine['sent']} ok, peak {mine['peak_streams']} streams in flight, "
          f"{mine['requests_per_s']} req/s, total TPM {mine['total_tpm']:,}, wall {mine['wall_s']} s, "
          f"client CPU {mine['client_cpu_s']} s ({mine['client_cpu_per_wall']:.0%} of one core) -> "
          + ("SATURATED a core: the client may be the bottleneck" if mine["saturated_a_core"]
             else "not the bottleneck"))
    if "skipped" in peer:
        print(f"sglang.bench_serving: skipped: {peer['skipped']}")
    else:
        print(f"sglang.bench_serving: {peer['ok']} ok, {peer['requests_per_s']} req/s, total TPM {peer['total_tpm']:,}, "
              f"client CPU {peer['client_cpu_s']} s ({peer['client_cpu_per_wall']:.0%} of one core)")
        print(f"total TPM difference: {result['tpm_difference']:+.2%} "
              f"({'within' if result['within_2_percent'] else 'OUTSIDE'} 2%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
