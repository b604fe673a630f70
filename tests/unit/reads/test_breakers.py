"""Serving means routable: smg's circuit breakers, read from its /metrics (the real smg 1.13.0's text,
tests/data/facts/smg_metrics_cb_open.txt: a decode SIGKILLed under requests opened its breaker and the
healthy prefill's), count in every judgement pdops makes of "serving"; no host."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pdops.facts import gateway as gw
from pdops.facts.gateway import Breaker, Worker
from pdops.model.placement import place
from pdops.model.topology import parse_topology
from pdops.reads.observation import GatewayObservation, InstanceObservation, Observation, Seen
from tests.unit.observed import obs, unit, word

DATA = Path(__file__).resolve().parents[2] / "data" / "facts"


def test_the_breakers_of_the_real_gateway_after_a_decode_died():
    text = (DATA / "smg_metrics_cb_open.txt").read_text()
    b = gw.parse_breakers(text)
    assert len(b) == 2  # the prefill and the decode
    # the PD router counts each failed request against both legs: the healthy prefill's opened too
    assert {x.state for x in b.values()} == {gw.OPEN}
    assert all(x.consecutive_failures == 10 and x.opened == 1 for x in b.values())
    # smg lists both healthy and ready all the same: only the breaker says they route nothing
    assert "smg_worker_health{" in text


def test_a_worker_routes_only_with_its_breaker_closed():
    w = Worker(id="w", url="http://127.0.10.2:30001/", worker_type="decode", is_healthy=True, load=0, status="ready")
    assert w.routable  # a client given no metrics address: /workers alone (tests, benches)
    closed = w.with_breaker({"http://127.0.10.2:30001": Breaker(gw.CLOSED)})
    assert closed.routable and closed.breaker_problem is None
    for state in (gw.OPEN, gw.HALF_OPEN, gw.REMOVED):
        x = w.with_breaker({"http://127.0.10.2:30001": Breaker(state, consecutive_failures=10)})
        assert not x.routable and x.breaker_problem.startswith(f"circuit {state}") and x.breaker_unknown is None
    # nothing assumed either way: a series not exported, or a /metrics that did not answer, is never said
    # to be closed, and never taken as open (nothing is removed or re-registered on it): it is said
    assert w.with_breaker({}).breaker_unknown == "its circuit breaker is not in the gateway's /metrics yet"
    unread = w.with_breaker(None, "connection refused")
    assert unread.breaker_problem is None and "could not be read (connection refused)" in unread.breaker_unknown
    assert closed.breaker_unknown is None


@pytest.fixture
def pl(lab_inv):
    return place(lab_inv, parse_topology("1p2d"))


def _open(o: InstanceObservation) -> InstanceObservation:
    w = o.workers["lab01"]
    return replace(o, workers={"lab01": w.with_breaker({w.url.rstrip("/"): Breaker(gw.OPEN, 10, 1)})})


def test_status_says_circuit_open_and_the_command_that_closes_it(pl):
    d01 = pl.get("d01")
    h = word(_open(obs(d01)))
    assert h.state == "degraded"
    assert h.reasons == ["circuit open after 10 consecutive failures in the gateway (it routes nothing to it)"]
    # its engine is healthy: no restart, a new registration
    assert h.action.startswith("inv deploy --topology") and "no restart" in h.action
    # with its engine unhealthy too, the engine is the matter: repair
    sick = _open(obs(d01, worker="not_ready", healthy=False))
    assert word(sick).action == "inv repair --instance d01"


def test_a_role_whose_only_ready_instance_has_an_open_circuit_serves_nothing(pl):
    """The planners' floors and the drain's refusal count from Seen: an open circuit is not serving."""
    d01, d02 = pl.get("d01"), pl.get("d02")
    o1, o2 = obs(d01), _open(obs(d02))
    g = GatewayObservation("lab01", unit(), None, [o1.workers["lab01"], o2.workers["lab01"]], ["d01", "d02"])
    seen = Seen.of(Observation(1, [g], [o1, o2]))
    assert "d01" not in seen.not_serving
    assert seen.not_serving["d02"].startswith("circuit open after 10 consecutive failures")


def test_a_drain_of_the_last_routable_decode_is_refused_with_the_reason(pl, lab_inv, tmp_path):
    from pdops.errors import Refused
    from pdops.model.render import manifest, render_files
    from pdops.ops.drain import plan_drain
    from pdops.record.local import StateDir

    state = StateDir("lab", tmp_path)
    rev = state.write_revision(topology="1p2d", inventory_hash=lab_inv.digest, placement=pl.to_dict(),
                               manifest=manifest(render_files(lab_inv, pl)), outcome="deployed",
                               instances={i.id: {"url": i.url, "worker_id": f"w-{i.id}"} for i in pl.instances})
    state.set_current(rev.number)
    seen = Seen(not_serving={"d02": "circuit open after 10 consecutive failures in the gateway"})
    with pytest.raises(Refused) as e:
        plan_drain(lab_inv, state, "d01", seen=seen)
    assert "last decode instance" in e.value.message
    assert "d02 observed not serving" in e.value.message
    # --force: no refusal, and no serving guard at leave-gateway either
    forced = plan_drain(lab_inv, state, "d01", seen=seen, force=True)
    leave = next(s for s in forced.steps if s.kind == "leave-gateway")
    assert leave.params["guard_s"] == 0
    # without --force the step waits for another routable decode, within a stated budget
    ok = plan_drain(lab_inv, state, "d01", seen=Seen())
    leave = next(s for s in ok.steps if s.kind == "leave-gateway")
    assert leave.params["guard_s"] == 30 and "until another decode is routable" in leave.description


def test_an_open_circuit_is_dated_from_the_first_look_that_saw_it(lab_inv, tmp_path, monkeypatch):
    """smg exports no time of opening: `inv status` says since when its own looks have seen it open, keeps
    that time across looks, forgets it once closed, and a read-only look (`inv repair` deciding) keeps none."""
    import time as _time

    from pdops.reads import looks

    monkeypatch.setattr(looks, "look_path", lambda inv: tmp_path / "look.json")
    k = "lab01 http://127.0.10.3:30001"
    assert looks.breakers_open_since(lab_inv, {k: "open"}, write=False) and not (tmp_path / "look.json").exists()
    first = looks.breakers_open_since(lab_inv, {k: "open"})[k]
    _time.sleep(0.01)
    assert looks.breakers_open_since(lab_inv, {k: "half-open"})[k] == first  # still not closed: same start
    assert looks.breakers_open_since(lab_inv, {}) == {}  # closed: forgotten
    assert looks.breakers_open_since(lab_inv, {k: "open"})[k] > first  # opened again: a new start


def test_a_gateway_whose_metrics_do_not_answer_is_a_finding_and_no_worker_is_taken_as_open(pl):
    d01 = pl.get("d01")
    o = obs(d01)
    w = o.workers["lab01"].with_breaker(None, "connection refused")
    g = GatewayObservation("lab01", unit(), None, [w], ["d01"])
    assert any("circuit breaker could not be read (connection refused): whether it routes to its workers is not known"
               in f for f in g.findings(1, []))
    o2 = replace(o, workers={"lab01": w})
    assert o2.gateway_problem is None and not o2.breaker_only  # not "circuit open": no re-registration offered
    assert "d01" not in Seen.of(Observation(1, [g], [o2])).not_serving  # no restart planned on a guess


def test_a_repair_moves_the_status_baseline_past_the_fault_it_named(lab_inv, pl, tmp_path, monkeypatch):
    """`move_baseline` (the repair's status-baseline step): what rose since the last look is returned (named
    with the fault), and both the last look and the one `inv repair` decides from become the counters now."""
    import types

    from pdops.reads import looks

    monkeypatch.setattr(looks, "look_path", lambda inv: tmp_path / "look.json")
    counters = {"d01": 1, "d02": 0, "p01": 0}
    monkeypatch.setattr(looks, "engine_reads", lambda inst: (None, {"bootstrap_failed": counters[inst.id]}))
    monkeypatch.setattr(looks, "gateway_counters", lambda node: {})
    pool = types.SimpleNamespace(unit_states=lambda host, units: {u: types.SimpleNamespace(main_pid=7) for u in units})
    looks.counter_deltas(lab_inv, {i: {"pid": 7, "counters": {"bootstrap_failed": 0}} for i in counters})  # a look
    counters["d02"] = 1  # the fault raised d02's counter
    assert looks.move_baseline(lab_inv, pool, pl) == {"d02": {"bootstrap_failed": 1}, "d01": {"bootstrap_failed": 1}}
    seen = {i: {"pid": 7, "counters": {"bootstrap_failed": counters[i]}} for i in counters}
    assert looks.counter_deltas(lab_inv, seen, write=False)["d02"] == {"bootstrap_failed": 0}  # repair's baseline
    assert looks.counter_deltas(lab_inv, seen)["d02"] == {"bootstrap_failed": 0}  # status's
