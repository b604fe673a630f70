"""pdops.ops.operate: how every operation on a live cluster runs (no host: the connections and the
observation are stand-ins). Planned from the record before any connection, planned again from what
serves now, printed once, walked once with the plan it printed."""

from __future__ import annotations

import contextlib

import pytest

from pdops.errors import Refused
from pdops.ops import operate as op


class _Plan:
    def __init__(self, name, noop=None):
        self.name, self.noop, self.renders = name, noop, 0

    def render(self):
        self.renders += 1
        return f"plan {self.name}"


class _Record:
    def __init__(self, live=True):
        self.live = live

    def current_revision(self):
        return object() if self.live else None


@pytest.fixture
def hosts(monkeypatch):
    """The connections and the observation, counted."""
    seen = {"connected": 0, "observed": []}

    @contextlib.contextmanager
    def connections(inv):
        seen["connected"] += 1
        yield {"pool": "pool", "gateways": "gateways"}

    monkeypatch.setattr(op, "connections", connections)
    monkeypatch.setattr(op, "observe", lambda inv, rev, pool, gateways, **kw: seen["observed"].append(kw) or "obs")
    monkeypatch.setattr(op.Seen, "of", staticmethod(lambda o: f"seen({o})"))
    return seen


def test_a_record_refusal_stands_only_if_the_plan_from_what_serves_now_refuses_too(hosts):
    made, walked, said = [], [], []
    observed = _Plan("observed")

    def make(seen):
        made.append(seen)
        if seen is None:
            raise Refused("a floor, counted from the record")
        return observed

    plan, v = op.operate("inv", _Record(), make, lambda p, conns: walked.append(p) or {"revision": 2},
                         dry_run=False, say=said.append)
    assert made == [None, "seen(obs)"] and plan is observed and walked == [observed] and v == {"revision": 2}
    assert said == ["plan observed"] and observed.renders == 1  # printed once: the plan that is walked

    def refuses(seen):
        raise Refused(f"refused from {seen}")

    with pytest.raises(Refused, match="refused from seen"):
        op.operate("inv", _Record(), refuses, lambda p, c: walked.append(p), dry_run=False, say=said.append)


def test_a_dry_run_or_a_plan_with_nothing_to_do_walks_nothing(hosts):
    walked = []
    for dry, plan in ((True, _Plan("a")), (False, _Plan("b", noop="nothing differs"))):
        got, v = op.operate("inv", _Record(), lambda seen: plan, lambda p, c: walked.append(p), dry_run=dry,
                            say=lambda s: None)
        assert got is plan and v is None and plan.renders == 1
    assert walked == []


def test_without_observation_bad_input_is_refused_before_any_connection(hosts):
    def make(seen):
        raise Refused("no such host in the inventory")

    with pytest.raises(Refused):
        op.operate("inv", _Record(), make, lambda p, c: None, dry_run=False, observe_first=False)
    assert hosts["connected"] == 0
    # and a change that starts and stops nothing is walked from the record alone
    plan = _Plan("cordon")
    got, v = op.operate("inv", _Record(), lambda seen: plan, lambda p, c: {"revision": 3}, dry_run=False,
                        observe_first=False, say=lambda s: None)
    assert (got, v) == (plan, {"revision": 3}) and hosts["observed"] == [] and hosts["connected"] == 1


def test_an_operation_on_one_instance_reads_the_units_it_names(hosts):
    op.operate("inv", _Record(), lambda seen: _Plan("drain"), lambda p, c: {}, dry_run=False,
               units_of=lambda rev: frozenset({"p01", "p02"}), say=lambda s: None)
    assert hosts["observed"] == [{"units_of": frozenset({"p01", "p02"})}]


# ---------------------------------------------------------------- run_operation: how any plan is carried out

def _ran(state, op_id: str) -> list[tuple[str, str]]:
    return [(r["step"], r["status"]) for r in state.journal().read(op_id)]


