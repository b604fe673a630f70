"""`inv capacity`: sizing arithmetic for a PD deployment, every input shown, every assumption named.

From the model shape (profile `model_shape`) and measured per-instance rates:

- KV bytes per token  = 2 (K and V) x layers x KV heads x head dim x bytes per element
- KV bytes per request = KV bytes per token x tokens
- KV transfer a busy prefill instance needs = its prefill rate (tokens/s) x KV bytes per token,
  compared with the NICs that serve the instance's GPUs in the inventory
- prefill instances for a TTFT target at an arrival rate: each instance an M/D/1 queue
  (Poisson arrivals split evenly, one prefill at a time at the measured rate):
  TTFT = service + rho x service / (2 (1 - rho)) + KV transfer time; the smallest count that meets the target
- decode instances for a TPOT target: decode step time linear in batch size
  (step = a + b x batch, fitted from measurements); the largest batch within the TPOT
  target (and within the instance's KV memory, if given); streams in decode by Little's
  law = arrival rate x output tokens x TPOT target
- the resulting P:D ratio and GPU count.

Note on the second field report: its 70B example (80 layers, 8 KV heads, head dim 128,
4K tokens, FP16) claims "about 10.5 GB" per request, but its own formula gives
2 x 80 x 8 x 128 x 4096 x 2 = 1,342,177,280 bytes = 1.25 GiB. 10 GiB is what 64 KV
heads (no GQA) would give. pdops computes from the formula; the unit tests pin both.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction

from pdops.errors import InvalidInput

GIB = 1024 ** 3


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype_bytes: float

    @classmethod
    def from_dict(cls, d: dict, where: str = "profile.model_shape") -> "ModelShape":
        fix = "set model_shape: {layers, kv_heads, head_dim, kv_dtype_bytes} in the profile"
        if not isinstance(d, dict) or not d:
            raise InvalidInput(where, "missing", fix=fix)
        vals = {}
        for k in ("layers", "kv_heads", "head_dim", "kv_dtype_bytes"):
            v = d.get(k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise InvalidInput(f"{where}.{k}", f"must be a positive number, got {v!r}", fix=fix)
            vals[k] = v
        return cls(**vals)


def kv_bytes_per_token(shape: ModelShape) -> float:
    """2 (K and V) x layers x KV heads x head dim x bytes per element."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * shape.kv_dtype_bytes


def kv_bytes_per_request(shape: ModelShape, tokens: int) -> float:
    """KV bytes of one request holding `tokens` tokens."""
    return kv_bytes_per_token(shape) * tokens


def md1_wait(rho: float, service_s: float) -> float:
    """Mean queueing wait of an M/D/1 queue (Pollaczek-Khinchine): rho x s / (2 (1 - rho))."""
    if rho >= 1:
        return math.inf
    return rho * service_s / (2 * (1 - rho))


