"""The canary's retry and a prefill that refuses a decode's Mooncake session it saw fail (real SGLang
0.5.23, seen in the lab: a decode drained and added back at the same address takes the same session,
and the prefill answers "remote mooncake session ... is not alive" until its next probe)."""

from __future__ import annotations

import pytest

from pdops.errors import DeployFailed, Unverified
from pdops.facts.engine import failed_session_wait_s
from pdops.steps import actions


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

    monkeypatch.setattr(actions, "canary_pair", canary_pair)
    monkeypatch.setattr(actions.time, "sleep", sleep)
    monkeypatch.setattr(actions.time, "monotonic", lambda: clock[0])
    return calls, slept


def test_a_refused_session_is_retried_after_the_prefills_probe_not_at_once(monkeypatch):
    calls, slept = _world(monkeypatch, [Unverified(DEAD), {"ok": True}])
    said = []
    out = actions.canary_pairs([(_I("p01"), _I("d01"))], said.append, retry_once=True, deadline_s=120,
                               session_wait_s=4)
    assert calls == [("p01", "d01")] * 2 and slept == [5.0]
    assert any("refuses the decode's Mooncake session" in s for s in said)
    assert out["first_attempt_failed"]["p01xd01"].endswith("is not alive")


def test_another_failure_is_retried_at_once_and_a_refused_session_that_stays_names_the_probe(monkeypatch):
    calls, slept = _world(monkeypatch, [Unverified("prefill answered HTTP 502"), {"ok": True}])
    actions.canary_pairs([(_I("p01"), _I("d01"))], lambda s: None, retry_once=True, deadline_s=120, session_wait_s=4)
    assert slept == []
    # seen in the lab: the first canary fails otherwise, and its failed transfer makes the prefill refuse
    # the session: the retry's refusal is waited out too
    calls, slept = _world(monkeypatch, [Unverified("prefill answered HTTP 500: timeout"), Unverified(DEAD),
                                        {"ok": True}])
    actions.canary_pairs([(_I("p01"), _I("d01"))], lambda s: None, retry_once=True, deadline_s=120, session_wait_s=4)
    assert len(calls) == 3 and slept == [5.0]
    # a refusal that outlasts the deadline fails, naming the probe's settings
    calls, slept = _world(monkeypatch, [Unverified(DEAD)] * 50)
    with pytest.raises(DeployFailed) as e:
        actions.canary_pairs([(_I("p01"), _I("d01"))], lambda s: None, retry_once=True, deadline_s=20,
                             session_wait_s=4)
    assert "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S" in e.value.fix and len(calls) < 50


def test_the_wait_is_the_profiles_longest_probe_interval():
    assert failed_session_wait_s({"SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S": "4"}) == 4.0
    assert failed_session_wait_s({}) == 300.0  # SGLang 0.5.23's default
