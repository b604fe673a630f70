"""What the engine reports: the histograms it observes, the load dict of /v1/loads (and
/server_info), and the Prometheus text of /metrics, with SGLang's names and labels."""

from __future__ import annotations

import time


class Histogram:
    """A Prometheus histogram per is_streaming label: bucket counts, sum, count."""

    BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))

    def __init__(self, buckets: tuple | None = None):
        if buckets is not None:
            self.BUCKETS = buckets
        self.counts = {}  # is_streaming -> [bucket counts], sum, count

    def observe(self, key: str, v: float) -> None:
        c = self.counts.setdefault(key, [[0] * len(self.BUCKETS), 0.0, 0])
        for i, b in enumerate(self.BUCKETS):
            if v <= b:
                c[0][i] += 1
        c[1] += v
        c[2] += 1


class LoadReport:
    """The Engine's load report (a mixin: it reads the engine's requests, queues and counters)."""

    def phase_counts(self) -> dict:
        c = {"bootstrap": 0, "waiting": 0, "prefill": 0, "inflight": 0, "prealloc": 0, "transfer": 0, "running": 0}
        for r in self.reqs.values():
            if r.phase in c:
                c[r.phase] += 1
        return c

    def gen_throughput(self) -> float:
        if len(self.gen_window) < 2:
            return 0.0
        span = self.gen_window[-1][0] - self.gen_window[0][0]
        toks = sum(n for _, n in list(self.gen_window)[1:])
        return toks / span if span > 0 else 0.0

    def used_tokens(self) -> int:
        return sum(r.prompt_tokens + r.tokens for r in self.running.values())

    def load(self) -> dict:
        c = self.phase_counts()
        if self.mode == "prefill":
            running, waiting = c["prefill"], c["waiting"]
        else:
            running, waiting = c["running"], c["waiting"] + c["prefill"]
        total = self.timing.max_total_tokens
        used = self.used_tokens()
        waiting_tokens = sum(r.prompt_tokens for r in self.reqs.values() if r.phase == "waiting")
        return {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": waiting_tokens,
            "num_used_tokens": used,
            "num_total_tokens": total,
            "num_active_tokens": total,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": total,
            "max_running_requests": self.max_running,
            "token_usage": round(used / total, 4) if total else 0.0,
            "gen_throughput": round(self.gen_throughput(), 2),
            "cache_hit_rate": 0.0,
            "utilization": round(min(1.0, running / self.max_running), 4) if self.max_running else 0.0,
            "total_prefill_uncached_tokens": self.total_prefill_tokens,
            "total_prefill_busy_us": self.total_prefill_busy_us,
            "decode_moments": None,
            "memory": {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0, "token_capacity": total},
            "disaggregation": {
                "mode": self.mode,
                "prefill_bootstrap_queue_reqs": c["bootstrap"],
                "prefill_inflight_queue_reqs": c["inflight"],
                "decode_prealloc_queue_reqs": c["prealloc"],
                "decode_transfer_queue_reqs": c["transfer"],
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": round(self.kv_speed_gb_s, 4),
                "kv_transfer_latency_ms": round(self.kv_latency_ms, 3),
            },
            "queues": {"waiting": waiting, "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0},
        }


def prometheus_text(e, a) -> str:
    """/metrics for engine `e` started with args `a`: SGLang's gauges, counters and histograms."""
    sl = f'model_name="{a.served_model_name}",engine_type="{a.engine_type}",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
    tl = f'model_name="{a.served_model_name}",engine_type="{a.engine_type}"'
    load = e.load()
    c = e.phase_counts()
    out = []

    def gauge(name, value, doc):
        out.append(f"# HELP sglang:{name} {doc}\n# TYPE sglang:{name} gauge\nsglang:{name}{{{sl}}} {float(value)}")

    def counter(name, values, doc, labels=tl, split=True, from_first=False):
        # from_first: a counter SGLang 0.5.23 creates with labels and first increments on a failure
        # has no series at all, not even HELP/TYPE, until then (seen on the real engine, docs/sim.md)
        if from_first and not values:
            return
        lines = [f"# HELP sglang:{name}_total {doc}", f"# TYPE sglang:{name}_total counter"]
        if split:
            for s, v in values.items():
                lines.append(f'sglang:{name}_total{{{labels},is_streaming="{s}"}} {float(v)}')
        else:
            lines.append(f"sglang:{name}_total{{{labels}}} {float(values)}")
        out.append("\n".join(lines))

    def hist(name, h, doc):
        lines = [f"# HELP sglang:{name} {doc}", f"# TYPE sglang:{name} histogram"]
        for s, (buckets, total, count) in h.counts.items():
            for b, n in zip(h.BUCKETS, buckets):
                le = "+Inf" if b == float("inf") else repr(float(b))
                lines.append(f'sglang:{name}_bucket{{{tl},is_streaming="{s}",le="{le}"}} {float(n)}')
            lines.append(f'sglang:{name}_sum{{{tl},is_streaming="{s}"}} {total}')
            lines.append(f'sglang:{name}_count{{{tl},is_streaming="{s}"}} {float(count)}')
        out.append("\n".join(lines))

    gauge("num_running_reqs", load["num_running_reqs"], "The number of running requests.")
    gauge("num_queue_reqs", load["num_waiting_reqs"], "The number of requests in the waiting queue.")
    gauge("num_used_tokens", load["num_used_tokens"], "The number of used tokens.")
    gauge("token_usage", load["token_usage"], "The token usage.")
    gauge("gen_throughput", load["gen_throughput"], "The generation throughput (token/s).")
    gauge("num_prefill_bootstrap_queue_reqs", c["bootstrap"], "The number of requests in the prefill bootstrap queue.")
    gauge("num_prefill_inflight_queue_reqs", c["inflight"], "The number of requests in the prefill inflight queue.")
    gauge("num_decode_prealloc_queue_reqs", c["prealloc"], "The number of requests in the decode prealloc queue.")
    gauge("num_decode_transfer_queue_reqs", c["transfer"], "The number of requests in the decode transfer queue.")
    counter("prompt_tokens", e.c_prompt, "Number of prefill tokens processed.")
    counter("generation_tokens", e.c_gen, "Number of generation tokens processed.")
    counter("num_requests", e.c_requests, "Number of requests processed.")
    counter("num_aborted_requests", e.c_aborted, "Number of requests aborted.", split=False, from_first=True)
    counter("num_bootstrap_failed_reqs", e.c_bootstrap_failed, "Number of bootstrap failed requests.", labels=sl, split=False, from_first=True)
    counter("num_transfer_failed_reqs", e.c_transfer_failed, "Number of transfer failed requests.", labels=sl, split=False, from_first=True)
    hist("time_to_first_token_seconds", e.h_ttft, "Histogram of time to first token in seconds.")
    hist("e2e_request_latency_seconds", e.h_e2e, "Histogram of End-to-end request latency in seconds")
    hist("inter_token_latency_seconds", e.h_itl, "Histogram of inter-token latency in seconds.")
    return "\n".join(out) + "\n"
