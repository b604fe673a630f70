"""Runner base pieces: Step, run_parallel, run_remote (with invoke's local Context as the connection)."""

import socket
import threading

import pytest
from invoke import Context

from pdops.errors import RemoteCommandFailed, Unreachable
from pdops.plans import Step
from pdops.fanout import failures, run_parallel, run_remote, succeeded


class LocalConn(Context):
    """invoke's local Context has the same run() as a Fabric Connection; give it a host."""

    host = "local-test"


def test_step_prints_host_and_budget():
    assert str(Step("stop", "h3", "systemctl stop pdops-p07.service", 120, kind="stop")) == \
        "[h3] stop: systemctl stop pdops-p07.service (within 120s)"
    assert str(Step("plan", None, "compute", kind="plan")) == "plan: compute"


def test_run_remote_ok_and_failure_carries_evidence():
    assert run_remote(LocalConn(), "echo hello").stdout.strip() == "hello"
    with pytest.raises(RemoteCommandFailed) as ei:
        run_remote(LocalConn(), "echo out; echo err >&2; exit 7")
    e = ei.value
    assert (e.host, e.returncode, e.command) == ("local-test", 7, "echo out; echo err >&2; exit 7")
    assert "out" in e.output and "err" in e.output and "err" in e.render()


def test_run_remote_timeout_is_a_failure_not_a_hang():
    with pytest.raises(RemoteCommandFailed) as ei:
        run_remote(LocalConn(), "sleep 30", timeout=0.5)
    assert ei.value.returncode == 124


class DeadConn:
    host = "h-dead"

    def run(self, *a, **kw):
        raise socket.timeout("timed out")


def test_run_remote_connection_failure_is_unreachable():
    with pytest.raises(Unreachable, match="h-dead"):
        run_remote(DeadConn(), "true")


def test_run_parallel_collects_every_outcome_and_runs_concurrently():
    hosts = ["h1", "h2", "h3", "h4"]
    barrier = threading.Barrier(len(hosts), timeout=10)  # deadlocks unless all run at once

    def work(h):
        barrier.wait()
        if h == "h2":
            raise RemoteCommandFailed(h, "x", 1, "boom")
        return run_remote(LocalConn(), f"echo {h}").stdout.strip()

    res = run_parallel(hosts, work, max_workers=4)
    assert list(res) == hosts
    assert res["h1"] == "h1" and res["h4"] == "h4"
    assert isinstance(res["h2"], RemoteCommandFailed)
    assert set(failures(res)) == {"h2"} and set(succeeded(res)) == {"h1", "h3", "h4"}
    assert run_parallel([], work) == {}


# ---------------------------------------------------------------- the runner walks plans

import time as _time  # noqa: E402

from pdops.errors import PdopsError, Unverified  # noqa: E402
from pdops.plans import Outcome, Plan
from pdops.runner import DeadlineExceeded, RunContext, walk  # noqa: E402
from pdops.record.local import StateDir  # noqa: E402


def _ctx(tmp_path, said=None):
    return RunContext(inv=None, record=StateDir("t", tmp_path / "state"), op="op-1",
                      say=(said.append if said is not None else (lambda s: None)))


def test_walk_journals_each_step_by_id_with_target_and_builds_the_verdict_from_outcomes(tmp_path, registry):
    plan = Plan("demo", "plan: demo", [Step("a p01", "h1", "first", kind="a", params={"instance": "p01"}),
                                       Step("b", None, "second", kind="b")])
    ex = {"a": lambda ctx, s: Outcome(evidence={"x": 1}, verified=["a verified"]),
          "b": lambda ctx, s: Outcome.noop("already done", was=2)}
    ctx = _ctx(tmp_path)
    registry.update(ex)
    v = walk(plan, ctx)
    recs = ctx.journal.read("op-1")
    assert [(r["step"], r["status"]) for r in recs] == [("plan", "ok"), ("a p01", "ok"), ("b", "noop")]
    assert recs[0]["evidence"]["steps"] == ["a p01", "b"]
    assert recs[1]["evidence"]["target"] == "h1" and recs[1]["evidence"]["instance"] == "p01"
    assert recs[2]["evidence"]["reason"] == "already done"
    assert v["verified"] == ["a verified"]  # the no-op is never listed as verified
    assert v["noops"] == ["b: already done"]


