"""pdops.ops.bench: workload parsing, the figures against the field report's tables, the ledger,
the revision guard, and run_bench against a real local HTTP/SSE server (no cluster)."""

from __future__ import annotations

import asyncio
import csv
import json
import threading

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from pdops.ops import bench as b
from pdops.errors import InvalidInput, Refused
from pdops.remote.loadgen import LedgerRow
from pdops.record.local import StateDir

# ---------------------------------------------------------------- workload strings


@pytest.mark.parametrize("spec,inp,out", [
    ("160k/1300", 160_000, 1300), ("80K/600", 80_000, 600), ("2000/64", 2000, 64),
    (" 380k / 7000 ", 380_000, 7000), ("352k/1300", 352_000, 1300), ("4k/1k", 4000, 1000),
])
def test_parse_workload(spec, inp, out):
    wl = b.parse_workload(spec)
    assert (wl.input_tokens, wl.output_tokens) == (inp, out)
    assert b.parse_workload(str(wl)) == wl


@pytest.mark.parametrize("spec", ["", None, "160k", "160k/", "/1300", "abc/12", "0/100", "100/0", "160m/1300",
                                  "-5/3", "1.5k/2", "160k/1300/2", "160kk/1", "20000000/1", "160 k 1300"])
def test_parse_workload_rejects_junk(spec):
    with pytest.raises(InvalidInput) as e:
        b.parse_workload(spec)
    assert e.value.field == "--workload"
    assert "160k/1300" in e.value.fix


@pytest.mark.parametrize("val", [0, "0", -1, "abc", "", True, "1.5"])
def test_concurrency_must_be_a_whole_number_of_at_least_one(val):
    with pytest.raises(InvalidInput) as e:
        b.parse_concurrency(val)
    assert e.value.field == "--concurrency"


# ---------------------------------------------------------------- the report's rows

# (label, input, output, GPUs, requests, total TPM, output TPM) from field report 000, section 4.1
REPORT_ROWS = [
    ("GLM 80K/600 12P4D C48", 80_000, 600, 128, 192, 7_079_236, 52_691),
    ("GLM 380K/7000 8P4D C16", 380_000, 7000, 96, 32, 2_360_829, 42_701),
    ("DeepSeek 80K/600 12P4D C48", 80_000, 600, 128, 192, 1_610_132, 11_982),
    ("DeepSeek 380K/7000 12P4D C16", 380_000, 7000, 128, 32, 676_175, 12_230),
]


def _rows(n, prompt, completion, wall, *, status="ok"):
    """n finished requests spread over [0, wall]: the last ends exactly at `wall`."""
    rows = []
    for i in range(n):
        start = wall * i / (2 * n)
        rows.append(LedgerRow(rid=f"r{i}", stream=True, start=start, first_token=start + 1.0,
                              end=wall if i == n - 1 else wall * 0.9, status=status,
                              prompt_tokens=prompt if status == "ok" else None,
                              completion_tokens=completion if status == "ok" else None))
    return rows


@pytest.mark.parametrize("label,inp,out,gpus,n,total,output", REPORT_ROWS, ids=[r[0] for r in REPORT_ROWS])
def test_tpm_formula_reproduces_the_report_rows(label, inp, out, gpus, n, total, output):
    # The wall clock that makes n requests of (inp + out) tokens give the reported total TPM.
    wall = 60 * n * (inp + out) / total
    rows = _rows(n, inp, out, wall)
    assert b.wall_clock(rows) == pytest.approx(wall)
    assert b.total_tpm(rows, wall) == pytest.approx(total, rel=1e-12)
    # The output TPM of the same ledger matches the report's to within its rounding of the
    # actual token counts: total/output = (inp + out)/out (134.33 for 80K/600, 55.29 for 380K/7000).
    assert b.output_tpm(rows, wall) == pytest.approx(output, rel=1e-3)
    assert total / output == pytest.approx((inp + out) / out, rel=1e-3)
    f = b.compute_figures(rows, gpus=gpus)
    assert f.total_tpm == pytest.approx(total)
    assert f.tpm_per_gpu == pytest.approx(total / gpus)
    assert (f.ok, f.sent, f.mark) == (n, n, "")


def test_glm_80k_row_needs_about_131_seconds():
    wall = 60 * 192 * 80_600 / 7_079_236
    assert wall == pytest.approx(131.2, abs=0.05)


