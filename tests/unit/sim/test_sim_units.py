"""Unit tests of the sim's pure parts: tokens, timing model, flags, faults."""

from __future__ import annotations

import pytest

from pdops.sim.args import parse_args
from pdops.model.sim_faults import parse_faults
from pdops.sim.procs import scheduler_titles
from pdops.sim.timing import TimingModel
from pdops.model.prompts import count_tokens, make_prompt

RENDERED = (
    "--model-path /models/m --served-model-name m --host 10.0.0.5 --port 30000 --tp-size 8 --pp-size 1 "
    "--ep-size 8 --disaggregation-mode prefill --disaggregation-transfer-backend mooncake "
    "--disaggregation-bootstrap-port 8998 --disaggregation-ib-device {\"0\":\"mlx5_0\",\"1\":\"mlx5_1\"} "
    "--disaggregation-decode-allocation-policy early --chunked-prefill-size 8192 --mem-fraction-static 0.5 "
    "--context-length 524288 --max-running-requests 4 --enable-metrics --log-requests --trust-remote-code "
    "--api-key K --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.4:5000"
).split()


@pytest.mark.parametrize("n", [0, 1, 7, 2000, 131072])
def test_make_prompt_round_trips(n):
    assert count_tokens(make_prompt(n, seed=3)) == n
    assert make_prompt(n, 3) == make_prompt(n, 3)


def test_make_prompt_seed_changes_text():
    assert make_prompt(50, 1) != make_prompt(50, 2)


def test_rendered_flags_are_accepted_and_used():
    a = parse_args(RENDERED, env={})
    assert (a.mode, a.tp_size, a.nnodes, a.node_rank, a.local_ranks) == ("prefill", 8, 2, 1, 4)
    assert (a.api_key, a.bootstrap_port, a.max_running_requests, a.chunked_prefill_size) == ("K", 8998, 4, 8192)
    assert a.enable_metrics and a.served_model_name == "m" and a.context_length == 524288


@pytest.mark.parametrize(
    "bad",
    [["--bogus"], ["--pp", "1"], ["--disaggregation-mode", "both"], ["--tp-size", "eight"],
     ["--disaggregation-decode-tp", "4"]],
)
def test_flags_sglang_rejects_are_rejected(bad):
    with pytest.raises(SystemExit) as e:
        parse_args(["--model-path", "m", *bad], env={})
    assert e.value.code == 2


def test_missing_model_path_is_rejected():
    with pytest.raises(SystemExit) as e:
        parse_args(["--port", "1"], env={})
    assert e.value.code == 2


def test_abbreviation_like_argparse():
    assert parse_args(["--model-path", "m", "--tp", "2"], env={}).tp_size == 2


def test_launch_checks():
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], env={})


def test_timing_from_env_and_plateau_shape():
    t = TimingModel.from_env({"PDOPS_SIM_DECODE_STEP_MS": "10", "PDOPS_SIM_DECODE_STEP_PER_REQ_MS": "0.5", "PDOPS_SIM_SEED": "4"})
    assert t.decode_step_ms == 10 and t.seed == 4
    tput = [b / t.decode_step_s(b) for b in (1, 8, 64, 512, 4096)]
    assert tput == sorted(tput) and tput[-1] < 1000 / 0.5  # rises, plateaus below 1/k
    assert tput[-1] / tput[-2] < 1.15


def test_prefill_chunks_and_jitter_are_deterministic():
    t = TimingModel(prefill_tokens_per_s=1000, prefill_chunk_overhead_ms=0, jitter=0.2, seed=1)
    a = t.prefill_chunks(2500, 1000, t.rng("r1"))
    assert len(a) == 3 and a == t.prefill_chunks(2500, 1000, t.rng("r1"))
    assert a != t.prefill_chunks(2500, 1000, t.rng("r2"))
    assert TimingModel(kv_bandwidth_gbps=1).kv_transfer_s(10**9) == 1.0


def test_faults_parse():
    f = parse_faults("fail_transfer, hang_room=12,crash_child=2")
    assert f.fail_transfer and f.hangs(12) and not f.hangs(13) and f.crash_child == 2.0
    assert not parse_faults("").fail_transfer
    with pytest.raises(ValueError):
        parse_faults("explode")


def test_scheduler_titles_like_sglang():
    assert scheduler_titles(1, 1, 1, 0) == ["sglang::scheduler"]
    assert scheduler_titles(4, 1, 2, 1) == ["sglang::scheduler_TP2", "sglang::scheduler_TP3"]
    assert scheduler_titles(2, 2, 1, 0)[-1] == "sglang::scheduler_PP1_TP1"


def test_a_request_aborted_before_its_task_first_runs_still_ends_and_says_so():
    """A client gone before the response's headers (the gateway dropping a prefill leg whose decode
    leg failed) aborts the request at once. It must leave the engine and log request.finished like any
    abort: before the fix it stayed open in the request log for good, an orphan no /abort_request ended."""
    import asyncio

    from pdops.sim.engine import Engine

    args = parse_args(["--model-path", "m", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                       "18998"], env={})

    async def go():
        e = Engine(args, TimingModel(), parse_faults(""))
        req = e.submit({"rid": "gone", "bootstrap_room": 7}, True, 10, 4)
        e.abort(req)  # in the same step as the submit: the task has not run yet
        await asyncio.wait_for(req.done.wait(), 5)
        return e, req

    e, req = asyncio.run(go())
    assert req.finish_reason["type"] == "abort" and "gone" not in e.reqs
