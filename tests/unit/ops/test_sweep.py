"""pdops.ops.sweep: fixed-budget planning, the matrix (measured / tried and failed / not tried),
repeats, the knee on the field report's numbers, rendering, plots, the sweep as one declared plan
(its step ids, its dry run, its journal, its lock), and execute_sweep with fakes."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

from pdops.ops import sweep as sw
from pdops.ops.bench import Figures
from pdops.errors import InvalidInput, Refused, Unverified
from pdops.reads.observation import Seen
from pdops.record.local import StateDir

# Field report 000, section 4.3: DS model, 160K/1300, 96 GPUs (12 instances of TP8), total TPM and TTFT p99.
REPORT_160K = {
    ("2:1", 8): (688_345, 69.3), ("2:1", 16): (1_080_916, 141.6), ("2:1", 32): (1_091_671, 277.3),
    ("2:1", 64): (1_091_671, 546.9), ("5:1", 16): (1_301_401, 141.3), ("5:1", 32): (1_306_779, 254.3),
}


def figs(tpm, ttft, *, ok=32, sent=32, failures=None, gpus=96, invalid=None) -> Figures:
    return Figures(sent=sent, ok=ok, failures=failures or {}, wall_s=100.0, total_tpm=tpm if ok else 0.0,
                   output_tpm=None, gpus=gpus, tpm_per_gpu=(tpm / gpus) if ok else 0.0, ttft_p50=ttft / 2,
                   ttft_p99=ttft, tpot_p50=0.05, tpot_p99=0.08, itl_p50=0.05, itl_p99=0.09, invalid=invalid)


# ---------------------------------------------------------------- parsing


def test_parse_ratios_and_concurrencies():
    assert [str(r) for r in sw.parse_ratios("2:1, 3:1,5:1")] == ["2:1", "3:1", "5:1"]
    assert sw.parse_concurrencies("32,8,16,64") == [8, 16, 32, 64]


@pytest.mark.parametrize("spec", ["", "2-1", "2:", ":1", "0:1", "2:0", "a:b", "2:1,,3:1", "2:1,4:2", "2:1:1", "-2:1"])
def test_bad_ratios(spec):
    with pytest.raises(InvalidInput) as e:
        sw.parse_ratios(spec)
    assert e.value.field == "--ratios"


@pytest.mark.parametrize("spec", ["0", "8,0,16", "8,8", "eight", "", "8,,16", "-8"])
def test_bad_concurrencies(spec):
    with pytest.raises(InvalidInput) as e:
        sw.parse_concurrencies(spec)
    assert e.value.field == "--concurrency"


# ---------------------------------------------------------------- planning


@pytest.mark.parametrize("ratio,topo", [("2:1", "8p4d"), ("3:1", "9p3d"), ("5:1", "10p2d"), ("11:1", "11p1d"),
                                        ("1:1", "6p6d"), ("1:2", "4p8d")])
def test_report_topologies_on_96_gpus(ratio, topo):
    t, why = sw.topology_for_ratio(96, 8, sw.parse_ratios(ratio)[0])
    assert (str(t), why) == (topo, None)


def test_a_ratio_that_cannot_use_the_whole_budget_is_not_tried_unless_allowed():
    r = sw.parse_ratios("4:1")[0]
    t, why = sw.topology_for_ratio(96, 8, r)
    assert t is None and "8p2d takes 80 of 96 GPUs" in why
    t, why = sw.topology_for_ratio(96, 8, r, allow_partial=True)
    assert str(t) == "8p2d" and why is None


def test_plan_sweep_on_the_reference_fleet(fleet):
    plan = sw.plan_sweep(96, "2:1,3:1,5:1", "8,16,32,64", "160k/1300", gpus_per_instance=8, inv=fleet)
    assert len(plan.cells) == 12 and len(plan.runnable()) == 12
    assert plan.topologies == {"2:1": "8p4d", "3:1": "9p3d", "5:1": "10p2d"}
    assert {c.gpus for c in plan.cells} == {96}
    text = plan.render()
    assert "fixed budget of 96 GPUs (12 instances of 8 GPUs)" in text and "5:1 -> 10p2d" in text


def test_cells_that_do_not_fit_are_not_tried_with_the_reason(fleet):
    plan = sw.plan_sweep(96, "2:1,13:1,4:1", "16,32", "160k/1300", gpus_per_instance=8, inv=fleet)
    states = {(c.ratio, c.concurrency): (c.state, c.reason) for c in plan.cells}
    assert states[("2:1", 16)] == (sw.PLANNED, None)
    assert states[("13:1", 32)][0] == sw.NOT_TRIED and "needs at least 14 instances" in states[("13:1", 32)][1]
    assert states[("4:1", 16)][0] == sw.NOT_TRIED and "80 of 96" in states[("4:1", 16)][1]
    assert "not tried" in plan.render()


@pytest.mark.parametrize("budget,msg", [(100, "not a whole number of 8-GPU instances"), (8, "fits no topology"),
                                        (0, "at least 1"), ("lots", "not a whole number")])
def test_budgets_that_fit_nothing_are_invalid_input(budget, msg, fleet):
    with pytest.raises(InvalidInput, match=msg) as e:
        sw.plan_sweep(budget, "2:1,3:1", "8,16", "160k/1300", gpus_per_instance=8, inv=fleet)
    assert e.value.field == "--budget"


def test_a_budget_beyond_the_inventory_fits_no_topology(fleet):
    with pytest.raises(InvalidInput, match="fits no topology") as e:
        sw.plan_sweep(256, "2:1,3:1", "8", "160k/1300", gpus_per_instance=8, inv=fleet)
    assert "does not fit the inventory" in str(e.value)


# ---------------------------------------------------------------- repeats and knee


def test_repeats_median_and_spread_as_the_report_states_them():
    # 3:1/C24 median 1,220,736 with range/median 3.96%; 5:1/C32 median 1,306,779 with 0.82%.
    med_a, spread_a = 1_220_736, 0.0396
    a = sw.Cell("3:1", "9p3d", 24, sw.MEASURED, runs=[
        figs(med_a - 0.5 * spread_a * med_a, 205).to_dict(), figs(med_a, 204).to_dict(),
        figs(med_a + 0.5 * spread_a * med_a, 209).to_dict()])
    med_b, spread_b = 1_306_779, 0.0082
    c = sw.Cell("5:1", "10p2d", 32, sw.MEASURED, runs=[
        figs(med_b + 0.7 * spread_b * med_b, 254).to_dict(), figs(med_b - 0.3 * spread_b * med_b, 252).to_dict(),
        figs(med_b, 253).to_dict()])
    assert a.median("total_tpm") == med_a and a.spread() == pytest.approx(spread_a)
    assert c.median("total_tpm") == med_b and c.spread() == pytest.approx(spread_b)
    assert c.median("total_tpm") / a.median("total_tpm") - 1 == pytest.approx(0.0705, abs=5e-5)
    assert "n=3, spread 3.96%" in sw.cell_text(a)
    single = sw.Cell("2:1", "8p4d", 8, sw.MEASURED, runs=[figs(688_345, 69.3).to_dict()])
    assert single.spread() is None and sw.cell_text(single) == "688,345 (n=1)"


def test_knee_on_the_report_numbers():
    pts = [(c, t, l) for (r, c), (t, l) in REPORT_160K.items() if r == "5:1"]
    c0, c1, gain, ttft = sw.find_knee(pts)
    assert (c0, c1) == (16, 32)
    assert gain == pytest.approx(0.0041, abs=5e-5)  # +0.41%
    assert ttft == pytest.approx(0.80, abs=0.005)  # TTFT +80%
    pts = [(c, t, l) for (r, c), (t, l) in REPORT_160K.items() if r == "2:1"]
    c0, c1, gain, ttft = sw.find_knee(pts)
    assert (c0, c1) == (16, 32) and gain == pytest.approx(0.00995, abs=5e-5)
    # C8 -> C16 added 57%: that is not a knee; with a threshold below 1% the knee moves to C32 -> C64 (0%).
    assert sw.find_knee(pts, min_gain=0.005)[:2] == (32, 64)
    assert sw.find_knee([(8, 100.0, 1.0), (16, 150.0, 2.0), (32, 200.0, 3.0)]) is None


# ---------------------------------------------------------------- execute_sweep with fakes


def sweep(plan, tmp_path, *, run_cell, scale_to=lambda t, row: None, out=None, **kw):
    """execute_sweep with fakes for the cluster, its record (lock, journal) in tmp_path/state."""
    return sw.execute_sweep(plan, scale_to=scale_to, run_cell=run_cell, out_dir=tmp_path if out is None else out,
                            record=StateDir("lab", tmp_path / "state"), say=lambda s: None, **kw)


def _run_report_sweep(tmp_path, *, scale_fail=None, cell_fail=None, plots=True):
    plan = sw.plan_sweep(96, "2:1,5:1,3:1,13:1", "8,16,32,64", "160k/1300", gpus_per_instance=8)
    scaled, ran = [], []

    def scale_to(topo, row):
        scaled.append(str(topo))
        if str(topo) == scale_fail:
            raise Unverified("p09 did not become healthy")

    def run_cell(run: sw.CellRun):
        ran.append((str(run.topology), run.concurrency, run.repeat, run.run_dir.name))
        key = ({"8p4d": "2:1", "10p2d": "5:1"}.get(str(run.topology)), run.concurrency)
        if key == cell_fail:
            return figs(0, 0, ok=0, failures={"http_503": 32})
        if key not in REPORT_160K:
            raise RuntimeError("protocol failure: stream ended without [DONE]")
        t, l = REPORT_160K[key]
        return figs(t, l)

    m = sweep(plan, tmp_path, scale_to=scale_to, run_cell=run_cell, plots=plots)
    return m, scaled, ran


def test_execute_sweep_records_measured_failed_and_not_tried(tmp_path):
    m, scaled, ran = _run_report_sweep(tmp_path, scale_fail="9p3d", cell_fail=("5:1", 64), plots=False)
    assert scaled == ["8p4d", "10p2d", "9p3d"]  # once per topology; 13:1 not tried, never scaled to
    assert ("8p4d", 8, 1, "8p4d-c8-r1") in ran and not any(t == "9p3d" for t, *_ in ran)
    st = {c.key: c for c in m.cells}
    assert st[("2:1", 16)].state == sw.MEASURED and st[("2:1", 16)].median("total_tpm") == 1_080_916
    assert st[("5:1", 64)].state == sw.FAILED and "HTTP 503 x32" in st[("5:1", 64)].reason
    assert st[("5:1", 8)].state == sw.FAILED and "protocol failure" in st[("5:1", 8)].reason
    assert st[("3:1", 16)].state == sw.FAILED and "scale to 9p3d failed" in st[("3:1", 16)].reason
    assert st[("13:1", 16)].state == sw.NOT_TRIED
    knees = {k.ratio: k for k in m.knees()}
    assert knees["5:1"].concurrency == 16 and "+0.41% total TPM" in knees["5:1"].describe()
    assert "TTFT p99 changes +80%" in knees["5:1"].describe()
    assert knees["2:1"].concurrency == 16

    text = (tmp_path / "matrix.txt").read_text()
    assert "1,080,916 (n=1)" in text and "FAILED: HTTP 503 x32 (0/32 ok)" in text
    assert "not tried" in text and "knee: 10p2d (5:1): knee at C16" in text
    with open(tmp_path / "matrix.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["state"] for r in rows} == {"measured", "tried and failed", "not tried"}
    assert len(rows) == 16
    back = sw.load_matrix(tmp_path)
    assert [c.to_dict() for c in back.cells] == [c.to_dict() for c in m.cells]
    assert json.loads((tmp_path / "matrix.json").read_text())["knees"][0]["concurrency"] == 16


def test_a_run_with_some_failed_requests_is_measured_but_marked_everywhere(tmp_path):
    plan = sw.plan_sweep(96, "2:1", "8,16", "160k/1300", gpus_per_instance=8)
    m = sweep(plan, tmp_path, plots=False,
              run_cell=lambda run: figs(1e6, 100, ok=29, sent=32, failures={"http_503": 3}))
    c = m.cell("2:1", 8)
    assert c.state == sw.MEASURED and "FAILURES 3/32: HTTP 503 x3" in c.mark
    assert sw.cell_text(c).endswith("!")
    text = sw.render_matrix(m)
    assert text.count("FAILURES 3/32: HTTP 503 x3") == 2  # in the detail row of both cells
    rows = list(csv.DictReader(open(tmp_path / "matrix.csv")))
    assert all("FAILURES 3/32" in r["mark"] for r in rows)


def test_an_invalid_run_makes_the_cell_failed(tmp_path):
    plan = sw.plan_sweep(96, "2:1", "8", "160k/1300", gpus_per_instance=8, repeats=2)
    m = sweep(plan, tmp_path, plots=False, run_cell=lambda run: figs(1e6, 100, invalid="the current revision changed"))
    c = m.cell("2:1", 8)
    assert c.state == sw.FAILED and "invalid run: the current revision changed" in c.reason
    assert len(c.runs) == 2


def test_plots_are_pngs(tmp_path):
    import matplotlib  # noqa: F401  -- pinned in pyproject: the plots are required, not optional here
    m, _, _ = _run_report_sweep(tmp_path, cell_fail=("5:1", 64))
    for name in ("tpm_vs_concurrency.png", "ttft_p99_vs_concurrency.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_without_matplotlib_plots_are_skipped_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    m, _, _ = _run_report_sweep(tmp_path, plots=False)
    paths, why = sw.plot_matrix(m, tmp_path)
    assert paths == [] and "matplotlib is not installed" in why
    res = sw.write_matrix(m, tmp_path)
    assert res["plots_skipped"] == why and (tmp_path / "matrix.txt").exists()


def test_the_knee_threshold_is_a_parameter_kept_in_the_matrix(tmp_path):
    plan = sw.plan_sweep(96, "2:1", "8,16,32", "160k/1300", gpus_per_instance=8)
    tpm = {8: 1.0e6, 16: 1.05e6, 32: 1.06e6}
    run = lambda r: figs(tpm[r.concurrency], r.concurrency / 4)  # noqa: E731
    m = sweep(plan, tmp_path, run_cell=run, out=tmp_path / "a", plots=False)
    assert [k.concurrency for k in m.knees()] == [16]  # +5% then +0.95%
    m = sweep(plan, tmp_path, run_cell=run, out=tmp_path / "b", plots=False, min_gain=0.08)
    assert [k.concurrency for k in m.knees()] == [8]
    assert sw.load_matrix(tmp_path / "b").min_gain == 0.08
    assert json.loads((tmp_path / "b" / "matrix.json").read_text())["knees"][0]["concurrency"] == 8


@pytest.mark.parametrize("bad", ["0", "1", "-0.1", "x", None, "nan"])
def test_bad_knee_thresholds_are_refused(bad):
    with pytest.raises(InvalidInput):
        sw.parse_min_gain(bad)




# ---------------------------------------------------------------- one declared plan, walked by the runner

SMALL = dict(budget=96, ratios="2:1,5:1,13:1", concurrencies="8,16", workload="160k/1300", gpus_per_instance=8,
             repeats=2)
SMALL_STEPS = ["open-matrix",
               "sweep-scale 8p4d", "sweep-run 8p4d C8 r1", "sweep-run 8p4d C8 r2", "sweep-run 8p4d C16 r1",
               "sweep-run 8p4d C16 r2",
               "sweep-scale 10p2d", "sweep-run 10p2d C8 r1", "sweep-run 10p2d C8 r2", "sweep-run 10p2d C16 r1",
               "sweep-run 10p2d C16 r2"]  # 13:1 needs 14 instances: not tried, no step


def small_plan(**kw):
    s = dict(SMALL)
    return sw.plan_sweep(s.pop("budget"), s.pop("ratios"), s.pop("concurrencies"), s.pop("workload"), **s, **kw)


def test_the_sweep_is_one_declared_plan_with_its_step_ids_and_kinds():
    from pdops.kinds import KINDS

    plan = small_plan(out_dir="/srv/x/sweep", requests=10, timeout_s=120).plan
    assert plan.operation == "sweep" and plan.step_ids() == SMALL_STEPS
    assert [s.name for s in plan.always] == ["write-matrix"] and plan.rescue == []
    assert plan.always_on_interrupt  # Ctrl-C still writes the matrix and the plots of what was measured
    assert {s.kind for s in plan.steps + plan.always} == {"open-matrix", "sweep-scale", "sweep-run", "write-matrix"}
    assert {s.kind for s in plan.steps + plan.always} <= set(KINDS)  # in the one table
    plan.check()  # every output a step reads is given by a step before it
    run = plan.steps[2]
    assert run.params == {"ratio": "2:1", "topology": "8p4d", "concurrency": 8, "repeat": 1, "repeats": 2,
                          "run_dir": "/srv/x/sweep/runs/8p4d-c8-r1", "workload": "160k/1300", "requests": 10,
                          "duration": None, "ignore_eos": False, "timeout_s": 120, "out_dir": "/srv/x/sweep"}
    assert run.needs == ("sweep_matrix", "sweep_failed_rows?")
    scale = plan.steps[6]
    assert scale.params == {"ratio": "5:1", "topology": "10p2d", "out_dir": "/srv/x/sweep"}
    # planned without the inventory and the record (stand-in seams): no row's change, and the step says so
    assert "not planned: the sweep was planned without the record" in scale.description
    # no executor reads the SweepPlan: the first step carries the whole matrix as planned
    assert len(plan.steps[0].params["matrix"]["cells"]) == 6


def test_the_dry_run_lists_every_step_and_the_always_step(capsys, tmp_path, monkeypatch):
    from invoke import Context

    from pdops.cli import bench as cli_bench

    text = small_plan().render()
    printed = [ln.split(". ", 1)[1].split(" — ", 1)[0] for ln in text.splitlines()
               if ln[:6].strip().rstrip(".").isdigit()]
    assert printed == SMALL_STEPS
    assert "whatever the outcome, last (always):\n  A1. write-matrix — " in text
    assert "13:1: not tried: 13:1 needs at least 14 instances" in text and "uses: sweep_matrix (step 1)" in text
    # the CLI prints the same plan and runs nothing with --dry-run
    monkeypatch.setattr(cli_bench.rec, "open_record", lambda inv, **kw: StateDir(inv.cluster, tmp_path / "state"))
    cli_bench.sweep(Context(), budget=32, ratios="3:1,1:1", concurrency="1,16", duration=6, dry_run=True,
                    inventory=str(Path(__file__).resolve().parents[3] / "inventory" / "lab"), out=str(tmp_path / "s"))
    out = capsys.readouterr().out
    assert [ln.split(". ", 1)[1].split(" — ", 1)[0] for ln in out.splitlines()
            if ln[:6].strip().rstrip(".").isdigit()] == [
        "open-matrix", "sweep-scale 3p1d", "sweep-run 3p1d C1 r1", "sweep-run 3p1d C16 r1",
        "sweep-scale 2p2d", "sweep-run 2p2d C1 r1", "sweep-run 2p2d C16 r1"]
    assert "A1. write-matrix" in out and f"into {tmp_path / 's'}" in out
    # each row's deploy or change is printed under its step, the second forecast from the first's revision
    assert "      plan: deploy 3p1d on lab (4 hosts" in out and "      plan: scale: lab from revision 1 (3p1d) to 2p2d" in out
    assert not (tmp_path / "s").exists() and not (tmp_path / "state").exists()  # nothing run, nothing recorded


def test_the_journal_has_the_plan_and_every_step_by_id_and_a_failed_scale_is_a_row_not_a_stop(tmp_path):
    state = StateDir("lab", tmp_path / "state")
    held = []

    def scale_to(topo, row):
        held.append(state.lock("other").holder().operation)  # the sweep holds the lock while it scales
        with pytest.raises(Refused, match="locked by"):  # and nobody else can take it meanwhile
            state.lock("scale").acquire()
        if str(topo) == "8p4d":
            raise Unverified("p09 did not become healthy")
        return {"how": "changed as scale-1", "op": "scale-1", "revision": 2}

    m = sw.execute_sweep(small_plan(), scale_to=scale_to, run_cell=lambda r: figs(1e6, r.concurrency), record=state,
                         out_dir=tmp_path / "out", say=lambda s: None, plots=False, op="sweep-test")
    assert held == ["sweep", "sweep"]
    recs = state.journal().read("sweep-test")
    plan_rec = next(r for r in recs if r["step"] == "plan")
    assert plan_rec["evidence"]["steps"] == SMALL_STEPS and plan_rec["evidence"]["always"] == ["write-matrix"]
    walked = [r["step"] for r in recs if r["step"] not in ("plan", "verdict")]
    assert walked == SMALL_STEPS + ["write-matrix"]
    st = {r["step"]: r for r in recs}
    assert st["sweep-scale 8p4d"]["evidence"]["scaled"] is False
    assert "scale to 8p4d failed: unverified: p09 did not become healthy" in st["sweep-scale 8p4d"]["evidence"]["error"]
    assert st["sweep-run 8p4d C8 r1"]["status"] == "noop"  # its row failed: not run, and said why
    assert "scale to 8p4d failed" in st["sweep-run 8p4d C8 r1"]["evidence"]["reason"]
    assert st["sweep-scale 10p2d"]["evidence"]["revision"] == 2 and st["sweep-run 10p2d C16 r2"]["status"] == "ok"
    verdict = st["verdict"]
    assert verdict["status"] == "ok" and verdict["evidence"]["cells"] == {"measured": 2, "failed": 2, "not_tried": 2,
                                                                          "planned": 0}
    assert any("2:1 (8p4d) not measured: scale to 8p4d failed" in u for u in verdict["evidence"]["unverified"])
    assert m.cell("2:1", 8).state == sw.FAILED and m.cell("5:1", 16).state == sw.MEASURED
    assert len(m.cell("5:1", 16).runs) == 2
    assert state.lock("next").holder() is None  # released after the walk


def test_an_interrupted_sweep_keeps_what_it_measured_and_still_writes_the_matrix(tmp_path):
    import matplotlib  # noqa: F401

    def run_cell(run):
        if run.topology.prefill == 10:
            raise KeyboardInterrupt
        return figs(1e6 + run.concurrency, run.concurrency)

    state = StateDir("lab", tmp_path / "state")
    with pytest.raises(KeyboardInterrupt):
        sw.execute_sweep(small_plan(), scale_to=lambda t, row: None, run_cell=run_cell, record=state,
                         out_dir=tmp_path / "out", say=lambda s: None, op="sweep-int")
    back = sw.load_matrix(tmp_path / "out")
    assert back.cell("2:1", 16).state == sw.MEASURED and len(back.cell("2:1", 16).runs) == 2
    assert back.cell("5:1", 8).state == sw.PLANNED
    assert (tmp_path / "out" / "tpm_vs_concurrency.png").exists()  # the always step ran after Ctrl-C
    recs = state.journal().read("sweep-int")
    assert [r["status"] for r in recs if r["step"] == "write-matrix"] == ["ok"]
    assert recs[-1]["step"] == "verdict" and recs[-1]["status"] == "interrupted"


def test_the_dry_run_prints_each_rows_deploy_and_change_in_full_forecast_from_the_row_before(fleet, tmp_path):
    """Every row's way to its topology is planned with the sweep: the first from the record (nothing
    live: a deploy), each later one from the revision the row before is to record. Nothing is written."""
    state = StateDir("fleet", tmp_path / "state")
    plan = sw.plan_sweep(96, "2:1,3:1,5:1", "8", "160k/1300", gpus_per_instance=8, inv=fleet, record=state)
    text = plan.render()
    rows = [s for s in plan.plan.steps if s.kind == "sweep-scale"]
    assert [(r.params["plan"].how, r.params["plan"].basis, r.params["plan"].forecast) for r in rows] == [
        ("deploy", None, False), ("change", 1, True), ("change", 2, True)]
    assert "2:1: deploy 8p4d, planned from nothing live: the steps below" in rows[0].description
    assert "3:1: the change to 9p3d, planned from revision 1, the one the row before is to record (forecast)" in text
    # each row's plan is printed under its step, step by step, with its rescue
    assert "      plan: deploy 8p4d on rtx6000d" in text and "        33. record — write the revision" in text
    assert "      plan: scale: rtx6000d from revision 1 (8p4d) to 9p3d" in text
    assert "      plan: scale: rtx6000d from revision 2 (9p3d) to 10p2d" in text
    assert "          9. drain d04: leave-gateway" in text and "DELETE /workers/<its id, found by its URL>" in text
    assert "          R8. record-halt" in text
    assert state.current() is None and state.revision_numbers() == []  # the forecast wrote nothing


def _record_row(state, how, plan, fleet):
    """What the walk of a row's plan records, with the ids and PIDs a forecast cannot know."""
    from pdops.ops.scale.change import change_facts
    from pdops.ops.scale.revision import record_change
    from pdops.steps.revisions import record_deploy

    if how == "deploy":
        pl = plan.placement
        return record_deploy(state, fleet, pl, plan.files, "deploy-1", workers={i.id: f"w-{i.id}" for i in pl.instances},
                             build="/b", running={}, main_pids={i.id: {"gpu01:u": 4242} for i in pl.instances}).number
    facts = change_facts(plan)
    rev = record_change(facts, state, "scale-1", {i.id: f"w-{i.id}" for i in facts.added}, "/b")
    state.set_current(rev.number)
    return rev.number