def test_failed_requests_add_no_tokens_but_count_in_wall_clock_and_are_marked():
    rows = _rows(32, 160_000, 1300, 600.0)
    clean = b.compute_figures(rows, gpus=96)
    late = LedgerRow(rid="late", stream=True, start=10.0, end=700.0, status="http_503", http_status=503)
    timeouts = [LedgerRow(rid=f"t{i}", stream=True, start=1.0, end=5.0, status="timeout") for i in range(2)]
    f = b.compute_figures(rows + [late, *timeouts], gpus=96)
    assert f.wall_s == pytest.approx(700.0)  # the failed request's end is part of the run
    tokens = 32 * 161_300
    assert f.total_tpm == pytest.approx(60 * tokens / 700.0)
    assert f.total_tpm < clean.total_tpm
    assert (f.ok, f.sent) == (32, 35)
    assert f.failures == {"http_503": 1, "timeout": 2}
    assert f.mark == "FAILURES 3/35: HTTP 503 x1, timeout x2"
    table = b.format_table([("8p4d C16", clean), ("8p4d C32", f)])
    clean_line, bad_line = table.splitlines()[2:4]
    assert clean_line.endswith("all ok") and "FAILURES" not in clean_line
    assert "FAILURES 3/35: HTTP 503 x1, timeout x2" in bad_line and "32/35" in bad_line


def test_invalid_run_is_marked_in_the_table():
    f = b.compute_figures(_rows(4, 10, 2, 10.0), gpus=8, invalid="the current revision changed during the run (1 -> 2)")
    assert f.mark.startswith("INVALID: the current revision changed")
    assert "INVALID" in b.format_table([("x", f)])


def test_total_tpm_accepts_plain_dicts_and_refuses_a_zero_wall_clock():
    rows = [{"prompt_tokens": 100, "completion_tokens": 20, "ok": True},
            {"prompt_tokens": 100, "completion_tokens": 20, "ok": False}]
    assert b.total_tpm(rows, 60.0) == 120
    assert b.output_tpm(rows, 60.0) == 20
    with pytest.raises(ValueError):
        b.total_tpm(rows, 0)
    with pytest.raises(ValueError):
        b.tpm_per_gpu(1000, 0)


def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(7)
    xs = list(rng.exponential(3.0, size=257))
    for q in (0, 1, 50, 90, 99, 100):
        assert b.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert b.percentile([], 50) is None
    assert b.percentile([5.0], 99) == 5.0


def test_ttft_tpot_itl_from_the_ledger():
    r = LedgerRow(rid="a", stream=True, start=100.0, first_token=102.0, end=112.0, status="ok",
                  prompt_tokens=10, completion_tokens=11, itl=[1.0, 1.0, 3.0])
    bad = LedgerRow(rid="b", stream=True, start=100.0, first_token=101.0, end=150.0, status="aborted",
                    completion_tokens=5, itl=[9.0])
    assert b.ttfts([r, bad]) == [2.0]
    assert b.tpots([r, bad]) == [1.0]  # (112 - 102) / (11 - 1)
    assert b.itls([r, bad]) == [1.0, 1.0, 3.0]
    f = b.compute_figures([r, bad])
    assert (f.ttft_p50, f.tpot_p99, f.itl_p50) == (2.0, 1.0, 1.0)


# ---------------------------------------------------------------- the ledger on disk


def test_ledger_round_trip(tmp_path):
    rows = _rows(3, 2000, 64, 30.0) + [LedgerRow(rid="x", stream=True, start=1.0, end=2.0, status="http_503",
                                                 http_status=503, error="busy")]
    rows[0].itl = [0.1, 0.2]
    rows[0].prefill_instance, rows[0].decode_instance = "p01", "d01"
    paths = b.write_ledger(tmp_path / "run", rows, {"gpus": 16, "invalid": None, "topology": "1p1d"})
    with open(paths["csv"]) as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == list(b.CSV_COLUMNS)
    assert [g["rid"] for g in got] == ["r0", "r1", "r2", "x"]
    assert got[3]["status"] == "http_503" and got[3]["http_status"] == "503"
    assert got[0]["prefill_instance"] == "p01" and float(got[0]["ttft_s"]) == pytest.approx(1.0)
    back, manifest = b.read_ledger(tmp_path / "run")
    assert manifest["topology"] == "1p1d"
    assert [r.to_dict() for r in back] == [r.to_dict() for r in rows]
    f = b.figures_of_run(tmp_path / "run")
    assert f.to_dict() == b.compute_figures(rows, gpus=16).to_dict()


