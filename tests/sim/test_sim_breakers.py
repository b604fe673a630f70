"""The real smg 1.13.0 and its circuit breakers, with sim engines: a decode SIGKILLed under requests
opens its breaker and the healthy prefill's (the PD router counts a failed request against both legs);
the restarted engine at the same URL is listed healthy and ready, yet smg turns every request away
(503) until its breaker closes. pdops reads that from /metrics and closes it by registering again."""

from __future__ import annotations

from pdops.facts import gateway as gw
from pdops.remote.gateway import GatewayClient, deadline_in
from pdops.sim.testing import free_port, http, poll, start_gateway, start_sim, wait_until
from pdops.model.prompts import make_prompt


def _generate(g, i):
    return http("POST", g.url + "/generate", {"text": make_prompt(50, i), "sampling_params": {"max_new_tokens": 4}},
                timeout=5)[0]


def test_an_open_breaker_is_not_routable_and_a_new_registration_closes_it():
    p = start_sim(["--disaggregation-mode", "prefill", "--enable-metrics"])
    dport = free_port()
    d = start_sim(["--disaggregation-mode", "decode", "--enable-metrics", "--port", str(dport)])
    g = start_gateway([p], [d], ["--health-check-interval-secs", "60"])
    d2 = None
    try:
        client = GatewayClient(g.url, timeout=3, poll_interval=0.1,
                               metrics_url=f"http://{g.host}:{g.prometheus_port}/metrics")
        assert all(w.routable and w.breaker.state == gw.CLOSED for w in client.list_workers())
        d.stop()
        codes = [_generate(g, i) for i in range(12)]
        assert codes[:10] == [502] * 10 and set(codes[10:]) == {503}, codes  # 10 failures open it
        d2 = start_sim(["--disaggregation-mode", "decode", "--enable-metrics", "--port", str(dport)])
        ws = {w.worker_type: w for w in client.list_workers()}
        # listed healthy and ready, both: /workers alone would call this cluster serving
        assert all(w.is_healthy and w.status == "ready" for w in ws.values())
        assert {w.breaker.state for w in ws.values()} == {gw.OPEN}
        assert not any(w.routable for w in ws.values())
        assert _generate(g, 99) == 503  # and smg indeed routes nothing
        # what register_one and the close-breakers step do: the worker at the URL whose breaker is open
        # is removed and added again, and comes back with a closed breaker (and a new id)
        new_d = client.reregister(ws["decode"], deadline_in(30))
        assert new_d.routable and new_d.breaker.state == gw.CLOSED and new_d.id != ws["decode"].id
        # the prefill's breaker is still open: one registration closes only its own URL
        assert _generate(g, 100) == 503
        new_p = client.reregister(ws["prefill"], deadline_in(30))
        assert new_p.routable and new_p.bootstrap_port == ws["prefill"].bootstrap_port
        assert [_generate(g, 200 + i) for i in range(3)] == [200] * 3
        assert all(w.breaker.state == gw.CLOSED for w in client.list_workers())
    finally:
        for h in (d2, g, p):
            if h is not None:
                h.stop()


def _running(sim) -> float:
    """The engine's running requests, from its /metrics."""
    from pdops.facts.engine import parse_metrics

    status, text = http("GET", sim.url + "/metrics", timeout=3)
    return sum(v for _, v in parse_metrics(text).get("sglang:num_running_reqs", [])) if status == 200 else 0


def test_a_stream_cut_after_its_head_counts_against_the_decode_alone():
    """Observed on smg 1.13.0: a streamed request whose decode dies after the 200 head is one failure
    for the decode's breaker and none for the prefill's; each request after that (502) counts against
    both. So under streams a dead decode's breaker can open one request before its prefill's, which
    then stays closed with nothing routed to it (why the lab's kill tests send no streams)."""
    import signal
    import threading

    from pdops.remote.loadgen import send

    p = start_sim(["--disaggregation-mode", "prefill", "--enable-metrics"])
    d = start_sim(["--disaggregation-mode", "decode", "--enable-metrics"], env={"PDOPS_SIM_DECODE_STEP_MS": "20"})
    g = start_gateway([p], [d], ["--health-check-interval-secs", "60"])
    try:
        client = GatewayClient(g.url, timeout=3, poll_interval=0.1,
                               metrics_url=f"http://{g.host}:{g.prometheus_port}/metrics")

        def failures():
            return {w.worker_type: w.breaker.consecutive_failures for w in client.list_workers()}

        rows: list = []
        t = threading.Thread(target=lambda: rows.extend(send(g.url, requests=1, concurrency=1, max_new_tokens=2000,
                                                             stream_every=1, rid_prefix="cut", timeout=30)))
        t.start()
        wait_until(lambda: _running(d), 20, "the stream in the decode", interval=0.05)
        d.proc.signal(signal.SIGKILL)
        t.join(30)
        assert rows and rows[0].http_status == 200 and not rows[0].ok, [r.to_dict() for r in rows]
        poll(lambda: failures()["decode"], 10, interval=0.05)  # smg may count it after the stream ends
        assert failures() == {"decode": 1, "prefill": 0}
        assert [_generate(g, i) for i in range(3)] == [502] * 3
        assert failures() == {"decode": 4, "prefill": 3}
    finally:
        for h in (g, p, d):
            h.stop()
