"""`inv report --op ID` with no hosts: a journal written here (a rolling change that failed in its
second wave, ran its rescue and its always step) becomes a page that shows every step, marks the
rescue and always steps, gives the verdict, says in words that no Prometheus answered, and shows
times in the operator's zone with UTC beside them; with a Prometheus (a stand-in query here) every
dashboard panel is drawn on the operation's time axis."""

from __future__ import annotations

import datetime as _dt
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdops.ops import prometheus as obs
from pdops.ops import report as rep
from pdops.ops.report import metrics, timeline
from pdops.ops.report.zone import Zone, operator_zone
from pdops.record.local import StateDir

REPO = Path(__file__).resolve().parents[3]
OP = "scale-20261204T120000Z-abc123"
T0 = _dt.datetime(2026, 12, 4, 12, 0, 0, tzinfo=_dt.timezone.utc)

# (step, status, end second, duration or None, extra evidence)
STEPS = [
    ("lock.held", "ok", 0.0, None, {"operator": "alice", "machine": "laptop-7", "operation": "scale"}),
    ("plan", "ok", 0.1, None, {"operation": "scale", "from": 3, "to": "2p2d", "waves": [["p01", "d01"], ["p02", "d02"]],
                               "steps": ["connect", "replace p01: leave-gateway", "replace d01: leave-gateway",
                                         "start p01", "start d01", "canary p01+d01", "register p01", "register d01",
                                         "replace p02: leave-gateway", "start p02", "record"],
                               "rescue": ["undo p02: verified-stop", "restore-gateway"],
                               "always": ["publish-targets"]}),
    ("connect", "ok", 1.2, 1.1, {"target": None}),
    ("replace p01: leave-gateway", "ok", 3.0, 1.7, {"target": "lab01", "instance": "p01"}),
    ("replace d01: leave-gateway", "ok", 3.1, 1.8, {"target": "lab03", "instance": "d01"}),
    ("start p01", "ok", 9.0, 5.8, {"target": "lab01", "instance": "p01"}),
    ("start d01", "noop", 9.1, 0.1, {"target": "lab03", "instance": "d01", "reason": "already running"}),
    ("canary p01+d01", "ok", 11.0, 1.9, {"target": None}),
    ("register p01", "ok", 12.0, 0.9, {"target": None, "instance": "p01"}),
    ("register d01", "ok", 12.1, 1.0, {"target": None, "instance": "d01"}),
    ("replace p02: leave-gateway", "ok", 14.0, 1.8, {"target": "lab02", "instance": "p02"}),
    ("start p02", "failed", 40.0, 26.0, {"target": "lab02", "instance": "p02", "error": "unverified: p02 not healthy"}),
    ("undo p02: verified-stop", "ok", 44.0, 3.9, {"target": "lab02", "instance": "p02"}),
    ("restore-gateway", "failed", 45.0, 0.9, {"target": None, "error": "gateway refused"}),
    ("publish-targets", "ok", 45.5, 0.4, {"target": None, "revision": 4}),
    ("verdict", "failed", 45.6, None, {"error": "unverified: p02 not healthy\n  fix: read its journal",
                                       "current": 4, "partial": True}),
]


def write_journal(root: Path, steps=STEPS, op=OP) -> StateDir:
    st = StateDir("lab", root)
    st.path.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, status, end, secs, ev in steps:
        evidence = dict(ev)
        if secs is not None:
            evidence["seconds"] = secs
        lines.append(json.dumps({"ts": (T0 + _dt.timedelta(seconds=end)).isoformat(timespec="milliseconds"),
                                 "op_id": op, "step": name, "status": status, "evidence": evidence}, sort_keys=True))
    # another operation in the same journal: never on this page
    lines.append(json.dumps({"ts": T0.isoformat(), "op_id": "drain-20261204T110000Z-000000", "step": "plan",
                             "status": "ok", "evidence": {"steps": ["other-step"]}}))
    (st.path / "journal.jsonl").write_text("\n".join(lines) + "\n")
    return st


TOKYO = Zone(__import__("zoneinfo").ZoneInfo("Asia/Tokyo"), "Asia/Tokyo", "from TZ")
NO_PROM = rep.Source(None, "the inventory names no Prometheus")


@pytest.fixture
def journal(tmp_path):
    return write_journal(tmp_path / "state")


