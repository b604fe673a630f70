"""Synchronous client for the model gateway (smg 1.13, ``pdops.model.versions.SMG_VERSION``).

Worker registration is asynchronous: ``POST /workers`` answers 202 with a worker id and
the gateway then probes the worker in the background (a worker it cannot reach stays
``pending``, out of ``GET /workers``, and is probed again). So
:meth:`GatewayClient.wait_worker_healthy` polls ``GET /workers`` until the URL is listed
healthy and ``ready`` or the deadline passes. Removal is by id (``DELETE /workers/{id}``,
202): the worker turns ``draining`` at once (no new request is routed to it, requests
already on it go on) and is gone after smg's settle time (about 5 s);
:meth:`wait_worker_out` returns at the first, :meth:`wait_worker_gone` at the second.

A worker is routable only when smg lists it healthy and ready **and** its circuit breaker is
closed, which only the gateway's ``/metrics`` says (pdops.facts.gateway): a client given
``metrics_url`` (every client :class:`Gateways` makes) reads both on every :meth:`list_workers`.
smg keeps a worker's breaker through a restart of its engine (the breaker belongs to the URL) and
has no call that closes one: :meth:`GatewayClient.reregister` removes the worker and adds it again,
which gives it a new, closed breaker (and a new id).

Deadlines are absolute ``time.monotonic()`` values (see :func:`deadline_in`).
The API key is read from a file and sent as a bearer token; it is never logged or
put into an error message.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from typing import Callable

from pdops.errors import InvalidInput, PdopsError, Unreachable, Unverified
from pdops.facts import gateway as gw_facts
from pdops.facts.gateway import Worker

WORKER_TYPES = ("prefill", "decode", "regular")


def deadline_in(seconds: float) -> float:
    """An absolute deadline ``seconds`` from now, for the ``wait_*`` methods."""
    return time.monotonic() + seconds


def _tail(text: str, n: int = 500) -> str:
    return text[-n:]


def _id_in(message: str) -> str | None:
    """The worker id in smg's 409 message ("... in progress for URL '...' with ID <id>. Poll ...")."""
    m = re.search(r"with ID ([0-9a-fA-F-]{36})", message)
    return m.group(1) if m else None


