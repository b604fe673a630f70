"""SGLang engine load: ``GET /v1/loads?include=all`` and Prometheus ``GET /metrics``.

Shapes checked against the SGLang 0.5.23 source: ``srt/entrypoints/v1_loads.py`` and
``srt/managers/load_snapshot.py`` (LoadSnapshot / DisaggregationMetrics / QueueMetrics),
``srt/managers/scheduler_components/load_inquirer.py`` (which queues make up
``num_waiting_reqs``: on a prefill, waiting + bootstrap, NOT the inflight KV-sending
queue; on a decode, waiting + prealloc + transfer + retracted), and
``srt/observability/metrics_collector.py`` (gauge names and labels: model_name,
engine_type, tp_rank, pp_rank, moe_ep_rank, optional dp_rank and priority).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields

from pdops.errors import Unverified
from pdops.facts import q

LOADS_PATH = "/v1/loads?include=all"
METRICS_PATH = "/metrics"


def _curl(url: str, timeout: float) -> str:
    return f"curl -fsS --max-time {float(timeout):g} {q(url)}"


def loads_command(base_url: str, timeout: float = 5.0) -> str:
    """Fetch /v1/loads from the host itself (the engine may bind an address only it reaches)."""
    return _curl(base_url.rstrip("/") + LOADS_PATH, timeout)


def metrics_command(base_url: str, timeout: float = 5.0) -> str:
    return _curl(base_url.rstrip("/") + METRICS_PATH, timeout)


# --- /v1/loads ----------------------------------------------------------------------------

@dataclass(frozen=True)
class RankLoad:
    """Queue counts of one DP rank."""

    dp_rank: int
    mode: str  # prefill | decode | null
    running: int
    waiting: int  # num_waiting_reqs (see module docstring for what it includes)
    prefill_bootstrap: int
    prefill_inflight: int
    decode_prealloc: int
    decode_transfer: int
    retracted: int
    num_used_tokens: int
    token_usage: float

    def busy(self) -> dict[str, int]:
        """Non-zero queues; empty means this rank holds no request and no KV transfer."""
        names = ("running", "waiting", "prefill_bootstrap", "prefill_inflight",
                 "decode_prealloc", "decode_transfer", "retracted")
        return {n: getattr(self, n) for n in names if getattr(self, n)}

    @property
    def is_idle(self) -> bool:
        # the prefill inflight queue (KV still leaving) is counted on purpose:
        # num_waiting_reqs does not include it
        return not self.busy()


@dataclass(frozen=True)
class EngineLoads:
    version: str | None
    timestamp: str | None
    ranks: tuple[RankLoad, ...]

    @property
    def is_idle(self) -> bool:
        return bool(self.ranks) and all(r.is_idle for r in self.ranks)

    def busy(self) -> dict[int, dict[str, int]]:
        """{dp_rank: non-zero queues} for evidence."""
        return {r.dp_rank: r.busy() for r in self.ranks if r.busy()}

    def total(self, name: str) -> int:
        return sum(getattr(r, name) for r in self.ranks)


def _rank(d: dict) -> RankLoad:
    disagg = d.get("disaggregation")
    if not isinstance(disagg, dict):
        # without this section the KV-sending queue is invisible: idle cannot be proven
        raise Unverified(
            "/v1/loads answer has no 'disaggregation' section; query it with include=all",
            evidence=json.dumps(d)[:2000],
        )
    queues = d.get("queues") or {}
    try:
        return RankLoad(
            dp_rank=int(d.get("dp_rank", 0)),
            mode=str(disagg.get("mode", "null")),
            running=int(d["num_running_reqs"]),
            waiting=int(d["num_waiting_reqs"]),
            prefill_bootstrap=int(disagg.get("prefill_bootstrap_queue_reqs", 0)),
            prefill_inflight=int(disagg.get("prefill_inflight_queue_reqs", 0)),
            decode_prealloc=int(disagg.get("decode_prealloc_queue_reqs", 0)),
            decode_transfer=int(disagg.get("decode_transfer_queue_reqs", 0)),
            retracted=max(int(disagg.get("decode_retracted_queue_reqs", 0)),
                          int(queues.get("retracted", 0) or 0)),
            num_used_tokens=int(d.get("num_used_tokens", 0)),
            token_usage=float(d.get("token_usage", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise Unverified(f"/v1/loads rank entry lacks {e}", evidence=json.dumps(d)[:2000]) from e


def parse_loads(body: str | dict) -> EngineLoads:
    """Parse ``/v1/loads?include=all`` JSON into per-DP-rank queue counts."""
    try:
        data = json.loads(body) if isinstance(body, str) else body
        loads = data["loads"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        text = body if isinstance(body, str) else json.dumps(body)
        raise Unverified("engine /v1/loads answer is not the expected JSON", evidence=str(text)[-2000:]) from e
    if not loads:
        raise Unverified("engine /v1/loads lists no DP rank", evidence=json.dumps(data)[:2000])
    return EngineLoads(data.get("version"), data.get("timestamp"), tuple(_rank(x) for x in loads))


# --- Prometheus text exposition -----------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+(-?\d+))?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def _unescape_label(v: str) -> str:
    return re.sub(r'\\(.)', lambda m: "\n" if m.group(1) == "n" else m.group(1), v)


def _labels(text: str | None) -> dict[str, str]:
    if not text:
        return {}
    inner = text[1:-1]
    out, pos = {}, 0
    while pos < len(inner):
        m = _LABEL.match(inner, pos)
        if not m:
            if inner[pos:].strip(" ,"):
                raise Unverified(f"bad label set {text!r}")
            break
        out[m.group(1)] = _unescape_label(m.group(2))
        pos = m.end()
    return out


_SPECIAL = {"+Inf": math.inf, "Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}


def _value(v: str) -> float:
    try:
        return _SPECIAL[v] if v in _SPECIAL else float(v)
    except ValueError as e:
        raise Unverified(f"bad metric value {v!r}") from e


Metrics = dict  # {name: [(labels, value)]}


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Parse Prometheus text format 0.0.4 into ``{sample name: [(labels, value)]}``.

    Comments (# HELP, # TYPE) are skipped; counters keep their exposed ``_total`` name.
    """
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise Unverified(f"unparseable metrics line: {line[:200]!r}")
        out.setdefault(m.group(1), []).append((_labels(m.group(2)), _value(m.group(3))))
    return out


