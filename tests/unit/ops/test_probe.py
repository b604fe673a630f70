"""`inv probe` without hosts: bundles checked against SGLang's flag table, the plan and its refusals
(before any connection), outcomes and failure signatures from ledger rows and journal text, the
probe table."""

from __future__ import annotations

import csv
import io

import pytest

from pdops.ops import probe as pr
from pdops.errors import InvalidInput, Refused
from pdops.remote.loadgen import LedgerRow
from pdops.model.commands import engine_args, override_args
from pdops.record.local import StateDir
from tests.unit.recorded import deployed


def bundle_file(tmp_path, text, name="b.yml"):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.fixture
def state(tmp_path):
    return StateDir("test", tmp_path / "state")


def test_a_bundle_is_checked_against_sglangs_flag_table(tmp_path):
    b = pr.load_bundle(bundle_file(tmp_path, "name: T3\nflags: {chunked-prefill-size: 16384, mem-fraction-static: 0.5}\n"))
    assert b.name == "T3" and dict(b.flags) == {"--chunked-prefill-size": "16384", "--mem-fraction-static": "0.5"}
    cases = {
        "flags: {chunked-prefil-size: 1}\n": "is not a flag of SGLang 0.5.23",       # unknown (typo)
        "flags: {chunked-prefill: 1}\n": "is not a flag",                            # an abbreviation
        "flags: {mem-fraction-static: lots}\n": "rejects the bundle",                # not a float
        "flags: {chunked-prefill-size: 1.5}\n": "rejects the bundle",                # not an int
        "flags: {attention-backend: warp}\n": "rejects the bundle",                  # not one of its choices
        "flags: {port: 1}\n": "set by pdops",                                        # pdops owns it
        "flags: {enable-mixed-chunk: 3}\n": "takes no value",
        "flags: {}\n": "non-empty mapping",
        "prefill: {chunked-prefill-size: 8192}\ndecode: {chunked-prefill-size: 4096}\n": "heterogeneous",
        "prefill: {chunked-prefill-size: 8192}\n": "heterogeneous",
        "flags: {chunked-prefill-size: 1}\nextra: 1\n": "unknown key",
    }
    for text, want in cases.items():
        with pytest.raises(InvalidInput, match=want):
            pr.load_bundle(bundle_file(tmp_path, text))
    same = pr.load_bundle(bundle_file(tmp_path, "prefill: {page-size: 64}\ndecode: {page-size: 64}\n"))
    assert dict(same.flags) == {"--page-size": "64"}


def test_the_bundle_replaces_the_profiles_flags_on_the_probed_instance_only(lab_inv, tmp_path):
    import dataclasses

    from pdops.model.placement import place
    from pdops.model.topology import parse_topology

    pl = place(lab_inv, parse_topology("2p1d"))
    b = pr.load_bundle(bundle_file(tmp_path, "flags: {chunked-prefill-size: 16384, enable-mixed-chunk: true}\n"))
    inv = dataclasses.replace(lab_inv, engine_overrides={"p01": b.flags})
    p1, p2 = pl.get("p01"), pl.get("p02")
    a1 = engine_args(inv, pl, p1, p1.ranks[0])
    assert a1.count("--chunked-prefill-size") == 1 and a1[a1.index("--chunked-prefill-size") + 1] == "16384"
    assert "--enable-mixed-chunk" in a1
    a2 = engine_args(inv, pl, p2, p2.ranks[0])
    assert a2[a2.index("--chunked-prefill-size") + 1] == "8192" and "--enable-mixed-chunk" not in a2
    assert override_args(["--x", "1", "--flag", "--y", "2"], [("--flag", False), ("--y", "3")]) == ["--x", "1", "--y", "3"]


