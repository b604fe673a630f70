"""Engine /v1/loads and /metrics (samples: tests/data/facts/engine.source)."""

import json
import math
import shlex
from pathlib import Path

import pytest

from pdops.errors import Unverified
from pdops.facts import engine

DATA = Path(__file__).resolve().parents[2] / "data" / "facts"


def loads(name):
    return engine.parse_loads((DATA / name).read_text())


def test_commands_quote_url():
    argv = shlex.split(engine.loads_command("http://10.0.0.5:30000/"))
    assert argv[-1] == "http://10.0.0.5:30000/v1/loads?include=all"
    assert shlex.split(engine.metrics_command("http://h:1"))[-1] == "http://h:1/metrics"


def test_prefill_with_only_inflight_kv_is_not_idle():
    el = loads("engine_loads_prefill_inflight.json")
    r = el.ranks[0]
    assert r.mode == "prefill" and r.waiting == 0 and r.running == 0
    assert r.prefill_inflight == 2
    assert not r.is_idle and not el.is_idle
    assert el.busy() == {0: {"prefill_inflight": 2}}
    assert el.version == "0.5.23"


def test_decode_idle_over_two_dp_ranks():
    el = loads("engine_loads_decode_idle.json")
    assert [r.dp_rank for r in el.ranks] == [0, 1]
    assert el.is_idle and el.busy() == {}


def test_decode_busy_counts():
    el = loads("engine_loads_decode_busy.json")
    assert el.busy()[0] == {"running": 3, "waiting": 2, "decode_prealloc": 1, "decode_transfer": 1}
    assert el.total("running") == 3


def test_loads_without_disaggregation_section_cannot_prove_idle():
    with pytest.raises(Unverified, match="include=all"):
        loads("engine_loads_core_only.json")


def test_loads_garbage_and_empty():
    with pytest.raises(Unverified):
        engine.parse_loads("<html>502</html>")
    with pytest.raises(Unverified):
        engine.parse_loads(json.dumps({"loads": []}))


def test_parse_metrics_labels_values_and_escapes():
    m = engine.parse_metrics((DATA / "engine_metrics_prefill.txt").read_text())
    series = m["sglang:num_prefill_inflight_queue_reqs"]
    assert len(series) == 2
    labels, value = series[1]
    assert labels["tp_rank"] == "1" and labels["engine_type"] == "prefill" and value == 3.0
    assert engine.counter(m, "sglang:num_requests_total") == 1207.0
    assert engine.counter(m, "sglang:num_transfer_failed_reqs_total") == 2.0
    (lab, v), = m["sglang:gen_throughput"]
    assert lab["model_name"] == 'glm "flash"\\x' and math.isnan(v)
    types = engine.metric_types((DATA / "engine_metrics_prefill.txt").read_text())
    assert types["sglang:num_requests_total"] == "counter"


def test_engine_queues_prefill_counts_inflight_once_across_tp_ranks():
    q = engine.EngineQueues.from_metrics(
        engine.parse_metrics((DATA / "engine_metrics_prefill.txt").read_text()))
    assert q.engine_type == "prefill"
    assert q.prefill_inflight == 3  # two tp ranks mirror the same 3 requests
    assert q.missing == [] and not q.is_idle
    assert q.busy() == {"prefill_inflight": 3}


def test_engine_queues_sum_dp_ranks_and_ignore_priority_breakdown():
    q = engine.EngineQueues.from_metrics(
        engine.parse_metrics((DATA / "engine_metrics_decode_dp_priority.txt").read_text()))
    assert q.running == 5  # 4 (dp0 total, not 4+3+1) + 1 (dp1)
    assert q.decode_transfer == 2
    assert not q.is_idle


def test_engine_queues_missing_gauge_is_not_idle():
    text = (DATA / "engine_metrics_prefill.txt").read_text()
    text = "\n".join(ln for ln in text.splitlines() if "inflight" not in ln)
    text = text.replace("} 3.0", "} 0.0")
    q = engine.EngineQueues.from_metrics(engine.parse_metrics(text))
    assert q.prefill_inflight is None
    assert q.missing == ["sglang:num_prefill_inflight_queue_reqs"]
    assert not q.is_idle


def test_metrics_all_zero_is_idle():
    text = (DATA / "engine_metrics_prefill.txt").read_text().replace("} 3.0", "} 0.0")
    assert engine.EngineQueues.from_metrics(engine.parse_metrics(text)).is_idle


def test_bad_metrics_line():
    with pytest.raises(Unverified):
        engine.parse_metrics("sglang:x{a=\"1\"} notanumber\n")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_parsers_read_the_real_engines_own_answers(role):
    """Recorded from real SGLang 0.5.23 in the lab (tests/data/facts/engine.source): every queue gauge
    the drain and status read is there, labelled with its engine type, and idle; the failure counters
    are absent (created at their first increment) and read as 0; /v1/loads names the mode and every queue."""
    text = (DATA / f"real_metrics_{role}_idle.txt").read_text()
    m = engine.parse_metrics(text)
    q = engine.EngineQueues.from_metrics(m)
    assert q.missing == [] and q.is_idle and q.engine_type == role
    for name in ("sglang:num_bootstrap_failed_reqs_total", "sglang:num_transfer_failed_reqs_total",
                 "sglang:num_aborted_requests_total"):
        assert name not in m and engine.counter(m, name) == 0
    assert engine.counter(m, "sglang:num_requests_total") >= 1  # the deploy's canary
    el = engine.parse_loads((DATA / f"real_loads_{role}_idle.json").read_text())
    assert el.version == "0.5.23" and [r.mode for r in el.ranks] == [role] and not el.busy()
