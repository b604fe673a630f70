"""pdops.model.capacity: KV sizes, transfer bandwidth, prefill/decode sizing, against the reports' examples."""

from __future__ import annotations

import pytest
from invoke import Context
from invoke.exceptions import Exit

from pdops.model import capacity as cap
from pdops.errors import InvalidInput

LLAMA70B = cap.ModelShape(layers=80, kv_heads=8, head_dim=128, kv_dtype_bytes=2)


def test_kv_size_of_the_second_reports_70b_example():
    # Report 002: 80 layers, 8 KV heads (GQA), head dim 128, 4K tokens, FP16.
    assert cap.kv_bytes_per_token(LLAMA70B) == 327_680  # 320 KiB per token
    per_req = cap.kv_bytes_per_request(LLAMA70B, 4096)
    assert per_req == 2 * 80 * 8 * 128 * 4096 * 2 == 1_342_177_280
    assert per_req / cap.GIB == 1.25
    # The report prints "about 10.5 GB": that is what 64 KV heads (no GQA) give, 8x the formula it quotes.
    mha = cap.ModelShape(80, 64, 128, 2)
    assert cap.kv_bytes_per_request(mha, 4096) / cap.GIB == 10.0
    assert cap.kv_bytes_per_request(mha, 4096) / 1e9 == pytest.approx(10.7, abs=0.05)


def test_model_shape_from_the_profiles():
    from pdops.model.inventory import load_profile

    glm = cap.ModelShape.from_dict(load_profile("glm-flash-80k").model_shape)
    assert cap.kv_bytes_per_token(glm) == 2 * 46 * 8 * 128 * 2
    with pytest.raises(InvalidInput, match="kv_heads"):
        cap.ModelShape.from_dict({"layers": 4, "kv_heads": 0, "head_dim": 128, "kv_dtype_bytes": 2})
    with pytest.raises(InvalidInput, match="missing"):
        cap.ModelShape.from_dict({})


def _inputs(**kw):
    base = dict(shape=LLAMA70B, input_tokens=4096, output_tokens=600, arrival_rate=30.0, ttft_target_s=0.5,
                tpot_target_s=0.05, prefill_tokens_per_s=4096 / 0.3, decode_step_ms=10.0,
                decode_step_per_req_ms=0.1, gpus_per_instance=8)
    base.update(kw)
    return cap.CapacityInputs(**base)


def test_prefill_sizing_counts_queueing_the_report_ignored():
    # Report 002: 300 ms per prefill, TTFT SLO 500 ms, 30 QPS -> "10 GPUs" (3 req/s each, 90% busy).
    rep = cap.plan_capacity(_inputs())
    # M/D/1: 0.3 + rho * 0.3 / (2 (1 - rho)) <= 0.5  <=>  rho <= 4/7, so n >= 9 / (4/7) = 15.75.
    assert rep.results["prefill_instances"] == 16
    assert cap.md1_wait(9 / 16, 0.3) + 0.3 <= 0.5 < cap.md1_wait(9 / 15, 0.3) + 0.3
    assert any("M/D/1" in a for a in rep.assumptions)


def test_kv_transfer_bandwidth_and_nic_check():
    # Report 002: a prefill doing 5 x 4K requests/s. Its KV is 6.71 GB/s (the report's 52.5 GB/s uses its 8x size).
    rep = cap.plan_capacity(_inputs(prefill_tokens_per_s=5 * 4096, nic_gbps=200, nics_per_instance=2))
    assert rep.results["kv_transfer_per_busy_prefill_instance"].startswith("6.71 GB/s")
    assert rep.results["nic_sufficient"] is True  # 2 x 200 Gbit/s x 0.8 = 40 GB/s
    assert "kv_transfer_time_per_request" in rep.results
    slow = cap.plan_capacity(_inputs(prefill_tokens_per_s=5 * 4096, nic_gbps=25, nics_per_instance=1))
    assert slow.results["nic_sufficient"] is False
    assert any("the transfer, not the GPU" in p for p in slow.problems)
    unknown = cap.plan_capacity(_inputs())
    assert unknown.results["nic_sufficient"].startswith("unknown")
    assert any("KV transfer time not counted" in a for a in unknown.assumptions)


def test_decode_sizing_ratio_and_gpus():
    rep = cap.plan_capacity(_inputs())
    # step = 10 + 0.1 b <= 50 ms -> b = 400; streams = 30 x 600 x 0.05 = 900 -> 3 instances.
    assert rep.results["decode_batch_per_instance"] == 400
    assert rep.results["decode_instances"] == 3
    assert rep.results["topology"] == "16p3d" and rep.results["gpus"] == 19 * 8
    assert rep.results["pd_ratio"].startswith("16:3")
    # KV memory binds first when smaller: 40 GiB / (4696 tokens x 320 KiB) = 27 streams.
    kv = cap.plan_capacity(_inputs(decode_kv_budget_gib=40))
    assert kv.results["decode_batch_per_instance"] == 27 and kv.results["decode_instances"] == 34


