"""The canary: one generation through exactly one prefill and one decode, before the gateway routes to
either, sent as the gateway would (the same body, one bootstrap room, to both halves at once), and its
retry where a decode or a prefill still holds what it knew of an earlier process at the same address."""

from __future__ import annotations

import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait

from pdops.errors import DeployFailed, PdopsError, Unverified
from pdops.facts.engine import FAILED_SESSION, PROBE_MAX_ENV, SEND_FAILED
from pdops.fanout import failures, run_parallel
from pdops.model.placement import Instance
from pdops.remote.hosts import http_json
from pdops.runner import Say


def canary_pair(p: Instance, d: Instance, timeout: float = 60) -> dict:
    """One generation through exactly this prefill and this decode, sent as the gateway does:
    the same body (with a shared bootstrap room) to both, concurrently."""
    rid = f"pdops-canary-{p.id}-{d.id}-{uuid.uuid4().hex[:8]}"
    body = {"text": f"pdops canary {p.id} to {d.id}", "rid": rid, "stream": False,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "bootstrap_host": p.head.data_addr, "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": random.getrandbits(62)}
    res = both_sides(p, d, body, rid, timeout)
    out = {"rid": rid}
    failed, evidence = [], []
    for role, r in res.items():
        if isinstance(r, Exception):
            failed.append(f"{role} did not answer: {r}")
            continue
        status, doc = r
        out[role] = status
        if status != 200:
            failed.append(f"{role} answered HTTP {status}")
            evidence.append(f"{role}: {str(doc)[-400:]}")
    if failed:
        # both sides named: with Mooncake the decode only learns "Failed to get kvcache from prefill
        # instance, it might be dead"; the prefill's own answer carries why (a refused session, a failed send)
        raise Unverified(f"canary {p.id} x {d.id}: {'; '.join(failed)}", evidence="\n".join(evidence) or None)
    meta = res["decode"][1].get("meta_info", {}) if isinstance(res["decode"][1], dict) else {}
    if not meta.get("completion_tokens"):
        raise Unverified(f"canary {p.id} x {d.id}: decode produced no tokens", evidence=str(res["decode"][1])[-400:])
    out["completion_tokens"] = meta.get("completion_tokens")
    return out


# A prefill that failed a transfer concludes it before it tells the decode, and answers its own request
# (HTTP 500 with the reason) within milliseconds after; an abort sent sooner turns that answer into an
# HTTP 200 "abort" and hides the reason (seen in CI: a refused Mooncake session read as an unknown failure).
PREFILL_ANSWER_GRACE_S = 3.0


def _answers_within(future, seconds: float) -> bool:
    """Whether the request behind `future` ended (an answer or an error) within `seconds`."""
    done, _ = wait([future], timeout=seconds)
    return bool(done)


def both_sides(p: Instance, d: Instance, body: dict, rid: str, timeout: float) -> dict:
    """POST the canary to the prefill and the decode at once. When the decode fails first (its
    bootstrap or transfer failed), the prefill gets PREFILL_ANSWER_GRACE_S to answer with its reason;
    one still holding the room then (the decode never reached it) would hold it until its own timeout:
    it is told to drop it (POST /abort_request with the canary's rid), so a failed canary fails in seconds."""

    def post(inst: Instance):
        return http_json("POST", f"{inst.url}/generate", body, timeout=timeout, headers={"x-request-id": rid})

    with ThreadPoolExecutor(max_workers=2) as ex:
        fp, fd = ex.submit(post, p), ex.submit(post, d)
        res: dict = {}
        try:
            res["decode"] = fd.result()
        except Exception as e:  # noqa: BLE001 - reported with the pair below
            res["decode"] = e
        dec = res["decode"]
        if (isinstance(dec, Exception) or dec[0] != 200) and not _answers_within(fp, PREFILL_ANSWER_GRACE_S):
            try:
                http_json("POST", f"{p.url}/abort_request", {"rid": rid}, timeout=5)
            except PdopsError:
                pass  # the prefill's own answer (or timeout) says the rest
        try:
            res["prefill"] = fp.result()
        except Exception as e:  # noqa: BLE001
            res["prefill"] = e
    return {"prefill": res["prefill"], "decode": res["decode"]}