def metric_types(text: str) -> dict[str, str]:
    """``# TYPE name kind`` lines, e.g. {"sglang:num_running_reqs": "gauge"}."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "#" and parts[1] == "TYPE":
            out[parts[2]] = parts[3]
    return out


QUEUE_GAUGES = {
    "running": "sglang:num_running_reqs",
    "waiting": "sglang:num_queue_reqs",
    "prefill_bootstrap": "sglang:num_prefill_bootstrap_queue_reqs",
    "prefill_inflight": "sglang:num_prefill_inflight_queue_reqs",
    "decode_prealloc": "sglang:num_decode_prealloc_queue_reqs",
    "decode_transfer": "sglang:num_decode_transfer_queue_reqs",
}


@dataclass(frozen=True)
class EngineQueues:
    """Queue gauges of one engine, aggregated over its scheduler series.

    Series are grouped by ``dp_rank`` (distinct schedulers, summed); inside one DP rank the
    tp/pp ranks report the same requests (with --enable-metrics-for-all-schedulers), so
    the largest value is taken rather than a sum that would count a request TP times.
    Per-priority breakdown series (``priority`` label not empty) are ignored: the total
    is under ``priority=""``. A gauge absent from /metrics is None, and then the engine is
    not provably idle.
    """

    running: float | None
    waiting: float | None
    prefill_bootstrap: float | None
    prefill_inflight: float | None
    decode_prealloc: float | None
    decode_transfer: float | None
    engine_type: str | None = None

    @classmethod
    def from_metrics(cls, metrics: dict, engine_type: str | None = None) -> "EngineQueues":
        values: dict[str, float | None] = {}
        seen_types: set[str] = set()
        for field_name, metric in QUEUE_GAUGES.items():
            samples = [
                (lab, v) for lab, v in metrics.get(metric, [])
                if not lab.get("priority") and (engine_type is None or lab.get("engine_type") == engine_type)
            ]
            if not samples:
                values[field_name] = None
                continue
            per_dp: dict[str, float] = {}
            for lab, v in samples:
                seen_types.add(lab.get("engine_type", ""))
                key = lab.get("dp_rank", "0")
                per_dp[key] = max(per_dp.get(key, 0.0), v)
            values[field_name] = sum(per_dp.values())
        et = engine_type or (seen_types.pop() if len(seen_types) == 1 else None)
        return cls(engine_type=et, **values)

    @property
    def missing(self) -> list[str]:
        return [QUEUE_GAUGES[f.name] for f in fields(self)
                if f.name in QUEUE_GAUGES and getattr(self, f.name) is None]

    def busy(self) -> dict[str, float]:
        return {n: getattr(self, n) for n in QUEUE_GAUGES if getattr(self, n)}

    @property
    def is_idle(self) -> bool:
        """True only if every queue gauge is present and zero (incl. prefill inflight)."""
        return not self.missing and not self.busy()


def counter(metrics: dict, name: str) -> float:
    """Sum of a counter over all its series (0 if absent)."""
    return sum(v for _, v in metrics.get(name, []))


# What a real SGLang 0.5.23 prefill answers for a Mooncake session it saw fail (its decode stopped or
# died): it refuses every transfer to that session until its probe finds it alive again, every
# SGLANG_FAILED_SESSION_PROBE_INTERVAL_S, backing off to ..._MAX_INTERVAL_S (defaults 30 and 300 s).
# A decode started again at the same address takes the same session (seen in the lab: docs/sim.md).
FAILED_SESSION = "is not alive"
PROBE_MAX_ENV = "SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S"
# What a prefill answers when Mooncake could not write the KV to the decode. One cause seen in the lab: a
# decode started again under its old Mooncake name (host:RPC port) while the prefill keeps the old
# process's segment descriptor (Mooncake caches it for good unless MC_DISABLE_METACACHE or
# MC_TE_METADATA_REFRESH_INTERVAL_SECONDS): every send to it fails until the prefill restarts.
SEND_FAILED = "Failed to send kv chunk"


def failed_session_wait_s(env: dict) -> float:
    """The longest a prefill may refuse a decode's session it saw fail: its probe's longest interval."""
    try:
        return float(env.get(PROBE_MAX_ENV, 300.0))
    except (TypeError, ValueError):
        return 300.0