def test_each_row_is_planned_again_when_it_starts_and_walked_only_as_printed(fleet, tmp_path, monkeypatch):
    """Live, each row is planned again from the record (with the worker ids the row before registered)
    and walked when it is the printed one; a row forecast from a revision never recorded (the row before
    it failed) is refused, naming how it differs, and nothing of it runs. The seam never takes the lock."""
    import contextlib

    from pdops.ops import deploy as dep
    from pdops.ops import scale as scale_mod
    from pdops.ops.sweep import execute as sweep_exec

    state = StateDir("fleet", tmp_path / "state")
    plan = sw.plan_sweep(96, "2:1,3:1,5:1", "8", "160k/1300", gpus_per_instance=8, inv=fleet, record=state)
    printed = {s.params["ratio"]: s.params["plan"] for s in plan.plan.steps if s.kind == "sweep-scale"}
    walked = []

    def deploy(p, say, op, **conns):
        walked.append(("deploy", str(p.placement.topology), op[:7]))
        return {"revision": _record_row(state, "deploy", p, fleet)}

    def change(p, st, say, op, **conns):
        walked.append(("scale", p.headline(), op[:6]))
        # the change walked has the facts of the record: the worker id row 1 registered, not the forecast's
        assert [i.id for i in p.removed] == [{"9p3d": "d04", "10p2d": "d03"}[str(p.target.topology)]]
        assert f"DELETE /workers/w-{p.removed[0].id}" in p.render()
        return {"revision": _record_row(state, "change", p, fleet) if str(p.target.topology) == "9p3d" else None}

    monkeypatch.setattr(sweep_exec, "connections", lambda inv: contextlib.nullcontext({}))  # no hosts here
    read = []  # what serves is read before each row that starts from a live revision: here, all of it
    monkeypatch.setattr(sweep_exec, "serving_now", lambda inv, rev, conns: read.append(rev.number) or Seen())
    monkeypatch.setattr(dep, "execute_deploy", deploy)
    monkeypatch.setattr(scale_mod, "execute_scale", change)
    monkeypatch.setattr(state, "lock", lambda *a, **kw: pytest.fail("the scale seam took the cluster lock"))
    said = []
    scale_to = sw.scale_live(fleet, state, said.append)
    topo = {r: printed[r].topology for r in printed}
    got = scale_to(topo["2:1"], printed["2:1"])
    assert got["revision"] == 1 and got["how"] == f"deployed as {got['op']}" and got["op"].startswith("deploy-")
    got = scale_to(topo["3:1"], printed["3:1"])
    assert got["revision"] == 2 and got["how"] == f"changed as {got['op']}" and got["op"].startswith("scale-")
    assert [w[:2] for w in walked] == [("deploy", "8p4d"), ("scale", "plan: scale: rtx6000d from revision 1 (8p4d) to 9p3d")]
    assert read == [1]  # nothing was live before the deploy
    assert any("the change planned again from revision 1 is the one printed, step for step" in ln for ln in said)
    # the third row, forecast from revision 2, is planned again from the recorded revision 2 and walked
    scale_to(topo["5:1"], printed["5:1"])
    assert walked[2][:2] == ("scale", "plan: scale: rtx6000d from revision 2 (9p3d) to 10p2d")