def test_variables_changed_are_counted_against_the_baseline(lab_inv, state, tmp_path):
    deployed(lab_inv, state, "1p1d")
    one = pr.plan_probe(lab_inv, state, pr.load_bundle(bundle_file(tmp_path, "flags: {chunked-prefill-size: 16384}\n")),
                        spare=True)
    assert [v["flag"] for v in one.variables] == ["--chunked-prefill-size"] and one.variables[0]["baseline"] == "8192"
    # the profile's own value is no change; a flag absent from the command line counts with SGLang's default
    two = pr.plan_probe(lab_inv, state, pr.load_bundle(bundle_file(
        tmp_path, "flags: {chunked-prefill-size: 8192, mem-fraction-static: 0.75, page-size: 64}\n")), spare=True)
    assert [v["flag"] for v in two.variables] == ["--mem-fraction-static", "--page-size"]
    assert "multi-variable" in two.render()
    control = pr.plan_probe(lab_inv, state, pr.load_bundle(bundle_file(tmp_path, "flags: {chunked-prefill-size: 8192}\n")),
                            spare=True)
    assert control.variables == [] and "control probe" in control.render()


def test_a_spare_pair_takes_free_gpus_and_touches_nothing_of_the_revision(lab_inv, state, tmp_path):
    deployed(lab_inv, state, "1p1d")
    plan = pr.plan_probe(lab_inv, state, pr.load_bundle(bundle_file(tmp_path, "flags: {chunked-prefill-size: 16384}\n")),
                         spare=True, workload="380k/8")
    assert plan.ids == ["p02", "d02"] and plan.workload == (380000, 8) and plan.requests == 4
    spare_hosts = {r.host for i in plan.pair for r in i.ranks}
    assert {f.path for f in plan.files} and all("p02" in f.path or "d02" in f.path or
                                                (f.path.endswith(".slice") and f.host in spare_hosts)
                                                for f in plan.files)
    assert not any(f.host in {r.host for i in plan.baseline.instances for r in i.ranks} and f.path.endswith(".slice")
                   for f in plan.files)  # a host the revision uses keeps its own
    names = [s.name for s in plan.steps]
    assert names[:2] == ["connect", "preflight"] and "probe-requests" in names
    assert not any(s.kind in ("register", "leave-gateway", "record-scale", "record-deploy") for s in plan.steps)
    back = [s.kind for s in pr.restore_steps(plan)]
    assert back[-2:] == ["probe-remove-files", "probe-verify-baseline"] and back.count("verify-stop") == 2


def test_probing_a_serving_pair_drains_it_and_the_way_back_is_a_recorded_change(lab_inv, state, tmp_path):
    deployed(lab_inv, state, "2p2d")
    b = pr.load_bundle(bundle_file(tmp_path, "flags: {chunked-prefill-size: 16384}\n"))
    plan = pr.plan_probe(lab_inv, state, b, instances="p02,d01")
    assert plan.ids == ["p02", "d01"]
    kinds = [s.kind for s in plan.steps]
    assert kinds.count("leave-gateway") == 2 and kinds.index("leave-gateway") < kinds.index("start")
    assert "register" not in kinds
    back = pr.change_after(plan, keep=False)
    assert sorted(i.id for i in back.replaced) == ["d01", "p02"] and back.run[-1].kind == "record-scale"
    assert all(s.name.startswith("restore: ") for s in back.run)
    kept = pr.change_after(plan, keep=True)
    assert any("16384" in f.content for f in kept.files if "p02" in f.path and f.path.endswith(".sh"))


def test_refused_before_any_host_is_touched(lab_inv, state, tmp_path):
    b = pr.load_bundle(bundle_file(tmp_path, "flags: {chunked-prefill-size: 16384}\n"))
    with pytest.raises(Refused, match="no current revision"):
        pr.plan_probe(lab_inv, state, b, spare=True)
    deployed(lab_inv, state, "1p1d")
    with pytest.raises(Refused, match="last serving prefill"):
        pr.plan_probe(lab_inv, state, b, instances="p01,d01")
    for kw, want in [({"instances": "p01,d01", "spare": True}, "exactly one"), ({}, "exactly one"),
                     ({"spare": True, "keep": True}, "nothing to keep"), ({"instances": "p01,p09"}, "not in revision"),
                     ({"instances": "p01"}, "one prefill and one decode"), ({"spare": True, "requests": 0}, "1..64"),
                     ({"spare": True, "requests": 4, "concurrency": 5}, "not 1..4"),
                     ({"spare": True, "workload": "lots"}, "INPUT/OUTPUT")]:
        with pytest.raises(InvalidInput, match=want):
            pr.plan_probe(lab_inv, state, b, **kw)
    full = StateDir("full", tmp_path / "full")
    deployed(lab_inv, full, "2p2d")
    with pytest.raises(Refused, match="no free GPUs for a spare"):
        pr.plan_probe(lab_inv, full, b, spare=True)


