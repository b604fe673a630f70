"""The canary's retry and a prefill that refuses a decode's Mooncake session it saw fail (real SGLang
0.5.23, seen in the lab: a decode drained and added back at the same address takes the same session,
and the prefill answers "remote mooncake session ... is not alive" until its next probe)."""

from __future__ import annotations

import pytest

from pdops.errors import DeployFailed, Unverified
from pdops.facts.engine import failed_session_wait_s
from pdops.steps import canary


class _I:
    def __init__(self, iid):
        self.id = iid


DEAD = ("prefill answered HTTP 500: Prefill transfer failed ... KVTransferError: Decode instance could be dead, "
        "remote mooncake session 127.0.15.1:15966 is not alive")


def _world(monkeypatch, answers):
    calls, slept = [], []
    seq = iter(answers)

    def canary_pair(p, d, timeout):
        calls.append((p.id, d.id))
        a = next(seq)
        if isinstance(a, Exception):
            raise a
        return a

    clock = [1000.0]  # the waits pass on a clock of the test's own

    def sleep(s):
        slept.append(s)
        clock[0] += s

    monkeypatch.setattr(canary, "canary_pair", canary_pair)
    monkeypatch.setattr(canary.time, "sleep", sleep)
    monkeypatch.setattr(canary.time, "monotonic", lambda: clock[0])
    return calls, slept


def test_a_refused_session_is_retried_after_the_prefills_probe_not_at_once(monkeypatch):
    calls, slept = _world(monkeypatch, [Unverified(DEAD), {"ok": True}])
    said = []
    out = canary.canary_pairs([(_I("p01"), _I("d01"))], said.append, retry_once=True, deadline_s=120,
                               session_wait_s=4)
    assert calls == [("p01", "d01")] * 2 and slept == [5.0]
    assert any("refuses the decode's Mooncake session" in s for s in said)
    assert out["first_attempt_failed"]["p01xd01"].endswith("is not alive")


def test_another_failure_is_retried_at_once_and_a_refused_session_that_stays_names_the_probe(monkeypatch):
    calls, slept = _world(monkeypatch, [Unverified("prefill answered HTTP 502"), {"ok": True}])
    canary.canary_pairs([(_I("p01"), _I("d01"))], lambda s: None, retry_once=True, deadline_s=120, session_wait_s=4)
    assert slept == []
    # seen in the lab: the first canary fails otherwise, and its failed transfer makes the prefill refuse
    # the session: the retry's refusal is waited out too
    calls, slept = _world(monkeypatch, [Unverified("prefill answered HTTP 500: timeout"), Unverified(DEAD),
                                        {"ok": True}])
    canary.canary_pairs([(_I("p01"), _I("d01"))], lambda s: None, retry_once=True, deadline_s=120, session_wait_s=4)
    assert len(calls) == 3 and slept == [5.0]
    # a refusal that outlasts the deadline fails, naming the probe's settings
    calls, slept = _world(monkeypatch, [Unverified(DEAD)] * 50)
    with pytest.raises(DeployFailed) as e:
        canary.canary_pairs([(_I("p01"), _I("d01"))], lambda s: None, retry_once=True, deadline_s=20,
                             session_wait_s=4)
    assert "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S" in e.value.fix and len(calls) < 50


def test_the_wait_is_the_profiles_longest_probe_interval():
    assert failed_session_wait_s({"SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S": "4"}) == 4.0
    assert failed_session_wait_s({}) == 300.0  # SGLang 0.5.23's default


GENERIC = ("{'object': 'error', 'message': \"Decode transfer failed for request rank=0 ... KVTransferError(...): "
           "Failed to get kvcache from prefill instance, it might be dead\", 'code': 500}")


class _Pair:
    def __init__(self, iid):
        self.id, self.url = iid, f"http://{iid}"
        self.head = type("H", (), {"data_addr": "127.0.0.1"})()
        self.bootstrap_port = 8998


def _engines(monkeypatch, prefill_after_s: float, prefill_answer):
    """The decode fails at once with Mooncake's generic message; the prefill answers after `prefill_after_s`
    (or holds the room until it is aborted). Returns the abort requests sent."""
    import threading

    aborted, released = [], threading.Event()

    def http_json(method, url, body=None, timeout=None, headers=None):
        if url.endswith("/abort_request"):
            aborted.append(body["rid"])
            released.set()
            return 200, {}
        if url.startswith("http://d01"):
            return 500, GENERIC
        if not released.wait(prefill_after_s):
            return prefill_answer
        return 200, {"meta_info": {"finish_reason": {"type": "abort"}}}  # what an abort makes of it

    monkeypatch.setattr(canary, "http_json", http_json)
    monkeypatch.setattr(canary, "PREFILL_ANSWER_GRACE_S", 0.5)
    return aborted


def test_a_failed_canary_names_the_prefills_reason_which_an_early_abort_would_hide(monkeypatch):
    """Seen in CI: the decode answered Mooncake's generic "it might be dead" and pdops aborted the prefill's
    request at once, so the prefill answered 200 "abort" and its reason (a refused session) was lost: the
    retry did not wait for the prefill's probe and the repair halted. The prefill's own answer is kept."""
    aborted = _engines(monkeypatch, 0.05, (500, {"message": DEAD}))
    with pytest.raises(Unverified) as e:
        canary.canary_pair(_Pair("p01"), _Pair("d01"), timeout=5)
    assert aborted == []
    assert "prefill answered HTTP 500" in e.value.message and "decode answered HTTP 500" in e.value.message
    assert "is not alive" in e.value.evidence and "might be dead" in e.value.evidence


def test_a_prefill_still_holding_the_room_is_aborted_after_the_grace(monkeypatch):
    aborted = _engines(monkeypatch, 30, (500, {"message": "never"}))
    with pytest.raises(Unverified) as e:
        canary.canary_pair(_Pair("p01"), _Pair("d01"), timeout=5)
    assert len(aborted) == 1 and aborted[0].startswith("pdops-canary-p01-d01-")
    assert e.value.message.endswith("decode answered HTTP 500")


def test_a_send_that_fails_after_the_probe_names_a_decode_under_its_old_mooncake_name(monkeypatch):
    """Seen in make test: a drained decode added back drew its old Mooncake name; the prefill refused the
    session, then, after its probe, failed every send to the old process's descriptor. The halt says
    what to do (restart the prefill, or the profile's Mooncake setting), not only `inv preflight`."""
    sent = Unverified("canary p01 x d01: prefill answered HTTP 500; decode answered HTTP 500",
                      evidence="prefill: Prefill transfer failed ... Failed to send kv chunk of 204 to 127.0.10.1:46833")
    calls, slept = _world(monkeypatch, [Unverified(DEAD), sent, sent])
    with pytest.raises(DeployFailed) as e:
        canary.canary_pairs([(_I("p01"), _I("d01"))], lambda s: None, retry_once=True, deadline_s=120,
                            session_wait_s=4)
    assert slept == [5.0] and len(calls) == 2  # the refusal is waited out once; a send failure is not
    assert "Restart the prefill" in e.value.fix and "MC_TE_METADATA_REFRESH_INTERVAL_SECONDS" in e.value.fix