class GatewayClient:
    def __init__(self, base_url: str, *, api_key_file: str | None = None, timeout: float = 5.0,
                 poll_interval: float = 0.25, metrics_url: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.metrics_url = metrics_url
        self.timeout = timeout
        self.poll_interval = poll_interval
        self._api_key: str | None = None
        if api_key_file:
            try:
                with open(api_key_file, encoding="utf-8") as f:
                    self._api_key = f.read().strip() or None
            except OSError as e:
                raise InvalidInput("gateway api key file", f"cannot read {api_key_file}: {e.strerror}",
                                   fix="point to a readable file holding the key") from None

    def __repr__(self) -> str:  # never shows the key
        return f"GatewayClient({self.base_url!r}, api_key={'set' if self._api_key else 'none'})"

    # -- HTTP
    def _request(self, method: str, path: str, body: dict | None = None,
                 ok: tuple[int, ...] = (200,)) -> tuple[int, str]:
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self._api_key:
            req.add_header("Authorization", f"Bearer {self._api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                status, text = resp.status, resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise Unreachable(f"gateway {self.base_url}: {method} {path} failed: {reason}",
                              fix="check that the gateway unit runs and the address is right") from None
        if status not in ok:
            raise Unverified(f"gateway {method} {path} answered HTTP {status}",
                             evidence=_tail(text))
        return status, text

    def _json(self, method: str, path: str, body: dict | None = None, ok=(200,)) -> dict:
        _, text = self._request(method, path, body, ok)
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise Unverified(f"gateway {method} {path} answered non-JSON", evidence=_tail(text)) from None

    # -- API
    def health(self) -> bool:
        """True if ``GET /health`` answers 200 (the gateway process is up)."""
        self._request("GET", "/health")
        return True

    def readiness(self) -> dict:
        """``GET /readiness`` body with ``ready`` added; 503 "not ready" is an answer, not an error."""
        status, text = self._request("GET", "/readiness", ok=(200, 503))
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            body = {"raw": _tail(text)}
        body["ready"] = status == 200
        return body

    def list_workers(self) -> list[Worker]:
        """``GET /workers``, each worker with its breaker from ``/metrics`` when this client has its address
        (a /metrics that does not answer leaves every breaker "unread": not routable)."""
        workers = gw_facts.parse(self._json("GET", "/workers"))
        if self.metrics_url is None:
            return workers
        try:
            breakers, error = self.breakers(), None
        except PdopsError as exc:
            breakers, error = None, exc.message
        return [w.with_breaker(breakers, error) for w in workers]

    def breakers(self) -> dict[str, gw_facts.Breaker]:
        """{worker URL: its breaker}, from the gateway's Prometheus endpoint."""
        if self.metrics_url is None:
            raise InvalidInput("metrics_url", "this gateway client has no metrics address")
        req = urllib.request.Request(self.metrics_url, method="GET")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                text = resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            raise Unverified(f"gateway metrics {self.metrics_url} answered HTTP {e.code}") from None
        except (urllib.error.URLError, OSError) as e:
            raise Unreachable(f"gateway metrics {self.metrics_url}: {getattr(e, 'reason', e)}") from None
        return gw_facts.parse_breakers(text)

    def get_worker(self, worker_id: str) -> Worker | None:
        """One worker by id, or None when the gateway does not know it (404)."""
        status, text = self._request("GET", f"/workers/{worker_id}", ok=(200, 404))
        return None if status == 404 else gw_facts.parse_worker(text)

    def add_worker(self, url: str, worker_type: str, bootstrap_port: int | None = None) -> str:
        """Queue a worker registration; returns the worker id (registration is asynchronous)."""
        if worker_type not in WORKER_TYPES:
            raise InvalidInput("worker_type", f"{worker_type!r} is not one of {WORKER_TYPES}")
        body: dict = {"url": url, "worker_type": worker_type}
        if bootstrap_port is not None:
            body["bootstrap_port"] = int(bootstrap_port)
        status, text = self._request("POST", "/workers", body, ok=(200, 201, 202, 409))
        try:
            answer = json.loads(text)
        except json.JSONDecodeError:
            raise Unverified("gateway POST /workers answered non-JSON", evidence=_tail(text)) from None
        if status == 409:
            # already queued or known (e.g. by the gateway unit's own start-up registration,
            # pdops.model.membership): the same URL is one worker; take its id
            known = gw_facts.by_url(self.list_workers(), url)
            worker_id = known[0].id if known else _id_in(answer.get("error", ""))
            if not worker_id:
                raise Unverified(f"gateway refused worker {url} (HTTP 409)", evidence=_tail(text))
            return worker_id
        worker_id = answer.get("worker_id")
        if not worker_id:
            raise Unverified("gateway accepted the worker but returned no worker_id",
                             evidence=json.dumps(answer)[-500:])
        return str(worker_id)

    def wait_worker_healthy(self, url: str, deadline: float,
                            progress: Callable[[str], None] | None = None) -> Worker:
        """Poll /workers until ``url`` is listed routable (healthy, ``ready``, its breaker not open or
        half-open, and exported where /metrics answers); Unverified at the deadline."""
        last = "not listed yet"
        while True:
            matches = gw_facts.by_url(self.list_workers(), url)
            # routable, and its breaker exported (a new registration's series appears a moment after it is
            # listed); a /metrics that does not answer is not waited for: it is said (Worker.breaker_unknown)
            healthy = [w for w in matches if w.routable and (w.breaker is None or w.breaker.state != gw_facts.NOT_EXPORTED)]
            if healthy:
                return healthy[0]
            state = (f"listed, {', '.join((w.status or 'unhealthy') + (f', {w.breaker_problem or w.breaker_unknown}' if w.breaker_problem or w.breaker_unknown else '') for w in matches)}"
                     if matches else "not listed")
            if progress and state != last:
                progress(f"worker {url}: {state}")
            last = state
            if time.monotonic() >= deadline:
                raise Unverified(
                    f"worker {url} not healthy in the gateway by the deadline ({state})",
                    fix="check the worker's /health and the gateway's log; the gateway never "
                        "lists a worker it could not reach",
                    evidence=json.dumps([w.__dict__ for w in matches], default=str)[-1000:] or None,
                )
            time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))

    def reregister(self, worker: Worker, deadline: float) -> Worker:
        """Close `worker`'s breaker the only way smg 1.13 has: remove it (it drains: requests on it go
        on), wait until it is gone, add it again (a new worker with a new, closed breaker), and wait
        until it is routable. Returns the new worker (its breaker read, when this client reads them)."""
        self.remove_worker(worker.id)
        self.wait_worker_gone(worker.id, deadline)
        self.add_worker(worker.url, worker.worker_type, worker.bootstrap_port)
        return self.wait_worker_healthy(worker.url, deadline)

    def remove_worker(self, worker_id: str) -> None:
        """Ask the gateway to drop a worker (by id). Confirm with :meth:`wait_worker_gone`."""
        self._request("DELETE", f"/workers/{worker_id}", ok=(200, 202, 204))

    def wait_worker_out(self, worker_id: str, deadline: float) -> str:
        """Poll until ``worker_id`` takes no new requests: ``draining`` or absent. Returns which."""
        while True:
            mine = [w for w in self.list_workers() if w.id == worker_id]
            if not mine:
                return "gone"
            if mine[0].status == gw_facts.DRAINING:
                return gw_facts.DRAINING
            if time.monotonic() >= deadline:
                raise Unverified(f"worker {worker_id} still {mine[0].status} in the gateway at the deadline")
            time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))

    def wait_worker_gone(self, worker_id: str, deadline: float,
                         progress: Callable[[str], None] | None = None) -> None:
        """Poll until ``worker_id`` is absent from /workers; Unverified at the deadline."""
        while True:
            if all(w.id != worker_id for w in self.list_workers()):
                return
            if progress:
                progress(f"worker {worker_id}: still listed")
            if time.monotonic() >= deadline:
                raise Unverified(f"worker {worker_id} still listed by the gateway at the deadline")
            time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))