def test_a_plan_runs_under_the_lock_from_its_basis_and_journals_one_verdict(tmp_path, registry):
    from pdops.plans import Outcome, Plan, Step
    from pdops.record.local import StateDir

    state = StateDir("t", tmp_path / "state")
    seen = {}

    def step(ctx, s):
        seen["holder"] = state.lock("x").holder()  # what another operator would read now
        seen["placement"] = ctx.placement
        return Outcome(verified=["did it"])

    registry["do"] = step
    plan = Plan("demo", "plan: demo", [Step("one", None, "one step", kind="do")])
    v = op.run_operation(plan, None, state, lambda s: None, pool=None, gateways=None, basis=None,
                         context={"placement": "pl"}, finish=lambda ctx, verdict: verdict.update(extra=1))
    assert seen["holder"] is not None and seen["holder"].operation == "demo" and seen["placement"] == "pl"
    assert state.lock("x").holder() is None  # released
    op_id = state.journal().operations()[-1]
    assert op_id.startswith("demo-") and _ran(state, op_id) == [("plan", "ok"), ("one", "ok"), ("verdict", "ok")]
    assert v["verified"] == ["did it"] and v["extra"] == 1
    assert state.journal().read(op_id)[-1]["evidence"]["extra"] == 1


def test_a_basis_that_moved_refuses_before_any_step_and_a_failure_is_one_verdict_with_the_hooks_evidence(
        tmp_path, registry):
    from pdops.errors import PdopsError, Refused
    from pdops.plans import Plan, Step
    from pdops.record.local import StateDir

    state = StateDir("t", tmp_path / "state")
    ran = []
    registry["do"] = lambda ctx, s: ran.append(s.name)
    plan = Plan("demo", "plan: demo", [Step("one", None, "one step", kind="do")])
    with pytest.raises(Refused, match="moved from revision 3"):
        op.run_operation(plan, None, state, lambda s: None, pool=None, gateways=None, basis=3)
    assert not ran

    def boom(ctx, s):
        raise PdopsError("the step failed")

    registry["boom"] = boom

    def failed(ctx, exc):
        exc.message += "\n  what the operator reads next"
        return "interrupted", {"last": ctx.done[-1]}

    plan = Plan("demo", "plan: demo", [Step("one", None, "one", kind="do"), Step("two", None, "two", kind="boom")])
    with pytest.raises(PdopsError) as ei:
        op.run_operation(plan, None, state, lambda s: None, pool=None, gateways=None, failed=failed)
    assert ei.value.message.endswith("what the operator reads next")
    op_id = state.journal().operations()[-1]
    verdict = state.journal().read(op_id)[-1]
    assert (verdict["step"], verdict["status"]) == ("verdict", "interrupted") and verdict["evidence"]["last"] == "one"
    assert "the step failed" in verdict["evidence"]["error"] and "reads next" not in verdict["evidence"]["error"]
    assert state.lock("x").holder() is None


def test_a_failed_plans_verdict_line_is_in_what_the_operator_reads_not_in_the_journalled_error(tmp_path, registry,
                                                                                               monkeypatch):
    """The line a plan's failure line writes after its rescue (a halted change's verdict line) ends the
    error the operator reads; the journal's failed verdict keeps the failed step's error alone, beside
    the evidence the hook returns."""
    import pdops.kinds
    from pdops.errors import PdopsError
    from pdops.plans import Plan, Step
    from pdops.record.local import StateDir

    monkeypatch.setattr(pdops.kinds, "FAILURE_LINES", {"t": (lambda c, p: "verdict: nothing changed", "a test line")})
    state = StateDir("t", tmp_path / "state")
    registry["boom"] = lambda ctx, s: (_ for _ in ()).throw(PdopsError("the step failed"))
    registry["undo"] = lambda ctx, s: None
    plan = Plan("demo", "plan: demo", [Step("one", None, "one", kind="boom")],
                rescue=[Step("undo", None, "undo", kind="undo")], failure_line="t")
    with pytest.raises(PdopsError) as ei:
        op.run_operation(plan, None, state, lambda s: None, pool=None, gateways=None)
    assert ei.value.message == "the step failed\nverdict: nothing changed"
    verdict = state.journal().read(state.journal().operations()[-1])[-1]
    assert verdict["step"] == "verdict" and verdict["evidence"]["error"] == "error: the step failed"


def test_an_operation_whose_lock_the_caller_holds_runs_under_it_with_its_own_id(tmp_path, registry):
    from pdops.plans import Plan, Step
    from pdops.record.local import StateDir

    state = StateDir("t", tmp_path / "state")
    registry["do"] = lambda ctx, s: None
    plan = Plan("scale", "plan: scale", [Step("one", None, "one step", kind="do")])
    with state.lock("sweep", op_id="sweep-1"):
        op.run_operation(plan, None, state, lambda s: None, pool=None, gateways=None, op="scale-2", lock_held=True)
        assert state.lock("x").holder().operation == "sweep"
    assert _ran(state, "scale-2") == [("plan", "ok"), ("one", "ok"), ("verdict", "ok")]


