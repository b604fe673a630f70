"""`inv status`'s state words and `inv repair`'s plan, decided from observation; no host: the
observation is built here as pdops.reads.observe makes it, the status document as collect_status does."""

from __future__ import annotations

import json

import pytest

from pdops.ops import repair as rp
from pdops.errors import InvalidInput, Refused
from pdops.facts import requestlog
from pdops.model.placement import place
from pdops.record.local import StateDir
from pdops.model.topology import parse_topology
from tests.unit.observed import obs, unit, word


@pytest.fixture
def d01(lab_inv):
    return place(lab_inv, parse_topology("1p2d")).get("d01")


def test_each_state_word_from_what_was_observed(d01):
    assert word(obs(d01)).state == "ok" and word(obs(d01)).action is None
    down = word(obs(d01, state=unit("activating", "auto-restart")))
    assert down.state == "down" and "auto-restart" in down.reasons[0] and down.action == "inv repair --instance d01"
    r = word(obs(d01, state=unit(pid=222, restarts=1)))
    assert r.state == "restarted" and "MainPID 222, recorded 100 (restarts: 1)" in r.reasons[0]
    assert word(obs(d01, worker=None)).state == "not registered"
    assert word(obs(d01), gateway_down=True).state == "not registered"
    assert word(obs(d01, worker="not_ready", healthy=False)).state == "degraded"
    f = word(obs(d01), failures={"transfer_failed": 3, "bootstrap_failed": 0})
    assert f.state == "degraded" and f.reasons == ["transfer_failed +3 since the last look"]
    s = word(obs(d01), strays=["lab03:u PID 7 (sglang::stray)"])
    assert s.state == "degraded" and "not under MainPID" in s.reasons[0]
    assert word(obs(d01), loads_error="timed out").state == "degraded"
    k0 = f"{d01.head.host}:{d01.units[0][1]}"
    unread = obs(d01, state="unreadable: lab02: connection failed")
    unread.units[k0] = "unreadable: lab02: connection failed"
    u = word(unread)
    assert u.state == "unknown" and u.action.startswith("check SSH to lab02")
    k = f"{d01.head.host}:{d01.units[0][1]}"
    st = word(obs(d01, running={k: "aaa"}, expected={k: "bbb"}))
    assert st.state == "degraded" and st.action.startswith("inv deploy")


def _journal(*entries):
    return "\n".join(json.dumps({"MESSAGE": m, "_SYSTEMD_INVOCATION_ID": inv}) for inv, m in entries)


def test_lost_work_is_what_an_ended_process_received_and_never_finished():
    rec = lambda rid: json.dumps({"event": "request.received", "rid": rid})  # noqa: E731
    fin = lambda rid, t="length": json.dumps({"event": "request.finished", "rid": rid,  # noqa: E731
                                              "out": {"meta_info": {"finish_reason": {"type": t}}}})
    out = _journal(("A", rec("r1")), ("A", rec("r2")), ("A", fin("r1")), ("A", "other log line"),
                   ("A", rec("r3")), ("A", fin("r3", "abort")), ("B", rec("r4")))
    logs = requestlog.by_invocation(out + "\nnot json")
    assert list(logs) == ["A", "B"]
    lost, failed = requestlog.lost_work(logs, current="B")
    assert lost == ["r2"] and failed == ["r3"]  # r4 is in flight on the running process: the drain's
    assert requestlog.lost_work(logs, current=None)[0] == ["r2", "r4"]  # unit down: every process ended
    # journald keeps a message with odd bytes as a list of ints
    raw = json.dumps({"MESSAGE": list(rec("r9").encode()), "_SYSTEMD_INVOCATION_ID": "C"})
    assert requestlog.by_invocation(raw)["C"].open == ["r9"]


@pytest.fixture
def live(lab_inv, tmp_path):
    from tests.unit.recorded import deployed

    state = StateDir("lab", tmp_path / "state")
    deployed(lab_inv, state, "1p2d")
    return state


def doc(**states):
    rows = []
    for iid, role in (("p01", "prefill"), ("d01", "decode"), ("d02", "decode")):
        s = states.get(iid, "ok")
        rows.append({"instance": iid, "role": role, "state": s, "reasons": [] if s == "ok" else [f"{iid} {s}"],
                     "registered": s not in ("down", "not registered"), "healthy": s in ("ok", "restarted")})
    return {"instances": rows}


def test_bad_instance_ids_are_refused_before_anything_is_read(lab_inv, live):
    for bad in (None, "", "x1", "d01; rm -rf /", "p1"):
        with pytest.raises(InvalidInput) as e:
            rp.check_instance_id(bad)
        assert "--instance" in e.value.render()
    with pytest.raises(InvalidInput) as e:
        rp.plan_repair(lab_inv, live, "d07", doc())
    assert "d07 is not an instance of revision 1" in e.value.message and "p01, d01, d02" in e.value.fix


def test_a_healthy_instance_is_a_no_op_that_says_so_unless_forced(lab_inv, live):
    said = rp.plan_repair(lab_inv, live, "d01", doc())
    assert isinstance(said, str) and "d01 is ok" in said and "--force" in said
    forced = rp.plan_repair(lab_inv, live, "d01", doc(), force=True)
    assert [i.id for i in forced.replaced] == ["d01"]


def test_the_last_serving_instance_of_its_role_is_refused_without_force(lab_inv, live):
    with pytest.raises(Refused) as e:
        rp.plan_repair(lab_inv, live, "p01", doc(p01="restarted"))
    assert "last serving prefill" in e.value.message and "--force" in e.value.fix
    assert rp.plan_repair(lab_inv, live, "p01", doc(p01="restarted"), force=True).repair["instance"] == "p01"
    # a prefill that is down serves nothing: repairing it takes nothing away
    assert rp.plan_repair(lab_inv, live, "p01", doc(p01="down")).repair["down"] is True


