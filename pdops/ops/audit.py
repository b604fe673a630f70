"""`inv audit.admission`: measure the admission layer's claims on a live cluster (rule 2).

A configured cap is a claim to be measured, not trusted. Two phases, each sampled every
~100 ms on every decode (`/v1/loads` num_running_reqs + waiting, `/metrics`
sglang:num_running_reqs and sglang:num_aborted_requests_total):

1. auth: requests without a key or with a wrong one must get 401 and reach no engine;
2. cap: 2C long streams sent 50 ms apart: in-flight at the decodes never exceeds C; the
   streams beyond C are served in order (FIFO) or refused with the configured status at
   the queue timeout (or at once when the queue is full);
3. cut: C streams; half are cut by the client midway: within a bound the decodes'
   running count drops by that many and their aborted counter rises by that many
   (a disconnect cancels the decode and releases it).

The pure part (claims from samples and stream records) is tested without hosts; the live
part (`run_audit`) only collects those records with aiohttp. `--against-gateway` runs the
same measurement straight on the gateway to show its flags are not a cap.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import aiohttp

from pdops.errors import Unreachable
from pdops.facts.engine import LOADS_PATH, METRICS_PATH, counter, parse_loads, parse_metrics

ABORTED = "sglang:num_aborted_requests_total"
REQUESTS = "sglang:num_requests_total"
RUNNING = "sglang:num_running_reqs"


# ---------------------------------------------------------------- records (pure)

@dataclass(frozen=True)
class DecodeSample:
    """One read of one decode: in-flight from /v1/loads, running and aborted from /metrics."""

    t: float
    url: str
    running: int  # /v1/loads num_running_reqs
    waiting: int  # /v1/loads num_waiting_reqs (decode: prealloc + transfer + retracted + waiting)
    metrics_running: float
    aborted: float
    requests: float

    @property
    def in_flight(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True)
class Round:
    """Every decode read once, at about time t."""

    t: float
    samples: tuple[DecodeSample, ...]

    @property
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.samples)

    @property
    def running(self) -> int:
        return sum(max(s.running, int(s.metrics_running)) for s in self.samples)

    @property
    def aborted(self) -> float:
        return sum(s.aborted for s in self.samples)

    @property
    def requests(self) -> float:
        return sum(s.requests for s in self.samples)


@dataclass
class StreamRecord:
    """One request as the client saw it (times: time.monotonic of the auditing process)."""

    index: int
    rid: str
    sent: float
    status: int | None = None  # HTTP status; None if no answer
    headers_at: float | None = None  # response headers arrived (admitted, for a 200)
    first_chunk_at: float | None = None
    end: float | None = None
    chunks: int = 0
    cut_at: float | None = None  # the client closed the stream here
    error: str | None = None

    @property
    def admitted(self) -> bool:
        return self.status == 200

    @property
    def wait_s(self) -> float | None:
        return None if self.headers_at is None else self.headers_at - self.sent


@dataclass(frozen=True)
class Claim:
    name: str
    passed: bool
    detail: str
    evidence: tuple[str, ...] = ()


@dataclass
class AuditReport:
    target: str
    mode: str  # admission | gateway
    cap: int
    claims: list[Claim] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.claims) and all(c.passed for c in self.claims)

    def format(self) -> str:
        head = "through the admission layer" if self.mode == "admission" else "straight at the gateway (its own flags)"
        lines = [f"admission audit of {self.target} {head}, cap C={self.cap}"]
        for k, v in self.facts.items():
            lines.append(f"  {k}: {v}")
        for c in self.claims:
            lines.append(f"  [{'PASS' if c.passed else 'FAIL'}] {c.name}: {c.detail}")
            lines.extend(f"      {e}" for e in c.evidence[:12])
        lines.append(f"result: {'PASS' if self.passed else 'FAIL'}")
        if self.mode == "gateway" and not self.passed:
            failed = [c.name for c in self.claims if not c.passed]
            lines.append(f"  the gateway's own flags fail: {', '.join(failed)}; the admission layer in front holds "
                         "every claim and rotates keys without a restart (docs/admission.md)")
        return "\n".join(lines)


# ---------------------------------------------------------------- decisions (pure)

def check_cap(rounds: list[Round], cap: int) -> Claim:
    """In-flight at the decodes (sum over decodes, per sampling round) never above the cap."""
    if not rounds:
        return Claim("cap", False, "no sample of the decodes was taken")
    peak = max(rounds, key=lambda r: r.in_flight)
    t0 = rounds[0].t
    over = [r for r in rounds if r.in_flight > cap]
    detail = f"peak in-flight at the decodes {peak.in_flight} (cap {cap}) over {len(rounds)} samples"
    ev = tuple(f"t={r.t - t0:.2f}s in-flight {r.in_flight}: " +
               ", ".join(f"{s.url} running={s.running} waiting={s.waiting}" for s in r.samples) for r in over[:5])
    return Claim("cap", not over and peak.in_flight > 0, detail if peak.in_flight > 0 else
                 detail + ": nothing was ever seen in flight, the measurement proves nothing", ev)


def check_queue(streams: list[StreamRecord], cap: int, queue: int, queue_timeout_s: float,
                overflow_status: int, tolerance_s: float = 0.5, order_slack_s: float = 0.3) -> Claim:
    """The first `cap` streams (by send order) are admitted at once; each later one is either
    admitted after every earlier-sent admitted stream (FIFO, within order_slack_s), or
    refused with `overflow_status`: at the queue timeout (+/- tolerance_s) if it fit in
    the queue, at once if the queue was full."""
    ev: list[str] = []
    ordered = sorted(streams, key=lambda s: s.index)
    for s in ordered[:cap]:
        if not s.admitted:
            ev.append(f"#{s.index} {s.rid}: within the cap but got {s.status} {s.error or ''}".rstrip())
    later = ordered[cap:]
    last_adm: StreamRecord | None = None
    served = refused = 0
    for pos, s in enumerate(later):
        if s.admitted:
            served += 1
            if last_adm is not None and s.headers_at is not None and last_adm.headers_at is not None \
                    and s.headers_at + order_slack_s < last_adm.headers_at:
                ev.append(f"#{s.index} admitted {last_adm.headers_at - s.headers_at:.2f}s before #{last_adm.index} "
                          "which was sent earlier: not in order")
            last_adm = s
            continue
        if s.status != overflow_status:
            ev.append(f"#{s.index} {s.rid}: got {s.status} ({s.error or 'no detail'}), expected 200 or {overflow_status}")
            continue
        refused += 1
        wait = (s.end or s.sent) - s.sent
        if pos < queue:  # it had a queue slot: refused only when the wait timed out
            if abs(wait - queue_timeout_s) > tolerance_s:
                ev.append(f"#{s.index}: {overflow_status} after {wait:.2f}s, queue timeout is {queue_timeout_s}s")
        elif wait > tolerance_s:
            ev.append(f"#{s.index}: queue full, yet refused only after {wait:.2f}s")
    detail = (f"{len(ordered[:cap])} within the cap, {served} queued and served, "
              f"{refused} refused with {overflow_status}")
    return Claim("queue", not ev, detail, tuple(ev))


def check_unauthorized(statuses: list[int | None], requests_before: float, requests_after: float,
                       in_flight_seen: int) -> Claim:
    """Requests without a valid key: every one 401, and the decodes saw none of them."""
    ev = [f"request #{i} without a valid key got {s}" for i, s in enumerate(statuses) if s != 401]
    reached = requests_after - requests_before
    if reached > 0 or in_flight_seen > 0:
        ev.append(f"the decodes counted {reached:g} new requests (in flight seen: {in_flight_seen})")
    return Claim("auth", not ev and bool(statuses),
                 f"{len(statuses)} requests without a valid key: {sorted(set(map(str, statuses)))}, "
                 f"{reached:g} reached a decode", tuple(ev))


def check_cut(rounds: list[Round], streams: list[StreamRecord], bound_s: float) -> Claim:
    """Streams the client cut: within bound_s of the last cut, the decodes' running count
    is down by the number cut (from its value just before the first cut), and their
    aborted counter is up by as many."""
    cut = [s for s in streams if s.cut_at is not None]
    wanted = [s for s in streams if s.error == "ended before the cut"]
    if not cut:
        return Claim("cancel", False, "no stream was cut", tuple(f"#{s.index}: {s.error}" for s in wanted))
    first, last = min(s.cut_at for s in cut), max(s.cut_at for s in cut)
    before = [r for r in rounds if r.t <= first]
    if not before:
        return Claim("cancel", False, "no sample before the first cut")
    r0 = before[-1]
    after = [r for r in rounds if last <= r.t <= last + bound_s]
    k = len(cut)
    hit = next((r for r in after if r.running <= r0.running - k and r.aborted >= r0.aborted + k), None)
    ev = [f"#{s.index}: {s.error}" for s in wanted]
    if hit is None:
        best = min(after, key=lambda r: r.running, default=None)
        ev.append(f"before the cut: running {r0.running}, aborted {r0.aborted:g}; "
                  + (f"within {bound_s}s at best running {best.running}, aborted {max(r.aborted for r in after):g}"
                     if best else "no sample after the cut"))
        return Claim("cancel", False, f"{k} streams cut: the decodes did not release them within {bound_s}s", tuple(ev))
    per = ", ".join(f"{a.url} running {a.running}->{b.running} aborted {a.aborted:g}->{b.aborted:g}"
                    for a, b in zip(r0.samples, hit.samples))
    return Claim("cancel", not wanted,
                 f"{k} streams cut: running {r0.running}->{hit.running}, aborted +{hit.aborted - r0.aborted:g} "
                 f"{hit.t - last:.2f}s after the last cut ({per})", tuple(ev))


# ---------------------------------------------------------------- live part

async def _sample_decode(session: aiohttp.ClientSession, url: str) -> DecodeSample:
    t = time.monotonic()
    async with session.get(url + LOADS_PATH) as r:
        loads = parse_loads(await r.text())
    async with session.get(url + METRICS_PATH) as r:
        m = parse_metrics(await r.text())
    return DecodeSample(t, url, loads.total("running"), loads.total("waiting"),
                        counter(m, RUNNING), counter(m, ABORTED), counter(m, REQUESTS))


class Sampler:
    """Reads every decode every `interval` s until stopped; keeps the rounds."""

    def __init__(self, session: aiohttp.ClientSession, decodes: list[str], interval: float = 0.1):
        self.session, self.decodes, self.interval = session, decodes, interval
        self.rounds: list[Round] = []
        self._stop = asyncio.Event()
        self.errors: list[str] = []

    async def once(self) -> Round:
        got = await asyncio.gather(*(_sample_decode(self.session, u) for u in self.decodes), return_exceptions=True)
        bad = [f"{u}: {g}" for u, g in zip(self.decodes, got) if isinstance(g, BaseException)]
        if bad:
            self.errors.extend(bad)
            raise Unreachable("cannot read a decode's /v1/loads or /metrics", evidence="\n".join(bad[:5]))
        r = Round(time.monotonic(), tuple(got))
        self.rounds.append(r)
        return r

    async def run(self) -> None:
        while not self._stop.is_set():
            await self.once()
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass

    def stop(self) -> None:
        self._stop.set()


def _body(rid: str, tokens: int) -> dict:
    return {"text": f"pdops admission audit {rid}", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}


async def _stream(session: aiohttp.ClientSession, url: str, key: str | None, rec: StreamRecord, tokens: int,
                  cut_after_chunks: int | None, timeout: float) -> None:
    headers = {"x-request-id": rec.rid}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        async with session.post(url + "/generate", json=_body(rec.rid, tokens), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            rec.status, rec.headers_at = resp.status, time.monotonic()
            if resp.status != 200:
                rec.error = (await resp.text())[:200]
                return
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                rec.chunks += 1
                if rec.first_chunk_at is None:
                    rec.first_chunk_at = time.monotonic()
                if cut_after_chunks is not None and rec.chunks >= cut_after_chunks:
                    rec.cut_at = time.monotonic()
                    resp.close()  # the client goes away mid-stream
                    return
            if cut_after_chunks is not None:
                rec.error = "ended before the cut"
    except asyncio.TimeoutError:
        rec.error = "client timeout"
    except aiohttp.ClientError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        rec.end = time.monotonic()


async def _wait_idle(sampler: Sampler, timeout: float) -> Round:
    deadline = time.monotonic() + timeout
    while True:
        r = await sampler.once()
        if r.in_flight == 0:
            return r
        if time.monotonic() > deadline:
            raise Unreachable(f"the decodes did not go idle within {timeout:.0f}s (in flight {r.in_flight})",
                              fix="run the audit on an idle cluster")
        await asyncio.sleep(0.1)


async def run_audit(target_url: str, decode_urls: list[str], key: str | None, *, cap: int, queue: int,
                    queue_timeout_s: float, overflow_status: int = 429, tokens: int = 1000,
                    mode: str = "admission", cut_bound_s: float = 5.0, stagger_s: float = 0.05,
                    timeout_s: float = 300.0, interval_s: float = 0.1) -> AuditReport:
    """Drive the three phases against `target_url` and decide. Needs an idle cluster."""
    target_url = target_url.rstrip("/")
    decodes = [u.rstrip("/") for u in decode_urls]
    report = AuditReport(target_url, mode, cap)
    tag = uuid.uuid4().hex[:6]
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as session:
        sampler = Sampler(session, decodes, interval_s)
        idle = await _wait_idle(sampler, 60)

        # 1. auth: no key, a wrong key
        bad = [StreamRecord(i, f"audit-{tag}-noauth-{i}", time.monotonic()) for i in range(2)]
        await asyncio.gather(_stream(session, target_url, None, bad[0], tokens, None, 30),
                             _stream(session, target_url, "pdops-audit-wrong-key-" + tag, bad[1], tokens, None, 30))
        # nothing should arrive: watch the decodes a moment for anything that did
        watch_until = time.monotonic() + 1.0
        seen = 0
        while time.monotonic() < watch_until:
            seen = max(seen, (await sampler.once()).in_flight)
            await asyncio.sleep(interval_s)
        if seen:
            await _wait_idle(sampler, timeout_s)
        report.claims.append(check_unauthorized([b.status for b in bad], idle.requests,
                                                sampler.rounds[-1].requests, seen))

        # 2. cap and queue: 2C streams, 50 ms apart so the send order is the arrival order
        streams = [StreamRecord(i, f"audit-{tag}-cap-{i:03d}", 0.0) for i in range(2 * cap)]
        task = asyncio.create_task(sampler.run())
        start = len(sampler.rounds)

        async def send(rec: StreamRecord, delay: float, cut: int | None) -> None:
            await asyncio.sleep(delay)
            rec.sent = time.monotonic()
            await _stream(session, target_url, key, rec, tokens, cut, timeout_s)

        await asyncio.gather(*(send(s, i * stagger_s, None) for i, s in enumerate(streams)))
        sampler.stop()
        await task
        cap_rounds = sampler.rounds[start:]
        report.claims.append(check_cap(cap_rounds, cap))
        report.claims.append(check_queue(streams, cap, queue, queue_timeout_s, overflow_status))
        ok = [s for s in streams if s.admitted and s.first_chunk_at and s.end]
        if ok:
            dur = sorted(s.end - s.first_chunk_at for s in ok)[len(ok) // 2]
            report.facts["stream length (median)"] = f"{dur:.2f}s, {tokens} tokens"
        report.facts["statuses (cap phase)"] = _count(s.status for s in streams)

        # 3. cut: C streams, half cut midway by the client
        await _wait_idle(sampler, timeout_s)
        sampler = Sampler(session, decodes, interval_s)
        cut_n = max(1, cap // 2)
        streams = [StreamRecord(i, f"audit-{tag}-cut-{i:03d}", 0.0) for i in range(cap)]
        task = asyncio.create_task(sampler.run())
        await asyncio.gather(*(send(s, 0.0, tokens // 2 if i < cut_n else None) for i, s in enumerate(streams)))
        sampler.stop()
        await task
        report.claims.append(check_cut(sampler.rounds, streams, cut_bound_s))
        report.facts["statuses (cut phase)"] = _count(s.status for s in streams)
    return report


def _count(values) -> str:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in sorted(out.items()))


def audit(target_url: str, decode_urls: list[str], key: str | None, **kw) -> AuditReport:
    """Synchronous wrapper of run_audit."""
    return asyncio.run(run_audit(target_url, decode_urls, key, **kw))