def _wait_for_probe(bad: dict, say: Say, session_wait_s: float, deadline_s: float | None, t0: float,
                    timeout: float) -> bool:
    """Where a prefill refused the decode's Mooncake session (FAILED_SESSION), wait for its probe, as long
    as a canary still fits in the deadline after it; False (no wait) otherwise."""
    dead = [f"{p.id}x{d.id}" for (p, d), e in bad.items() if FAILED_SESSION in f"{e} {getattr(e, 'evidence', '')}"]
    if not dead or session_wait_s <= 0:
        return False
    left = (deadline_s - (time.monotonic() - t0) - timeout) if deadline_s else session_wait_s + 1.0
    wait = min(session_wait_s + 1.0, left)
    if wait <= 0:
        return False
    say(f"  {', '.join(dead)}: the prefill refuses the decode's Mooncake session, which it saw fail, until "
        f"its next probe ({PROBE_MAX_ENV} at most {session_wait_s:g}s): waiting {wait:.0f}s, then again")
    time.sleep(wait)
    return True


def canary_fix(bad: dict) -> str:
    """What the operator does next, from what the failed pairs' prefills answered."""
    said = " ".join(f"{e} {getattr(e, 'evidence', '')}" for e in bad.values())
    if FAILED_SESSION in said:
        return ("a prefill refuses a decode's Mooncake session it saw fail until its next probe: wait for it and "
                f"deploy again, or set SGLANG_FAILED_SESSION_PROBE_INTERVAL_S and {PROBE_MAX_ENV} lower in the "
                "profile's env")
    if SEND_FAILED in said:
        return ("the prefill could not write the KV to the decode. If the decode was just started again at its old "
                "address, it may have drawn its old Mooncake name (host:RPC port): the prefill still aims at the old "
                "process (Mooncake caches a peer's descriptor for good). Restart the prefill (`inv repair --instance "
                "<prefill> --force`), or set MC_TE_METADATA_REFRESH_INTERVAL_SECONDS (or MC_DISABLE_METACACHE) in "
                "the profile's env; otherwise check the transfer settings (NIC/GID) with `inv preflight`")
    return ("the named pair cannot serve; check its transfer settings (bootstrap port reachable, NIC/GID) with "
            "`inv preflight`")


def canary_pairs(pairs: list[tuple[Instance, Instance]], say: Say, *, retry_once: bool = False,
                 deadline_s: float | None = None, session_wait_s: float = 0.0) -> dict:
    """One canary through each pair, in parallel; DeployFailed naming every pair that failed.

    `retry_once`: a decode keeps the route to a prefill's bootstrap address and drops it only
    when a transfer through it fails, so an instance re-added at an address it had before
    (rollback, re-scale) fails its first canary with each decode that knew the old process.
    One retry per pair, before the instance is registered (no user request can reach it).
    `session_wait_s`: where a prefill answered that the decode's Mooncake session "is not alive" (a session
    it saw fail, refused until its next probe), the retry waits until the probe has run (at most this
    long, within the deadline)."""
    t0 = time.monotonic()
    timeout = min(60.0, deadline_s / (2 if retry_once else 1)) if deadline_s else 60.0
    res = run_parallel(pairs, lambda pd: canary_pair(*pd, timeout=timeout), max_workers=16)
    bad = failures(res)
    retried = {}
    if bad and retry_once:
        retried = {f"{p.id}x{d.id}": str(e) for (p, d), e in bad.items()}
        say(f"  first canary failed for {', '.join(retried)} (a decode may hold a stale route to this address); "
            "retrying each once")
        _wait_for_probe(bad, say, session_wait_s, deadline_s, t0, timeout)
        again = run_parallel(list(bad), lambda pd: canary_pair(*pd, timeout=timeout), max_workers=16)
        res.update(again)
        bad = failures(again)
        # a failed canary transfer can itself make the prefill mark the session failed: while the
        # answer is that refusal and the deadline allows, wait for the probe and try once more
        while bad and session_wait_s > 0 and _wait_for_probe(bad, say, session_wait_s, deadline_s, t0, timeout):
            again = run_parallel(list(bad), lambda pd: canary_pair(*pd, timeout=timeout), max_workers=16)
            res.update(again)
            bad = failures(again)
    if bad:
        names = ", ".join(f"{p.id} x {d.id}" for p, d in bad)
        raise DeployFailed(f"canary failed for {names}", fix=canary_fix(bad),
                           evidence="\n".join(f"{e}" + (f": {e.evidence}" if getattr(e, "evidence", None) else "")
                                              for e in bad.values()))
    say(f"  canary ok through {len(pairs)} prefill x decode pair(s)")
    out = {f"{p.id}x{d.id}": r for (p, d), r in res.items()}
    if retried:
        out["first_attempt_failed"] = retried
    return out
