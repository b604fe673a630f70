"""Benchmark of pdops's load generator (pdops.remote.loadgen): can one core drive >= 1,000 concurrent
streams without becoming the bottleneck, and does it agree with SGLang's own client?

Starts a PD pair behind the real gateway on 127.0.0.1: one prefill and one decode sim engine
(`python -m pdops.sim`, each its own process) registered with `smg launch --pd-disaggregation`
(the sglang-router binary, as deployed), drives the gateway with `pdops.remote.loadgen.run_load` from
this process at a fixed concurrency, and prints:
requests/s, total TPM (the ledger formula of pdops.ops.bench), the peak number of streams
actually in flight (from the ledger), the client's CPU time (resource.getrusage of this
process only: the sim is another process) and whether the client saturated a core.

Then the same workload through `python -m sglang.bench_serving` (the peer client in
docs/design/sglang.md; dataset `random-ids`, fixed lengths, same concurrency and request count) against
the same gateway, and the two total TPMs side by side (target: within 2%), with both clients'
CPU time. SGLang's benchmark imports torchvision, which cannot live beside the project's CPU
torch, so it runs from its own environment, `.venv-bench` (`make bench-env`); a word-level
tokenizer over the sim's vocabulary, built with `tokenizers`, lets both sides count the same
tokens offline. Without that environment the comparison prints "skipped: <reason>".

    .venv/bin/python bench/loadgen.py [--streams 1200] [--requests 3600] [--input 200] [--output 32]
        [--repeats 2] [--decode-step-ms 1000] [--peer-keepalive]

An untimed warm-up run goes first; then each client runs --repeats times, rotating which
goes first, and the runs with the median total TPM are compared. The sim's decode step
defaults to 1 s so that the server core stays well below saturation (its busy share is
printed): with a 20-ms step the one server core is 99% busy at 1,200 streams, the figure is
then set by CPU contention and moved 9% between two runs of the same client.

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

from pdops.ops import bench as b  # noqa: E402
from pdops.remote.loadgen import run_load  # noqa: E402
from pdops.sim.testing import start_gateway, start_sim  # noqa: E402

PEER_VENV = Path(__file__).resolve().parents[1] / ".venv-bench" / "bin" / "python"
SATURATED = 0.90  # client CPU / wall above this: the client, not the server, may be the limit


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def cpu_busy(cpus: set[int]) -> tuple[float, float]:
    """(busy, total) jiffies of these CPUs so far, from /proc/stat."""
    busy = total = 0.0
    with open("/proc/stat") as f:
        for line in f:
            name, *vals = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                v = [float(x) for x in vals[:8]]
                total += sum(v)
                busy += sum(v) - v[3] - v[4]  # all but idle and iowait
    return busy, total


class ServerLoad:
    """CPU seconds the server cores were busy during a run; divided by the run's own measured
    duration it gives their busy share. A server near 100% is the limit: then anything a client
    costs the server moves the figure."""

    def __init__(self, cpus: set[int]):
        self.cpus = cpus

    def __enter__(self):
        self.b0, _ = cpu_busy(self.cpus)
        return self

    def __exit__(self, *exc):
        b1, _ = cpu_busy(self.cpus)
        self.busy_s = (b1 - self.b0) / os.sysconf("SC_CLK_TCK")

    def share(self, wall_s: float) -> float:
        return round(self.busy_s / (len(self.cpus) * wall_s), 3)


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
    return {"client": "pdops.remote.loadgen", "sent": f.sent, "ok": f.ok, "failures": f.failures, "wall_s": round(f.wall_s, 3),
            "requests_per_s": round(f.ok / f.wall_s, 1), "total_tpm": round(f.total_tpm or 0),
            "output_tpm": round(f.output_tpm or 0), "ttft_p99_s": f.ttft_p99, "peak_streams": peak_in_flight(rows),
            "mean_streams": round(sum(r.end - r.start for r in rows if r.end is not None) / f.wall_s, 1),
            "client_cpu_s": round(cpu, 2), "client_cpu_per_wall": round(cpu / wall, 3),
            "saturated_a_core": cpu / wall > SATURATED}


def build_word_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer over the sim's vocabulary, saved as a HF folder (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    from pdops.model.prompts import VOCAB

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "unk_token": "[UNK]", "model_max_length": 1 << 20}))
    return folder


# SGLang's client opens a new aiohttp session (and so a new connection) for every request
# (sglang/benchmark/serving.py, _create_bench_client_session, used by async_request_sglang_generate).
# With --peer-keepalive this shim runs the same benchmark with one session per event loop, as
# pdops.remote.loadgen does: the difference between the two peer runs is what that choice costs.
KEEPALIVE_SHIM = """
import asyncio, sys, aiohttp, sglang.benchmark.serving as s
_sessions = {}
class _Shared:
    async def __aenter__(self):
        loop = asyncio.get_running_loop()
        if loop not in _sessions:
            _sessions[loop] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=6 * 3600), read_bufsize=10 * 1024 ** 2)
        return _sessions[loop]
    async def __aexit__(self, *exc):
        return False
