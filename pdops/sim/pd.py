"""The PD hand-off between a prefill and a decode sim over real TCP: the prefill side (the decode
connects for a room, the KV leaves) and the decode side (bootstrap /route, connect, KV arrives,
heartbeat the prefill's bootstrap server), as SGLang's disaggregation prefill and decode mixins.

KV wire protocol between the two sim processes (sim-specific; SGLang uses Mooncake):
the decode connects to the prefill rank's KV port (from ``GET /route``), sends one JSON
line ``{"room", "rid", "generation"}``; the prefill answers ``{"status": "ok", "bytes": N}`` then N
bytes, the decode answers ``ack``. ``{"status": "failed"}`` or a closed connection is a
transfer failure: HTTP 500 on both sides. The decode closing early (abort, disconnect,
timeout) makes the prefill drop the room.

Generations (pdops.model.generation): the prefill's generation fields travel in its bootstrap
registration (``GET /route`` -1 answers them), the decode's in its first line. Each side compares
them with its own: another generation (page size, KV dtype, model, versions, ...) fails the room as a
transfer error on both sides, as SGLang's decode refuses a prefill of another page size or KV dtype.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp

from pdops.model.generation import mismatch
from pdops.sim.request import Req, RequestFailed

_PAYLOAD = bytes(1 << 20)


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class PdTimeouts:
    """SGLang's PD timeouts, read from the same environment variables."""

    def __init__(self):
        self.bootstrap = _env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300)
        self.waiting = _env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300)
        # as SGLang's decode: at least 2 s and at least 1 failure
        self.heartbeat_interval = max(_env_float("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 5), 2.0)
        self.heartbeat_max_failure = max(int(_env_float("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2)), 1)
        self.route_retry_s = _env_float("PDOPS_SIM_ROUTE_RETRY_S", 1.0)
        self.route_max_failures = 15


class KVConn:
    """The prefill's end of one room's KV connection from a decode."""

    def __init__(self, room, rid, reader, writer):
        self.room = room
        self.rid = rid
        self.reader = reader
        self.writer = writer
        self.closed = asyncio.Event()  # peer closed or errored
        self.ack = asyncio.Event()
        self.req: Req | None = None
        self.released = asyncio.Event()  # the prefill is done with it
        self.mismatch: str | None = None  # the decode is of another generation: the room fails


class PdHandOff:
    """The Engine's PD hand-off (a mixin: it reads the engine's mode, timeouts, faults, rooms and
    routes, and aborts through it)."""

    # ---------------------------------------------------------------- prefill side of PD
    async def _on_kv_conn(self, reader, writer) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 30)
            hello = json.loads(line)
            conn = KVConn(int(hello["room"]), hello.get("rid"), reader, writer)
        except Exception:
            writer.close()
            return
        peer = hello.get("generation")
        if peer is not None:  # the decode's generation: another one fails this room (each side checks for itself)
            conn.mismatch = mismatch(self.generation, peer)
        waiter = self.room_waiters.pop(conn.room, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(conn)
        else:
            self.kv_conns[conn.room] = conn
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                if line.strip() == b"ack":
                    conn.ack.set()
        except (ConnectionError, OSError):
            pass
        conn.closed.set()
        if conn.req is not None and not conn.ack.is_set() and not conn.req.finished:
            # the decode went away before the KV landed: drop the room here too
            if conn.req.phase == "inflight":
                self.abort(conn.req, RequestFailed("KV transfer failed: decode closed the connection", 500, "transfer"))
            else:
                self.abort(conn.req, RequestFailed("Aborted by the decode side", None))
        if conn.req is None:  # no request took this room (yet): forget it
            if self.kv_conns.get(conn.room) is conn:
                if conn.mismatch is None:
                    del self.kv_conns[conn.room]
                else:  # its request, when it comes, fails at once (not at the bootstrap timeout)
                    asyncio.get_running_loop().call_later(self.to.bootstrap, self._forget_conn, conn)
            writer.close()
            return
        await conn.released.wait()
        writer.close()

    def _forget_conn(self, conn: KVConn) -> None:
        if self.kv_conns.get(conn.room) is conn:
            del self.kv_conns[conn.room]

    async def _wait_decode(self, req: Req) -> KVConn:
        req.phase = "bootstrap"
        conn = self.kv_conns.pop(req.room, None)
        if conn is None:
            fut = asyncio.get_running_loop().create_future()
            self.room_waiters[req.room] = fut
            try:
                conn = await asyncio.wait_for(fut, self.to.bootstrap)
            except asyncio.TimeoutError:
                raise RequestFailed(
                    f"Request {req.rid} timed out after {self.to.bootstrap:.1f}s in bootstrap queue", 500, "bootstrap"
                ) from None
            finally:
                if self.room_waiters.get(req.room) is fut:
                    del self.room_waiters[req.room]
        conn.req = req
        req.kvconn = conn
        if conn.mismatch is not None:
            # the decode learns why the KV will not come (as after an OOM)
            conn.writer.write(json.dumps({"status": "failed", "reason": conn.mismatch}).encode() + b"\n")
            raise RequestFailed(f"KV transfer failed for request rid={req.rid}: {conn.mismatch}", 500, "transfer")
        if conn.closed.is_set():
            raise RequestFailed("Aborted by the decode side", None)
        return conn

    async def _send_kv(self, req: Req, conn: KVConn) -> None:
        req.phase = "inflight"
        above = self.faults.fail_transfer_above
        if self.faults.fail_transfer or (above is not None and req.prompt_tokens > above):
            conn.writer.write(b'{"status": "failed", "reason": "injected fault fail_transfer"}\n')
            await conn.writer.drain()
            raise RequestFailed(f"KV transfer failed for request rid={req.rid} (injected)", 500, "transfer")
        if self.faults.hangs(req.room):
            await conn.closed.wait()  # the decode times out and leaves
            raise RequestFailed(f"KV transfer of room {req.room} never completed (hang_room)", 500, "transfer")
        n = self.timing.kv_bytes(req.prompt_tokens)
        t0 = time.monotonic()
        min_s = self.timing.kv_transfer_s(n)
        try:
            conn.writer.write(json.dumps({"status": "ok", "bytes": n}).encode() + b"\n")
            sent = 0
            while sent < n:
                k = min(len(_PAYLOAD), n - sent)
                conn.writer.write(_PAYLOAD[:k] if k < len(_PAYLOAD) else _PAYLOAD)
                sent += k
                await conn.writer.drain()
                if min_s:
                    ahead = t0 + min_s * sent / n - time.monotonic()
                    if ahead > 0:
                        await asyncio.sleep(ahead)
        except (ConnectionError, OSError):
            raise RequestFailed(f"KV transfer failed for request rid={req.rid}: connection lost", 500, "transfer") from None
        ack = asyncio.create_task(conn.ack.wait())
        closed = asyncio.create_task(conn.closed.wait())
        try:
            await asyncio.wait({ack, closed}, timeout=self.to.waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ack.cancel()
            closed.cancel()
        if not conn.ack.is_set():
            raise RequestFailed(f"KV transfer failed for request rid={req.rid}: no acknowledgement", 500, "transfer")
        dt = max(time.monotonic() - t0, 1e-9)
        self.kv_speed_gb_s = n / dt / 1e9
        self.kv_latency_ms = dt * 1000

    def _close_kv(self, req: Req) -> None:
        kv = req.kvconn
        req.kvconn = None
        if isinstance(kv, KVConn):
            kv.released.set()
        else:  # decode side: (reader, writer)
            try:
                kv[1].close()
            except Exception:
                pass

    # ---------------------------------------------------------------- decode side of PD
    async def _route(self, host: str, port: int, deadline: float) -> tuple:
        key = (host, int(port))
        if key in self.routes:
            return self.routes[key]
        base = f"http://{host}:{port}/route"
        failures = 0
        q = "?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        while True:
            try:
                async with self.http.get(base + q) as r:
                    if r.status == 200:
                        layout = await r.json()
                        async with self.http.get(
                            base + "?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
                        ) as r2:
                            if r2.status == 200:
                                info = await r2.json()
                                self.routes[key] = (info["rank_ip"], int(info["rank_port"]))
                                self.peer_generations[key] = layout.get("pdops_generation")
                                self._ensure_heartbeat(key[0], key[1])
                                return self.routes[key]
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
                pass
            failures += 1
            if failures >= self.to.route_max_failures or time.monotonic() + self.to.route_retry_s > deadline:
                raise RequestFailed(f"Failed to get prefill server info from bootstrap server {host}:{port}", 500, "bootstrap")
            await asyncio.sleep(self.to.route_retry_s)

    async def _bootstrap(self, req: Req):
        req.phase = "prealloc"
        deadline = time.monotonic() + self.to.bootstrap
        ip, port = await self._route(req.bhost, req.bport, deadline)
        self._ensure_heartbeat(req.bhost, int(req.bport))
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(ip, port), max(0.1, deadline - time.monotonic())
            )
        except (OSError, asyncio.TimeoutError):
            self.routes.pop((req.bhost, int(req.bport)), None)
            raise RequestFailed(f"Failed to connect to prefill KV endpoint {ip}:{port}", 500, "bootstrap") from None
        req.kvconn = (reader, writer)
        writer.write(json.dumps({"room": int(req.room), "rid": req.rid, "generation": self.generation}).encode() + b"\n")
        await writer.drain()
        # the prefill's generation, read with its layout: another one fails the room (the first line
        # has told the prefill, which fails its side too)
        peer = self.peer_generations.get((req.bhost, int(req.bport)))
        why = mismatch(peer, self.generation) if peer is not None else None
        if why is not None:
            raise RequestFailed(f"KV transfer failed for request rid={req.rid}: {why}", 500, "transfer")
        return reader, writer

    async def _receive_kv(self, req: Req, reader, writer) -> None:
        req.phase = "transfer"
        if self.faults.dead_session:
            # the decode's transfer session is gone: it drops the connection, so the prefill fails
            # the room too (sglang#13054: every request fails until the decode restarts)
            self._close_kv(req)
            raise RequestFailed(f"KV transfer failed for request rid={req.rid}: session not alive", 500, "transfer")
        t_wait = time.monotonic()
        try:
            line = await asyncio.wait_for(reader.readline(), self.to.waiting)
        except asyncio.TimeoutError:
            raise RequestFailed(
                f"Request {req.rid} timed out after {self.to.waiting:.1f}s waiting for KV transfer", 500, "transfer"
            ) from None
        except (ConnectionError, OSError):
            line = b""
        if not line:
            raise RequestFailed(f"KV transfer failed for request rid={req.rid}: prefill closed the connection", 500, "transfer")
        head = json.loads(line)
        if head.get("status") != "ok":
            raise RequestFailed(f"KV transfer failed for request rid={req.rid}: {head.get('reason', 'failed')}", 500, "transfer")
        n = int(head["bytes"])
        t0 = time.monotonic()
        left = n
        try:
            while left > 0:
                remaining = self.to.waiting - (time.monotonic() - t_wait)
                chunk = await asyncio.wait_for(reader.read(min(left, 1 << 20)), max(remaining, 0.01))
                if not chunk:
                    raise RequestFailed(f"KV transfer failed for request rid={req.rid}: short payload", 500, "transfer")
                left -= len(chunk)
            writer.write(b"ack\n")
            await writer.drain()
        except asyncio.TimeoutError:
            raise RequestFailed(f"Request {req.rid} timed out receiving KV", 500, "transfer") from None
        except (ConnectionError, OSError):
            raise RequestFailed(f"KV transfer failed for request rid={req.rid}: connection lost", 500, "transfer") from None
        dt = max(time.monotonic() - t0, 1e-9)
        self.kv_speed_gb_s = n / dt / 1e9
        self.kv_latency_ms = dt * 1000
        self._close_kv(req)

    def _ensure_heartbeat(self, host: str, port: int) -> None:
        key = (host, port)
        t = self.heartbeats.get(key)
        if t is None or t.done():
            self.heartbeats[key] = asyncio.create_task(self._heartbeat(key))

    async def _heartbeat(self, key: tuple) -> None:
        """As SGLang's decode (mooncake conn.py, heartbeat_checker): heartbeat every prefill bootstrap
        server it has a cached route to, rooms open or not; after
        SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE misses in a row forget the route and fail the
        rooms open with it (500). A prefill restarted at the same address before that keeps the
        stale route: the decode only learns on the next transfer."""
        misses = 0
        url = f"http://{key[0]}:{key[1]}/health"
        while True:
            await asyncio.sleep(self.to.heartbeat_interval)
            if key not in self.routes:
                self.heartbeats.pop(key, None)
                return
            mine = [r for r in self.reqs.values() if (r.bhost, r.bport and int(r.bport)) == key and r.phase in ("prealloc", "transfer")]
            try:
                async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=self.to.heartbeat_interval)) as r:
                    ok = r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                ok = False
            misses = 0 if ok else misses + 1
            if misses >= self.to.heartbeat_max_failure:
                self.routes.pop(key, None)
                for r in mine:
                    self.abort(r, RequestFailed(f"Prefill bootstrap server {key[0]}:{key[1]} is unreachable (heartbeat)", 500, "transfer"))
                self.heartbeats.pop(key, None)
                return
