"""Two patches that let real SGLang 0.5.23's PD prefill run with Mooncake on a CPU (lab only;
docs/lab.md). Python runs this file at start because the lab puts this folder on the engine's
PYTHONPATH; it changes nothing unless SGLANG_USE_CPU_ENGINE=1 and torch has no CUDA.

- MooncakeKVSender.supports_host_tensor_indices is set False when its module loads: with it True the
  prefill copies page indices into pinned memory (disaggregation/prefill.py: pin_memory=True needs an
  accelerator) and records a CUDA event; False takes SGLang's plain page-index path.
- torch.cuda.Event becomes an object whose record/wait/synchronize do nothing (prefill.py also
  records one under the overlap scheduler): on a CPU every step has finished when it returns.
"""

import importlib.abc
import os
import sys

_PATCHED = {
    "sglang.srt.disaggregation.mooncake.conn": "_patch_mooncake_sender",
    "sglang.srt.disaggregation.prefill": "_patch_cuda_event",
}


def _patch_mooncake_sender(module) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


class _CpuEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        return None

    def wait(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True


def _patch_cuda_event(module) -> None:
    import torch

    if not torch.cuda.is_available():
        torch.cuda.Event = _CpuEvent


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module
        patch = globals()[_PATCHED[name]]

        def exec_then_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    sys.meta_path.insert(0, _PatchAfterLoad())
