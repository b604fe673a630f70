"""Gateway /workers parser (samples: tests/data/facts/gateway.source, real smg 0.3.2 output)."""

from pathlib import Path

import pytest

from pdops.errors import Unverified
from pdops.facts import gateway

DATA = Path(__file__).resolve().parents[1] / "data" / "facts"


def test_parse_pd_workers():
    ws = gateway.parse((DATA / "gateway_workers_pd.json").read_text())
    assert [w.worker_type for w in ws] == ["decode", "prefill"]
    d, p = ws
    assert d.id == "0f3662b1-3e98-4ef0-9117-64fedeec8a78" and d.url == "http://127.0.0.1:30101"
    assert d.is_healthy and d.load == 0 and d.bootstrap_port is None
    assert p.bootstrap_port == 8998 and p.metadata["disaggregation_mode"] == "prefill"
    assert gateway.by_url(ws, "http://127.0.0.1:30102/") == [p]


def test_parse_unhealthy():
    ws = gateway.parse((DATA / "gateway_workers_unhealthy.json").read_text())
    assert {w.worker_type: w.is_healthy for w in ws} == {"decode": False, "prefill": True}


def test_parse_empty_and_bad():
    assert gateway.parse('{"workers":[],"total":0,"stats":{}}') == []
    with pytest.raises(Unverified):
        gateway.parse('{"error":"nope"}')
    with pytest.raises(Unverified):
        gateway.parse('{"workers":[{"url":"x"}]}')
