"""The model gateway's worker list: ``GET /workers`` (sglang-router 0.3.2, ``smg``).

Shape observed from the real binary (tests/data/facts/gateway_workers_pd.json):
``{"workers": [{"id", "url", "model_id", "worker_type", "is_healthy", "load",
"bootstrap_port" (prefill only), "connection_mode", "metadata", ...}], "total", "stats"}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pdops.errors import Unverified


@dataclass(frozen=True)
class Worker:
    id: str
    url: str
    worker_type: str  # prefill | decode | regular
    is_healthy: bool
    load: int
    bootstrap_port: int | None = None
    model_id: str | None = None
    metadata: dict = field(default_factory=dict, compare=False)


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
            metadata=dict(d.get("metadata") or {}),
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
