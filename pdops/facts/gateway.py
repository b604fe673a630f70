"""The model gateway's worker list: ``GET /workers`` and ``GET /workers/{id}`` (smg 1.13).

Shape observed from the real binary (tests/data/facts/smg_*.json, gateway.source):
``{"workers": [{"id", "url", "model_id", "worker_type", "status", "is_healthy", "load",
"bootstrap_port" (prefill only), "connection_mode", "labels", ...}], "total", "stats"}``.

``status`` is smg's worker state: ``ready`` (routable), ``not_ready`` (failing health checks),
``draining`` (removal accepted: no new request is routed to it; gone after its settle time) and
``pending`` (queued, not yet reachable: shown by ``GET /workers/{id}`` only).

smg routes a request to a worker only when it is healthy **and** its circuit breaker lets traffic
through; ``/workers`` has no breaker field. The breaker's state is read from the gateway's
``/metrics`` (``smg_worker_cb_state{worker=<url>}``: 0 closed, 1 open, 2 half-open, -1 removed;
``smg_worker_cb_consecutive_failures``), observed on the real smg 1.13.0
(tests/data/facts/smg_metrics_cb_open.txt, docs/gateway.md "Circuit breakers").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from pdops.errors import Unverified
from pdops.facts.engine import parse_metrics

READY = "ready"
DRAINING = "draining"

# smg_worker_cb_state's values (smg 1.13 metrics.rs) and the words pdops says for them
CLOSED, OPEN, HALF_OPEN, REMOVED = "closed", "open", "half-open", "removed"
CB_STATES = {0: CLOSED, 1: OPEN, 2: HALF_OPEN, -1: REMOVED}
# what a worker's breaker is when it could not be read: never said to be closed, never acted on
NOT_EXPORTED = "not exported"  # the gateway's /metrics answered without a series for the URL
UNREAD = "unread"  # the gateway's /metrics did not answer
# the states in which smg routes no new request to the worker (half-open: trial requests only)
BLOCKING = (OPEN, HALF_OPEN, REMOVED)


@dataclass(frozen=True)
class Breaker:
    """One worker's circuit breaker in one gateway, from its /metrics."""

    state: str  # closed | open | half-open | removed | not exported | unread
    consecutive_failures: int = 0
    opened: int = 0  # closed->open and half-open->open transitions since the gateway started
    error: str | None = None  # why it is unread


def parse_breakers(text: str) -> dict[str, Breaker]:
    """{worker URL (no trailing /): its breaker} from smg's /metrics text."""
    m = parse_metrics(text)
    fails = {lb.get("worker", "").rstrip("/"): int(v) for lb, v in m.get("smg_worker_cb_consecutive_failures", [])}
    opened: dict[str, int] = {}
    for lb, v in m.get("smg_worker_cb_transitions_total", []):
        if lb.get("to") == "open":
            u = lb.get("worker", "").rstrip("/")
            opened[u] = opened.get(u, 0) + int(v)
    out = {}
    for lb, v in m.get("smg_worker_cb_state", []):
        url = lb.get("worker", "").rstrip("/")
        if url:
            out[url] = Breaker(CB_STATES.get(int(v), f"state {v:g}"), fails.get(url, 0), opened.get(url, 0))
    return out


@dataclass(frozen=True)
class Worker:
    id: str
    url: str
    worker_type: str  # prefill | decode | regular
    is_healthy: bool
    load: int
    bootstrap_port: int | None = None
    model_id: str | None = None
    status: str | None = None  # ready | not_ready | draining | pending
    metadata: dict = field(default_factory=dict, compare=False)
    # its breaker in this gateway; None only from a client given no metrics address (a test's or a
    # bench's look at /workers alone): every product read goes through pdops.remote.gateway.Gateways
    breaker: Breaker | None = field(default=None, compare=False)

    @property
    def routable(self) -> bool:
        """A request sent now could be routed to it: healthy, ``ready``, and its breaker not open,
        half-open or removed. A breaker that could not be read is not taken as open (nothing is done
        on it) nor as closed (never said to be): :attr:`breaker_unknown` says so, and the gateway's
        observation makes it a finding (pdops.reads.observe)."""
        return self.is_healthy and self.status == READY and (self.breaker is None
                                                             or self.breaker.state not in BLOCKING)

    @property
    def breaker_problem(self) -> str | None:
        """Why its breaker keeps requests from it (open, half-open, removed), or None."""
        b = self.breaker
        if b is None or b.state not in BLOCKING:
            return None
        return (f"circuit {b.state}" + (f" after {b.consecutive_failures} consecutive failures"
                                        if b.consecutive_failures else ""))

    @property
    def breaker_unknown(self) -> str | None:
        """Why its breaker's state is not known (its gateway's /metrics unread, or no series for it yet)."""
        b = self.breaker
        if b is None or b.state not in (UNREAD, NOT_EXPORTED):
            return None
        if b.state == UNREAD:
            return f"its circuit breaker could not be read ({b.error})"
        return "its circuit breaker is not in the gateway's /metrics yet"

    def describe(self) -> str:
        cb = f", circuit {self.breaker.state}" if self.breaker is not None else ""
        return (f"{self.url} ({self.worker_type}, {self.status or '?'}, "
                f"{'healthy' if self.is_healthy else 'unhealthy'}{cb})")

    def with_breaker(self, breakers: dict[str, Breaker] | None, error: str | None = None) -> "Worker":
        """This worker with its breaker from `breakers` (parse_breakers); None: /metrics unread (`error`)."""
        if breakers is None:
            b = Breaker(UNREAD, error=error)
        else:
            b = breakers.get(self.url.rstrip("/")) or Breaker(NOT_EXPORTED)
        return replace(self, breaker=b)


def _worker(d: dict) -> Worker:
    try:
        return Worker(
            id=str(d["id"]),
            url=str(d["url"]),
            worker_type=str(d.get("worker_type", "regular")),
            is_healthy=bool(d["is_healthy"]),
            load=int(d.get("load") or 0),
            bootstrap_port=None if d.get("bootstrap_port") is None else int(d["bootstrap_port"]),
            model_id=d.get("model_id"),
            status=None if d.get("status") is None else str(d["status"]),
            metadata=dict(d.get("labels") or d.get("metadata") or {}),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise Unverified(f"gateway worker entry lacks a field: {e}", evidence=json.dumps(d)[:2000]) from e


def parse_worker(body: str | dict) -> Worker:
    """Parse one worker (``GET /workers/{id}``)."""
    return _worker(json.loads(body) if isinstance(body, str) else body)


def parse(body: str | dict) -> list[Worker]:
    """Parse ``GET /workers`` into workers."""
    try:
        data = json.loads(body) if isinstance(body, str) else body
        items = data["workers"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        text = body if isinstance(body, str) else json.dumps(body)
        raise Unverified("gateway /workers answer is not the expected JSON", evidence=text[-2000:]) from e
    return [_worker(w) for w in items]


def by_url(workers: list[Worker], url: str) -> list[Worker]:
    norm = url.rstrip("/")
    return [w for w in workers if w.url.rstrip("/") == norm]