# A scheduler's traceback as SGLang logs it in the journal (`journalctl -o cat`): the message line, the
# frames, the exception line with PyTorch's CUDA OOM text (c10/cuda/CUDACachingAllocator.cpp format).
REAL_OOM = """[2026-11-20 03:12:44 TP3] Scheduler hit an exception: Traceback (most recent call last):
  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 2847, in run_scheduler_process
    scheduler.event_loop_overlap_disagg_prefill()
  File "/sgl-workspace/sglang/python/sglang/srt/models/deepseek_v2.py", line 3012, in forward
    hidden_states = self.model(input_ids, positions, forward_batch)
  File "/sgl-workspace/sglang/python/sglang/srt/layers/attention/nsa/nsa_indexer.py", line 412, in _low_ratio_index_topk_extend
    scores = torch.empty((q.shape[0], k.shape[0]), dtype=torch.float8_e4m3fn, device=q.device)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 5.50 GiB. GPU 3 has a total capacity of 95.00 GiB of which 2.10 GiB is free.
[2026-11-20 03:12:45] Received sigquit from a child process. It usually means the child failed.
"""
TRANSFER = "[2026-11-20 03:12:50 sim prefill :30001] request pdops-probe-1 aborted: KV transfer failed for request rid=pdops-probe-1 (injected) (status 500)\n"


def test_signatures_from_journal_text():
    sigs = pr.signatures(REAL_OOM + REAL_OOM + TRANSFER, "lab02:pdops-p02.service")
    exc = [s for s in sigs if s["kind"] == "exception"]
    assert len(exc) == 1 and exc[0]["count"] == 2  # the same signature twice: counted, not repeated
    s = exc[0]
    assert s["exception"] == "torch.OutOfMemoryError" and s["alloc_gib"] == 5.5
    assert s["top_frames"][0] == "nsa_indexer.py:412 _low_ratio_index_topk_extend"
    assert s["top_frames"][1] == "deepseek_v2.py:3012 forward" and s["where"] == ["lab02:pdops-p02.service"]
    tr = [s for s in sigs if s["kind"] == "transfer"]
    assert len(tr) == 1 and tr[0]["rids"] == ["pdops-probe-1"] and "rid=*" in tr[0]["line"]
    mib = pr.signatures(REAL_OOM.replace("5.50 GiB", "512.00 MiB"))
    assert mib[0]["alloc_gib"] == 0.5
    assert pr.signatures("all good\nno traceback here\n") == []


def row(status="ok", error=None, pre=None, http=200):
    r = LedgerRow(rid="r1", stream=False, start=0.0, status=status, error=error, http_status=http)
    r.extra["prefill"] = pre or {"http_status": 200}
    return r