def test_a_row_forecast_from_a_revision_that_was_never_recorded_is_not_walked(fleet, tmp_path, monkeypatch):
    """The row before failed and its change was undone: the next row was forecast from a revision that
    never came, so planned again it differs; it is refused, naming how, and nothing of it runs."""
    from pdops.ops import scale as scale_mod

    state = StateDir("fleet", tmp_path / "state")
    plan = sw.plan_sweep(96, "2:1,3:1,5:1", "8", "160k/1300", gpus_per_instance=8, inv=fleet, record=state)
    printed = {s.params["ratio"]: s.params["plan"] for s in plan.plan.steps if s.kind == "sweep-scale"}
    _record_row(state, "deploy", printed["2:1"].plan, fleet)  # row 1 deployed; row 2 (9p3d) failed, undone
    monkeypatch.setattr(scale_mod, "execute_scale", lambda *a, **kw: pytest.fail("a row not as printed was walked"))
    _no_hosts(monkeypatch, Seen())
    with pytest.raises(Refused) as e:
        sw.scale_live(fleet, state, lambda s: None)(printed["5:1"].topology, printed["5:1"])
    msg = e.value.message
    assert ("the row's change planned now, from revision 1, is not the one printed (planned from revision 2, the one "
            "the row before is to record (forecast))") in msg
    assert "nothing of it was run" in msg and "the steps differ" in msg and "printed only: " in msg
    assert state.current() == 1
    # and a row whose record is the forecast one differs in nothing
    from pdops.ops.sweep.rows import differences, plan_row
    assert differences(printed["3:1"], plan_row(fleet, "3:1", printed["3:1"].topology, state)) == []


