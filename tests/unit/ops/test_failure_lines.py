"""What a failed operation adds to the error the operator reads (pdops.kinds.FAILURE_LINES, named by its
plan): a halted change's verdict line (pdops.ops.scale.rescue.halted_change_line), written once the walk
is over from what its rescue recorded (`halt_record`), a deploy's and a drain's; never by an executor."""

from __future__ import annotations

from types import SimpleNamespace

from pdops.ops.scale.rescue import halted_change_line


def _ctx(record):
    return SimpleNamespace(op="op-7", output=lambda name, default=None: record if name == "halt_record" else default)


def _plan_ctx(record):
    """(the context, the plan): the line reads only what the rescue recorded, not the plan."""
    return _ctx(record), None


BASE = {"current": 4, "partial": True, "from_revision": 3, "topology": "2p1d", "live": ["p01", "p02", "d01"],
        "drained": [], "replaced": [], "replaced_not_serving": [], "untouched": [], "out_of_service": [],
        "down": [], "restored": [], "not_restored": [], "out_of_gateway": [], "undone": [], "left": []}


def test_a_rollout_halted_midway_names_what_was_replaced_what_is_out_and_what_is_untouched():
    line = halted_change_line(*_plan_ctx({**BASE, "how": "rolling", "replaced": ["p01"], "replaced_not_serving": ["p02"],
                                    "untouched": ["d01"], "undone": ["p02 (never registered; stopped, verified)"]}))
    assert line == ("verdict: the rollout halted; replaced with the new files: p01; out of service (old process "
                    "stopped, new one not serving): p02; still serving revision 3's files, untouched: d01; `current` "
                    "moved to revision 4 (partial, 2p1d) to describe what is live; `inv rollback` returns to "
                    "revision 3; undone: p02 (never registered; stopped, verified)")


def test_a_change_halted_after_a_drain_names_the_partial_revision_and_what_is_live():
    line = halted_change_line(*_plan_ctx({**BASE, "how": "partial", "topology": "1p1d", "live": ["p01", "d01"],
                                    "drained": ["p02"], "down": ["p02"]}))
    assert line.startswith("verdict: the change stopped after draining p02; `current` moved to revision 4 "
                           "(partial, 1p1d) to describe what is live: p01, d01; `inv rollback` returns to revision 3; "
                           "undone: nothing was started; out of service (left the gateway, not running now): p02")


def test_a_change_halted_before_it_stopped_anything_says_what_is_not_back_and_not_undone():
    line = halted_change_line(*_plan_ctx({**BASE, "how": "unchanged", "current": 3, "partial": False, "restored": ["d01"],
                                    "out_of_gateway": ["p02"], "not_restored": ["p02: canary failed: timeout"],
                                    "left": ["p03: undo failed (journal: step `undo p03`)"]}))
    assert line == ("verdict: the change stopped; current revision unchanged: 3 (2p1d); live now: p01, p02, d01; "
                    "undone: nothing was started; back in service (were out of the gateway, never stopped): d01; "
                    "OUT OF THE GATEWAY but running, not restored: p02 (p02: canary failed: timeout) (`inv deploy` "
                    "puts them back); NOT undone: p03: undo failed (journal: step `undo p03`)")


def test_a_rescue_that_recorded_nothing_points_at_the_journal_of_the_operation():
    assert halted_change_line(*_plan_ctx(None)) == ("verdict: the rescue did not finish (see the journal: "
                                              "`inv journal --op op-7`); read `inv status`")


def _record_halt(plan, state, outputs: dict):
    """Run the change plan's own `record-halt` step, as its rescue would, on what the walk left."""
    from pdops.ops.scale.rescue import do_record_halt
    from pdops.runner import RunContext

    ctx = RunContext(plan.inv, state, "scale-1", lambda s: None)
    ctx._outputs.update(outputs)
    step = next(s for s in plan.plan.rescue if s.kind == "record-halt")
    do_record_halt(ctx, step)
    return ctx