def test_each_requests_outcome():
    assert pr.classify(row()) == "ok"
    oom = row("http_500", '{"message": "KV transfer failed for request rid=r1: prefill aborted the request: '
              'CUDA out of memory. Tried to allocate 1.00 GiB"}', {"http_status": 500, "error": "CUDA out of memory"}, 500)
    assert pr.classify(oom) == "OOM"  # the prefill's OOM, not the decode's transfer error it caused
    assert pr.classify(row("http_500", "KV transfer failed for request rid=r1 (injected)", None, 500)) == "transfer failure"
    assert pr.classify(row("http_500", "Failed to get prefill server info from bootstrap server 1.2.3.4:8998", None,
                           500)) == "bootstrap failure"
    assert pr.classify(row("timeout", None, {"error": "timeout"}, None)) == "timeout"
    assert pr.classify(row("http_400", "Input length (380008 tokens) exceeds the maximum allowed length", None,
                           400)) == "HTTP 400"
    # a bare 500 whose journal names an OOM for its request
    assert pr.classify(row("http_500", "internal", None, 500),
                       [{"kind": "exception", "exception": "torch.OutOfMemoryError", "rids": ["r1"]}]) == "OOM"
    assert pr.result_line(["ok", "OOM", "OOM", "OOM"]) == "1/4 ok, 3/4 OOM"
    assert pr.result_line(["OOM"] * 4) == "0/4 ok, 4/4 OOM"
    assert pr.result_line(["transfer failure", "OOM", "OOM", "OOM"]) == "0/4 ok, 3/4 OOM, 1/4 transfer failure"
    assert pr.mixed_reasons(["OOM"] * 4, [], False) == []
    assert pr.mixed_reasons(["transfer failure", "OOM"], [], False)[0].startswith("1 request(s) ended in a transfer")
    assert pr.mixed_reasons(["ok"], ["lab01:u"], True) == ["lab01:u restarted during the window",
                                                          "the pair's canary failed once before it passed"]
    # a real scheduler exits on its OOM: the restart and the cut requests are the bundle's outcome
    sigs = pr.signatures(REAL_OOM, "lab02:pdops-p02.service")
    assert pr.mixed_reasons(["OOM"], ["lab02:pdops-p02.service"], False, sigs) == []
    assert pr.attribute_crash(["ok", "error", "HTTP 502", "timeout"], ["lab02:pdops-p02.service"], sigs) == [
        "ok", "OOM", "OOM", "timeout"]
    assert pr.attribute_crash(["error"], ["lab03:pdops-d02.service"], sigs) == ["error"]  # another unit: not it
    assert pr.attribute_crash(["error"], [], sigs) == ["error"]


def test_the_table_never_says_best_and_marks_multi_variable_and_mixed(tmp_path):
    st = StateDir("t", tmp_path / "s")
    j = st.journal()
    base = {"bundle": {"name": "x"}, "pair": ["p02", "d02"], "workload": {"input_tokens": 380000, "output_tokens": 8}}
    j.step("op1", "probe-result", "ok", {**base, "probe": "T1", "variables": [{"flag": "--chunked-prefill-size",
            "baseline": "8192", "candidate": "16384"}], "n_variables": 1, "multi_variable": False,
            "result": "1/4 ok, 3/4 OOM", "mixed": False, "mixed_reasons": [],
            "signatures": pr.signatures(REAL_OOM)})
    j.step("op2", "probe-result", "ok", {**base, "probe": "T2", "variables": [{"flag": "--a", "baseline": "1",
            "candidate": "2"}, {"flag": "--b", "baseline": "1", "candidate": "2"}], "n_variables": 2,
            "multi_variable": True, "result": "0/4 ok, 3/4 OOM, 1/4 transfer failure", "mixed": True,
            "mixed_reasons": ["1 request(s) ended in a transfer failure"], "signatures": []})
    j.step("op3", "probe-note", "ok", {"probe": "T1", "note": "workspace short at chunk 16384", "operator": "me"})
    rows = pr.probe_table(j)
    assert [r["probe"] for r in rows] == ["T1", "T2"] and rows[0]["notes"][0]["note"].startswith("workspace")
    text = pr.render_table(rows)
    assert "OutOfMemoryError 5.50 GiB in _low_ratio_index_topk_extend (x1)" in text
    assert "[multi-variable]" in text and "[mixed]" in text and "best" not in text.replace("not a best practice", "")
    got = list(csv.DictReader(io.StringIO(pr.table_csv(rows))))
    assert got[0]["reading"] == "workspace short at chunk 16384" and got[1]["multi_variable"] == "True"
    assert got[1]["mixed"] == "True" and got[0]["workload"] == "380000/8"
    assert pr.next_probe_id(j) == "T3"
    with pytest.raises(InvalidInput, match="no probe T9"):
        pr.add_note(st, "T9", "x")
    with pytest.raises(InvalidInput, match="empty"):
        pr.add_note(st, "T1", "  ")
    pr.add_note(st, "T2", "mixed: says nothing about --b")
    assert pr.probe_table(st.journal())[1]["notes"][-1]["note"] == "mixed: says nothing about --b"