s._create_bench_client_session = _Shared
sys.argv[0] = "sglang.benchmark.serving"
s.cli_main()
"""


def run_sglang(url: str, args, tok_dir: Path, keepalive: bool = False) -> dict:
    """`python -m sglang.bench_serving` on the same workload; its CPU from RUSAGE_CHILDREN.
    `keepalive`: through KEEPALIVE_SHIM (one shared session) instead."""
    py = args.peer_python
    c0 = cpu_children()
    probe = subprocess.run([py, "-c", "import sglang.benchmark.serving, transformers"], capture_output=True, text=True)
    import_cpu = cpu_children() - c0  # what its start-up alone costs (torch, transformers, sglang)
    if probe.returncode != 0:
        return {"client": "sglang.bench_serving", "skipped": f"{py} cannot import sglang.benchmark.serving "
                f"({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe.returncode}); "
                "build its environment with `make bench-env`"}
    out = Path(tempfile.mkdtemp(prefix="pdops-loadgen-")) / "sglang.jsonl"
    entry = ["-c", KEEPALIVE_SHIM] if keepalive else ["-m", "sglang.bench_serving"]
    cmd = [py, *entry, "--backend", "sglang", "--base-url", url,
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
    return {"client": "sglang.bench_serving" + (" (shared session)" if keepalive else ""), "ok": doc.get("completed"), "wall_s": round(dur, 3),
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
    ap.add_argument("--output", type=int, default=32, help="output tokens")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each client, rotating which goes first")
    ap.add_argument("--decode-step-ms", type=float, default=1000,
                    help="the sim's decode step (PDOPS_SIM_DECODE_STEP_MS); longer steps leave the server cores "
                    "idle enough that the timing model, not CPU, sets the throughput")
    ap.add_argument("--peer-keepalive", action="store_true",
                    help="also run SGLang's client with one shared session (KEEPALIVE_SHIM), as pdops.remote.loadgen does")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--peer-python", default=str(PEER_VENV if PEER_VENV.exists() else sys.executable),
                    help="python with sglang.benchmark importable (default: .venv-bench, from `make bench-env`)")
    args = ap.parse_args()
    raise_fd_limit(4 * args.streams + 256)
    env = {"PDOPS_SIM_DECODE_STEP_MS": str(args.decode_step_ms), "PDOPS_SIM_DECODE_STEP_PER_REQ_MS": "0.001",
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
            clients = ["pdops", "sglang"] + (["sglang_shared"] if args.peer_keepalive else [])
            runs: dict[str, list[dict]] = {c: [] for c in clients}
            for r in range(args.repeats):  # rotate which client goes first
                for who in clients[r % len(clients):] + clients[:r % len(clients)]:
                    with ServerLoad(server_cpus) as load:
                        run = (run_pdops(url, args) if who == "pdops"
                               else run_sglang(url, args, tok_dir, keepalive=who == "sglang_shared"))
                    if "wall_s" in run:
                        run["server_cores_busy"] = load.share(run["wall_s"])
                    runs[who].append(run)
                if any("skipped" in runs[c][-1] for c in clients):
                    break
        finally:
            for h in reversed(procs):
                h.stop()
    med = {c: median_run(rs) for c, rs in runs.items()}
    mine = med["pdops"]
    result = {"workload": f"{args.input}/{args.output}", "streams": args.streams, "decode_step_ms": args.decode_step_ms,
              "client_cpus": sorted(client_cpu), "server_cpus": sorted(server_cpus), **med,
              "runs_tpm": {c: [m.get("total_tpm") for m in rs] for c, rs in runs.items()},
              "server_busy": {c: [m.get("server_cores_busy") for m in rs] for c, rs in runs.items()}}
    for c in clients[1:]:
        if med[c].get("total_tpm"):
            diff = round(mine["total_tpm"] / med[c]["total_tpm"] - 1, 4)
            result[f"tpm_difference_vs_{c}"] = diff
            result[f"within_2_percent_of_{c}"] = abs(diff) <= 0.02
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"workload {result['workload']} at {args.streams} concurrent streams, {args.requests} requests x "
          f"{args.repeats} runs per client (clients on CPU {result['client_cpus']}, gateway and sims on "
          f"{result['server_cpus']}), real gateway + 1 prefill + 1 decode sim on loopback, "
          f"sim decode step {args.decode_step_ms:g} ms")
    print(f"pdops.remote.loadgen: {mine['ok']}/{mine['sent']} ok, peak {mine['peak_streams']} streams in flight, "
          f"mean {mine['mean_streams']}, {mine['requests_per_s']} req/s, total TPM {mine['total_tpm']:,}, wall {mine['wall_s']} s, "
          f"client CPU {mine['client_cpu_s']} s ({mine['client_cpu_per_wall']:.0%} of one core) -> "
          + ("SATURATED a core: the client may be the bottleneck" if mine["saturated_a_core"]
             else "not the bottleneck"))
    for c in clients[1:]:
        peer = med[c]
        if "skipped" in peer:
            print(f"{peer['client']}: skipped: {peer['skipped']}")
            continue
        print(f"{peer['client']}: {peer['ok']} ok, peak {peer['peak_streams']} streams in flight, mean "
              f"{peer['mean_streams']}, {peer['requests_per_s']} req/s, total TPM {peer['total_tpm']:,}, "
              f"client CPU {peer['client_cpu_s']} s ({peer['client_cpu_per_wall']:.0%} of one core; "
              f"{peer['startup_cpu_s']} s of it its imports, {peer['cpu_after_startup_s']} s driving the load)")
    print("total TPM per run: " + "; ".join(f"{c} {v}" for c, v in result["runs_tpm"].items()) + " (medians compared)")
    busy = [b for v in result["server_busy"].values() for b in v if b is not None]
    print("server cores busy per run: " + "; ".join(f"{c} {v}" for c, v in result["server_busy"].items())
          + ("  <- a server near 100% is the limit: the figures then also measure what each client costs it"
             if busy and max(busy) > SATURATED else ""))
    for c in clients[1:]:
        if f"tpm_difference_vs_{c}" in result:
            d = result[f"tpm_difference_vs_{c}"]
            print(f"total TPM, pdops.remote.loadgen vs {med[c]['client']}: {d:+.2%} ({'within' if abs(d) <= 0.02 else 'OUTSIDE'} 2%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