def test_a_change_plan_says_its_failure_is_reported_with_the_halted_change_line(lab_inv, tmp_path):
    from pdops.ops import scale as sc
    from pdops.model.topology import parse_topology
    from pdops.record.local import StateDir
    from tests.unit.recorded import deployed

    state = StateDir("lab", tmp_path / "s")
    deployed(lab_inv, state, "2p1d")
    plan = sc.plan_scale(lab_inv, parse_topology("3p1d"), state)
    assert plan.plan.failure_line == "halted-change"
    assert ("if a step fails, then (rescue), and the failure is reported with the verdict line of a halted change"
            in plan.render())


def test_what_record_halt_records_writes_the_line_when_nothing_was_stopped_and_when_a_drain_happened(
        lab_inv, tmp_path):
    """From the rescue's own step to the operator's line: nothing stopped leaves the revision current;
    a drained instance moves `current` to a partial revision that says it halted, named in the line."""
    from pdops.ops import scale as sc
    from pdops.model.topology import parse_topology
    from pdops.record.local import StateDir
    from tests.unit.recorded import deployed

    state = StateDir("lab", tmp_path / "s")
    deployed(lab_inv, state, "2p1d")
    grow = sc.plan_scale(lab_inv, parse_topology("3p1d"), state)
    ctx = _record_halt(grow, state, {"left_gateway": ["p01"], "restored": {"p01"}})
    assert halted_change_line(ctx, None) == ("verdict: the change stopped; current revision unchanged: 1 (2p1d); live now: "
                                       "p01, p02, d01; undone: nothing was started; back in service (were out of the "
                                       "gateway, never stopped): p01")
    assert state.current() == 1
    shrink = sc.plan_scale(lab_inv, parse_topology("1p1d"), state)
    ctx = _record_halt(shrink, state, {"drained": ["p02"], "left_gateway": ["p02"]})
    cur = state.current_revision()
    assert cur.number == 2 and cur.outcome == "partial" and cur.extra["halted"] is True
    assert halted_change_line(ctx, None) == ("verdict: the change stopped after draining p02; `current` moved to revision 2 "
                                       "(partial, 1p1d) to describe what is live: p01, d01; `inv rollback` returns to "
                                       "revision 1; undone: nothing was started")


def test_a_deploy_and_a_drain_say_what_their_failure_adds_and_write_it_from_what_ran(lab_inv, tmp_path):
    """Every operation's failure line is the plan's (pdops.kinds.FAILURE_LINES), printed by the dry run: a
    first deploy's names what is current and the units it started; a drain's names the instance as not
    stopped, the last step completed and how to resume."""
    from pdops.ops import deploy as dep
    from pdops.ops.deploy.execute import deploy_failed_line
    from pdops.ops.drain import plan_drain
    from pdops.ops.drain.execute import drain_interrupted_line
    from pdops.model.topology import parse_topology
    from pdops.record.local import StateDir
    from pdops.runner import RunContext
    from tests.unit.recorded import deployed

    state = StateDir("lab", tmp_path / "s")
    first = dep.plan_deploy(lab_inv, parse_topology("2p1d"), state).plan
    assert first.failure_line == "deploy-failed"
    assert ("the failure is reported with the revision current and the units this deploy started (left for "
            "inspection)") in first.render()
    ctx = RunContext(lab_inv, state, "deploy-1", lambda s: None)
    ctx._outputs["started"] = ["lab01:pdops-p01.service"]
    assert deploy_failed_line(ctx, first) == ("  current revision unchanged: none; units started by this deploy (left "
                                              "for inspection): lab01:pdops-p01.service")
    deployed(lab_inv, state, "2p1d")
    drain = plan_drain(lab_inv, state, "p02").plan
    assert drain.failure_line == "drain-interrupted"
    assert ("  if a step fails, the failure is reported with that the instance is not recorded as stopped, the last "
            "step completed and how to resume") in drain.render().splitlines()
    ctx = RunContext(lab_inv, state, "drain-1", lambda s: None)
    ctx.done.append("leave-gateway")
    assert drain_interrupted_line(ctx, drain) == (
        "  p02 is NOT recorded as stopped; last completed step: leave-gateway; current revision: 1. Re-run the same "
        "command to resume (each step re-checks what is already done).")