def test_every_input_and_assumption_is_shown():
    rep = cap.plan_capacity(_inputs(nic_gbps=200, nics_per_instance=2))
    text = rep.render()
    # the KV transfer time (1.25 GiB over 40 GB/s) now counts in TTFT: more prefills than without NICs
    assert rep.results["topology"] == "18p3d"
    for name in ("arrival_rate = 30.0", "ttft_target_s = 0.5", "prefill_tokens_per_s", "decode_step_ms = 10.0",
                 "model_shape.layers = 80", "model_shape.kv_heads = 8", "nic_efficiency = 0.8",
                 "assumptions:", "Little's law", "kv_transfer_time_per_request = 0.034 s",
                 "verdict: 18p3d = 168 GPUs"):
        assert name in text


def test_targets_no_topology_can_meet():
    rep = cap.plan_capacity(_inputs(ttft_target_s=0.2))
    assert "prefill_instances" not in rep.results
    assert any("no number of instances meets it" in p for p in rep.problems)
    assert rep.verdict.startswith("no topology")
    rep = cap.plan_capacity(_inputs(tpot_target_s=0.005))
    assert any("cannot hold one stream" in p for p in rep.problems)


@pytest.mark.parametrize("kw,field", [({"arrival_rate": 0}, "--arrival-rate"), ({"ttft_target_s": -1}, "--ttft-target-s"),
                                      ({"nic_efficiency": 1.5}, "--nic-efficiency"),
                                      ({"decode_step_per_req_ms": 0}, "--decode-step-per-req-ms"),
                                      ({"nic_gbps": -5}, "--nic-gbps")])
def test_bad_capacity_inputs(kw, field):
    with pytest.raises(InvalidInput) as e:
        cap.plan_capacity(_inputs(**kw))
    assert e.value.field == field


def test_nics_per_instance_from_the_inventory(fleet):
    assert cap.nics_per_instance(fleet) == 2  # TP8 on a host whose GPUs 0-3 / 4-7 sit behind mlx5_0 / mlx5_1


def test_capacity_task_prints_inputs_and_maps_bad_input_to_exit_2(capsys):
    from pdops.cli import bench as cli

    cli.capacity(Context(), arrival_rate="0.5", ttft_target="60", tpot_target="0.05", prefill_tps="20000",
                 decode_step_ms="20", decode_step_per_req_ms="0.2", profile="glm-flash-80k", workload="80k/600")
    out = capsys.readouterr().out
    assert "input_tokens = 80000" in out and "model_shape.layers = 46" in out and "verdict:" in out
    with pytest.raises(Exit) as e:
        cli.capacity(Context(), arrival_rate="fast", ttft_target="60", tpot_target="0.05", prefill_tps="20000",
                     decode_step_ms="20", decode_step_per_req_ms="0.2", profile="glm-flash-80k")
    assert e.value.code == 2
    assert "invalid input: --arrival-rate" in capsys.readouterr().err


def test_sweep_and_bench_tasks_refuse_bad_input_with_exit_2(capsys, monkeypatch, tmp_path):
    from pdops.cli import bench as cli
    from pdops.record.local import StateDir

    # the fleet's record is on a host off this machine: the sweep's plan reads a local one instead
    monkeypatch.setattr(cli.rec, "open_record", lambda inv, **kw: StateDir(inv.cluster, tmp_path / "state"))

    with pytest.raises(Exit) as e:
        cli.sweep(Context(), budget="96", ratios="2:1", concurrency="0", inventory="inventory/rtx6000d", dry_run=True)
    assert e.value.code == 2 and "--concurrency" in capsys.readouterr().err
    with pytest.raises(Exit) as e:
        cli.sweep(Context(), budget="12", ratios="2:1", concurrency="8", inventory="inventory/rtx6000d", dry_run=True)
    assert e.value.code == 2 and "--budget" in capsys.readouterr().err
    cli.sweep(Context(), budget="96", ratios="2:1,5:1", concurrency="16,32", inventory="inventory/rtx6000d",
              dry_run=True)
    assert "5:1 -> 10p2d" in capsys.readouterr().out
    with pytest.raises(Exit) as e:
        cli.bench(Context(), concurrency="4", workload="160k", requests="1", inventory="inventory/rtx6000d")
    assert e.value.code == 2 and "--workload" in capsys.readouterr().err