def test_a_repair_plan_restarts_that_one_instance_and_names_its_lost_work_first(lab_inv, live):
    plan = rp.plan_repair(lab_inv, live, "d01", doc(d01="restarted"))
    assert plan.operation == "repair" and not plan.added and not plan.removed
    assert [i.id for i in plan.kept] == ["p01", "d02"]
    names = [s.name for s in plan.run]
    lw = names.index("lost-work d01")
    assert lw < names.index("replace d01: leave-gateway") < names.index("replace d01: wait-empty") \
        < names.index("replace d01: verify-stop") < names.index("start d01") < names.index("canary d01") \
        < names.index("register d01") < names.index("verify-running") < names.index("record")
    assert plan.render().startswith("plan: repair d01 of lab (revision 1, 1p2d): observed restarted")


def test_a_down_instance_is_not_waited_for_and_a_prefill_takes_its_other_bootstrap_port(lab_inv, live):
    plan = rp.plan_repair(lab_inv, live, "p01", doc(p01="down"))
    names = [s.name for s in plan.run]
    assert "replace p01: leave-gateway" in names and "replace p01: verify-stop" in names
    assert not any(n.startswith("replace p01: wait-empty") or "empty-check" in n for n in names)
    old = plan.current_placement.get("p01")
    assert plan.target.get("p01").bootstrap_port != old.bootstrap_port
    assert "a port no decode has a cached route to" in plan.render()


def test_a_repair_refuses_an_inventory_that_renders_other_files(lab_inv, live, tmp_path):
    from tests.unit.recorded import edited

    from pdops.model.inventory import load_inventory

    def edit(doc):
        doc["all"]["vars"]["pdops_drain"]["budget_s"] = 33
    inv2 = load_inventory(edited(tmp_path, edit))
    with pytest.raises(Refused) as e:
        rp.plan_repair(inv2, live, "d01", doc(d01="restarted"))
    assert "renders other files than revision 1" in e.value.message and "inv deploy --topology 1p2d" in e.value.fix


def test_failures_count_since_the_last_look_and_repair_sees_what_that_look_showed(lab_inv, tmp_path, monkeypatch):
    from pdops.reads import looks as st

    monkeypatch.setattr(st, "look_path", lambda inv: tmp_path / "look.json")
    look = lambda n, pid=7, write=True: st.counter_deltas(  # noqa: E731
        lab_inv, {"d01": {"pid": pid, "counters": {"transfer_failed": n}}}, write=write)["d01"]["transfer_failed"]
    assert look(2) == 2  # first look at this process: since its start
    assert look(5) == 3 and look(5) == 0  # since the last look
    assert look(5, write=False) == 0
    assert look(9) == 4
    assert look(9, write=False) == 4  # repair: still the failures the last `inv status` showed
    assert look(1, pid=8) == 1  # another process: counted from its start


def test_a_repair_plans_from_what_serves_now_and_starts_a_gateway_that_does_not_answer(lab_inv, tmp_path):
    """d01 repaired while d02 is down and the gateway does not answer: the gateway starts first and
    waits for what serves (p01), and d02 is named and left as it is (not restarted). The canary pairs
    with a prefill that is down: tests/data/plans/repair_d01_with_p02_and_the_gateway_down_of_2p1d.yml."""
    from pdops.reads.observation import Seen
    from tests.unit.recorded import deployed

    state = StateDir("lab", tmp_path / "state")
    deployed(lab_inv, state, "1p2d")
    seen = Seen({"d01": "observed restarted", "d02": "units not running: lab03:x inactive/dead"},
                frozenset({"d02"}), {lab_inv.gateway.first.host: "pdops-gateway.service failed/failed"})
    plan = rp.plan_repair(lab_inv, state, "d01", doc(d01="restarted", d02="down"), seen=seen, force=True)
    assert [i.id for i in plan.replaced] == ["d01"] and not plan.added and not plan.removed
    names = [s.name for s in plan.run]
    assert names.index("gateway") < names.index("lost-work d01")
    gw = next(s for s in plan.run if s.name == "gateway")
    assert gw.params["wait_for"].keys() == {"p01"} and gw.params["restart"] is False
    text = plan.render()
    assert "observed: the gateway does not answer (pdops-gateway.service failed/failed): started first" in text
    assert "observed: d02 does not serve (units not running: lab03:x inactive/dead): not part of this change" in text


def test_inv_repair_plans_with_what_the_status_reading_saw(lab_inv, live, monkeypatch, capsys):
    """The task passes the Observation `inv status` judged to the planner: with the gateway observed
    down, the dry run starts it first (the planner alone, given no observation, would not)."""
    import pdops.record as rec
    from pdops.ops import repair as st  # the operation reads the status as `inv status` does
    from pdops.cli import core
    from pdops.reads.observation import Seen

    reading = object()
    monkeypatch.setattr(rec, "open_record", lambda inv, **kw: live)
    monkeypatch.setattr(st, "read_status", lambda inv, state, **kw: (doc(d01="not registered"), reading))
    monkeypatch.setattr(Seen, "of", classmethod(lambda cls, obs: Seen(
        {"d01": "observed not registered"} if obs is reading else {}, frozenset(),
        {lab_inv.gateway.first.host: "pdops-gateway.service failed/failed"})))
    core.repair.body(None, inventory=str(lab_inv.path), instance="d01", dry_run=True)
    out = capsys.readouterr().out
    assert "observed: the gateway does not answer (pdops-gateway.service failed/failed): started first" in out
    assert " gateway — " in out  # the gateway step is printed before the repair's own steps
