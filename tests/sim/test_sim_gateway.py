"""The sim behind the real gateway (sglang-router 0.3.2): PD requests, counts, abort,
disconnect, injected transfer failure."""

from __future__ import annotations

import http.client as httpc
import json
import threading
import time

from pdops.sim.testing import http, metric, wait_until
from pdops.sim.tokens import make_prompt


def _total(handles, name, **labels):
    return sum(metric(h, name, **labels) for h in handles)


def _sse(url_host, port, path, body, timeout=30):
    c = httpc.HTTPConnection(url_host, port, timeout=timeout)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return c, c.getresponse()


def test_pd_requests_through_gateway_succeed_and_counts_match(pd_cluster):
    g, d, ps = pd_cluster["gateway"], pd_cluster["decode"], pd_cluster["prefills"]
    before_d = metric(d, "sglang:num_requests_total")
    before_p = _total(ps, "sglang:num_requests_total")
    before_tok = metric(d, "sglang:prompt_tokens_total")
    before_gen = metric(d, "sglang:generation_tokens_total")
    results = []

    def one(i):
        t0 = time.monotonic()
        s, r = http("POST", g.url + "/generate", {"text": make_prompt(2000, i), "sampling_params": {"max_new_tokens": 64}})
        results.append((s, r, time.monotonic() - t0))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [s for s, _, _ in results] == [200] * 6, results
    for _, r, dt in results:
        assert r["meta_info"]["prompt_tokens"] == 2000
        assert r["meta_info"]["completion_tokens"] == 64
        assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 64}
        assert dt < 3.0
    # streaming through the gateway returns the decode's SSE stream
    c, resp = _sse(g.host, g.port, "/generate", {"text": make_prompt(100, 7), "stream": True, "sampling_params": {"max_new_tokens": 8}})
    assert resp.status == 200
    events = [ln for ln in resp.read().decode().split("\n\n") if ln]
    c.close()
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["meta_info"]["completion_tokens"] == 8 and len(events) >= 3
    assert metric(d, "sglang:num_requests_total") - before_d == 7
    assert metric(d, "sglang:num_requests_total", is_streaming="true") >= 1
    assert _total(ps, "sglang:num_requests_total") - before_p == 7
    assert metric(d, "sglang:prompt_tokens_total") - before_tok == 6 * 2000 + 100
    assert metric(d, "sglang:generation_tokens_total") - before_gen == 6 * 64 + 8
    # every prefill got work (KV really left both), and nothing is left in any queue
    for h in [d, *ps]:
        s, loads = h.get("/v1/loads?include=all")
        load = loads["loads"][0]
        assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
        dis = load["disaggregation"]
        assert dis["prefill_inflight_queue_reqs"] == dis["decode_transfer_queue_reqs"] == 0
    assert d.get("/v1/loads?include=all")[1]["loads"][0]["disaggregation"]["kv_transfer_latency_ms"] > 0


def test_loads_report_running_requests_while_in_flight(pd_cluster):
    g, d = pd_cluster["gateway"], pd_cluster["decode"]
    done = []
    ts = [threading.Thread(target=lambda i=i: done.append(http("POST", g.url + "/generate", {"text": make_prompt(50, i), "sampling_params": {"max_new_tokens": 150}})[0])) for i in range(3)]
    for t in ts:
        t.start()
    wait_until(lambda: d.get("/v1/loads")[1]["loads"][0]["num_running_reqs"] == 3, 10, "3 running on the decode")
    assert metric(d, "sglang:num_running_reqs") == 3
    for t in ts:
        t.join(30)
    assert done == [200, 200, 200]


def test_client_disconnect_through_gateway_aborts_on_decode(pd_cluster):
    g, d = pd_cluster["gateway"], pd_cluster["decode"]
    aborted = metric(d, "sglang:num_aborted_requests_total")
    c, resp = _sse(g.host, g.port, "/generate", {"text": make_prompt(10, 1), "stream": True, "sampling_params": {"max_new_tokens": 20000}})
    assert resp.status == 200
    resp.fp.readline()  # first event arrived: it is running on the decode
    wait_until(lambda: d.state()["in_flight"], 5, "request in flight on decode")
    c.sock.close()
    c.close()
    wait_until(lambda: not d.state()["in_flight"], 10, "decode released the disconnected request")
    assert metric(d, "sglang:num_aborted_requests_total") == aborted + 1


def test_injected_transfer_failure_gives_500_on_both_sides(pd_cluster):
    g, d, ps = pd_cluster["gateway"], pd_cluster["decode"], pd_cluster["prefills"]
    failed_d = metric(d, "sglang:num_transfer_failed_reqs_total")
    failed_p = _total(ps, "sglang:num_transfer_failed_reqs_total")
    for p in ps:
        assert p.post("/_sim/faults", {"fail_transfer": True})[0] == 200
    try:
        t0 = time.monotonic()
        s, body = http("POST", g.url + "/generate", {"text": make_prompt(200, 3), "sampling_params": {"max_new_tokens": 8}})
        assert s == 500, body
        assert time.monotonic() - t0 < 10
        wait_until(lambda: _total(ps, "sglang:num_transfer_failed_reqs_total") == failed_p + 1, 5, "prefill counted the failure")
        assert metric(d, "sglang:num_transfer_failed_reqs_total") == failed_d + 1
        assert not d.state()["in_flight"] and not any(p.state()["in_flight"] for p in ps)
    finally:
        for p in ps:
            p.post("/_sim/faults", {"fail_transfer": False})
    assert http("POST", g.url + "/generate", {"text": "a b", "sampling_params": {"max_new_tokens": 2}})[0] == 200