def test_a_parallel_group_runs_together_collects_every_outcome_then_stops(tmp_path, registry):
    started, ran_after = [], []
    together = threading.Barrier(3, timeout=10)  # passes only if the three run at the same time

    def step(ctx, s):
        started.append(s.name)
        together.wait()
        if s.name == "s2":
            raise Unverified("s2 broke")
        return Outcome()

    plan = Plan("demo", "t", [Step(f"s{i}", None, "", kind="step", group="g") for i in range(1, 4)]
                + [Step("after", None, "", kind="after")])
    ctx = _ctx(tmp_path)
    with pytest.raises(Unverified) as ei:
        registry.update({"step": step, "after": lambda c, s: ran_after.append(1)})
        walk(plan, ctx)
    assert sorted(started) == ["s1", "s2", "s3"] and not ran_after  # stopped at the failed batch
    statuses = {r["step"]: r["status"] for r in ctx.journal.read("op-1")}
    assert statuses == {"plan": "ok", "s1": "ok", "s2": "failed", "s3": "ok"}
    assert "s2 broke" in ei.value.message


def test_a_step_past_its_deadline_fails_even_if_its_executor_returns(tmp_path, monkeypatch, registry):
    import pdops.runner as runner

    monkeypatch.setattr(runner, "DEADLINE_GRACE_S", 0.0)
    plan = Plan("demo", "t", [Step("w", None, "", deadline=0.1, kind="w")])
    ctx = _ctx(tmp_path)
    registry["w"] = lambda c, s: _time.sleep(0.3)
    with pytest.raises(DeadlineExceeded):
        walk(plan, ctx)
    rec = ctx.journal.read("op-1")[-1]
    assert rec["step"] == "w" and rec["status"] == "failed" and "past its deadline of 0.1s" in rec["evidence"]["error"]


def test_the_executor_sees_the_deadline_the_plan_printed(tmp_path, registry):
    seen = {}

    def ex(ctx, s):
        seen["left"] = ctx.deadline(s) - _time.monotonic()

    registry["w"] = ex
    walk(Plan("demo", "t", [Step("w", None, "", deadline=30, kind="w")]), _ctx(tmp_path))
    assert 29 < seen["left"] <= 30


def test_a_failed_remote_command_is_journalled_with_host_command_status_and_tail(tmp_path, registry):
    def ex(ctx, s):
        run_remote(LocalConn(), "echo boom; exit 3")

    ctx = _ctx(tmp_path)
    registry["x"] = ex
    with pytest.raises(RemoteCommandFailed):
        walk(Plan("demo", "t", [Step("x", "local-test", "", kind="x")]), ctx)
    err = ctx.journal.read("op-1")[-1]["evidence"]["error"]
    assert "local-test: `echo boom; exit 3` exited 3" in err and "boom" in err


def test_a_step_kind_without_executor_is_refused_before_anything_runs(tmp_path, registry):
    ran = []
    registry["ok"] = lambda c, s: ran.append(s.name)
    ctx = _ctx(tmp_path)
    plan = Plan("demo", "t", [Step("first", None, "", kind="ok"), Step("later", None, "", kind="nope")],
                rescue=[Step("undo", None, "", kind="nope-either")])
    with pytest.raises(PdopsError, match="no executor for step kind\\(s\\) 'nope', 'nope-either' .*nothing was run"):
        walk(plan, ctx)
    assert ran == [] and ctx.journal.read("op-1") == []


def test_a_step_names_its_kind(registry):
    with pytest.raises(ValueError, match="step 'start p01' has no kind"):
        Step("start p01", "h1", "")  # never read from the id


