"""A small client of etcd's v3 JSON gateway (the HTTP API every etcd 3.4+ member serves on its
client URL), over the standard library: ranges, puts, transactions, leases, member status.

Why not a client library (docs/state.md, "The etcd client"): ``etcd3`` needs a gRPC build;
``etcd3gw`` 2.7 speaks the same gateway but to one endpoint only (no failover between members,
which is the point of running three), pulls ``requests``, ``futurist`` and ``pbr``, and leaves
transactions as raw dicts anyway. What pdops uses is eight calls of one documented API.

Failover: the endpoints are tried in turn, starting from the one that answered last. A read is
tried on every endpoint. A write is tried on the next endpoint only when the connection failed
before anything was sent; once sent, an error leaves its outcome unknown
(:class:`EtcdUnavailable` with ``maybe_applied``), and the caller decides: pdops's writes are
transactions that compare first, so it reads back rather than writing twice.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from pdops.errors import InvalidInput, Unreachable, Unverified

TIMEOUT_S = 5.0  # one request to one member; a member without quorum answers "request timed out" after ~7 s

# gRPC status codes the gateway returns in its error body
_UNAVAILABLE_CODES = {4, 14}  # DEADLINE_EXCEEDED, UNAVAILABLE: no leader, request timed out, stopping
# What a live member answers while its cluster elects a leader (a leader killed or stopped): etcd's
# ErrLeaderChanged and ErrNoLeader. A read that met only these and members that are down is tried again
# until ELECTION_WAIT_S: an election takes etcd's election timeout (1 s by default), longer on a busy
# machine (the make-test soak read the record once just after SIGKILLing the leader, beside a busy loop,
# and both members left answered "leader changed"). A write is never sent again by the client: its
# caller reads back first (pdops.record.etcdstore).
_ELECTING = ("etcdserver: leader changed", "etcdserver: no leader")
ELECTION_WAIT_S = 10.0


class EtcdUnavailable(Unreachable):
    """No member answered (or none with a quorum). `maybe_applied`: a write was sent and its
    outcome is unknown; `electing`: a member that answered said its cluster was electing a leader."""

    def __init__(self, message: str, *, maybe_applied: bool = False, **kw):
        super().__init__(message, **kw)
        self.maybe_applied = maybe_applied
        self.electing = False


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode("utf-8") if isinstance(data, str) else data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(key: bytes | str) -> bytes:
    """The range end that covers every key starting with `key`."""
    k = bytearray(key.encode("utf-8") if isinstance(key, str) else key)
    while k:
        if k[-1] < 0xFF:
            k[-1] += 1
            return bytes(k)
        k.pop()
    return b"\0"


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @property
    def text(self) -> str:
        return self.value.decode("utf-8")

    @classmethod
    def of(cls, d: dict) -> "KV":
        return cls(unb64(d.get("key")).decode("utf-8"), unb64(d.get("value")), int(d.get("create_revision", 0)),
                   int(d.get("mod_revision", 0)), int(d.get("version", 0)), int(d.get("lease", 0)))


@dataclass(frozen=True)
class Range:
    kvs: list[KV]
    count: int
    more: bool
    revision: int

    def get(self, key: str) -> KV | None:
        for kv in self.kvs:
            if kv.key == key:
                return kv
        return None


@dataclass
class TxnResult:
    succeeded: bool
    revision: int
    responses: list[dict] = field(default_factory=list)

    def range(self, i: int) -> Range:
        """The i-th response, a range."""
        return _range(self.responses[i].get("response_range") or {}, self.revision)


def _range(d: dict, revision: int | None = None) -> Range:
    return Range([KV.of(kv) for kv in d.get("kvs") or []], int(d.get("count", 0)), bool(d.get("more")),
                 int((d.get("header") or {}).get("revision", revision or 0)))


# -- the parts of a transaction (etcd's Compare and RequestOp, as the gateway spells them)

def cmp_created(key: str, revision: int) -> dict:
    """The key was created at `revision` (0: the key does not exist)."""
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": str(int(revision))}


def cmp_modified(key: str, revision: int) -> dict:
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(int(revision))}


def cmp_value(key: str, value: bytes | str) -> dict:
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value)}


def put(key: str, value: bytes | str, lease: int = 0) -> dict:
    req = {"key": b64(key), "value": b64(value)}
    if lease:
        req["lease"] = str(int(lease))
    return {"request_put": req}


def delete(key: str, *, prefix: bool = False) -> dict:
    req = {"key": b64(key)}
    if prefix:
        req["range_end"] = b64(prefix_end(key))
    return {"request_delete_range": req}


def get(key: str, *, end: str | bytes | None = None, prefix: bool = False, limit: int = 0,
        count_only: bool = False, keys_only: bool = False) -> dict:
    return {"request_range": _range_req(key, end=end, prefix=prefix, limit=limit, count_only=count_only,
                                        keys_only=keys_only)}


def _range_req(key: str, *, end=None, prefix=False, limit=0, count_only=False, keys_only=False,
               serializable=False) -> dict:
    req: dict = {"key": b64(key)}
    if prefix:
        req["range_end"] = b64(prefix_end(key))
    elif end is not None:
        req["range_end"] = b64(end)
    if limit:
        req["limit"] = str(int(limit))
    if count_only:
        req["count_only"] = True
    if keys_only:
        req["keys_only"] = True
    if serializable:
        req["serializable"] = True
    return req


class Etcd:
    """One etcd cluster, reached through any of its members' client URLs."""

    def __init__(self, endpoints: list[str], *, ca: str | None = None, cert: str | None = None,
                 key: str | None = None, timeout: float = TIMEOUT_S, down_fix: str | None = None):
        """`down_fix`: the fix line when no member answers (the members' owner knows the command)."""
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.endpoints = list(endpoints)
        self.down_fix = down_fix
        self.timeout = timeout
        self._good = 0
        self._ssl: ssl.SSLContext | None = None
        if any(e.startswith("https://") for e in endpoints):
            try:
                self._ssl = ssl.create_default_context(cafile=ca)
                if cert:
                    self._ssl.load_cert_chain(cert, key)
            except (OSError, ssl.SSLError) as e:  # FileNotFoundError, a key that does not match, ...
                raise InvalidInput("pdops_state.etcd", f"the TLS files (ca {ca}, cert {cert}, key {key}) cannot be "
                                   f"used: {e}", fix="name readable PEM files on this machine") from None
        self._conns: dict[str, http.client.HTTPConnection] = {}
        # one request at a time: an operation's thread and its lease keepalive share the connections
        self._busy = threading.Lock()

    @property
    def endpoint(self) -> str:
        """The member that answered last."""
        return self.endpoints[self._good]

    def _conn(self, endpoint: str) -> http.client.HTTPConnection:
        c = self._conns.get(endpoint)
        if c is None:
            u = urllib.parse.urlsplit(endpoint)
            if u.scheme == "https":
                c = http.client.HTTPSConnection(u.hostname, u.port or 2379, timeout=self.timeout, context=self._ssl)
            else:
                c = http.client.HTTPConnection(u.hostname, u.port or 2379, timeout=self.timeout)
            self._conns[endpoint] = c
        return c

    def _drop(self, endpoint: str) -> None:
        c = self._conns.pop(endpoint, None)
        if c is not None:
            c.close()

    def call(self, path: str, body: dict, *, write: bool) -> dict:
        """POST `body` to /v3/`path` on the first member that answers; its decoded answer. A read that
        found the members electing a leader is tried again, up to ELECTION_WAIT_S."""
        deadline = time.monotonic() + ELECTION_WAIT_S
        with self._busy:
            while True:
                try:
                    return self._call(path, body, write=write)
                except EtcdUnavailable as exc:
                    if write or not exc.electing or time.monotonic() > deadline:
                        raise
                time.sleep(0.2)

    def _call(self, path: str, body: dict, *, write: bool) -> dict:
        errors = []
        n = len(self.endpoints)
        for i in range(n):
            idx = (self._good + i) % n
            ep = self.endpoints[idx]
            conn = self._conn(ep)
            sent = False
            try:
                if conn.sock is None:
                    conn.connect()
                sent = True
                conn.request("POST", f"/v3/{path}", body=json.dumps(body), headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                status = resp.status
            except (OSError, http.client.HTTPException) as e:
                self._drop(ep)
                why = ("timed out" if isinstance(e, (socket.timeout, TimeoutError)) else
                       f"TLS: {e}" if isinstance(e, ssl.SSLError) else f"{type(e).__name__}: {e}")
                errors.append(f"{ep}: {why}")
                if write and sent:  # the next try goes to another member
                    self._good = (idx + 1) % n
                    raise EtcdUnavailable(f"etcd {path} sent to {ep} got no answer ({why}); its outcome is unknown",
                                          maybe_applied=True) from None
                continue
            try:
                doc = json.loads(data or b"{}")
            except json.JSONDecodeError:
                doc = None
            if doc is None or status in (502, 503, 504) or (doc.get("code") in _UNAVAILABLE_CODES):
                msg = (doc or {}).get("message") or (doc or {}).get("error") or f"HTTP {status} with no JSON"
                errors.append(f"{ep}: {msg}")
                if write:  # a member stopping, or losing its leader, may have committed it: unknown
                    self._good = (idx + 1) % n
                    raise EtcdUnavailable(f"etcd {ep}: {msg}; the outcome of this {path} is unknown",
                                          maybe_applied=True) from None
                continue
            if status == 200 and "error" not in doc:
                self._good = idx
                return doc
            msg = doc.get("message") or doc.get("error") or f"HTTP {status}"
            raise Unverified(f"etcd {ep}: /v3/{path} refused: {msg}", evidence=json.dumps(body)[:500])
        tls = [e for e in errors if ": TLS: " in e]
        exc = EtcdUnavailable("no etcd member answered: " + "; ".join(errors),
                              fix=("the TLS handshake failed: check pdops_state.etcd ca, cert and key against the "
                                   "members' certificates" if tls and len(tls) == len(errors) else
                                   self.down_fix or
                                   "check the members (`inv state.show` names them); two of three must be up"))
        exc.electing = any(e.endswith(_ELECTING) for e in errors)
        raise exc

    # -- keys
    def range(self, key: str, *, end=None, prefix: bool = False, limit: int = 0, count_only: bool = False,
              keys_only: bool = False, serializable: bool = False) -> Range:
        doc = self.call("kv/range", _range_req(key, end=end, prefix=prefix, limit=limit, count_only=count_only,
                                               keys_only=keys_only, serializable=serializable), write=False)
        return _range(doc)

    def txn(self, compare: list[dict], success: list[dict], failure: list[dict] = ()) -> TxnResult:
        doc = self.call("kv/txn", {"compare": compare, "success": success, "failure": list(failure)},
                        write=any("request_range" not in op for op in [*success, *failure]))
        return TxnResult(bool(doc.get("succeeded")), int((doc.get("header") or {}).get("revision", 0)),
                         doc.get("responses") or [])

    def read(self, *ranges: dict) -> TxnResult:
        """Several ranges at one revision (a transaction without compares, of reads only)."""
        return self.txn([], list(ranges))

    # -- leases
    def grant(self, ttl: float) -> int:
        return int(self.call("lease/grant", {"TTL": str(int(ttl))}, write=True)["ID"])

    def keepalive(self, lease: int) -> int:
        """The lease's TTL after the refresh; 0 when it has expired or was revoked."""
        doc = self.call("lease/keepalive", {"ID": str(int(lease))}, write=False)
        return int((doc.get("result") or doc).get("TTL", 0))

    def time_to_live(self, lease: int) -> int:
        """Seconds left on the lease; -1 when there is no such lease."""
        return int(self.call("lease/timetolive", {"ID": str(int(lease))}, write=False).get("TTL", -1))

    def revoke(self, lease: int) -> bool:
        """End the lease (and every key under it); False when it was gone already."""
        try:
            self.call("lease/revoke", {"ID": str(int(lease))}, write=True)
        except Unverified as e:
            if "lease not found" in e.message:
                return False
            raise
        return True

    # -- members
    def status(self, endpoint: str) -> dict:
        """One member's own status (version, leader, db size), asked of that member only."""
        one = Etcd([endpoint], timeout=self.timeout)
        one._ssl = self._ssl
        try:
            return one.call("maintenance/status", {}, write=False)
        finally:
            one.close()

    def close(self) -> None:
        for ep in list(self._conns):
            self._drop(ep)
