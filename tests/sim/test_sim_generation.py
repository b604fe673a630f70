"""Generations at the sim's PD handshake: a prefill and a decode of another generation (page size, KV
dtype, pinned versions: pdops.model.generation) fail the room as a transfer error on both sides, fast,
as SGLang's decode refuses a prefill of another page size or KV dtype; one generation is served."""

from __future__ import annotations

import threading
import time

import pytest

from pdops.model.generation import digest, generation_fields, pair_fields, versions_from_env
from pdops.sim.testing import http, metric, wait_until

FAILED = "sglang:num_transfer_failed_reqs_total"
# a mismatch must fail at once, never at the bootstrap or waiting timeout
ENV = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30"}


def _send(p, d, room, *, prefill_first=False):
    """One PD request sent to both sides directly, as the gateway does: {"p": (status, body), "d": ...}."""
    body = {"text": "a b c d", "sampling_params": {"max_new_tokens": 3}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": p.bootstrap_port, "bootstrap_room": room, "rid": f"g{room}"}
    out = {}
    ts = []
    for h, tag in ((p, "p"), (d, "d")) if prefill_first else ((d, "d"), (p, "p")):
        t = threading.Thread(target=lambda h=h, tag=tag: out.__setitem__(tag, http("POST", h.url + "/generate", body, timeout=60)))
        t.start()
        ts.append(t)
        time.sleep(0.3 if prefill_first else 0)
    for t in ts:
        t.join(60)
    return out


def _message(body) -> str:
    """The error a failed /generate answers (SGLang's error object)."""
    return body.get("message", "") if isinstance(body, dict) else str(body)


def _view(args_p, args_d, env_p=None, env_d=None):
    full = lambda a: ["--model-path", "sim-model", *a]  # noqa: E731
    p = generation_fields(full(args_p), versions_from_env(env_p or {}))
    d = generation_fields(full(args_d), versions_from_env(env_d or {}))
    return digest(pair_fields(p, [d])), digest(pair_fields(d, [p]))


@pytest.mark.parametrize("flag,p_val,d_val,what", [
    ("--page-size", "64", "32", "page size 64 -> 32"),
    ("--kv-cache-dtype", "fp8_e4m3", "auto", "KV cache dtype fp8_e4m3 -> auto"),
])
def test_another_generation_fails_the_room_on_both_sides_as_a_transfer_error(sims, flag, p_val, d_val, what):
    p = sims(["--disaggregation-mode", "prefill", "--enable-metrics", flag, p_val], ENV)
    d = sims(["--disaggregation-mode", "decode", "--enable-metrics", flag, d_val], ENV)
    t0 = time.monotonic()
    out = _send(p, d, 41)
    assert time.monotonic() - t0 < 10, "failed at a timeout, not at the handshake"
    gp, gd = _view(["--disaggregation-mode", "prefill", flag, p_val], ["--disaggregation-mode", "decode", flag, d_val])
    assert p.state()["generation"] != d.state()["generation"]
    for side in "pd":
        status, body = out[side]
        assert status == 500, (side, body)
        msg = _message(body)
        assert f"generation mismatch: prefill {gp}, decode {gd} ({what})" in msg, (side, msg)
    assert metric(d, FAILED) == 1 and metric(p, FAILED) == 1
    wait_until(lambda: not d.state().get("in_flight", True) and not p.state().get("in_flight", True), 10,
               "both sides released the room")
    # the same decode, paired with a prefill of its generation, is served
    q = sims(["--disaggregation-mode", "prefill", "--enable-metrics", flag, d_val], ENV)
    ok = _send(q, d, 42)
    assert ok["p"][0] == 200 and ok["d"][0] == 200, ok
    assert ok["d"][1]["meta_info"]["finish_reason"]["type"] == "length"
    assert metric(d, FAILED) == 1 and metric(q, FAILED) == 0


def test_the_decode_refuses_a_prefill_of_another_generation_by_itself(sims):
    """As SGLang's decode, from the prefill's bootstrap info: it fails at once, even before (or
    without) the prefill's side of the request, not at the 30 s waiting timeout."""
    p = sims(["--disaggregation-mode", "prefill", "--enable-metrics", "--page-size", "16"], ENV)
    d = sims(["--disaggregation-mode", "decode", "--enable-metrics"], ENV)
    t0 = time.monotonic()
    s, body = d.post("/generate", {"text": "a b", "sampling_params": {"max_new_tokens": 2}, "bootstrap_host": "127.0.0.1",
                                   "bootstrap_port": p.bootstrap_port, "bootstrap_room": 46}, timeout=60)
    assert time.monotonic() - t0 < 10
    assert s == 500 and "generation mismatch" in _message(body) and "page size 16 -> unset" in _message(body), body
    assert metric(d, FAILED) == 1


def test_a_prefill_waiting_for_its_decode_fails_as_soon_as_another_generation_connects(sims):
    """The prefill's request came first and waits in the bootstrap queue: the decode's first line
    ends it (not the 30 s bootstrap timeout). Another pinned SGLang version is another generation."""
    p = sims(["--disaggregation-mode", "prefill", "--enable-metrics"], {**ENV, "PDOPS_SGLANG_VERSION": "0.5.24"})
    d = sims(["--disaggregation-mode", "decode", "--enable-metrics"], ENV)
    t0 = time.monotonic()
    out = _send(p, d, 43, prefill_first=True)
    assert time.monotonic() - t0 < 10
    assert out["p"][0] == 500 and out["d"][0] == 500, out
    assert "SGLang version 0.5.24 -> 0.5.23" in _message(out["p"][1])
    assert metric(d, FAILED) == 1 and metric(p, FAILED) == 1

