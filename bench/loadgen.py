"""Benchmark of pdops's load generator (pdops.load): can one core drive >= 1,000 concurrent
streams without becoming the bottleneck, and does it agree with SGLang's own client?

Starts a PD pair behind the real gateway on 127.0.0.1: one prefill and one decode sim engine
(`python -m pdops.sim`, each its own process) registered with `smg launch --pd-disaggregation`
(the sglang-router binary, as deployed), drives the gateway with `pdops.load.run_load` from
this process at a fixed concurrency, and prints:
requests/s, total TPM (the ledger formula of pdops.bench), the peak number of streams
actually in flight (from the ledger), the client's CPU time (resource.getrusage of this
process only: the sim is another process) and whether the client saturated a core.

Then the same workload through `python -m sglang.bench_serving` (the peer client in
SGLANG.md; dataset `random-ids`, fixed lengths, same concurrency and request count) against
the same gateway, and the two total TPMs side by side (target: within 2%), with both clients'
CPU time. SGLang's benchmark imports torchvision, which cannot live beside the project's CPU
torch, so it runs from its own environment, `.venv-bench` (`make bench-env`); a word-level
tokenizer over the sim's vocabulary, built with `tokenizers`, lets both sides count the same
tokens offline. Without that environment the comparison prints "skipped: <reason>".

    .venv/bin/python bench/loadgen.py [--streams 1200] [--requests 3600] [--input 200] [--output 64] [--repeats 3]

An untimed warm-up run goes first; then each client runs --repeats times, alternating which
goes first, and the runs with the median total TPM are compared.

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
from pdops.sim.testing import start_gateway, start_sim  # noqa: E402

PEER_VENV = Path(__file__).resolve().parents[1] / ".venv-bench" / "bin" / "python"
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
            "mean_streams": round(sum(r.end - r.start for r in rows if r.end is not None) / f.wall_s, 1),
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
    py = args.peer_python
    c0 = cpu_children()
    probe = subprocess.run([py, "-c", "import sglang.benchmark.serving, transformers"], capture_output=True, text=True)
    import_cpu = cpu_children() - c0  # what its start-up alone costs (torch, transformers, sglang)
    if probe.returncode != 0:
        return {"client": "sglang.bench_serving", "skipped": f"{py} cannot import sglang.benchmark.serving "
                f"({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe.returncode}); "
                "build its environment with `make bench-env`"}
    out = Path(tempfile.mkdtemp(prefix="pdops-loadgen-")) / "sglang.jsonl"
    cmd = [py, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
           "--dataset-name", "random-ids", "--random-input-len", str(args.input), "--random-output-len", str(args.output),
           "--random-range-ratio", "1", "--num-prompts", str(args.requests), "--max-concurrency", str(args.streams),
           "--tokenizer", str(tok_dir), "--output-file", str(out), "--disable-tqdm"]
    c0, t0 = cpu_children(), time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, "HF_HUB_OFFLINE": "1"})
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
            "client_cpu_per_wall": round(cpu / wall, 3), "startup_cpu_s": round(import_cpu, 2),
            "cpu_after_startup_s": round(cpu - import_cpu, 2),
            "peak_streams": doc.get("max_concurrent_requests"), "mean_streams": round(doc.get("concurrency") or 0, 1)}


def median_run(runs: list[dict]) -> dict:
    """The run with the median total TPM (the lower middle one for an even count); a skip as is."""
    done = sorted((r for r in runs if "total_tpm" in r), key=lambda r: r["total_tpm"])
    return done[(len(done) - 1) // 2] if done else runs[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=1200, help="concurrent streams (>= 1000 for the claim)")
    ap.add_argument("--requests", type=int, default=3600)
    ap.add_argument("--input", type=int, default=200, help="prompt tokens")
    ap.add_argument("--output", type=int, default=64, help="output tokens")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each client, alternating which goes first")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--peer-python", default=str(PEER_VENV if PEER_VENV.exists() else sys.executable),
                    help="python with sglang.benchmark importable (default: .venv-bench, from `make bench-env`)")
    args = ap.parse_args()
    raise_fd_limit(4 * args.streams + 256)
    env = {"PDOPS_SIM_DECODE_STEP_MS": "20", "PDOPS_SIM_DECODE_STEP_PER_REQ_MS": "0.001",
           "PDOPS_SIM_PREFILL_TOKENS_PER_S": "50000000"}
    with tempfile.TemporaryDirectory(prefix="pdops-loadgen-tok-") as td:
        tok_dir = build_word_tokenizer(Path(td) / "sim-words")
        common = ["--model-path", str(tok_dir), "--max-running-requests", str(2 * args.streams)]
        procs = []
        cpus = sorted(os.sched_getaffinity(0))
        client_cpu, server_cpus = ({cpus[0]}, set(cpus[1:])) if len(cpus) > 1 else (set(cpus), set(cpus))
        try:
            # The servers (and every process they fork) on the other cores, the clients on one
            # core of their own: a client's CPU then cannot slow the server it measures, and
            # "from one core" is literal.
            os.sched_setaffinity(0, server_cpus)
            procs.append(start_sim([*common, "--disaggregation-mode", "prefill"], env))
            procs.append(start_sim([*common, "--disaggregation-mode", "decode"], env))
            procs.append(start_gateway([procs[0]], [procs[1]]))
            os.sched_setaffinity(0, client_cpu)  # bench_serving, started from here, inherits it
            url = procs[-1].url
            # warm-up, not recorded: the first client would otherwise pay the cold gateway and sims
            warm = argparse.Namespace(**{**vars(args), "requests": args.streams})
            run_pdops(url, warm)
            mine_runs, peer_runs = [], []
            for r in range(args.repeats):  # alternate which client goes first
                order = (("pdops", "sglang") if r % 2 == 0 else ("sglang", "pdops"))
                for who in order:
                    if who == "pdops":
                        mine_runs.append(run_pdops(url, args))
                    else:
                        peer_runs.append(run_sglang(url, args, tok_dir))
                if "skipped" in peer_runs[-1]:
                    break
        finally:
            for h in reversed(procs):
                h.stop()
    mine, peer = median_run(mine_runs), median_run(peer_runs)
    result = {"workload": f"{args.input}/{args.output}", "streams": args.streams, "pdops": mine, "sglang": peer,
              "client_cpus": sorted(client_cpu), "server_cpus": sorted(server_cpus),
              "pdops_runs_tpm": [m["total_tpm"] for m in mine_runs],
              "sglang_runs_tpm": [m.get("total_tpm") for m in peer_runs]}
    if "total_tpm" in peer and peer["total_tpm"]:
        result["tpm_difference"] = round(mine["total_tpm"] / peer["total_tpm"] - 1, 4)
        result["within_2_percent"] = abs(result["tpm_difference"]) <= 0.02
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"workload {result['workload']} at {args.streams} concurrent streams, {args.requests} requests x "
          f"{args.repeats} runs per client (clients on CPU {result['client_cpus']}, gateway and sims on "
          f"{result['server_cpus']}), "
          "real gateway + 1 prefill + 1 decode sim on loopback")
    print(f"pdops.load: {mine['ok']}/{mine['sent']} ok, peak {mine['peak_streams']} streams in flight, "
          f"mean {mine['mean_streams']}, {mine['requests_per_s']} req/s, total TPM {mine['total_tpm']:,}, wall {mine['wall_s']} s, "
          f"client CPU {mine['client_cpu_s']} s ({mine['client_cpu_per_wall']:.0%} of one core) -> "
          + ("SATURATED a core: the client may be the bottleneck" if mine["saturated_a_core"]
             else "not the bottleneck"))
    if "skipped" in peer:
        print(f"sglang.bench_serving: skipped: {peer['skipped']}")
    else:
        print(f"sglang.bench_serving: {peer['ok']} ok, peak {peer['peak_streams']} streams in flight, mean "
              f"{peer['mean_streams']}, {peer['requests_per_s']} req/s, total TPM {peer['total_tpm']:,}, "
              f"client CPU {peer['client_cpu_s']} s ({peer['client_cpu_per_wall']:.0%} of one core; "
              f"{peer['startup_cpu_s']} s of it its imports, {peer['cpu_after_startup_s']} s driving the load)")
        print(f"total TPM per run: pdops.load {result['pdops_runs_tpm']}, sglang.bench_serving "
              f"{result['sglang_runs_tpm']} (medians compared)")
        print(f"total TPM difference: {result['tpm_difference']:+.2%} "
              f"({'within' if result['within_2_percent'] else 'OUTSIDE'} 2%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
