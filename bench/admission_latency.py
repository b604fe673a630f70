"""Latency the admission layer (HAProxy) adds, and the request rate it sustains, on loopback.

Starts a prefill and a decode sim, the real gateway, and HAProxy rendered by
pdops.model.admission (cap far above the load, so it never queues), then runs the same load
straight at the gateway and through HAProxy, alternating, and prints p50/p99 latency of
short non-streaming requests at concurrency 1 and the request rate at concurrency 32,
with the ratios admission/direct. Every process is killed by PID at the end.

    .venv/bin/python bench/admission_latency.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from pdops.model.admission import AdmissionConfig
from pdops.sim.testing import start_haproxy
from pdops.remote.loadgen import send
from pdops.sim.testing import free_port, start_gateway, start_sim

KEY = "bench-admission-key-0123456789"


def run(url: str, concurrency: int, seconds: float, headers: dict) -> tuple[float, float, float, int]:
    rows = send(url, concurrency=concurrency, duration=seconds, max_new_tokens=1, stream_every=0, headers=headers,
                rid_prefix="bench-adm", timeout=30)
    ok = [r for r in rows if r.ok]
    if len(ok) != len(rows):
        raise SystemExit(f"{len(rows) - len(ok)} of {len(rows)} requests failed: {rows[0].status} {rows[0].error}")
    lat = sorted(r.end - r.start for r in ok)
    span = max(r.end for r in ok) - min(r.start for r in ok)
    return statistics.median(lat), lat[int(0.99 * (len(lat) - 1))], len(ok) / span, len(ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    args = ap.parse_args()
    env = {"PDOPS_SIM_DECODE_STEP_MS": "1"}
    started = []
    try:
        p = start_sim(["--disaggregation-mode", "prefill"], env)
        started.append(p)
        d = start_sim(["--disaggregation-mode", "decode"], env)
        started.append(d)
        g = start_gateway([p], [d])
        started.append(g)
        cfg = AdmissionConfig("local", "127.0.0.1", free_port(), cap=1024, queue=1024, queue_timeout_s=30,
                              overflow_status=429, api_keys_file="(bench)", gateways=(("gw", "127.0.0.1", g.port),),
                              keys=(KEY,))
        hx = start_haproxy(cfg, tempfile.mkdtemp(prefix="pdops-bench-adm-"))
        started.append(hx)
        auth = {"Authorization": f"Bearer {KEY}"}
        run(g.url, 4, 1.0, {})  # warm both paths
        run(cfg.url, 4, 1.0, auth)
        res: dict[tuple[str, int], list] = {}
        for _ in range(2):  # alternate, so drift hits both paths alike
            for name, url, h in (("direct", g.url, {}), ("admission", cfg.url, auth)):
                for conc in (1, 32):
                    res.setdefault((name, conc), []).append(run(url, conc, args.seconds, h))

        def best(name, conc, i, fn):
            return fn(r[i] for r in res[(name, conc)])

        print(f"admission layer (HAProxy {cfg.url}) vs straight to the gateway ({g.url}), loopback, "
              f"max_new_tokens=1, {args.seconds:g}s per run, 2 runs each (best shown)")
        print(f"{'':24}{'direct':>12}{'admission':>12}{'ratio':>8}")
        for label, conc, i, fn, unit, scale in (("p50 latency, conc 1", 1, 0, min, "ms", 1000),
                                               ("p99 latency, conc 1", 1, 1, min, "ms", 1000),
                                               ("p50 latency, conc 32", 32, 0, min, "ms", 1000),
                                               ("p99 latency, conc 32", 32, 1, min, "ms", 1000),
                                               ("request rate, conc 32", 32, 2, max, "req/s", 1)):
            a, b = best("direct", conc, i, fn) * scale, best("admission", conc, i, fn) * scale
            print(f"{label:24}{a:>9.2f}{unit:>3}{b:>9.2f}{unit:>3}{b / a:>8.2f}")
        added = (best("admission", 1, 0, min) - best("direct", 1, 0, min)) * 1000
        print(f"added p50 latency at concurrency 1: {added:.2f} ms")
    finally:
        for h in reversed(started):
            (h.kill_all if hasattr(h, "kill_all") else h.stop)()


if __name__ == "__main__":
    main()
