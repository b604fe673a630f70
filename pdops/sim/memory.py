"""The sim's GPU memory model (off unless PDOPS_SIM_GPU_MEMORY_GIB is set): where a real engine
would run out of memory, the sim fails the request with an OOM-shaped log.

Per GPU, in GiB (docs/sim.md, "Memory model"); M is the profile's GPU memory:

- static region ``f * M`` (``--mem-fraction-static`` f) holds the weights W, buffers sized by
  ``--context-length`` L (``L * CONTEXT_BYTES_PER_TOKEN``) and the KV pool: pool tokens =
  ``(f*M - W - L*b_ctx) / KV_BYTES_PER_TOKEN``. No room for a pool: the engine exits at start-up
  ("Not enough memory"). A request needing more tokens than the pool holds is refused (400).
- workspace ``(1 - f) * M - RESERVED`` (CUDA graphs, NCCL, runtime take RESERVED). Each prefill
  chunk of c tokens ending at prefix length n allocates ``c * n * INDEXER_BYTES_PER_SCORE`` (a
  sparse-attention indexer's score buffer), which grows with ``--chunked-prefill-size``. It fails
  (OOM) when it exceeds the workspace less what is retained.
- retained: after a long prefill, ``RETAINED_RATIO`` x its peak allocation stays reserved (the
  caching allocator's split blocks) while other requests are queued on the engine; it is given
  back when the engine has no request left. So with k long requests sent at once, the first can
  fit while the next ones do not: the field report's "1/4 ok, 3/4 OOM".

The numbers are the model's, not a claim about a real model on a real GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pdops.sim.timing import env_float as _num

GIB = 1 << 30


@dataclass(frozen=True)
class MemoryModel:
    gpu_gib: float  # M
    weights_gib: float = 0.0
    reserved_gib: float = 0.0
    kv_bytes_per_token: float = 16384.0
    context_bytes_per_token: float = 0.0
    indexer_bytes_per_score: float = 1.0
    retained_ratio: float = 1.0
    fraction: float = 0.88  # --mem-fraction-static (SGLang picks one by GPU size when absent)
    context_length: int = 0
    oom_frame: str = "_low_ratio_index_topk_extend"
    oom_file: str = "python/sglang/srt/layers/attention/nsa/nsa_indexer.py"

    @classmethod
    def from_env(cls, args, env=None) -> "MemoryModel | None":
        env = os.environ if env is None else env
        m = _num(env, "PDOPS_SIM_GPU_MEMORY_GIB", 0.0)
        if m <= 0:
            return None
        flags = getattr(args, "all", {}) or {}
        frac = flags.get("mem_fraction_static")
        return cls(gpu_gib=m,
                   weights_gib=_num(env, "PDOPS_SIM_WEIGHTS_GIB", 0.0),
                   reserved_gib=_num(env, "PDOPS_SIM_RESERVED_GIB", 0.0),
                   kv_bytes_per_token=_num(env, "PDOPS_SIM_KV_POOL_BYTES_PER_TOKEN", 16384.0),
                   context_bytes_per_token=_num(env, "PDOPS_SIM_CONTEXT_BYTES_PER_TOKEN", 0.0),
                   indexer_bytes_per_score=_num(env, "PDOPS_SIM_INDEXER_BYTES_PER_SCORE", 1.0),
                   retained_ratio=_num(env, "PDOPS_SIM_RETAINED_RATIO", 1.0),
                   fraction=float(frac) if frac is not None else 0.88,
                   context_length=int(args.context_length or 0),
                   oom_frame=env.get("PDOPS_SIM_OOM_FRAME") or cls.oom_frame,
                   oom_file=env.get("PDOPS_SIM_OOM_FILE") or cls.oom_file)

    # -- the static region
    @property
    def pool_gib(self) -> float:
        return (self.fraction * self.gpu_gib - self.weights_gib
                - self.context_length * self.context_bytes_per_token / GIB)

    @property
    def pool_tokens(self) -> int:
        return max(int(self.pool_gib * GIB / self.kv_bytes_per_token), 0)

    # -- the workspace
    @property
    def workspace_gib(self) -> float:
        return (1.0 - self.fraction) * self.gpu_gib - self.reserved_gib

    def startup_error(self) -> str | None:
        """SGLang's start-up refusals, where the model has no room."""
        if self.pool_gib <= 0:
            return ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
                    f"(model: {self.fraction:g} x {self.gpu_gib:g} GiB - weights {self.weights_gib:g} GiB - "
                    f"context buffers {self.context_length * self.context_bytes_per_token / GIB:.2f} GiB "
                    "leaves no KV pool)")
        if self.workspace_gib <= 0:
            return (f"torch.OutOfMemoryError: CUDA out of memory while capturing CUDA graphs (model: "
                    f"{1 - self.fraction:.2f} x {self.gpu_gib:g} GiB - reserved {self.reserved_gib:g} GiB leaves "
                    "no workspace)")
        return None

    def chunk_allocations(self, prompt_tokens: int, chunk: int | None) -> list[int]:
        """Bytes each prefill chunk allocates for the indexer's scores: c x prefix x b."""
        c = chunk if chunk and chunk > 0 else max(prompt_tokens, 1)
        out, done = [], 0
        while done < prompt_tokens:
            k = min(c, prompt_tokens - done)
            done += k
            out.append(int(k * done * self.indexer_bytes_per_score))
        return out

    def oom(self, alloc: int, retained: int) -> dict:
        """The numbers of a CUDA OOM for an allocation of `alloc` bytes with `retained` held."""
        total = self.gpu_gib * GIB
        free = max(self.workspace_gib * GIB - retained, 0)
        return {"alloc_gib": alloc / GIB, "total_gib": self.gpu_gib, "free_gib": free / GIB,
                "in_use_gib": (total - free) / GIB, "reserved_unallocated_gib": retained / GIB}