def test_read_ledger_of_a_folder_without_one(tmp_path):
    with pytest.raises(InvalidInput, match="manifest.json"):
        b.read_ledger(tmp_path)


# ---------------------------------------------------------------- revision guard and run_bench

PLACEMENT_2P1D = {"topology": "2p1d", "instances": [{"id": "p01"}, {"id": "p02"}, {"id": "d01"}]}


def _state(tmp_path, lab_inv) -> StateDir:
    st = StateDir("lab", tmp_path / "state")
    rev = st.write_revision(topology="2p1d", inventory_hash=lab_inv.digest, placement=PLACEMENT_2P1D,
                            manifest={}, instances={}, outcome="deployed")
    st.set_current(rev.number)
    return st


def test_revision_change_detects_new_revision_pointer_move_and_rewrite(tmp_path, lab_inv):
    st = _state(tmp_path, lab_inv)
    m0 = b.revision_mark(st)
    assert b.revision_change(m0, b.revision_mark(st)) is None
    st.write_revision(topology="3p1d", inventory_hash="x", placement={}, manifest={}, instances={})
    m1 = b.revision_mark(st)
    assert "revision 2 was recorded" in b.revision_change(m0, m1)
    st.set_current(2)
    assert "(1 -> 2)" in b.revision_change(m1, b.revision_mark(st))
    m2 = b.revision_mark(st)
    st.set_current(2)  # rewritten in place (a rollback-and-back would look the same)
    assert "rewritten" in b.revision_change(m2, b.revision_mark(st))


def _fake_load(calls, *, during=None):
    def load(url, **kw):
        calls.append((url, kw))
        if during:
            during()
        rows = []
        for i in range(kw["requests"]):
            text = kw["prompt_for"](i)
            rows.append(LedgerRow(rid=f"{kw['rid_prefix']}-{i}", stream=True, start=float(i), first_token=i + 0.5,
                                  end=i + 10.0, status="ok", prompt_tokens=len(text.split()),
                                  completion_tokens=kw["max_new_tokens"]))
        return rows
    return load


def test_run_bench_records_ledger_and_manifest(tmp_path, lab_inv):
    st = _state(tmp_path, lab_inv)
    calls = []
    res = b.run_bench(lab_inv, st, "2000/64", 4, requests=8, out_dir=tmp_path / "run", load=_fake_load(calls),
                      say=lambda s: None)
    (url, kw), = calls
    assert url == lab_inv.gateway.first.url
    assert (kw["concurrency"], kw["requests"], kw["max_new_tokens"], kw["stream_every"]) == (4, 8, 64, 1)
    assert res.valid and res.figures.ok == 8
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["revision"]["number"] == 1 and m["topology"] == "2p1d"
    assert m["gpus"] == 3 * lab_inv.profile.gpus_per_instance
    assert m["parameters"]["workload"] == "2k/64" and m["parameters"]["retries"] == 0
    assert m["profile"]["name"] == "lab-sim" and m["versions"]["pdops"]
    assert m["prompt_tokens_mismatch"] == 0  # prompts are exactly 2000 tokens as the sim counts them
    assert m["revision_check"]["changed"] is None and m["invalid"] is None
    assert m["figures"]["total_tpm"] == pytest.approx(b.total_tpm(res.rows, b.wall_clock(res.rows)))
    rows, _ = b.read_ledger(tmp_path / "run")
    assert len(rows) == 8 and len({r.rid for r in rows}) == 8
    assert "all 8 requests succeeded" in b.format_result(res)
    # the run's page (pdops.ops.report.runs): its span beside the requests each second, all 8 counted ok
    from pdops.ops.report import embedded_data

    assert f"page: {tmp_path / 'run' / 'report.html'}" in b.format_result(res)
    page = embedded_data((tmp_path / "run" / "report.html").read_text())
    assert sum(page["per_second"]["ok"]) == 8 and sum(page["per_second"]["not_ok"]) == 0
    assert [s["label"] for s in page["spans"]] == ["bench C4"]