def test_what_a_step_could_not_check_is_listed_as_not_verified_never_as_verified(tmp_path, registry):
    plan = Plan("demo", "t", [Step("gpu", None, "", kind="gpu")])
    ex = {"gpu": lambda c, s: Outcome(verified=["cgroup empty"], unverified=["GPU processes: skipped: no nvidia-smi"])}
    registry.update(ex)
    v = walk(plan, _ctx(tmp_path))
    assert v["verified"] == ["cgroup empty"]
    assert v["unverified"] == ["GPU processes: skipped: no nvidia-smi"]


def test_a_failed_walk_runs_the_plans_rescue_journals_it_and_raises_the_failure(tmp_path, registry):
    ran = []
    registry.update({
        "ok": lambda c, s: Outcome(),
        "boom": lambda c, s: (_ for _ in ()).throw(Unverified("step two broke")),
        "undo": lambda c, s: ran.append(s.name) or Outcome(evidence={"removed": ["p01"]}),
        "undo-bad": lambda c, s: (_ for _ in ()).throw(Unverified("rescue could not reach the gateway")),
    })
    plan = Plan("demo", "plan: demo", [Step("one", None, "", kind="ok"), Step("two", None, "", kind="boom"),
                                       Step("three", None, "", kind="ok")],
                rescue=[Step("undo-a", None, "put back", kind="undo-bad"), Step("undo-b", None, "remove", kind="undo")])
    assert "if a step fails, then (rescue)" in plan.render() and "  R2. undo-b — remove" in plan.render()
    ctx = _ctx(tmp_path)
    with pytest.raises(Unverified, match="step two broke"):  # the walk's failure, not the rescue's
        walk(plan, ctx)
    assert ran == ["undo-b"]  # the second rescue step ran although the first failed
    recs = ctx.journal.read("op-1")
    assert recs[0]["evidence"]["rescue"] == ["undo-a", "undo-b"]
    assert [(r["step"], r["status"]) for r in recs[1:]] == [("one", "ok"), ("two", "failed"), ("undo-a", "failed"),
                                                          ("undo-b", "ok")]
    assert recs[-1]["evidence"]["removed"] == ["p01"]
    # a walk that succeeds runs no rescue
    ran.clear()
    ok = Plan("demo", "t", [Step("one", None, "", kind="ok")], rescue=[Step("undo-b", None, "", kind="undo")])
    walk(ok, _ctx(tmp_path / "2"))
    assert ran == []


def test_always_steps_run_last_whatever_the_outcome_and_never_change_it(tmp_path, registry):
    ran = []
    registry.update({
        "ok": lambda c, s: ran.append(s.name) or Outcome(),
        "boom": lambda c, s: (_ for _ in ()).throw(Unverified("step two broke")),
        "publish": lambda c, s: ran.append(s.name) or Outcome(verified=["targets follow revision 3"]),
        "publish-bad": lambda c, s: (_ for _ in ()).throw(Unverified("the Prometheus host did not answer")),
    })
    always = [Step("last-a", None, "write the targets", kind="publish-bad"), Step("last-b", None, "", kind="publish")]
    failing = Plan("demo", "t", [Step("one", None, "", kind="ok"), Step("two", None, "", kind="boom")],
                   rescue=[Step("undo", None, "", kind="ok")], always=always)
    assert "whatever the outcome, last (always):" in failing.render()
    assert "  A1. last-a — write the targets" in failing.render()
    ctx = _ctx(tmp_path)
    with pytest.raises(Unverified, match="step two broke"):  # the walk's failure, neither always step's
        walk(failing, ctx)
    assert ran == ["one", "undo", "last-b"]  # after the rescue; the second ran although the first failed
    recs = ctx.journal.read("op-1")
    assert recs[0]["evidence"]["always"] == ["last-a", "last-b"]
    assert [(r["step"], r["status"]) for r in recs[-2:]] == [("last-a", "failed"), ("last-b", "ok")]
    # a walk that passes runs them too; one that fails is not verified, and the walk still passes
    ran.clear()
    v = walk(Plan("demo", "t", [Step("one", None, "", kind="ok")], always=always), _ctx(tmp_path / "2"))
    assert ran == ["one", "last-b"]
    assert "targets follow revision 3" in v["verified"]
    assert any("last-a failed: " in u and "did not answer" in u for u in v["unverified"])