def test_each_cells_bench_is_named_by_its_step_before_it_runs_even_when_it_fails(tmp_path):
    """Every cell's bench is an operation of its own (`inv journal --op <id>`): the sweep-run step names
    it, whether the run ended well or raised (its failed verdict is then found by that id)."""
    state = StateDir("lab", tmp_path / "state")
    given = []

    def run_cell(run):
        given.append(run.op)
        if run.concurrency == 16:
            raise RuntimeError("the gateway refused every request")
        return figs(1e6, run.concurrency)

    sw.execute_sweep(small_plan(), scale_to=lambda t, row: None, run_cell=run_cell, record=state,
                     out_dir=tmp_path / "out", say=lambda s: None, plots=False, op="sweep-ops")
    runs = [r for r in state.journal().read("sweep-ops") if r["step"].startswith("sweep-run")]
    assert [r["evidence"]["op"] for r in runs] == given and len(set(given)) == len(given)
    assert all(op.startswith("bench-") for op in given)
    assert any(r["evidence"].get("error") and r["evidence"]["op"] for r in runs)


def test_after_a_failed_row_the_rows_planned_from_it_are_not_run_and_their_cells_say_why(fleet, tmp_path):
    """Row 2's change fails: row 3 was planned from the revision row 2 was to record, which never came.
    It is not run (no scale, no bench), its cells are not tried with the reason, and the matrix keeps
    what row 1 measured."""
    state = StateDir("fleet", tmp_path / "state")
    plan = sw.plan_sweep(96, "2:1,3:1,5:1", "8", "160k/1300", gpus_per_instance=8, inv=fleet, record=state)
    assert "the rows after it, planned from the revision it was to record, are then not run" in \
        plan.plan.steps[1].description
    assert "are then not run" not in plan.plan.steps[5].description  # the last row has none after it
    scaled = []

    def scale_to(topo, row):
        scaled.append((str(topo), row.how, row.basis))
        if str(topo) == "9p3d":
            raise Unverified("p09 did not become healthy")

    m = sw.execute_sweep(plan, scale_to=scale_to, run_cell=lambda r: figs(1e6, r.concurrency), record=state,
                         out_dir=tmp_path / "out", say=lambda s: None, plots=False, op="sweep-cascade")
    assert scaled == [("8p4d", "deploy", None), ("9p3d", "change", 1)]
    assert m.cell("2:1", 8).state == sw.MEASURED and m.cell("3:1", 8).state == sw.FAILED
    last = m.cell("5:1", 8)
    assert last.state == sw.NOT_TRIED and last.runs == []
    assert last.reason.startswith("not run: its change was planned from revision 2, which the rows before it were "
                                  "to record, and row 3:1 failed")
    st = {r["step"]: r for r in state.journal().read("sweep-cascade")}
    assert st["sweep-scale 10p2d"]["status"] == "noop" and st["sweep-run 10p2d C8 r1"]["status"] == "noop"
    assert st["sweep-scale 10p2d"]["evidence"]["cells_not_tried"] == ["5:1/C8"]
    assert st["verdict"]["evidence"]["cells"] == {"measured": 1, "failed": 1, "not_tried": 1, "planned": 0}
    assert sw.load_matrix(tmp_path / "out").cell("5:1", 8).state == sw.NOT_TRIED


