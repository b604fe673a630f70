"""Orphaned halves (pdops.reads.orphans): a prefill's open requests that no decode holds, read from the
engines' request logs with each host's clock; what `inv status` says of them. No hosts."""

from __future__ import annotations

import json
import types

import pytest

from pdops.reads import orphans
from pdops.steps import orphans as ending
from pdops.steps.orphans import abort_orphans
from pdops.model.inventory import load_inventory
from pdops.model.placement import place
from pdops.model.topology import parse_topology
from tests.unit.observed import obs
from tests.unit.recorded import REPO


def test_a_half_no_decode_holds_is_orphaned_once_held_past_the_grace():
    found = orphans.classify({"p01": {"a": 30.0, "b": 30.0, "c": 1.0, "d": None}, "p02": {"e": 12.0}},
                             {"b"}, now=1000.0, timeout_s=300)
    # a: no decode holds it; b: a decode does; c: too young to conclude; d: no readable stamp
    assert [(o.prefill, o.rid, o.ends_by) for o in found["p01"]] == [("p01", "a", 1270.0)]
    assert [o.rid for o in found["p02"]] == ["e"]


def test_a_half_cut_just_now_is_read_again_once_old_enough_to_conclude_on():
    """Right after a fault the halves it cut are younger than the grace: the end step waits until the
    youngest unpaired one is GRACE_S old (a paired one or one already past the grace asks no wait)."""
    assert orphans.unsettled({"p01": {"a": 1.5, "b": 0.5, "c": 30.0}}, {"b"}) == pytest.approx(3.5)
    assert orphans.unsettled({"p01": {"b": 0.5, "c": 30.0, "d": None}}, {"b"}) == 0.0


def test_one_past_its_timeout_ends_now():
    [o] = orphans.classify({"p01": {"a": 400.0}}, set(), now=1000.0, timeout_s=300)["p01"]
    assert o.ends_by == 1000.0


def log_line(event, rid, stamp):
    return json.dumps({"timestamp": stamp, "event": event, "rid": rid})


class Pool:
    """Answers `systemctl show -p InvocationID` and the dated request-log read per unit."""

    def __init__(self, logs: dict[str, list[str]], now: str = "2026-12-02T10:00:30.000000"):
        self.logs, self.now = logs, now

    def run(self, host, command, timeout=60):
        assert "--since -360s" in command  # the bootstrap timeout and a minute: a small read
        unit = next(u for u in self.logs if u in command)
        return types.SimpleNamespace(stdout=self.now + "\n" + "\n".join(self.logs[unit]) + "\n", stderr="")


def test_the_age_comes_from_the_engine_hosts_own_clock():
    inv = load_inventory(REPO / "inventory" / "lab")
    pl = place(inv, parse_topology("1p1d"))
    p, d = pl.get("p01"), pl.get("d01")
    pool = Pool({p.units[0][1]: [log_line("request.received", "held", "2026-12-02T10:00:00"),
                                 log_line("request.received", "paired", "2026-12-02T10:00:10"),
                                 log_line("request.received", "done", "2026-12-02T10:00:01"),
                                 log_line("request.finished", "done", "2026-12-02T10:00:02")],
                 d.units[0][1]: [log_line("request.received", "paired", "2026-12-02T10:00:10")]})
    assert orphans.open_requests(pool, p) == {"held": 30.0, "paired": 20.0}
    r = orphans.read(pool, pl, inv)
    assert [o.rid for o in r.orphans["p01"]] == ["held"] and r.unknown == [] and r.unsettled_s == 0.0


def test_a_decode_log_that_cannot_be_read_concludes_nothing():
    from pdops.errors import Unreachable

    inv = load_inventory(REPO / "inventory" / "lab")
    pl = place(inv, parse_topology("1p1d"))
    p, d = pl.get("p01"), pl.get("d01")

    class Half(Pool):
        def run(self, host, command, timeout=60):
            if host == d.head.host:
                raise Unreachable(f"{host}: no route")
            return super().run(host, command, timeout)

    r = orphans.read(Half({p.units[0][1]: [log_line("request.received", "held", "2026-12-02T10:00:00")]}), pl, inv)
    assert r.orphans == {} and "d01: request log unreadable" in r.unknown[0]


def test_an_orphan_whose_rid_prefixes_another_open_request_is_named_not_aborted(monkeypatch):
    inv = load_inventory(REPO / "inventory" / "lab")
    p = place(inv, parse_topology("1p1d")).get("p01")
    sent = []
    monkeypatch.setattr(ending, "http_json", lambda m, url, body, timeout: sent.append(body["rid"]) or (200, {}))
    o = [orphans.Orphan("p01", "req-1", 30.0, None), orphans.Orphan("p01", "req-2", 30.0, None)]
    ended, left = abort_orphans(p, o, {"req-1", "req-10", "req-2"})
    assert ended == ["req-2"] and sent == ["req-2"] and "prefix" in left[0]


def test_status_calls_a_prefill_with_orphans_degraded_and_names_them():
    from pdops.reads.status import judge

    o = obs(place(load_inventory(REPO / "inventory" / "lab"), parse_topology("1p1d")).get("p01"))
    h = judge(o, gateway_down=False, loads_error=None, failures={}, strays=[],
              orphans=[orphans.Orphan("p01", "r1", 40.0, 1_800_000_000.0)])
    assert h.state == "degraded" and h.action.startswith("inv end-orphans")
    assert h.reasons[0].startswith("1 orphaned request(s) waiting for a decode side that is gone")
    assert "r1; they end by timeout at" in h.reasons[0]
    assert judge(o, gateway_down=False, loads_error=None, failures={}, strays=[]).state == "ok"


@pytest.mark.parametrize("bad", ["x", None])
def test_a_bootstrap_timeout_that_is_not_a_number_falls_back_to_sglangs_default(bad):
    inv = types.SimpleNamespace(profile=types.SimpleNamespace(env={"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": bad}))
    assert orphans.bootstrap_timeout_s(inv) == 300.0
