"""The sim's timing model, set by PDOPS_SIM_* environment variables (docs/sim.md).

- Prefill: one compute stream per instance, FIFO. A prompt of n tokens is computed in
  chunks of ``--chunked-prefill-size`` tokens; each chunk takes
  ``chunk / PREFILL_TOKENS_PER_S + PREFILL_CHUNK_OVERHEAD_MS``. Queued prompts wait.
- Decode: one step loop per instance; every running request gets one token per step.
  A step with batch b takes ``DECODE_STEP_MS + DECODE_STEP_PER_REQ_MS * b``, so
  throughput b / step(b) plateaus at 1000 / DECODE_STEP_PER_REQ_MS tokens/s while the
  wait to enter the batch (``--max-running-requests``) and TTFT keep rising.
- KV hand-off: ``KV_BYTES_PER_TOKEN * prompt_tokens`` real bytes over TCP, paced to
  ``KV_BANDWIDTH_GBPS`` (0 = as fast as the socket goes).
- ``JITTER`` (fraction) scales each duration by a factor drawn from a RNG seeded with
  ``SEED`` and the request id: same seed, same request, same times.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, fields


def env_float(env, name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"pdops.sim: {name}={raw!r} is not a number") from None


@dataclass(frozen=True)
class TimingModel:
    prefill_tokens_per_s: float = 200_000.0
    prefill_chunk_overhead_ms: float = 1.0
    decode_step_ms: float = 4.0
    decode_step_per_req_ms: float = 0.02
    kv_bytes_per_token: float = 1024.0
    kv_bandwidth_gbps: float = 0.0
    jitter: float = 0.0
    seed: int = 0
    startup_s: float = 0.3
    max_running_default: int = 1024
    max_total_tokens: int = 1_000_000

    @classmethod
    def from_env(cls, env=None) -> "TimingModel":
        """Read every PDOPS_SIM_<FIELD> (upper case) from ``env`` (default os.environ)."""
        env = os.environ if env is None else env
        values = {}
        for f in fields(cls):
            default = f.default
            v = env_float(env, "PDOPS_SIM_" + f.name.upper(), float(default))
            values[f.name] = int(v) if isinstance(default, int) else v
        return cls(**values)

    def rng(self, rid: str) -> random.Random:
        return random.Random(f"{self.seed}:{rid}")

    def _jit(self, rng: random.Random | None) -> float:
        if not self.jitter or rng is None:
            return 1.0
        return max(0.0, 1.0 + rng.uniform(-self.jitter, self.jitter))

    def prefill_chunks(self, n_tokens: int, chunk_size: int | None, rng=None) -> list[float]:
        """Seconds per prefill chunk for a prompt of ``n_tokens``."""
        chunk = chunk_size if chunk_size and chunk_size > 0 else max(n_tokens, 1)
        out = []
        left = max(n_tokens, 1)
        while left > 0:
            c = min(chunk, left)
            left -= c
            out.append((c / self.prefill_tokens_per_s + self.prefill_chunk_overhead_ms / 1000) * self._jit(rng))
        return out

    def decode_step_s(self, batch: int) -> float:
        """Seconds one decode step takes with ``batch`` running requests."""
        return (self.decode_step_ms + self.decode_step_per_req_ms * batch) / 1000

    def kv_bytes(self, n_tokens: int) -> int:
        return int(self.kv_bytes_per_token * max(n_tokens, 1))

    def kv_transfer_s(self, n_bytes: int) -> float:
        """Minimum seconds a KV payload of ``n_bytes`` takes at the configured bandwidth."""
        if self.kv_bandwidth_gbps <= 0:
            return 0.0
        return n_bytes / (self.kv_bandwidth_gbps * 1e9)