def test_a_row_already_running_is_nothing_to_change_and_the_next_is_planned_from_the_real_revision(
        fleet, tmp_path, monkeypatch):
    from pdops.ops import scale as scale_mod

    state = StateDir("fleet", tmp_path / "state")
    first = sw.plan_sweep(96, "2:1", "8", "160k/1300", gpus_per_instance=8, inv=fleet, record=state)
    _record_row(state, "deploy", first.plan.steps[1].params["plan"].plan, fleet)  # 8p4d runs, revision 1
    plan = sw.plan_sweep(96, "2:1,3:1", "8", "160k/1300", gpus_per_instance=8, inv=fleet, record=state)
    rows = [s.params["plan"] for s in plan.plan.steps if s.kind == "sweep-scale"]
    assert [(r.how, r.basis, r.forecast) for r in rows] == [("nothing", 1, False), ("change", 1, False)]
    text = plan.render()
    assert "2:1: nothing to change (8p4d runs), planned from revision 1" in text
    assert not any("forecast revision" in n for n in plan.plan.notes)  # no row is planned from a forecast
    monkeypatch.setattr(scale_mod, "execute_scale", lambda *a, **kw: pytest.fail("nothing to change was walked"))
    _no_hosts(monkeypatch, Seen())  # every instance serves, read now
    got = sw.scale_live(fleet, state, lambda s: None)(rows[0].topology, rows[0])
    assert got["op"] is None and got["how"].startswith("nothing to change") and got["revision"] == 1
    assert got["how"].endswith("every instance serves (read now)")
    # the record says 8p4d runs, but d02's units are not running now: not "nothing to change", and not the
    # row printed (its change would replace d02): refused, naming what was observed, nothing walked
    _no_hosts(monkeypatch, Seen(not_serving={"d02": "units not running: gpu10:pdops-d02.service failed"},
                                down=frozenset({"d02"})))
    with pytest.raises(Refused) as e:
        sw.scale_live(fleet, state, lambda s: None)(rows[0].topology, rows[0])
    assert "the row's change planned now, from revision 1, is not the one printed" in e.value.message
    assert "observed now: d02 does not serve (units not running: gpu10:pdops-d02.service failed)" in e.value.message
    assert state.current() == 1