def test_the_page_shows_every_step_marks_rescue_and_always_and_gives_the_verdict(lab_inv, journal):
    r = rep.build_report(lab_inv, journal, OP, NO_PROM, zone=TOKYO, now=T0 + _dt.timedelta(minutes=10))
    data = rep.embedded_data(r.html)
    assert [s["step"] for s in data["steps"]] == [s[0] for s in STEPS]  # each journal record, in order, drawn
    assert "other-step" not in r.html
    for name, *_ in STEPS:
        assert f"<td>{name}</td>" in r.html  # the table of every record (html-escaped names are plain here)
    phase = {s["step"]: s["phase"] for s in data["steps"]}
    assert phase["undo p02: verified-stop"] == phase["restore-gateway"] == "rescue"
    assert phase["publish-targets"] == "always" and phase["start p02"] == "main" and phase["plan"] == "record"
    assert '<span class="rescue">rescue</span>' in r.html and '<span class="always">always</span>' in r.html
    # a step's bar spans its journalled duration, ending when it was journalled
    start_p01 = next(s for s in data["steps"] if s["step"] == "start p01")
    assert start_p01["start"] == (T0 + _dt.timedelta(seconds=3.2)).isoformat()
    assert start_p01["end"] == (T0 + _dt.timedelta(seconds=9)).isoformat() and not start_p01["point"]
    assert next(s for s in data["steps"] if s["step"] == "verdict")["point"]
    # waves and instances labelled
    wave = {s["step"]: s["wave"] for s in data["steps"]}
    assert wave["canary p01+d01"] == 1 and wave["start p02"] == 2 and wave["connect"] is None
    assert wave["undo p02: verified-stop"] is None  # a rescue step belongs to no wave
    assert [w["label"] for w in data["waves"]] == ["wave 1: p01, d01", "wave 2: p02, d02"]
    assert "wave 1: p01, d01" in r.html
    assert {s["step"]: s["instance"] for s in data["steps"]}["canary p01+d01"] == "p01+d01"
    # the verdict: failed, with its error; the plan with what each step did
    assert data["outcome"] == "failed" and '<span class="badge failed">failed</span>' in r.html
    assert "p02 not healthy" in r.html
    assert "<td>R2</td><td>restore-gateway</td><td>failed</td>" in r.html
    assert "<td>A1</td><td>publish-targets</td><td>ok</td>" in r.html
    assert "<td>11</td><td>record</td><td>not run</td>" in r.html
    assert "by alice on laptop-7" in r.html
    # the timeline is a PNG drawn into the page; nothing is fetched when it is opened
    assert r.html.count('src="data:image/png;base64,') == 1
    assert "http://" not in r.html.replace("http://mon01:9090", "") and "<link" not in r.html
    assert "<script src" not in r.html


def test_what_the_journal_holds_is_shown_as_text_never_as_markup(lab_inv, tmp_path):
    evil = "</script><script>alert(1)</script><!--"
    steps = STEPS[:3] + [("connect", "ok", 2.0, 0.5, {"target": None, "error": evil})] + STEPS[-1:]
    st = write_journal(tmp_path / "s", steps)
    r = rep.build_report(lab_inv, st, OP, NO_PROM, zone=TOKYO)
    assert "<script>alert" not in r.html and "<!--" not in r.html
    assert r.html.count("<script") == 1  # the data block alone, which runs nothing
    assert rep.embedded_data(r.html)["steps"][3]["step"] == "connect"


def test_a_passed_verdict_lists_what_was_verified_and_what_was_not(lab_inv, tmp_path):
    steps = STEPS[:11] + [("record", "ok", 15.0, 0.9, {"revision": 4}),
                          ("verdict", "ok", 15.1, None, {"verified": ["revision 4 recorded and current"],
                                                         "unverified": ["gateway mon01 not read"],
                                                         "notes": ["p02 kept"]})]
    st = write_journal(tmp_path / "s", steps)
    r = rep.build_report(lab_inv, st, OP, NO_PROM, zone=TOKYO, now=T0 + _dt.timedelta(minutes=10))
    assert '<span class="badge ok">ok</span>' in r.html
    assert "<h3>verified (1)</h3>" in r.html and '<li class="verified">revision 4 recorded and current</li>' in r.html
    assert "<h3>not verified (1)</h3>" in r.html and '<li class="unverified">gateway mon01 not read</li>' in r.html