def test_the_verdict_of_a_probe_names_its_result_where_the_pair_is_and_its_mixed_windows():
    doc = {"probe": "T3", "bundle": {"name": "big-chunk"}, "pair": ["p01", "d01"], "result": "2 ok, 2 oom",
           "multi_variable": True, "mixed": True, "mixed_reasons": ["another request ran on d01"],
           "verified": ["4 requests sent"], "unverified": [], "after": {"how": "the revision's files, as a new revision"}}
    head, v = pr.probe_verdict(doc)
    assert head == "probe T3 of bundle 'big-chunk' on p01, d01: 2 ok, 2 oom [multi-variable] [mixed]"
    assert v["verified"] == ["4 requests sent", "the revision's files, as a new revision"]
    assert v["unverified"] == ["mixed window: another request ran on d01"]
    assert "inv probe --note T3" in v["notes"][0]


def test_a_probe_is_numbered_and_its_result_recorded_however_its_walk_and_its_way_back_end(tmp_path, registry):
    """execute_probe on stand-in steps: a probe whose requests failed is a result (returned, exit 0); one
    whose way back failed, or was cut short by a second Ctrl-C, is an error saying the pair may still run
    the bundle; a Ctrl-C with the way back done is raised on. Every one is numbered (T1, T2, ...) and has
    its probe-result record after its verdict."""
    from types import SimpleNamespace

    from pdops.errors import PdopsError
    from pdops.model.placement import Placement
    from pdops.ops.probe.execute import execute_probe
    from pdops.ops.probe.plan import ProbePlan
    from pdops.plans import Outcome, Step

    record = StateDir("test", tmp_path / "state")
    how = {}

    def requests(ctx, s):
        ctx.give(s, "probe_result", {"result": "0/4 ok", "outcomes": [], "signatures": [], "mixed_reasons": []})
        if how["requests"] == "ctrl-c":
            raise KeyboardInterrupt
        if how["requests"] == "fail":
            raise PdopsError("0 of 4 requests answered")
        return Outcome(verified=["4 requests sent"])

    def back(ctx, s):
        if how["back"] == "fail":
            raise PdopsError("the revision's files could not be put back")
        if how["back"] == "ctrl-c":
            raise KeyboardInterrupt
        return Outcome(verified=["the pair's files are the revision's again"])

    registry.bind({"measure": requests, "restore": back}, gives={"measure": ("probe_result",)})
    p, d = SimpleNamespace(id="p01"), SimpleNamespace(id="d01")
    plan = ProbePlan(inv=None, probe_inv=None, record=record, rev=SimpleNamespace(number=None),
                     bundle=SimpleNamespace(name="T", as_dict=lambda: {"name": "T"}), mode="instances", pair=(p, d),
                     baseline=Placement(SimpleNamespace(), ()), workload=(64, 32), requests=4, concurrency=2,
                     timeout_s=60, keep=False, variables=[{"flag": "--chunked-prefill-size"}],
                     steps=[Step("requests", None, "requests", kind="measure")],
                     always=[Step("restore", None, "the way back", kind="restore")])

    def probe(requests_end, back_end):
        how.update(requests=requests_end, back=back_end)
        return execute_probe(plan, lambda line: None, pool=None, gateways=None)

    doc = probe("fail", "ok")
    assert doc["probe"] == "T1" and doc["result"] == "0/4 ok" and doc["after"]["restored"] is True
    assert doc["verified"] == ["the pair's files are the revision's again"]
    with pytest.raises(PdopsError, match=r"probe T2 \(0/4 ok\): the way back did not complete: restore: "):
        probe("pass", "fail")
    with pytest.raises(KeyboardInterrupt):
        probe("ctrl-c", "ok")
    with pytest.raises(PdopsError, match=r"probe T4 .*the way back did not complete: restore: interrupted"):
        probe("ctrl-c", "ctrl-c")
    results = record.journal().tagged("step:probe-result")
    assert [(r["evidence"]["probe"], r["status"], r["evidence"]["after"]["restored"]) for r in results] == [
        ("T1", "ok", True), ("T2", "failed", False), ("T3", "ok", True), ("T4", "failed", False)]
    for r in results:  # after its operation's verdict, under its lock
        steps = [x["step"] for x in record.journal().read(r["op_id"])]
        assert steps[-2:] == ["verdict", "probe-result"]
    assert [record.journal().read(r["op_id"])[-2]["status"] for r in results] == \
        ["failed", "failed", "interrupted", "interrupted"]
