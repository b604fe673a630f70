"""The real smg 1.13.0 and its circuit breakers, with sim engines: a decode SIGKILLed under requests
opens its breaker and the healthy prefill's (the PD router counts a failed request against both legs);
the restarted engine at the same URL is listed healthy and ready, yet smg turns every request away
(503) until its breaker closes. pdops reads that from /metrics and closes it by registering again."""

from __future__ import annotations

from pdops.facts import gateway as gw
from pdops.remote.gateway import GatewayClient, deadline_in
from pdops.sim.testing import free_port, http, start_gateway, start_sim
from pdops.sim.tokens import make_prompt


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