def oom_message(n: dict, gpu: int = 0) -> str:
    """PyTorch's CUDA OOM message (torch.OutOfMemoryError, torch 2.x c10/cuda/CUDACachingAllocator.cpp)."""
    return (f"CUDA out of memory. Tried to allocate {n['alloc_gib']:.2f} GiB. GPU {gpu} has a total capacity of "
            f"{n['total_gib']:.2f} GiB of which {n['free_gib']:.2f} GiB is free. Including non-PyTorch memory, this "
            f"process has {n['in_use_gib']:.2f} GiB memory in use. Of the allocated memory "
            f"{n['in_use_gib'] - n['reserved_unallocated_gib']:.2f} GiB is allocated by PyTorch, and "
            f"{n['reserved_unallocated_gib']:.2f} GiB is reserved by PyTorch but unallocated. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


def oom_traceback(model: MemoryModel, rid: str, message: str) -> str:
    """A scheduler's traceback shaped as SGLang logs one (innermost frame last): the request's forward
    through the model to the configured top frame."""
    base = "/usr/local/lib/python3.12/dist-packages/sglang"
    frames = [
        (f"{base}/srt/managers/scheduler.py", 2847, "event_loop_overlap_disagg_prefill", "result = self.run_batch(batch)"),
        (f"{base}/srt/managers/scheduler.py", 2105, "run_batch", "batch_result = self.model_worker.forward_batch_generation("),
        (f"{base}/srt/model_executor/model_runner.py", 2293, "forward_extend", "return self.model.forward("),
        (f"{base}/srt/models/deepseek_v2.py", 3012, "forward", "hidden_states = self.model(input_ids, positions, forward_batch)"),
        (f"{base}/srt/layers/attention/nsa/nsa_indexer.py", 655, "forward", "return self._forward_extend(q, k, forward_batch)"),
        (f"{base}/{model.oom_file.removeprefix('python/sglang/')}", 412, model.oom_frame,
         "scores = torch.empty((q.shape[0], k.shape[0]), dtype=torch.float8_e4m3fn, device=q.device)"),
    ]
    lines = [f"Scheduler hit an exception while running request {rid}: Traceback (most recent call last):"]
    for f, ln, fn, code in frames:
        lines.append(f'  File "{f}", line {ln}, in {fn}')
        lines.append(f"    {code}")
    lines.append(f"torch.OutOfMemoryError: {message}")
    return "\n".join(lines)
