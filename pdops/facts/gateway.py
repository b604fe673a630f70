"""The model gateway's worker list: ``GET /workers`` and ``GET /workers/{id}`` (smg 1.13).

Shape observed from the real binary (tests/data/facts/smg_*.json, gateway.source):
``{"workers": [{"id", "url", "model_id", "worker_type", "status", "is_healthy", "load",
"bootstrap_port" (prefill only), "connection_mode", "labels", ...}], "total", "stats"}``.

``status`` is smg's worker state: ``ready`` (routable), ``not_ready`` (failing health checks),
``draining`` (removal accepted: no new request is routed to it; gone after its settle time) and
``pending`` (queued, not yet reachable: shown by ``GET /workers/{id}`` only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pdops.errors import Unverified

READY = "ready"
DRAINING = "draining"


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

    @property
    def routable(self) -> bool:
        """The gateway routes new requests to it: healthy and ``ready``."""
        return self.is_healthy and self.status == READY

    def describe(self) -> str:
        return f"{self.url} ({self.worker_type}, {self.status or '?'}, {'healthy' if self.is_healthy else 'unhealthy'})"


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
