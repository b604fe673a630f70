"""The sim behind the real gateway (smg 1.13): PD requests, counts, abort,
disconnect, injected transfer failure."""

from __future__ import annotations

import http.client as httpc
import json
import threading
import time

from pdops.sim.testing import http, metric, wait_until
from pdops.model.prompts import make_prompt


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
    wait_until(lambda: d.state().get("in_flight"), 5, "request in flight on decode")
    c.sock.close()
    c.close()
    wait_until(lambda: not d.state().get("in_flight", True), 10, "decode released the disconnected request")
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
        # both sides release the failed room (the 500 can reach the client a moment before the
        # prefill has dropped it: waited for, bounded)
        wait_until(lambda: not d.state().get("in_flight", True) and not any(p.state().get("in_flight", True)
                                                                            for p in ps), 10, "the room released")
    finally:
        for p in ps:
            p.post("/_sim/faults", {"fail_transfer": False})
    assert http("POST", g.url + "/generate", {"text": "a b", "sampling_params": {"max_new_tokens": 2}})[0] == 200


def test_dead_session_fails_every_request_fast_until_the_decode_restarts(pd_cluster):
    """sglang#13054 as the sim's `dead_session` fault: the decode fails each request at the transfer,
    fast (no hang on either side), counted as a transfer failure; clearing it (what a restart does)
    serves again."""
    g, d, ps = pd_cluster["gateway"], pd_cluster["decode"], pd_cluster["prefills"]
    failed_d = metric(d, "sglang:num_transfer_failed_reqs_total")
    assert d.post("/_sim/faults", {"dead_session": True})[0] == 200
    try:
        for n in range(3):
            t0 = time.monotonic()
            s, body = http("POST", g.url + "/generate", {"text": make_prompt(50, n), "sampling_params": {"max_new_tokens": 4}})
            # the gateway relays whichever side fails first: the decode ("session not alive") or the
            # prefill whose transfer the decode closed; either way the same transfer failure, fast
            assert s == 500 and ("session not alive" in str(body)
                                 or "KV transfer failed: decode closed the connection" in str(body)), body
            assert time.monotonic() - t0 < 10
        assert metric(d, "sglang:num_transfer_failed_reqs_total") == failed_d + 3
        # state() is {} when /_sim/state does not answer in time (a busy machine): not released yet
        wait_until(lambda: not d.state().get("in_flight", True) and not any(p.state().get("in_flight", True)
                                                                            for p in ps), 10,
                   "both sides released the failed rooms")
    finally:
        d.post("/_sim/faults", {"dead_session": False})
    assert http("POST", g.url + "/generate", {"text": "a b", "sampling_params": {"max_new_tokens": 2}})[0] == 200


def test_smg_routes_nothing_to_a_worker_once_its_removal_is_accepted(sims):
    """pdops's drain relies on this: after `DELETE /workers/{id}` answers 202 the worker is
    `draining` (then gone); a stream already on it finishes; no new request reaches it."""
    from pdops.remote.gateway import GatewayClient, deadline_in
    from pdops.remote.loadgen import send
    from pdops.sim.testing import start_gateway

    from pdops.facts import requestlog

    log = ["--enable-metrics", "--log-requests", "--log-requests-format", "json", "--log-requests-level", "0"]
    env = {"PDOPS_SIM_DECODE_STEP_MS": "10"}
    p = sims(["--disaggregation-mode", "prefill", *log], env)
    d1 = sims(["--disaggregation-mode", "decode", *log], env)
    d2 = sims(["--disaggregation-mode", "decode", *log], env)
    g = start_gateway([p], [d1, d2], ["--policy", "round_robin"])
    try:
        client = GatewayClient(g.url, timeout=3, poll_interval=0.05)
        [w1] = [w for w in client.list_workers() if w.url == d1.url]
        long_rows: list = []
        t = threading.Thread(target=lambda: long_rows.extend(
            send(g.url, requests=4, concurrency=4, max_new_tokens=200, stream_every=1, rid_prefix="long")))
        t.start()
        wait_until(lambda: metric(d1, "sglang:num_running_reqs") > 0, 10, "a stream on d1")
        client.remove_worker(w1.id)
        accepted = time.time()
        assert client.wait_worker_out(w1.id, deadline_in(2)) == "draining"
        during = send(g.url, requests=60, concurrency=6, max_new_tokens=2, stream_every=2, rid_prefix="after")
        t.join(30)
        assert all(r.ok for r in during) and all(r.ok and r.completion_tokens == 200 for r in long_rows)
        on_d1 = set(requestlog.parse(d1.proc.log()).received)
        on_d2 = set(requestlog.parse(d2.proc.log()).received)
        assert {r.rid for r in long_rows} & on_d1, "no stream was on d1 before its removal"
        late = {r.rid for r in during} & on_d1
        assert not late, f"{len(late)} request(s) reached d1 after its removal was accepted at {accepted}"
        assert {r.rid for r in during} <= on_d2  # all 60 went to the other decode
        client.wait_worker_gone(w1.id, deadline_in(15))
    finally:
        g.stop()


