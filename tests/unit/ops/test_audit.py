"""The admission audit's decisions, from samples and stream records: no host, no process."""

from pdops.ops.audit import (AuditReport, Claim, DecodeSample, Round, StreamRecord, check_cap, check_cut,
                         check_queue, check_unauthorized)


def rnd(t, *per_decode):
    """per_decode: (running, waiting, aborted) per decode."""
    return Round(t, tuple(DecodeSample(t, f"http://d{i}", r, w, r, a, 0) for i, (r, w, a) in enumerate(per_decode)))


def rec(i, sent, status, headers_at=None, end=None, cut_at=None, error=None):
    return StreamRecord(i, f"r{i}", sent, status, headers_at, headers_at, end, 10, cut_at, error)


# ---- cap

def test_cap_holds_when_the_sum_over_decodes_never_exceeds_it():
    rounds = [rnd(0, (1, 0, 0), (1, 0, 0)), rnd(0.1, (2, 0, 0), (2, 0, 0)), rnd(0.2, (1, 0, 0), (0, 0, 0))]
    c = check_cap(rounds, 4)
    assert c.passed and "peak in-flight at the decodes 4" in c.detail


def test_cap_broken_by_one_sample_fails_with_evidence():
    rounds = [rnd(0, (2, 0, 0)), rnd(0.1, (2, 1, 0))]  # a waiting request at the decode counts
    c = check_cap(rounds, 2)
    assert not c.passed and "in-flight 3" in c.evidence[0]


def test_cap_with_nothing_ever_in_flight_proves_nothing():
    assert not check_cap([rnd(0, (0, 0, 0))], 2).passed
    assert not check_cap([], 2).passed


# ---- queue

def test_queued_requests_served_in_order_pass():
    s = [rec(0, 0, 200, 0.01), rec(1, 0.05, 200, 0.06), rec(2, 0.1, 200, 3.0), rec(3, 0.15, 200, 3.05)]
    c = check_queue(s, cap=2, queue=4, queue_timeout_s=30, overflow_status=429)
    assert c.passed and "2 queued and served" in c.detail


def test_queued_requests_served_out_of_order_fail():
    s = [rec(0, 0, 200, 0.01), rec(1, 0.05, 200, 0.06), rec(2, 0.1, 200, 5.0), rec(3, 0.15, 200, 3.0)]
    c = check_queue(s, cap=2, queue=4, queue_timeout_s=30, overflow_status=429)
    assert not c.passed and "not in order" in c.evidence[0]


def test_refused_at_the_queue_timeout_with_the_configured_status_passes():
    s = [rec(0, 0, 200, 0.01), rec(1, 0.05, 200, 0.06), rec(2, 0.1, 429, 1.1, 1.1), rec(3, 0.15, 429, 0.16, 0.16)]
    assert check_queue(s, cap=2, queue=1, queue_timeout_s=1, overflow_status=429).passed


def test_wrong_overflow_status_fails():
    s = [rec(0, 0, 200, 0.01), rec(1, 0.05, 200, 0.06), rec(2, 0.1, 503, 1.1, 1.1)]
    c = check_queue(s, cap=2, queue=1, queue_timeout_s=1, overflow_status=429)
    assert not c.passed and "expected 200 or 429" in c.evidence[0]


def test_full_queue_must_refuse_at_once_not_at_the_timeout():
    """What HAProxy's server maxqueue alone does: the overflow waits in the backend queue."""
    s = [rec(0, 0, 200, 0.01), rec(1, 0.05, 200, 0.06), rec(2, 0.1, 429, 1.1, 1.1), rec(3, 0.15, 429, 1.15, 1.15)]
    c = check_queue(s, cap=2, queue=1, queue_timeout_s=1, overflow_status=429)
    assert not c.passed and "queue full" in c.evidence[0]


def test_refused_too_early_for_its_queue_slot_fails():
    s = [rec(0, 0, 200, 0.01), rec(1, 0.05, 200, 0.06), rec(2, 0.1, 429, 0.11, 0.11)]
    assert not check_queue(s, cap=2, queue=4, queue_timeout_s=10, overflow_status=429).passed


def test_a_request_within_the_cap_refused_fails():
    s = [rec(0, 0, 200, 0.01), rec(1, 0.05, 429, 0.06, 0.06)]
    assert not check_queue(s, cap=2, queue=0, queue_timeout_s=1, overflow_status=429).passed


# ---- auth

def test_unauthorized_all_401_and_none_reached_passes():
    assert check_unauthorized([401, 401], 10, 10, 0).passed


def test_unauthorized_that_reached_the_decode_fails():
    c = check_unauthorized([200, 401], 10, 11, 0)
    assert not c.passed and any("reached" in e or "counted" in e for e in c.evidence)
    assert not check_unauthorized([401, 401], 10, 10, 1).passed
    assert not check_unauthorized([], 10, 10, 0).passed


# ---- cancel on disconnect

def test_cut_streams_released_within_the_bound_pass():
    streams = [rec(0, 0, 200, 0.1, 2.0, cut_at=2.0), rec(1, 0, 200, 0.1, 4.0)]
    rounds = [rnd(1.9, (2, 0, 5)), rnd(2.1, (2, 0, 5)), rnd(2.6, (1, 0, 6))]
    c = check_cut(rounds, streams, bound_s=3)
    assert c.passed and "running 2->1, aborted +1" in c.detail


def test_cut_streams_still_running_fail():
    streams = [rec(0, 0, 200, 0.1, 2.0, cut_at=2.0), rec(1, 0, 200, 0.1, 4.0)]
    rounds = [rnd(1.9, (2, 0, 5)), rnd(2.5, (2, 0, 5)), rnd(4.5, (1, 0, 6))]  # released only after the bound
    assert not check_cut(rounds, streams, bound_s=2).passed


def test_cut_without_abort_counted_fails():
    streams = [rec(0, 0, 200, 0.1, 2.0, cut_at=2.0)]
    rounds = [rnd(1.9, (1, 0, 5)), rnd(2.5, (0, 0, 5))]  # finished, not aborted
    assert not check_cut(rounds, streams, bound_s=2).passed


def test_nothing_cut_fails():
    streams = [rec(0, 0, 200, 0.1, 1.0, error="ended before the cut")]
    c = check_cut([rnd(0.5, (1, 0, 0))], streams, bound_s=2)
    assert not c.passed and "ended before the cut" in c.evidence[0]


# ---- report

def test_report_passes_only_if_every_claim_does():
    r = AuditReport("http://a", "admission", 2, [Claim("cap", True, "ok"), Claim("auth", True, "ok")])
    assert r.passed and r.format().endswith("result: PASS")
    r.claims.append(Claim("cancel", False, "no", ("evidence line",)))
    assert not r.passed and "[FAIL] cancel" in r.format() and "evidence line" in r.format()
    assert not AuditReport("http://a", "admission", 2).passed
    g = AuditReport("http://g", "gateway", 2, [Claim("cap", True, "peak 2"), Claim("auth", False, "200")])
    assert "the gateway's own flags fail: auth;" in g.format()
