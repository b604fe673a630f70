"""Stand-in for sgl_kernel (lab, real SGLang on CPU only; docs/lab.md).

SGLang's CPU path imports kernels from Intel's CPU build of sgl-kernel, which no package index
holds. One of them runs on every allocation and is written here in plain torch; every other name
exists so that `from sgl_kernel import X` succeeds, and raises if it is ever called. With no
`torch.ops.sgl_kernel` registered, SGLang's layers take their `forward_native` paths."""

from __future__ import annotations

import torch

__version__ = "0.0.0+pdops-lab-standin"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Write each request's new token slots into its row of the req-to-token table: request i's
    slots start_offset[i]:end_offset[i] get the next (end - start) entries of out_cache_loc, taken
    in request order (what SGLang's Triton kernel `assign_req_to_token_pool` does on a GPU)."""
    del pool_len  # the row length; a torch view knows it
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[taken:taken + n].to(req_to_token.dtype)
        taken += n


class _NotHere:
    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{self._name}: not in the pdops lab's stand-in (only "
                           "assign_req_to_token_pool_cpu is); the CPU build of sgl-kernel has it")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _NotHere(name)