def test_a_bench_is_an_operation_under_the_lock_its_steps_and_verdict_in_the_journal(tmp_path, lab_inv):
    """`inv bench` once ran with no plan, no lock and no journal: a change could start beside it, and
    `inv journal` never named it. Now its plan is printed, another operator's lock refuses it before a
    request is sent, and its steps and one verdict are journalled under its run id."""
    st = _state(tmp_path, lab_inv)
    calls, said = [], []
    with st.lock("scale", op_id="scale-1"):
        with pytest.raises(Refused, match="locked by .* running 'scale'"):
            b.run_bench(lab_inv, st, "2000/64", 2, requests=2, out_dir=tmp_path / "no", load=_fake_load(calls),
                        say=lambda s: None)
    assert calls == [] and not (tmp_path / "no").exists()
    res = b.run_bench(lab_inv, st, "2000/64", 2, requests=2, out_dir=tmp_path / "run", load=_fake_load(calls),
                      say=said.append)
    assert said[0].startswith("plan: bench lab: 2k/64 at C2, 2 requests") and " 2. bench-load — " in said[0]
    recs = st.journal().read(res.manifest["run_id"])
    assert [(r["step"], r["status"]) for r in recs] == [
        ("plan", "ok"), ("bench-mark", "ok"), ("bench-load", "ok"), ("bench-check", "ok"), ("bench-write", "ok"),
        ("verdict", "ok")]
    assert recs[2]["evidence"]["sent"] == 2 and recs[-1]["evidence"]["run_dir"] == str(tmp_path / "run")
    # --dry-run: the same plan printed, nothing sent, no lock, nothing journalled or written
    benches, said = [o for o in st.journal().operations() if o.startswith("bench-")], []
    with st.lock("scale", op_id="scale-2"):  # a held lock does not matter to a dry run
        assert b.run_bench(lab_inv, st, "2000/64", 2, requests=2, out_dir=tmp_path / "dry", load=_fake_load(calls),
                           say=said.append, dry_run=True) is None
    assert " 2. bench-load — " in said[0] and len(calls) == 1 and not (tmp_path / "dry").exists()
    assert [o for o in st.journal().operations() if o.startswith("bench-")] == benches


def test_a_bench_whose_later_steps_fail_keeps_every_row_marked_unchecked(tmp_path, lab_inv):
    """The requests sent are never lost to a failure after them (a lock taken over, a journal that cannot
    be written, here the routing hook): bench-load wrote the ledger, its manifest saying unchecked."""
    from pdops.errors import PdopsError

    st = _state(tmp_path, lab_inv)

    def routing_fails(rows):
        raise PdopsError("the engines' request logs cannot be read")

    with pytest.raises(PdopsError):
        b.run_bench(lab_inv, st, "2000/64", 2, requests=3, out_dir=tmp_path / "run", load=_fake_load([]),
                    resolve_routing=routing_fails, say=lambda s: None)
    rows, manifest = b.read_ledger(tmp_path / "run")
    assert len(rows) == 3 and manifest["invalid"].startswith("unchecked")
    op = st.journal().operations()[-1]
    assert st.journal().read(op)[-1]["step"] == "verdict" and st.journal().read(op)[-1]["status"] == "failed"


def test_run_bench_marks_the_run_invalid_when_the_revision_changes_mid_run(tmp_path, lab_inv):
    st = _state(tmp_path, lab_inv)

    def scale_happens():
        rev = st.write_revision(topology="3p1d", inventory_hash="x", placement={}, manifest={}, instances={})
        st.set_current(rev.number)

    res = b.run_bench(lab_inv, st, "2000/64", 2, requests=4, out_dir=tmp_path / "run",
                      load=_fake_load([], during=scale_happens), say=lambda s: None)
    assert not res.valid
    assert "(1 -> 2)" in res.manifest["invalid"]
    assert res.figures.invalid and "INVALID" in res.figures.mark
    assert "verdict: INVALID run" in b.format_result(res)
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["invalid"] == res.manifest["invalid"]


def test_run_bench_refuses_without_a_current_revision_and_checks_its_inputs(tmp_path, lab_inv):
    empty = StateDir("lab", tmp_path / "empty")
    with pytest.raises(Refused, match="no current revision"):
        b.run_bench(lab_inv, empty, "2000/64", 2, requests=1, load=_fake_load([]), say=lambda s: None)
    st = _state(tmp_path, lab_inv)
    for kw, field in (({"requests": 1, "duration": 5}, "--requests/--duration"), ({}, "--requests/--duration"),
                      ({"requests": 0}, "--requests"), ({"duration": "-3"}, "--duration"),
                      ({"duration": "soon"}, "--duration")):
        with pytest.raises(InvalidInput) as e:
            b.run_bench(lab_inv, st, "2000/64", 2, load=_fake_load([]), say=lambda s: None, **kw)
        assert e.value.field == field
    with pytest.raises(InvalidInput) as e:
        b.run_bench(lab_inv, st, "2000/64", 0, requests=1, load=_fake_load([]), say=lambda s: None)
    assert e.value.field == "--concurrency"
    with pytest.raises(InvalidInput):
        b.run_bench(lab_inv, st, "lots", 2, requests=1, load=_fake_load([]), say=lambda s: None)