def test_without_a_prometheus_the_page_says_so_in_words_and_draws_no_empty_chart(lab_inv, journal, tmp_path):
    r = rep.build_report(lab_inv, journal, OP, NO_PROM, zone=TOKYO)
    data = rep.embedded_data(r.html)
    assert data["prometheus"]["state"] == "not configured" and data["panels"] == []
    assert 'id="no-prometheus">No Prometheus is configured for this cluster' in r.html
    assert r.html.count("data:image/png") == 1  # the timeline alone
    # one that is configured but does not answer: said, with the address and the error
    silent = rep.Source("http://127.0.0.1:9", "given with --prometheus")
    r = rep.build_report(lab_inv, journal, OP, silent, zone=TOKYO)
    data = rep.embedded_data(r.html)
    assert data["prometheus"]["state"] == "no answer"
    assert "The cluster&#x27;s Prometheus at http://127.0.0.1:9 (given with --prometheus) did not answer" in r.html
    assert r.html.count("data:image/png") == 1


def test_times_are_in_the_operators_zone_with_utc_beside_them(lab_inv, journal):
    r = rep.build_report(lab_inv, journal, OP, NO_PROM, zone=TOKYO)
    line = ("Times are in Asia/Tokyo (JST, UTC+09:00), from TZ, with UTC beside each; set TZ to show another "
            "zone (e.g. TZ=Europe/Berlin).")
    assert f'<p class="tz" id="timezone">{line}</p>' in r.html
    assert rep.embedded_data(r.html)["timezone"]["offset"] == "UTC+09:00"
    # the operation started at 12:00:00 UTC: 21:00:00 in Tokyo; each step's end in both zones
    assert "from 2026-12-04 21:00:00 JST (12:00:00 UTC)" in r.html
    assert "<td>21:00:09 JST (12:00:09 UTC)</td>" in r.html  # start p01 ended


@pytest.mark.parametrize("env,name,offset_at_t0", [
    ({"TZ": "Asia/Tokyo"}, "Asia/Tokyo", "UTC+09:00"),
    ({"TZ": ":Europe/Berlin"}, "Europe/Berlin", "UTC+01:00"),
    ({"TZ": "America/New_York"}, "America/New_York", "UTC-05:00"),
    ({"TZ": "UTC"}, "UTC", "UTC+00:00"),
])
def test_tz_overrides_the_machines_zone(env, name, offset_at_t0):
    z = operator_zone(env)
    assert (z.name, z.offset(T0)) == (name, offset_at_t0) and z.source == "from TZ"
    # daylight saving time: the offset is the zone's at that moment
    if name == "Europe/Berlin":
        assert z.offset(_dt.datetime(2026, 7, 1, tzinfo=_dt.timezone.utc)) == "UTC+02:00"


def test_without_tz_the_zone_is_this_machines():
    z = operator_zone({})
    assert z.source.startswith("this machine's time zone")