def test_a_way_back_cut_short_by_a_second_ctrl_c_is_named_as_not_completed(tmp_path, registry):
    """`inv probe` runs its way back (always steps) after Ctrl-C; a second Ctrl-C during it leaves the
    pair as it was then: the interrupted step and those after it are what did not complete, so the
    probe cannot say the baseline was restored."""
    ran = []

    def interrupt(c, s):
        raise KeyboardInterrupt

    registry.update({"ok": lambda c, s: ran.append(s.name) or Outcome(), "ctrl-c": interrupt})
    plan = Plan("probe", "t", [Step("requests", None, "", kind="ctrl-c")],
                always=[Step("probe-remove", None, "", kind="ctrl-c"), Step("restore", None, "", kind="ok")],
                always_on_interrupt=True)
    ctx = _ctx(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        walk(plan, ctx)
    assert ran == []
    assert ctx.after_failed == ["probe-remove: interrupted by the operator",
                                "restore: not run (interrupted before it)"]
    assert [(r["step"], r["status"]) for r in ctx.journal.read("op-1")][-1] == ("probe-remove", "interrupted")
    assert "restore" not in [r["step"] for r in ctx.journal.read("op-1")]


def test_a_step_reads_only_what_an_earlier_step_declared_it_gives_and_the_plan_is_checked_first(tmp_path, registry):
    """Outputs pass between steps only as declared: a plan whose step needs what no earlier step gives
    is refused before anything runs, and an executor that reads or gives an undeclared name fails."""
    ran = []

    def render(c, s):
        c.give(s, "build", tmp_path / "b1")
        return Outcome()

    def deliver(c, s):
        ran.append(c.get(s, "build"))
        return Outcome()

    def sneaky(c, s):
        c.get(s, "workers")  # not declared by its kind
        return Outcome()

    registry.bind({"render": render, "deliver": deliver, "sneaky": sneaky},
                  gives={"render": ("build",)}, needs={"deliver": ("build",)})
    backwards = Plan("demo", "t", [Step("deliver", None, "", kind="deliver"), Step("render", None, "", kind="render")])
    with pytest.raises(PdopsError, match="step 1 \\(deliver\\) needs 'build'.*which no step before it gives"):
        walk(backwards, _ctx(tmp_path))
    assert ran == [] and _ctx(tmp_path).journal.read("op-1") == []  # refused before the plan record
    good = Plan("demo", "t", [Step("render", None, "", kind="render"), Step("deliver", None, "", kind="deliver")])
    assert "uses: build (step 1)" in good.render()  # the dry run names the dependency
    walk(good, _ctx(tmp_path))
    assert ran == [tmp_path / "b1"]
    with pytest.raises(PdopsError, match="reads 'workers' without declaring it"):
        walk(Plan("demo", "t", [Step("s", None, "", kind="sneaky")]), _ctx(tmp_path))


def test_a_walk_plan_step_walks_its_declared_plan_only_when_its_condition_holds(tmp_path, registry):
    """A conditional step runs only if the output it names is as printed; a walk-plan step walks the
    plan in its params (printed under it), its rescue on a failure, in outputs of its own."""
    import pdops.runner as runner

    registry.bind({"walk-plan": runner.do_walk_plan}, gives={"walk-plan": ("plan_verdicts",)})
    ran = []

    def decide(c, s):
        c.give(s, "probe_keep", s.params["keep"])
        return Outcome()

    registry.bind({"decide": decide, "note": lambda c, s: ran.append(s.name) or Outcome(),
                   "boom": lambda c, s: (_ for _ in ()).throw(Unverified("sub step broke"))},
                  gives={"decide": ("probe_keep",)})
    inner = Plan("inner", "inner", [Step("inner: one", None, "first", kind="note")],
                 rescue=[Step("inner: undo", None, "undo", kind="note")])
    keep = Step("keep", None, "the keep change", kind="walk-plan", when=("probe_keep", True), params={"plan": inner})
    restore = Step("restore", None, "the restore change", kind="walk-plan", when=("probe_keep", False),
                   params={"plan": Plan("back", "back", [Step("back: one", None, "", kind="note")])})
    plan = Plan("demo", "t", [Step("decide", None, "", kind="decide", params={"keep": True})], always=[restore, keep])
    text = plan.render()
    assert "restore — the restore change (only if not probe_keep)" in text and "keep — the keep change (only if probe_keep)" in text
    assert "     1. inner: one — first" in text and "R1. inner: undo — undo" in text  # the walked plan, printed under it
    ctx = _ctx(tmp_path)
    walk(plan, ctx)
    assert ran == ["inner: one"]  # restore was not run, keep was; no rescue
    recs = {r["step"]: r for r in ctx.journal.read("op-1")}
    assert recs["restore"]["status"] == "noop" and "only if not probe_keep" in recs["restore"]["evidence"]["reason"]
    assert recs["plan"]["evidence"]["walks"] == {"restore": ["back: one"], "keep": ["inner: one", "inner: undo"]}
    # a failing walked plan runs its own rescue; as an `always` step its failure is listed, not hidden
    inner.steps = [Step("inner: boom", None, "", kind="boom")]
    ctx = _ctx(tmp_path)
    v = walk(plan, ctx)
    assert ran[-1] == "inner: undo" and any("sub step broke" in u for u in v["unverified"])
    assert ctx.after_failed and ctx.after_failed[0].startswith("keep: ")


def test_a_step_keyed_on_an_instance_runs_only_for_the_instances_an_earlier_step_named(tmp_path, registry):
    """(output, True, key): the step runs only if the output an earlier step gave holds `key` (a halted
    change's undo plans run for the instances `undo-decide` named); the dry run prints the condition,
    a step not run is journalled as a no-op naming it."""
    import pdops.runner as runner

    registry.bind({"walk-plan": runner.do_walk_plan}, gives={"walk-plan": ("plan_verdicts",)})
    ran = []

    def decide(c, s):
        c.give(s, "undo_drain", {"p02"})
        return Outcome()

    registry.bind({"decide": decide, "note": lambda c, s: ran.append(s.name) or Outcome()},
                  gives={"decide": ("undo_drain",)})
    undo = [Step(f"undo {i}", None, f"drain {i}", kind="walk-plan", when=("undo_drain", True, i),
                 params={"plan": Plan("undo", f"undo {i}", [Step(f"undo {i}: stop", None, "", kind="note")])})
            for i in ("p02", "p03")]
    plan = Plan("demo", "t", [Step("decide", None, "", kind="decide")] + undo)
    assert "undo p03 — drain p03 (only if p03 in undo_drain)" in plan.render()
    assert "undo p03: stop" in plan.render()  # each walked plan printed in full
    ctx = _ctx(tmp_path)
    walk(plan, ctx)
    assert ran == ["undo p02: stop"]
    recs = {r["step"]: r for r in ctx.journal.read("op-1")}
    assert recs["undo p02"]["status"] == "ok" and recs["undo p03"]["status"] == "noop"
    assert "only if p03 in undo_drain" in recs["undo p03"]["evidence"]["reason"]
    assert Step("x", None, "", kind="note", when=("undo_drain", False, "p03")).holds({"p02"})


def test_the_verdict_reports_the_revision_a_step_gave_and_a_walked_plan_keeps_its_own(tmp_path, registry):
    """The revision in a verdict is the output the record step gave (pdops.outputs.REPORTED), not a
    field an executor writes: the operation's verdict reports its own record step's revision, a
    walk-plan step's plan_verdicts the one its plan recorded, and neither leaks into the other."""
    import pdops.runner as runner

    registry.bind({"walk-plan": runner.do_walk_plan,
                   "record": lambda c, s: c.give(s, "revision", s.params["n"]) or Outcome(verified=["recorded"]),
                   "note": lambda c, s: Outcome()},
                  gives={"walk-plan": ("plan_verdicts",), "record": ("revision",)})
    inner = Plan("inner", "inner", [Step("inner: record", None, "", kind="record", params={"n": 8})])
    plan = Plan("demo", "t", [Step("walk", None, "", kind="walk-plan", params={"plan": inner}),
                              Step("record", None, "", kind="record", params={"n": 7})])
    ctx = _ctx(tmp_path)
    v = walk(plan, ctx)
    assert v["revision"] == 7 and ctx.output("plan_verdicts") == {"walk": {"revision": 8}}
    assert "revision" not in walk(Plan("demo", "t", [Step("only", None, "", kind="note")]), _ctx(tmp_path))


def test_a_failed_walk_adds_the_line_its_plan_names_written_from_what_its_rescue_gave(tmp_path, registry, monkeypatch):
    """A plan's failure line (pdops.kinds.FAILURE_LINES, a halted change's verdict line) is written once
    its rescue has run, from what the rescue gave, and carried by the error: the operation adds it to
    what the operator reads after journalling the failure (pdops.ops.operate), a walk-plan step at
    once (its journalled error has it); Ctrl-C writes none; the dry run names it; a plan naming a line
    that is not in the table is refused before anything runs; one that fails to be written is said, and
    the walk's own failure raised. No executor writes it."""
    import pdops.kinds
    import pdops.runner as runner

    monkeypatch.setattr(pdops.kinds, "FAILURE_LINES", {
        "test": (lambda c, p: f"verdict: kept {c.output('halt_record')} ({p.operation})", "what the test rescue kept")})
    registry.bind({"walk-plan": runner.do_walk_plan,
                   "boom": lambda c, s: (_ for _ in ()).throw(Unverified("step broke")),
                   "keep": lambda c, s: c.give(s, "halt_record", {"kept": "p01"}) or Outcome()},
                  gives={"walk-plan": ("plan_verdicts",), "keep": ("halt_record",)})
    inner = Plan("inner", "inner", [Step("boom", None, "", kind="boom")],
                 rescue=[Step("keep", None, "keep what serves", kind="keep")], failure_line="test")
    assert "if a step fails, then (rescue), and the failure is reported with what the test rescue kept:" in inner.render()
    with pytest.raises(Unverified) as got:
        walk(inner, _ctx(tmp_path))
    assert got.value.message == "step broke" and got.value.verdict_line == "verdict: kept {'kept': 'p01'} (inner)"
    outer = Plan("demo", "t", [Step("walk", None, "", kind="walk-plan", params={"plan": inner})])
    ctx = _ctx(tmp_path)
    with pytest.raises(Unverified) as got:
        walk(outer, ctx)
    assert got.value.message == "step broke\nverdict: kept {'kept': 'p01'} (inner)" and got.value.verdict_line is None
    assert "verdict: kept" in {r["step"]: r for r in ctx.journal.read("op-1")}["walk"]["evidence"]["error"]
    # a line that cannot be written never hides the walk's own failure: it says so instead
    pdops.kinds.FAILURE_LINES["broken"] = (lambda c, p: c.output("halt_record")["missing"], "a broken line")
    with pytest.raises(Unverified) as got:
        walk(Plan("inner", "inner", [Step("boom", None, "", kind="boom")], failure_line="broken"), _ctx(tmp_path))
    assert got.value.message == "step broke" and got.value.verdict_line.startswith(
        "verdict: its line (broken) could not be written (TypeError: ") and got.value.verdict_line.endswith(
        "see the journal, `inv journal --op op-1`")  # a command that exists: `inv history` takes no --op
    registry.bind({"stop": lambda c, s: (_ for _ in ()).throw(KeyboardInterrupt())})
    with pytest.raises(KeyboardInterrupt):
        walk(Plan("demo", "t", [Step("stop", None, "", kind="stop")],
                  rescue=[Step("keep", None, "", kind="keep")], failure_line="test"), _ctx(tmp_path))
    with pytest.raises(PdopsError, match="failure line 'nope' is not in pdops.kinds.FAILURE_LINES"):
        walk(Plan("demo", "t", [Step("boom", None, "", kind="boom")], failure_line="nope"), _ctx(tmp_path))