def _no_hosts(monkeypatch, seen):
    """The live seam's connections and its reading of what serves, for a cluster no test can reach."""
    import contextlib

    from pdops.ops.sweep import execute as sweep_exec

    monkeypatch.setattr(sweep_exec, "connections", lambda inv: contextlib.nullcontext({}))
    monkeypatch.setattr(sweep_exec, "serving_now", lambda inv, rev, conns: seen)


def test_a_sweep_no_row_of_which_can_be_planned_from_the_record_is_refused(fleet, tmp_path):
    """6p6d runs with every host cordoned: no change to another topology can place its new instances.
    The sweep is refused before anything runs, naming each row's reason; nothing is recorded."""
    import json

    from pdops.ops.sweep.rows import plan_row

    state = StateDir("fleet", tmp_path / "state")
    row = plan_row(fleet, "1:1", sw.topology_for_ratio(96, 8, sw.parse_ratios("1:1")[0])[0], state)
    n = _record_row(state, "deploy", row.plan, fleet)
    doc = json.loads(state.revision_file(n).read_text())
    doc["extra"]["cordoned"] = [h.name for h in fleet.hosts]
    state.revision_file(n).write_text(json.dumps(doc))
    with pytest.raises(Refused) as e:
        sw.plan_sweep(96, "2:1,3:1", "8", "160k/1300", gpus_per_instance=8, inv=fleet, record=state)
    assert e.value.message.startswith("no row of the sweep can be planned from the record: 2:1: its change cannot "
                                      "be planned: --topology: 8p4d needs 12 instances")
    assert "; 3:1: its change cannot be planned: " in e.value.message and e.value.message.endswith("nothing was run")
    assert state.revision_numbers() == [1] and state.current() == 1


def test_differences_name_what_is_not_as_printed(fleet, tmp_path):
    import dataclasses

    from pdops.ops.sweep.rows import differences, plan_row

    state = StateDir("fleet", tmp_path / "state")
    row = plan_row(fleet, "2:1", sw.topology_for_ratio(96, 8, sw.parse_ratios("2:1")[0])[0], state)
    assert differences(row, row) == []
    f0 = row.plan.files[0]
    edited = dataclasses.replace(row, plan=dataclasses.replace(
        row.plan, files=[dataclasses.replace(f0, content=f0.content + "#")] + row.plan.files[1:]))
    assert differences(row, edited) == [f"1 rendered file(s) differ: {f0.host}:{f0.path}"]
    other = plan_row(fleet, "1:1", sw.topology_for_ratio(96, 8, sw.parse_ratios("1:1")[0])[0], state)
    diff = differences(row, other)
    assert diff[0] == "the target placement differs" and any(d.startswith("the steps differ") for d in diff)
