"""The sim's memory model (docs/sim.md): the field report's probes T1..T6 (000, section 5: 380K-token
prompts, four at once, on the report's bundles) replay on a sim prefill x decode pair with the
report's pattern of outcomes, and an OOM is logged as SGLang's scheduler logs one."""

from __future__ import annotations

import re

import pytest
import yaml

from pdops.remote.loadgen import send_pair
from pdops.sim.memory import GIB, MemoryModel
from pdops.sim.testing import free_port
from pdops.model.prompts import make_prompt
from tests.sim.conftest import FAST

from pathlib import Path

LAB = yaml.safe_load((Path(__file__).resolve().parents[2] / "pdops/profiles/lab-sim.yml").read_text())
MEMORY_ENV = {**{k: v for k, v in LAB["env"].items() if k.startswith("PDOPS_SIM_")},
              "PDOPS_SIM_GPU_MEMORY_GIB": str(LAB["gpu_memory_gib"]),
              "PDOPS_SIM_PREFILL_TOKENS_PER_S": "20000000", "PDOPS_SIM_KV_BYTES_PER_TOKEN": "1"}
PROMPT = 380_000

# the report's table: bundle, and what each probe's four requests did
REPORT = {
    "T1": ({"chunked-prefill-size": 16384}, ["ok", "oom", "oom", "oom"]),
    "T2": ({"chunked-prefill-size": 16384, "mem-fraction-static": 0.75}, ["oom"] * 4),
    "T3": ({"chunked-prefill-size": 16384, "mem-fraction-static": 0.50}, ["ok", "oom", "oom", "oom"]),
    "T4": ({"chunked-prefill-size": 16384, "mem-fraction-static": 0.50, "context-length": 524288},
           ["ok", "oom", "oom", "oom"]),
    # T4 + max-running 2, with a transfer fault in the window: the report's "OOM + transfer failure"
    "T5": ({"chunked-prefill-size": 16384, "mem-fraction-static": 0.50, "context-length": 524288,
            "max-running-requests": 2}, ["transfer", "oom", "oom", "oom"]),
    "T6": ({"chunked-prefill-size": 8192, "mem-fraction-static": 0.50, "context-length": 524288,
            "max-running-requests": 4}, ["ok"] * 4),
}
BASELINE = {"chunked-prefill-size": 4096, "max-prefill-tokens": 4096, "mem-fraction-static": 0.60,
            "context-length": 1048576}


def _flags(bundle: dict) -> list[str]:
    out = []
    for k, v in {**BASELINE, **bundle}.items():
        out += [f"--{k}", str(v)]
    return out


def _kind(row) -> str:
    text = f"{row.error or ''} {row.extra.get('prefill', {}).get('error') or ''}"
    if row.ok:
        return "ok"
    if "CUDA out of memory" in text:
        return "oom"
    if "KV transfer failed" in text:
        return "transfer"
    return row.status


@pytest.mark.parametrize("probe", sorted(REPORT))
def test_the_reports_probes_replay_with_its_pattern(sims, probe):
    bundle, want = REPORT[probe]
    bport = free_port()
    env = {**MEMORY_ENV, **({"PDOPS_SIM_FAULTS": "fail_transfer_above=100000"} if probe == "T5" else {})}
    p = sims(["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bport), *_flags(bundle)], env)
    d = sims(["--disaggregation-mode", "decode", *_flags(bundle)], MEMORY_ENV)
    rows = send_pair(p.url, d.url, "127.0.0.1", bport, requests=4, concurrency=4, max_new_tokens=4,
                     prompt_for=lambda i: make_prompt(PROMPT, i), timeout=120)
    # the four are sent at once: which of them the scheduler admits first (the one that is served, or
    # whose transfer fails) is its pick, so the pattern is what happened to the four, in any order
    assert sorted(_kind(r) for r in rows) == sorted(want), [(r.status, r.error) for r in rows]
    log = p.proc.log()
    if "oom" in want:
        # SGLang's scheduler traceback, innermost frame the indexer's, PyTorch's message with the size
        assert "Scheduler hit an exception" in log and "in _low_ratio_index_topk_extend" in log
        sizes = {f"{a / GIB:.2f}" for a in MemoryModel(gpu_gib=1).chunk_allocations(PROMPT, bundle["chunked-prefill-size"])}
        tried = re.findall(r"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate (\d+\.\d\d) GiB", log)
        assert len(tried) == want.count("oom") and set(tried) <= sizes  # the chunk's c x n bytes
    else:
        assert "OutOfMemoryError" not in log


def test_a_bundle_without_room_for_a_kv_pool_does_not_start(sims):
    # 0.30 x 40 GiB - 8 GiB weights - 4 GiB of context buffers (1M tokens) leaves no pool
    h = sims(["--mem-fraction-static", "0.30", "--context-length", "1048576"], MEMORY_ENV, ready=False)
    assert h.proc.wait(15) == 1
    assert "Not enough memory. Please try to increase --mem-fraction-static" in h.proc.log()


def test_the_model_in_numbers():
    m = MemoryModel(gpu_gib=40, weights_gib=8, reserved_gib=9.5, kv_bytes_per_token=16384,
                    context_bytes_per_token=4096, fraction=0.5, context_length=524288)
    assert m.workspace_gib == pytest.approx(10.5)
    assert m.pool_tokens == int((20 - 8 - 2) * GIB / 16384)
    # the chunk allocation grows with the chunk and the prefix: c x n bytes
    assert m.chunk_allocations(10, 4) == [4 * 4, 4 * 8, 2 * 10]
    assert max(m.chunk_allocations(PROMPT, 16384)) == 2 * max(m.chunk_allocations(PROMPT, 8192))
    assert MemoryModel.from_env(type("A", (), {"all": {}, "context_length": None})(), {}) is None