def test_prompt_maker_gives_exact_lengths_and_distinct_heads():
    from pdops.model.prompts import count_tokens

    make = b.prompt_maker(b.parse_workload("2000/64"))
    ps = [make(i) for i in range(50)]
    assert all(count_tokens(p) == 2000 for p in ps)
    assert len({" ".join(p.split()[:4]) for p in ps}) > 45  # the prefix cache cannot share them
    assert count_tokens(b.prompt_maker(b.Workload(3, 1))(0)) == 3


# ---------------------------------------------------------------- against a real local SSE server


class _Server:
    """A tiny /generate server in a thread: streams `max_new_tokens` chunks, answers 503 for
    every 5th request, and records every request it received (to prove nothing is retried)."""

    def __init__(self):
        self.seen: list[tuple[str, str]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    async def generate(self, request):
        body = await request.json()
        self.seen.append((body["rid"], request.headers.get("x-request-id")))
        if len(self.seen) % 5 == 0:
            return web.json_response({"error": {"message": "server_selection_failed"}}, status=503)
        n_prompt = len(body["text"].split())
        n = body["sampling_params"]["max_new_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(1, n + 1):
            meta = {"prompt_tokens": n_prompt, "completion_tokens": k,
                    "finish_reason": {"type": "length"} if k == n else None}
            await resp.write(b"data: " + json.dumps({"text": "w " * k, "meta_info": meta}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _run(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        self.runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.ready.set()
        self.loop.run_forever()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_run_bench_over_http_one_row_per_request_no_retries(tmp_path, lab_inv, monkeypatch):
    import dataclasses

    st = _state(tmp_path, lab_inv)
    with _Server() as srv:
        node = dataclasses.replace(lab_inv.gateway.first, addr="127.0.0.1", port=int(srv.url.rsplit(":", 1)[1]))
        gw = dataclasses.replace(lab_inv.gateway, nodes=(node,), port=node.port)
        inv = dataclasses.replace(lab_inv, gateway=gw)
        res = b.run_bench(inv, st, "300/12", 4, requests=20, out_dir=tmp_path / "run", say=lambda s: None,
                          timeout=30)
    assert len(res.rows) == 20 and len(srv.seen) == 20  # every request sent once, failures not retried
    assert all(rid == hdr for rid, hdr in srv.seen)  # rid in the body and x-request-id agree
    ok = [r for r in res.rows if r.ok]
    assert len(ok) == 16 and sum(r.status == "http_503" for r in res.rows) == 4
    assert all(r.prompt_tokens == 300 and r.completion_tokens == 12 and r.chunks == 12 for r in ok)
    assert all(len(r.itl) == 11 and r.first_token <= r.end for r in ok)
    assert res.figures.mark == "FAILURES 4/20: HTTP 503 x4"
    assert res.figures.total_tpm == pytest.approx(60 * 16 * 312 / b.wall_clock(res.rows))
    assert "run with failures" in b.format_result(res)


def test_load_duration_mode_stops_sending_and_waits_out_in_flight(tmp_path):
    from pdops.remote.loadgen import send

    with _Server() as srv:
        rows = send(srv.url, duration=0.3, concurrency=3, max_new_tokens=4, stream_every=1, prompt="a b c")
    assert len(rows) == len(srv.seen) >= 3
    assert all(r.end is not None and r.status in ("ok", "http_503") for r in rows)


def test_load_marks_a_stream_without_done_as_error():
    async def main():
        async def gen(request):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"text": "x", "meta_info": {"completion_tokens": 1}}\n\n')
            return resp  # no [DONE]

        app = web.Application()
        app.router.add_post("/generate", gen)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        from pdops.remote.loadgen import run_load

        try:
            return await run_load(f"http://127.0.0.1:{port}", requests=2, concurrency=2, stream_every=1)
        finally:
            await runner.cleanup()

    rows = asyncio.run(main())
    assert [r.status for r in rows] == ["error", "error"]
    assert all("without [DONE]" in r.error for r in rows)
    assert aiohttp  # the client library under test