def test_smg_exports_the_metrics_docs_gateway_names(pd_cluster):
    """docs/gateway.md, "Metrics": names read from the real smg after PD requests, for dashboards
    and alerts; a rename in an smg upgrade fails here."""
    import urllib.request

    g = pd_cluster["gateway"]
    for i in range(2):
        assert http("POST", g.url + "/generate", {"text": f"m {i}", "sampling_params": {"max_new_tokens": 2}})[0] == 200
    text = urllib.request.urlopen(f"http://{g.host}:{g.prometheus_port}/metrics", timeout=5).read().decode()
    names = {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and not ln.startswith("#")}
    for name in ("smg_http_requests_total", "smg_http_responses_total", "smg_pd_ttft_seconds_count",
                 "smg_pd_prefill_duration_seconds_count", "smg_worker_health", "smg_worker_requests_active",
                 "smg_worker_pool_size", "smg_worker_cb_state", "smg_engine_running_requests"):
        assert name in names, f"{name} not exported by smg ({len(names)} names)"


def test_registering_a_url_whose_worker_is_still_draining_waits_it_out(sims):
    """An instance added at the address of one drained moments ago (a scale 3p1d -> 2p2d puts d02
    where p03 was): smg keeps the old worker `draining` about 5 s and answers a POST of the same
    URL with 409 and that worker. pdops.ops.deploy.register waits until it is gone, then registers."""
    from pdops.steps.actions import register_one
    from pdops.remote.gateway import GatewayClient, deadline_in
    from pdops.model.placement import Instance, Rank
    from pdops.sim.testing import start_gateway

    p = sims(["--disaggregation-mode", "prefill"])
    d = sims(["--disaggregation-mode", "decode"])
    g = start_gateway([p], [d], ["--policy", "round_robin"])
    try:
        client = GatewayClient(g.url, timeout=3, poll_interval=0.05)
        [w] = [w for w in client.list_workers() if w.url == d.url]
        client.remove_worker(w.id)
        assert client.wait_worker_out(w.id, deadline_in(2)) == "draining"
        host, port = d.url.removeprefix("http://").rsplit(":", 1)
        inst = Instance("d02", "decode", (Rank(0, "h", host, (0,)),), 0, int(port), None, None)
        said: list = []
        new_id = register_one(client, inst, said.append, deadline_in(30)).id
        assert new_id != w.id and any("still drains" in s for s in said)
        [now] = [x for x in client.list_workers() if x.url == d.url]
        assert now.id == new_id and now.routable
    finally:
        g.stop()


def test_decode_exports_inter_token_latency_as_sglang_names_it(pd_cluster):
    """sglang:inter_token_latency_seconds: one observation per token after the first, per request."""
    g, d = pd_cluster["gateway"], pd_cluster["decode"]
    before = metric(d, "sglang:inter_token_latency_seconds_count")
    s, _ = http("POST", g.url + "/generate", {"text": "a b c", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
    assert s == 200
    assert metric(d, "sglang:inter_token_latency_seconds_count") == before + 4
    assert metric(d, "sglang:inter_token_latency_seconds_bucket", le="+Inf") >= before + 4


def test_registering_a_prefill_the_gateway_lists_under_its_old_bootstrap_port_replaces_that_worker(sims):
    """A gateway started with a prefill's old identity in its start-up list (its URL, the slot's
    other bootstrap port), the prefill now serving on the new port: requests routed through the
    old entry would fail at the bootstrap. pdops.ops.deploy.register removes the stale worker first
    and proves the gateway lists the new port; generations then succeed."""
    from pdops.steps.actions import register_one
    from pdops.remote.gateway import GatewayClient, deadline_in
    from pdops.model.placement import Instance, Rank
    from pdops.sim.testing import start_gateway

    p = sims(["--disaggregation-mode", "prefill"])
    d = sims(["--disaggregation-mode", "decode"])
    g = start_gateway([(p.url, p.bootstrap_port + 1)], [d], ["--policy", "round_robin"])
    try:
        client = GatewayClient(g.url, timeout=3, poll_interval=0.05)
        [stale] = [w for w in client.list_workers() if w.url == p.url]
        assert stale.bootstrap_port == p.bootstrap_port + 1
        host, port = p.url.removeprefix("http://").rsplit(":", 1)
        inst = Instance("p01", "prefill", (Rank(0, "h", host, (0,)),), 0, int(port), p.bootstrap_port, None)
        said: list = []
        new_id = register_one(client, inst, said.append, deadline_in(30)).id
        assert any(f"with bootstrap port {p.bootstrap_port + 1}, not {p.bootstrap_port}" in s for s in said), said
        [now] = [x for x in client.list_workers() if x.url == p.url]
        assert now.id == new_id and now.bootstrap_port == p.bootstrap_port and now.routable
        s, doc = http("POST", g.url + "/generate", {"text": "a b", "sampling_params": {"max_new_tokens": 3}})
        assert s == 200, doc
    finally:
        g.stop()