def test_a_caller_that_records_its_own_result_numbers_it_and_records_it_under_the_lock_however_the_walk_ends(
        tmp_path, registry):
    """`inv probe`: its number is read from the journal under the cluster lock, before the walk (`head`),
    and its result record is written under the lock after the verdict (`closing`), from the outputs the
    walk gave, when a step failed too (a step that fails is the probe's result) and after Ctrl-C."""
    from pdops.errors import PdopsError
    from pdops.plans import Outcome, Plan, Step
    from pdops.record.local import StateDir

    state = StateDir("t", tmp_path / "state")
    ending = {"requests": "fail"}

    def measure(ctx, s):
        ctx.give(s, "probe_result", {"result": "0/4 ok"})
        if ending["requests"] == "fail":
            raise PdopsError("the requests failed")
        if ending["requests"] == "ctrl-c":
            raise KeyboardInterrupt

    registry.bind({"measure": measure, "back": lambda ctx, s: Outcome(verified=["the way back ran"])},
                  gives={"measure": ("probe_result",)})
    plan = Plan("probe", "plan: probe", [Step("requests", None, "requests", kind="measure")],
                always=[Step("back", None, "back", kind="back")], always_on_interrupt=True)
    seen = []

    def number(journal):
        assert state.lock("x").holder().operation == "probe", "numbered outside the lock"
        return {"probe": f"T{len(journal.tagged('step:probe-result')) + 1}"}

    def result(ctx, verdict, exc):
        assert state.lock("x").holder().operation == "probe", "recorded outside the lock"
        seen.append((type(exc).__name__ if exc else None, ctx.output("probe_result"),
                     ctx.always_outcome["verified"] if exc else verdict["verified"]))
        ctx.journal.step(ctx.op, "probe-result", "ok", {"probe": ctx.journal.read(ctx.op)[0]["evidence"]["probe"]})

    def run():
        op.run_operation(plan, None, state, lambda s: None, pool=None, gateways=None, head=number, closing=result)

    with pytest.raises(PdopsError):
        run()
    ending["requests"] = "pass"
    run()
    ending["requests"] = "ctrl-c"
    with pytest.raises(KeyboardInterrupt):
        run()
    assert seen == [("PdopsError", {"result": "0/4 ok"}, ["the way back ran"]),
                    (None, {"result": "0/4 ok"}, ["the way back ran"]),
                    ("KeyboardInterrupt", {"result": "0/4 ok"}, ["the way back ran"])]
    ops = state.journal().operations()
    assert [[s for s, _ in _ran(state, o)][-2:] for o in ops] == [["verdict", "probe-result"]] * 3
    assert [r["evidence"]["probe"] for r in state.journal().tagged("step:probe-result")] == ["T1", "T2", "T3"]
    assert [_ran(state, o)[-2][1] for o in ops] == ["failed", "ok", "interrupted"]
    assert state.lock("x").holder() is None


def test_a_finish_hook_may_fail_the_verdict_of_a_walk_whose_steps_passed(tmp_path, registry):
    """A probe whose measuring steps passed but whose way back (an always step) failed: the pair may still
    run the bundle, so `inv journal` must not list it ok."""
    from pdops.errors import PdopsError
    from pdops.ops.probe.execute import _way_back_failed
    from pdops.plans import Plan, Step
    from pdops.record.local import StateDir

    state = StateDir("t", tmp_path / "state")

    def back(ctx, s):
        raise PdopsError("the revision's files could not be put back")

    registry.update({"do": lambda ctx, s: None, "back": back})
    plan = Plan("probe", "plan: probe", [Step("requests", None, "requests", kind="do")],
                always=[Step("restore", None, "restore", kind="back")])
    v = op.run_operation(plan, None, state, lambda s: None, pool=None, gateways=None,
                         finish=lambda ctx, verdict: _way_back_failed(plan, ctx, verdict))
    rec = state.journal().read(state.journal().operations()[-1])[-1]
    assert (rec["step"], rec["status"]) == ("verdict", "failed")
    assert "the way back did not complete: restore" in v["error"] and "could not be put back" in v["error"]