def nics_per_instance(inv) -> int:
    """RDMA NICs serving one instance's GPUs (first slot of the first host; whole hosts when it spans)."""
    g = inv.profile.gpus_per_instance
    h = inv.hosts[0]
    if g > h.gpu_count:
        return len(h.nics) * (g // h.gpu_count)
    return len({n.device for n in h.nics for gpu in range(g) if gpu in n.gpus})


@dataclass
class CapacityInputs:
    """Everything the arithmetic uses; each is printed with the result."""

    shape: ModelShape
    input_tokens: int
    output_tokens: int
    arrival_rate: float  # requests/s
    ttft_target_s: float
    tpot_target_s: float
    prefill_tokens_per_s: float  # per prefill instance, measured
    decode_step_ms: float  # decode step time at batch 0 (fit of measurements)
    decode_step_per_req_ms: float  # added step time per running request
    gpus_per_instance: int
    nic_gbps: float | None = None  # line rate of one NIC (the inventory does not record it)
    nics_per_instance: int | None = None
    nic_efficiency: float = 0.8
    decode_kv_budget_gib: float | None = None  # KV memory one decode instance can hold

    def validate(self) -> None:
        for name in ("input_tokens", "output_tokens", "arrival_rate", "ttft_target_s", "tpot_target_s",
                     "prefill_tokens_per_s", "gpus_per_instance"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or math.isinf(v):
                raise InvalidInput(f"--{name.replace('_', '-')}", f"must be a positive number, got {v!r}",
                                   fix="give a measured, positive value")
        for name in ("decode_step_ms", "decode_step_per_req_ms"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v < 0 or math.isinf(v):
                raise InvalidInput(f"--{name.replace('_', '-')}", f"must be 0 or more, got {v!r}",
                                   fix="fit step = a + b x batch from two decode measurements")
        if self.decode_step_per_req_ms == 0 and self.decode_kv_budget_gib is None:
            raise InvalidInput("--decode-step-per-req-ms", "0 leaves the decode batch unbounded",
                               fix="give the measured per-request step cost, or --decode-kv-gib to bound the batch")
        if not 0 < self.nic_efficiency <= 1:
            raise InvalidInput("--nic-efficiency", f"must be in (0, 1], got {self.nic_efficiency}", fix="e.g. 0.8")
        for name in ("nic_gbps", "nics_per_instance", "decode_kv_budget_gib"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not v > 0):
                raise InvalidInput(f"--{name.replace('_', '-')}", f"must be positive, got {v!r}", fix="or leave it out")


@dataclass
class CapacityReport:
    inputs: dict
    assumptions: list[str]
    results: dict
    verdict: str
    problems: list[str] = field(default_factory=list)

    def render(self) -> str:
        lines = ["inputs:"]
        lines += [f"  {k} = {v}" for k, v in self.inputs.items()]
        lines.append("assumptions:")
        lines += [f"  - {a}" for a in self.assumptions]
        lines.append("results:")
        for k, v in self.results.items():
            lines.append(f"  {k} = {v}")
        lines += [f"problem: {p}" for p in self.problems]
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)


def _gib(b: float) -> str:
    return f"{b:,.0f} B ({b / GIB:.3f} GiB)"


def plan_capacity(ci: CapacityInputs) -> CapacityReport:
    """Size prefill and decode pools for the inputs. Pure arithmetic."""
    ci.validate()
    kvt = kv_bytes_per_token(ci.shape)
    kv_in = kv_bytes_per_request(ci.shape, ci.input_tokens)
    kv_full = kv_bytes_per_request(ci.shape, ci.input_tokens + ci.output_tokens)
    assumptions = [
        "KV bytes per token = 2 x layers x kv_heads x head_dim x kv_dtype_bytes (K and V, every layer; "
        "no KV compression, no MLA latent sharing beyond what model_shape states)",
        "a prefill instance serves one request at a time at the measured rate (FIFO); requests arrive as a "
        "Poisson stream split evenly over the prefill instances (M/D/1 per instance)",
        "TTFT = prefill service + queueing wait + KV transfer of the prompt's KV (first decode step not counted)",
        "decode step time is linear in the batch: step = decode_step_ms + decode_step_per_req_ms x batch",
        "streams held by decode = arrival rate x output tokens x TPOT target (Little's law)",
        "the prefix cache is cold (every prompt is computed in full)",
    ]
    problems: list[str] = []
    res: dict = {
        "kv_bytes_per_token": f"{kvt:,.0f} B ({kvt / 1024:.1f} KiB)",
        "kv_bytes_per_request_prompt": _gib(kv_in),
        "kv_bytes_per_request_prompt_plus_output": _gib(kv_full),
    }
    # -- KV transfer
    need_bps = ci.prefill_tokens_per_s * kvt
    res["kv_transfer_per_busy_prefill_instance"] = f"{need_bps / 1e9:.2f} GB/s ({need_bps * 8 / 1e9:.1f} Gbit/s)"
    pool_bps = ci.arrival_rate * kv_in
    res["kv_transfer_pool_average"] = f"{pool_bps / 1e9:.2f} GB/s ({pool_bps * 8 / 1e9:.1f} Gbit/s)"
    t_kv = 0.0
    if ci.nic_gbps and ci.nics_per_instance:
        have = ci.nic_gbps * 1e9 / 8 * ci.nics_per_instance * ci.nic_efficiency
        assumptions.append(f"usable NIC bandwidth = line rate x {ci.nic_efficiency:g} (protocol and congestion "
                           "overhead); the instance's NICs share its KV traffic evenly")
        res["nic_bandwidth_per_instance"] = (f"{have / 1e9:.2f} GB/s usable ({ci.nics_per_instance} x "
                                             f"{ci.nic_gbps:g} Gbit/s x {ci.nic_efficiency:g})")
        res["nic_sufficient"] = have >= need_bps
        if have < need_bps:
            problems.append(f"a busy prefill instance produces {need_bps / 1e9:.2f} GB/s of KV but its NICs carry "
                            f"{have / 1e9:.2f} GB/s: the transfer, not the GPU, sets the prefill rate")
        t_kv = kv_in / have
        res["kv_transfer_time_per_request"] = f"{t_kv:.3f} s"
    else:
        assumptions.append("KV transfer time not counted in TTFT: NIC line rate or NIC count unknown "
                           "(give --nic-gbps and an inventory)")
        res["nic_sufficient"] = "unknown (no NIC line rate given)"
    # -- prefill
    s = ci.input_tokens / ci.prefill_tokens_per_s
    res["prefill_service_s"] = f"{s:.3f} s ({ci.input_tokens:,} tokens / {ci.prefill_tokens_per_s:,.0f} tokens/s)"
    n_p: int | None = None
    if s + t_kv > ci.ttft_target_s:
        problems.append(f"one request's prefill ({s:.2f} s) plus KV transfer ({t_kv:.2f} s) already exceeds the TTFT "
                        f"target ({ci.ttft_target_s:g} s): no number of instances meets it; a faster instance "
                        "(more GPUs per instance) or a shorter input is needed")
    else:
        load = ci.arrival_rate * s
        n = max(1, math.floor(load) + 1)
        while n < 1_000_000:
            rho = load / n
            if s + md1_wait(rho, s) + t_kv <= ci.ttft_target_s:
                break
            n += 1
        n_p = n
        rho = load / n
        res["prefill_load_erlangs"] = f"{load:.2f} (arrival rate x service)"
        res["prefill_instances"] = n_p
        res["prefill_utilization"] = f"{rho:.1%}"
        res["ttft_expected_s"] = f"{s + md1_wait(rho, s) + t_kv:.3f} s (target {ci.ttft_target_s:g} s)"
    # -- decode
    n_d: int | None = None
    tpot_ms = ci.tpot_target_s * 1000
    b_tpot = math.inf if ci.decode_step_per_req_ms == 0 else math.floor(
        (tpot_ms - ci.decode_step_ms) / ci.decode_step_per_req_ms)
    b_kv = math.inf
    if ci.decode_kv_budget_gib:
        b_kv = math.floor(ci.decode_kv_budget_gib * GIB / kv_full)
        res["decode_batch_by_kv_memory"] = b_kv
    res["decode_batch_by_tpot"] = b_tpot if b_tpot != math.inf else "unbounded"
    b = min(b_tpot, b_kv)
    if b < 1:
        problems.append(f"a decode instance cannot hold one stream within the TPOT target ({ci.tpot_target_s:g} s: "
                        f"step at batch 1 is {ci.decode_step_ms + ci.decode_step_per_req_ms:.1f} ms) or its KV memory")
    else:
        streams = ci.arrival_rate * ci.output_tokens * ci.tpot_target_s
        n_d = max(1, math.ceil(streams / b))
        res["decode_streams_in_flight"] = f"{streams:.1f}"
        res["decode_batch_per_instance"] = b
        res["decode_instances"] = n_d
    if n_p and n_d:
        fr = Fraction(n_p, n_d)
        res["pd_ratio"] = f"{n_p}:{n_d} (= {fr.numerator}:{fr.denominator})"
        res["topology"] = f"{n_p}p{n_d}d"
        res["gpus"] = (n_p + n_d) * ci.gpus_per_instance
        verdict = (f"{n_p}p{n_d}d = {(n_p + n_d) * ci.gpus_per_instance} GPUs for {ci.arrival_rate:g} req/s of "
                   f"{ci.input_tokens:,}/{ci.output_tokens:,} tokens at TTFT <= {ci.ttft_target_s:g} s, "
                   f"TPOT <= {ci.tpot_target_s:g} s; a model to check with `inv sweep`, not a measurement")
    else:
        verdict = "no topology meets the targets with these rates (see problems)"
    inputs = {k: v for k, v in asdict(ci).items() if k != "shape"}
    inputs.update({f"model_shape.{k}": v for k, v in asdict(ci.shape).items()})
    return CapacityReport(inputs, assumptions, res, verdict, problems)


__all__ = ["ModelShape", "kv_bytes_per_token", "kv_bytes_per_request", "md1_wait", "nics_per_instance",
           "CapacityInputs", "CapacityReport", "plan_capacity", "GIB"]