class Gateways:
    """Every gateway of the cluster (`pdops_gateway.host` or `.hosts`), each an independent smg with
    its own registrations: what pdops asks of "the gateway" it asks of each, and a worker is in
    service only when every gateway routes to it (docs/gateway.md "Two or more gateways")."""

    def __init__(self, nodes, *, api_key_file: str | None = None, timeout: float = 5.0,
                 poll_interval: float = 0.25):
        if not nodes:
            raise InvalidInput("pdops_gateway", "no gateway named", fix="name at least one gateway host")
        self.nodes = tuple(nodes)
        self.clients: dict[str, GatewayClient] = {
            n.host: GatewayClient(n.url, api_key_file=api_key_file, timeout=timeout, poll_interval=poll_interval,
                                  metrics_url=n.metrics_url)
            for n in self.nodes}

    @classmethod
    def of(cls, inv, **kw) -> "Gateways":
        return cls(inv.gateway.nodes, api_key_file=inv.gateway.api_key_file, **kw)

    def __repr__(self) -> str:
        return f"Gateways({', '.join(self.clients)})"

    def subset(self, hosts) -> "Gateways":
        """The same clients, only those of `hosts` (None: all)."""
        if hosts is None:
            return self
        out = object.__new__(Gateways)
        out.nodes = tuple(n for n in self.nodes if n.host in set(hosts))
        out.clients = {h: c for h, c in self.clients.items() if h in set(hosts)}
        return out

    def __len__(self) -> int:
        return len(self.clients)

    def items(self):
        return self.clients.items()

    def client(self, host: str) -> GatewayClient:
        return self.clients[host]

    def workers(self) -> dict[str, list[Worker]]:
        """{gateway host: its /workers}; Unreachable names the first gateway that does not answer."""
        return {h: c.list_workers() for h, c in self.clients.items()}

    def wait_worker_healthy(self, url: str, deadline: float,
                            progress: Callable[[str], None] | None = None) -> dict[str, Worker]:
        """Until every gateway lists ``url`` healthy and ready: {gateway host: its worker}."""
        return {h: c.wait_worker_healthy(url, deadline, progress) for h, c in self.clients.items()}

    def wait_url_gone(self, url: str, deadline: float) -> None:
        """Until no gateway lists a worker at ``url`` (smg drops a removed worker after its settle time)."""
        for h, c in self.clients.items():
            for w in gw_facts.by_url(c.list_workers(), url):
                c.wait_worker_gone(w.id, deadline)

    def routable_everywhere(self) -> set[str]:
        """The worker URLs (without a trailing /) every gateway routes to now."""
        sets = [{w.url.rstrip("/") for w in ws if w.routable} for ws in self.workers().values()]
        return set.intersection(*sets) if sets else set()