def test_with_a_prometheus_every_dashboard_panel_is_drawn_on_the_operations_axis(lab_inv, journal, monkeypatch):
    """A stand-in Prometheus: each query answers with one series per instance over the window;
    the breaker panel names workers by the instance a revision gives their URL."""
    asked = []

    def query(url, expr, start, end, step):
        asked.append((expr, start, end, step))
        t = start.timestamp()
        pts = [(t + k * step, float(k % 5)) for k in range(int((end - start).total_seconds() // step))]
        labels = {"instance": "p01"}
        if "smg_worker_cb_state" in expr:
            labels = {"worker": "http://127.0.10.1:30000", "host": "lab01"}
        if "status_code" in expr:
            labels = {"status_code": "200", "error_code": ""}
        return [metrics.Series(expr, labels, pts)]

    monkeypatch.setattr(metrics, "answers", lambda url: "2.42.0")
    monkeypatch.setattr(rep, "worker_names", lambda state: {"http://127.0.10.1:30000": "p01"})
    src = rep.Source("http://mon01:9090", "the inventory's pdops_prometheus_url")
    now = T0 + _dt.timedelta(hours=1)
    r = rep.build_report(lab_inv, journal, OP, src, margin_s=60, zone=TOKYO, now=now, query=query)
    data = rep.embedded_data(r.html)
    # exactly the dashboard's queries, every revision, over the operation plus 60 s each side
    assert [e for e, *_ in asked] == [q for _, q in obs.panel_queries("lab", ".*")]
    assert {(s, e) for _, s, e, _ in asked} == {(T0 - _dt.timedelta(seconds=60), T0 + _dt.timedelta(seconds=105.6))}
    assert [p["title"] for p in data["panels"]] == [t for t, _, _ in obs.PANELS]
    assert all(p["drawn"] and p["points"] > 0 for p in data["panels"])
    assert r.html.count("data:image/png") == 1 + len(obs.PANELS)
    breakers = next(p for p in data["panels"] if "smg_worker_cb_state" in p["queries"][0])
    assert breakers["series"][0]["label"] == "p01 @ lab01"
    requests = next(p for p in data["panels"] if p["title"] == obs.REQUESTS_PANEL)
    assert requests["series"][0]["label"] == "200"
    assert r.summary().endswith(f"{len(obs.PANELS)} of {len(obs.PANELS)} dashboard panels with data from http://mon01:9090")


def test_an_instance_in_two_revisions_is_two_series_each_named_by_its_revision(lab_inv, journal, monkeypatch):
    """The target file's `revision` label moves with the operation's record step: the same instance
    is then two series, and the legend tells them apart."""
    def query(url, expr, start, end, step):
        t = start.timestamp()
        return [metrics.Series(expr, {"instance": "p01", "revision": rev}, [(t + k, 1.0) for k in range(5)])
                for rev in ("10", "9")]

    monkeypatch.setattr(metrics, "answers", lambda url: "2.42.0")
    r = rep.build_report(lab_inv, journal, OP, rep.Source("http://mon01:9090", "x"), zone=TOKYO, query=query)
    running = next(p for p in rep.embedded_data(r.html)["panels"] if p["title"] == "Running requests")
    assert [s["label"] for s in running["series"]] == ["p01 (rev 9)", "p01 (rev 10)"]


def test_a_panel_without_data_says_why_instead_of_an_empty_chart(lab_inv, journal, monkeypatch):
    monkeypatch.setattr(metrics, "answers", lambda url: "2.42.0")
    src = rep.Source("http://mon01:9090", "x")
    r = rep.build_report(lab_inv, journal, OP, src, zone=TOKYO, query=lambda *a: [])
    data = rep.embedded_data(r.html)
    assert not any(p["drawn"] for p in data["panels"]) and r.html.count("data:image/png") == 1
    tpm = next(p for p in data["panels"] if p["title"] == "Total TPM (input + output)")
    assert "is the file of `inv prometheus.rules` loaded?" in tpm["words"]
    assert "no data in the window" in r.html


def test_the_issue_s_panels_are_on_the_dashboard():
    """Requests by outcome, TTFT, TPM per instance, PD failures, the gateway's breakers, queue depths:
    the page draws the dashboard's panels, so these are the dashboard's too."""
    exprs = " ".join(e for _, _, es in obs.PANELS for e in es)
    for needle in ("smg_http_responses_total", "pdops:ttft_seconds:p99", "pdops:output_tpm:instance",
                   "pdops:input_tpm:instance", "pdops:pd_failures:rate5m", "smg_worker_cb_state",
                   "sglang:num_queue_reqs", "sglang:num_decode_transfer_queue_reqs"):
        assert needle in exprs, needle


def test_prometheus_source_follows_the_flag_then_the_inventory(lab_inv):
    import dataclasses

    from pdops.errors import InvalidInput
    from pdops.model.prometheus_setting import PrometheusConfig

    assert rep.source(lab_inv).url is None
    assert rep.source(lab_inv, "http://mon01:9090/").url == "http://mon01:9090"
    inv = dataclasses.replace(lab_inv, vars={**lab_inv.vars, "pdops_prometheus_url": "https://prom.example:9443"})
    assert rep.source(inv).url == "https://prom.example:9443" and "pdops_prometheus_url" in rep.source(inv).why
    inv = dataclasses.replace(lab_inv, prometheus=PrometheusConfig("lab02"))
    assert rep.source(inv).url == f"http://{lab_inv.host('lab02').ssh_addr}:9090"
    bad = dataclasses.replace(lab_inv, vars={**lab_inv.vars, "pdops_prometheus_url": "mon01:9090"})
    with pytest.raises(InvalidInput, match="pdops_prometheus_url: 'mon01:9090' is not an http"):
        rep.source(bad)


def test_a_timeline_of_a_journal_without_plan_or_verdict(tmp_path):
    tl = timeline.build("x-1", [{"ts": T0.isoformat(), "step": "lock.held", "status": "ok", "evidence": {}},
                                {"ts": (T0 + _dt.timedelta(seconds=2)).isoformat(), "step": "connect", "status": "ok",
                                 "evidence": {"seconds": 1.5}}])
    assert tl.outcome() == "no verdict" and tl.seconds == 2.0 and tl.bars[1].phase == "main"


def inv_report(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "invoke", "report", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args,needle", [
    ([], "--op: missing"),
    (["--op", "scale;reboot"], "--op: 'scale;reboot' is not an operation id"),
    (["--op", OP, "--out", "/etc/hostname/reports"], "--out: /etc/hostname/reports cannot be made: /etc/hostname is not a directory"),
    (["--op", OP, "--out", "/etc/hostname"], "--out: /etc/hostname is a file, not a directory"),
    (["--op", OP, "--prometheus", "mon01:9090"], "--prometheus: 'mon01:9090' is not an http(s) URL"),
    (["--op", OP, "--margin", "-3"], "--margin: '-3' is not a non-negative number of seconds"),
    (["--op", OP, "--margin", "1e9"], "--margin: 1e9 seconds is more than a day"),
])
def test_bad_options_are_refused_before_anything_is_contacted(args, needle):
    proc = inv_report("-i", "inventory/lab", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr and "fix:" in proc.stderr and "Traceback" not in proc.stderr


def test_an_out_dir_that_cannot_be_written_is_refused_before_anything_is_contacted():
    import os

    # root may write almost anywhere: a directory that refuses even root (procfs's) where there is one
    where = next((d for d in ("/etc", "/proc/1", "/proc/sys") if not os.access(d, os.W_OK | os.X_OK)), None)
    if where is None:
        pytest.skip("no directory here refuses this user")
    proc = inv_report("-i", "inventory/lab", "--op", OP, "--out", f"{where}/reports")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--out: {where}/reports is not writable" in proc.stderr and "fix:" in proc.stderr


def test_inv_report_writes_the_page_and_refuses_an_unknown_operation(tmp_path, monkeypatch, capsys):
    """The task itself, on a record in a folder here (no state host): the page is written to --out
    in TZ's zone; an operation the journal does not hold is invalid input (exit 2)."""
    import time

    from invoke import Context
    from invoke.exceptions import Exit

    import pdops.record
    from pdops.cli.report import report

    st = write_journal(tmp_path / "state")
    monkeypatch.setattr(pdops.record, "open_record", lambda inv, **kw: st)
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    out = tmp_path / "pages"
    try:
        report(Context(), op=OP, inventory="inventory/lab", out=str(out))
    finally:
        monkeypatch.undo()
        time.tzset()
    page = out / f"{OP}.html"
    printed = capsys.readouterr().out
    assert f"wrote {page}" in printed and "no chart of what the cluster served" in printed
    data = rep.embedded_data(page.read_text())
    assert data["timezone"]["name"] == "Europe/Berlin" and data["timezone"]["offset"] == "UTC+01:00"
    monkeypatch.setattr(pdops.record, "open_record", lambda inv, **kw: st)
    with pytest.raises(Exit) as e:
        report(Context(), op="scale-20991231T000000Z-ffffff", inventory="inventory/lab", out=str(out))
    assert e.value.code == 2
    assert "--op: no operation 'scale-20991231T000000Z-ffffff' in the journal" in capsys.readouterr().err


def test_a_run_page_puts_every_operation_on_a_timeline_beside_the_requests_per_second():
    """`make soak` and `inv bench` write this page (pdops.ops.report.runs): each operation a span, its
    fault window kept, and the clients' requests counted by the second they ended, ok and not ok."""
    from pdops.ops.report import embedded_data
    from pdops.ops.report.runs import Span, runs_page
    from pdops.ops.report.zone import Zone
    import datetime as _dt

    t = 1_796_000_000.0
    spans = [Span("1 drain", t, t + 5), Span("2 engine-kill", t + 6, t + 9, ok=False, detail="x<y",
                                                     fault_window=(t + 6, t + 11))]
    rows = [{"start": t + 0.1, "end": t + 0.5, "ok": True}, {"start": t + 6.2, "end": t + 6.4, "ok": False},
            {"start": t + 7.0, "end": None, "ok": False, "status": "timeout"}, {"start": t + 8.0, "end": t + 8.9, "ok": True}]
    page, data = runs_page("soak, seed 3", spans, rows, summary={"lost_outside_fault_windows": []},
                           zone=Zone(_dt.timezone.utc, "Etc/UTC", "TZ"))
    assert embedded_data(page) == json.loads(json.dumps(data, sort_keys=True, default=str))
    assert [s["label"] for s in data["spans"]] == ["1 drain", "2 engine-kill"]
    assert data["spans"][1]["fault_window"] == [t + 6, t + 11] or data["spans"][1]["fault_window"] == (t + 6, t + 11)
    assert sum(data["per_second"]["ok"]) == 2 and sum(data["per_second"]["not_ok"]) == 2
    assert data["per_second"]["not_ok"][6] == 1 and data["per_second"]["not_ok"][7] == 1  # unended: its start
    assert "x&lt;y" in page and "x<y" not in page.split('id="pdops-report-data"')[0]
    assert page.count('src="data:image/png;base64,') == 2 and "Etc/UTC" in page
