"""Gateway /workers parser (samples: tests/data/facts/gateway.source, real smg 1.13 output)."""

import json
from pathlib import Path

import pytest

from pdops.errors import Unverified
from pdops.facts import gateway

DATA = Path(__file__).resolve().parents[2] / "data" / "facts"


def load(name):
    return (DATA / name).read_text()


def test_parse_pd_workers_ready():
    ws = gateway.parse(load("smg_workers_pd.json"))
    assert sorted(w.worker_type for w in ws) == ["decode", "decode", "prefill"]
    [p] = [w for w in ws if w.worker_type == "prefill"]
    assert p.bootstrap_port and p.status == "ready" and p.routable
    assert p.metadata["disaggregation_mode"] == "prefill"
    assert all(w.routable and w.bootstrap_port is None for w in ws if w.worker_type == "decode")
    assert gateway.by_url(ws, p.url + "/") == [p]


def test_draining_worker_is_listed_but_not_routable():
    ws = gateway.parse(load("smg_workers_draining.json"))
    draining = [w for w in ws if w.status == "draining"]
    assert len(draining) == 1 and not draining[0].routable and not draining[0].is_healthy
    assert sum(w.routable for w in ws) == 2
    gone = gateway.parse(load("smg_workers_gone.json"))
    assert draining[0].url not in {w.url for w in gone} and len(gone) == 2


def test_unhealthy_and_pending():
    ws = gateway.parse(load("smg_workers_unhealthy.json"))
    assert {w.worker_type: (w.status, w.routable) for w in ws} == {"decode": ("not_ready", False),
                                                                    "prefill": ("ready", True)}
    pending = gateway.parse_worker(load("smg_worker_pending.json"))
    assert pending.status == "pending" and not pending.routable


def test_parse_empty_and_bad():
    assert gateway.parse('{"workers":[],"total":0,"stats":{}}') == []
    with pytest.raises(Unverified):
        gateway.parse('{"error":"nope"}')
    with pytest.raises(Unverified):
        gateway.parse(json.dumps({"workers": [{"url": "x"}]}))
