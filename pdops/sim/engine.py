"""The sim's scheduler: request lifecycle, PD hand-off over real TCP, timing, counters.

Phases a request goes through (they are the queues /v1/loads and /metrics report):

- null (no PD):  waiting -> prefill -> running (decode batch) -> done
- prefill role:  bootstrap (until the decode connects for the room) -> waiting ->
                 prefill -> inflight (KV leaving) -> done, finish length 0
- decode role:   prealloc (bootstrap: /route, connect) -> transfer (KV arriving) ->
                 waiting (for a batch slot) -> running -> done

KV wire protocol between the two sim processes (sim-specific; SGLang uses Mooncake):
the decode connects to the prefill rank's KV port (from ``GET /route``), sends one JSON
line ``{"room", "rid"}``; the prefill answers ``{"status": "ok", "bytes": N}`` then N
bytes, the decode answers ``ack``. ``{"status": "failed"}`` or a closed connection is a
transfer failure: HTTP 500 on both sides. The decode closing early (abort, disconnect,
timeout) makes the prefill drop the room.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import sys
import time
import uuid
from collections import deque

import aiohttp

from pdops.sim.faults import Faults
from pdops.sim.memory import MemoryModel, oom_message, oom_traceback
from pdops.sim.timing import TimingModel
from pdops.sim.tokens import Counter, output_word

log = logging.getLogger("pdops.sim")

FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's warmup/health marker: no real transfer
_PAYLOAD = bytes(1 << 20)


def env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class PdTimeouts:
    """SGLang's PD timeouts, read from the same environment variables."""

    def __init__(self):
        self.bootstrap = env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300)
        self.waiting = env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300)
        # as SGLang's decode: at least 2 s and at least 1 failure
        self.heartbeat_interval = max(env_float("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 5), 2.0)
        self.heartbeat_max_failure = max(int(env_float("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2)), 1)
        self.route_retry_s = env_float("PDOPS_SIM_ROUTE_RETRY_S", 1.0)
        self.route_max_failures = 15


class RequestFailed(Exception):
    """Ends a request with finish_reason abort and an HTTP status."""

    def __init__(self, message: str, status: int = 500, kind: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind  # "bootstrap" | "transfer" | None


class Req:
    def __init__(self, rid, prompt_tokens, max_new, stream, room=None, bhost=None, bport=None):
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.max_new = max_new
        self.stream = stream
        self.room = room
        self.bhost = bhost
        self.bport = bport
        self.created = time.time()
        self.first_token_t: float | None = None
        self.last_token_t: float = 0.0
        self.tokens = 0
        self.phase = "new"
        self.finish_reason: dict | None = None
        self.status = 200
        self.progress = asyncio.Event()
        self.done = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.abort_reason: RequestFailed | None = None
        self.started = False  # its task ran: cancelling it reaches _run's handlers
        self.kvconn = None
        self._text = ""
        self._text_n = 0
        self.streamed_ids = 0  # output ids already sent in a stream chunk

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def text(self) -> str:
        while self._text_n < self.tokens:  # grows incrementally: O(new tokens) per call
            w = output_word(self._text_n)
            self._text = w if not self._text_n else self._text + " " + w
            self._text_n += 1
        return self._text

    def meta(self) -> dict:
        return {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens,
            "cached_tokens": 0,
            "e2e_latency": time.time() - self.created,
        }

    def output(self) -> dict:
        return {"text": self.text(), "output_ids": list(range(self.tokens)), "meta_info": self.meta()}

    def stream_chunk(self) -> dict:
        """A streaming chunk: cumulative text (SGLang's default), the new output ids."""
        ids = list(range(self.streamed_ids, self.tokens))
        self.streamed_ids = self.tokens
        return {"text": self.text(), "output_ids": ids, "meta_info": self.meta()}


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


class Histogram:
    BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))

    def __init__(self, buckets: tuple | None = None):
        if buckets is not None:
            self.BUCKETS = buckets
        self.counts = {}  # is_streaming -> [bucket counts], sum, count

    def observe(self, key: str, v: float) -> None:
        c = self.counts.setdefault(key, [[0] * len(self.BUCKETS), 0.0, 0])
        for i, b in enumerate(self.BUCKETS):
            if v <= b:
                c[0][i] += 1
        c[1] += v
        c[2] += 1


class Engine:
    def __init__(self, args, timing: TimingModel, faults: Faults):
        self.args = args
        self.timing = timing
        self.faults = faults
        self.to = PdTimeouts()
        self.counter = Counter(args.model_path)
        self.mode = args.mode
        self.max_running = args.max_running_requests or timing.max_running_default
        self.reqs: dict[str, Req] = {}
        self.running: dict[str, Req] = {}
        self.decode_waiting: deque[Req] = deque()
        self.decode_wake = asyncio.Event()
        self.slot_free = asyncio.Event()
        self.prefill_lock = asyncio.Lock()
        self.kv_conns: dict[int, KVConn] = {}
        self.room_waiters: dict[int, asyncio.Future] = {}
        self.routes: dict[tuple, tuple] = {}  # (host, port) -> (rank_ip, rank_port)
        self.heartbeats: dict[tuple, asyncio.Task] = {}
        self.http: aiohttp.ClientSession | None = None
        self.kv_server = None
        self.kv_port = None
        self.gen_window: deque = deque()  # (t, tokens) of recent decode steps
        self.kv_speed_gb_s = 0.0
        self.kv_latency_ms = 0.0
        self.total_prefill_tokens = 0
        self.total_prefill_busy_us = 0
        # counters (label key -> value)
        self.c_requests = {"true": 0, "false": 0}
        self.c_prompt = {"true": 0, "false": 0}
        self.c_gen = {"true": 0, "false": 0}
        self.c_aborted = 0
        self.c_bootstrap_failed = 0
        self.c_transfer_failed = 0
        self.h_ttft = Histogram()
        self.h_e2e = Histogram()
        # SGLang's sglang:inter_token_latency_seconds (its finer buckets for per-token gaps)
        self.h_itl = Histogram((0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0,
                                2.0, float("inf")))
        self.seen_first_request = asyncio.Event()
        self._decode_task = None
        # GPU memory model (pdops.sim.memory; off unless PDOPS_SIM_GPU_MEMORY_GIB is set)
        self.memory = MemoryModel.from_env(args)
        self.retained = 0  # bytes of workspace a long prefill left reserved while requests are queued
        self.c_oom = 0

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        if self.mode in ("null", "decode"):
            self._decode_task = asyncio.create_task(self._decode_loop())
        if self.mode == "prefill":
            self.kv_server = await asyncio.start_server(self._on_kv_conn, self.args.host, 0)
            self.kv_port = self.kv_server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._decode_task:
            self._decode_task.cancel()
        for t in self.heartbeats.values():
            t.cancel()
        if self.kv_server:
            self.kv_server.close()
        if self.http:
            await self.http.close()

    # ---------------------------------------------------------------- submission
    def count(self, text: str) -> int:
        return self.counter.count(text)

    def submit(self, body: dict, stream: bool, prompt_tokens: int, max_new: int) -> Req:
        """Create and start a request; raises ValueError for a bad body (HTTP 400)."""
        self.seen_first_request.set()
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise ValueError("rid must be a string (batch requests are not supported by the sim)")
        if rid in self.reqs:
            raise ValueError(f"Duplicate request ID {rid}")
        room = body.get("bootstrap_room")
        bhost = body.get("bootstrap_host")
        bport = body.get("bootstrap_port")
        if self.mode != "null" and bhost != FAKE_BOOTSTRAP_HOST:
            if room is None or (self.mode == "decode" and (bhost is None or bport is None)):
                raise ValueError(
                    f"{self.mode} server needs bootstrap_host, bootstrap_port and bootstrap_room"
                )
        ctx = self.args.context_length
        if ctx and prompt_tokens + max_new > ctx:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens."
            )
        mem = self.memory
        if mem is not None and prompt_tokens + max_new > mem.pool_tokens:
            # SGLang's check against max_req_input_len (the KV pool's size, when smaller than the context)
            raise ValueError(
                f"Input length ({prompt_tokens + max_new} tokens) exceeds the maximum allowed length "
                f"({mem.pool_tokens} tokens). Use a shorter input or enable --allow-auto-truncate."
            )
        req = Req(rid, prompt_tokens, max_new, stream, room, bhost, bport)
        self.reqs[rid] = req
        self._log_request("request.received", req)
        req.task = asyncio.create_task(self._run(req))
        return req

    def abort(self, req: Req, reason: RequestFailed | None = None) -> None:
        """Abort a request on this side (the PD peer is told through the KV connection)."""
        if req.finished or req.abort_reason is not None:
            return
        req.abort_reason = reason or RequestFailed("Aborted", status=None)
        # a task cancelled before it first runs never enters _run: the request would stay in `reqs`
        # and open in the request log for good (an HTTP client gone before the response's headers
        # did that). One not started yet sees abort_reason as its first act instead.
        if req.task and req.started:
            req.task.cancel()

    def abort_rid(self, rid: str, abort_all: bool) -> int:
        """SGLang's /abort_request: the rid must exist; then every rid it prefixes is aborted."""
        if abort_all:
            victims = list(self.reqs.values())
        elif rid and rid in self.reqs:
            victims = [r for k, r in self.reqs.items() if k.startswith(rid)]
        else:
            victims = []
        for r in victims:
            self.abort(r)
        return len(victims)

    # ---------------------------------------------------------------- request task
    async def _run(self, req: Req) -> None:
        req.started = True
        fake = req.bhost == FAKE_BOOTSTRAP_HOST
        try:
            if req.abort_reason is not None:  # aborted before its task first ran
                raise req.abort_reason
            if self.mode == "null" or (fake and self.mode == "prefill"):
                await self._prefill_compute(req)
                if self.mode == "prefill":
                    self._finish(req, {"type": "length", "length": 0})
                    return
                await self._decode(req)
            elif self.mode == "prefill":
                conn = await self._wait_decode(req)
                await self._prefill_compute(req)
                await self._send_kv(req, conn)
                self._finish(req, {"type": "length", "length": 0})
            else:
                if not fake:
                    reader, writer = await self._bootstrap(req)
                    await self._receive_kv(req, reader, writer)
                await self._decode(req)
        except asyncio.CancelledError:
            r = req.abort_reason or RequestFailed("Aborted", status=None)
            self._fail(req, r)
        except RequestFailed as e:
            self._fail(req, e)
        except Exception as e:  # a sim bug must still answer, never hang
            log.exception("request %s failed", req.rid)
            self._fail(req, RequestFailed(f"sim internal error: {e!r}"))
        finally:
            self.running.pop(req.rid, None)
            try:
                self.decode_waiting.remove(req)
            except ValueError:
                pass
            if req.kvconn is not None:
                self._close_kv(req)
            self.slot_free.set()
            self.reqs.pop(req.rid, None)
            if not self.reqs:
                self.retained = 0  # idle: the caching allocator's blocks are given back
            req.progress.set()
            req.done.set()

    def _log_request(self, event: str, req: Req) -> None:
        """SGLang's --log-requests output (srt/utils/request_logger.py): one line per event;
        in json format `{"timestamp", "event", "rid", "obj"[, "out"]}` as log_json writes it."""
        flags = getattr(self.args, "all", {}) or {}
        if not flags.get("log_requests"):
            return
        obj = {"rid": req.rid, "stream": req.stream, "bootstrap_room": req.room}
        if flags.get("log_requests_format", "text") == "json":
            doc = {"timestamp": datetime.datetime.now().isoformat(), "event": event, "rid": req.rid, "obj": obj}
            if event == "request.finished":
                doc["out"] = {"meta_info": req.meta()}
            line = json.dumps(doc, ensure_ascii=False)
        elif event == "request.received":
            line = f"Receive: obj=GenerateReqInput(rid='{req.rid}', stream={req.stream})"
        else:
            line = f"Finish: obj=GenerateReqInput(rid='{req.rid}'), out={{'meta_info': {req.meta()!r}}}"
        print(line, file=sys.stderr, flush=True)

    def _finish(self, req: Req, reason: dict) -> None:
        req.finish_reason = reason
        req.phase = "done"
        self._log_request("request.finished", req)
        s = "true" if req.stream else "false"
        self.c_requests[s] += 1
        self.c_prompt[s] += req.prompt_tokens
        self.c_gen[s] += req.tokens
        self.h_e2e.observe(s, time.time() - req.created)

    def _fail(self, req: Req, e: RequestFailed) -> None:
        if req.finished:
            return
        if e.kind == "bootstrap":
            self.c_bootstrap_failed += 1
        elif e.kind == "transfer":
            self.c_transfer_failed += 1
        self.c_aborted += 1
        req.status = e.status or 200
        log.info("request %s aborted: %s (status %s)", req.rid, e.message, e.status)
        self._finish(req, {"type": "abort", "message": e.message, "status_code": e.status, "err_type": None})

    # ---------------------------------------------------------------- compute
    async def _prefill_compute(self, req: Req) -> None:
        req.phase = "waiting"
        async with self.prefill_lock:
            req.phase = "prefill"
            t0 = time.monotonic()
            rng = self.timing.rng(req.rid)
            chunks = self.timing.prefill_chunks(req.prompt_tokens, self.args.chunked_prefill_size, rng)
            mem = self.memory
            allocs = mem.chunk_allocations(req.prompt_tokens, self.args.chunked_prefill_size) if mem else []
            peak = 0
            for k, dt in enumerate(chunks):
                if mem is not None:
                    a = allocs[k]
                    if a > mem.workspace_gib * (1 << 30) - self.retained:
                        self._oom(req, a)
                    peak = max(peak, a)
                await asyncio.sleep(dt)
            if mem is not None:
                self.retained = max(self.retained, int(peak * mem.retained_ratio))
            self.total_prefill_tokens += req.prompt_tokens
            self.total_prefill_busy_us += int((time.monotonic() - t0) * 1e6)

    def _oom(self, req: Req, alloc: int) -> None:
        """The chunk's allocation does not fit: log the scheduler's traceback, fail the request."""
        msg = oom_message(self.memory.oom(alloc, self.retained))
        self.c_oom += 1
        log.error("%s", oom_traceback(self.memory, req.rid, msg))
        kv = req.kvconn
        if isinstance(kv, KVConn):  # the decode learns why the KV will not come
            reason = "prefill aborted the request: " + msg.split(". GPU", 1)[0]
            kv.writer.write(json.dumps({"status": "failed", "reason": reason}).encode() + b"\n")
        raise RequestFailed(msg, 500, "oom")

    async def _decode(self, req: Req) -> None:
        if req.max_new <= 0:
            self._finish(req, {"type": "length", "length": 0})
            return
        req.phase = "waiting"
        self.decode_waiting.append(req)
        self.decode_wake.set()
        await req.done.wait()  # the decode loop finishes it

    async def _decode_loop(self) -> None:
        while True:
            while self.decode_waiting and len(self.running) < self.max_running:
                r = self.decode_waiting.popleft()
                r.phase = "running"
                self.running[r.rid] = r
            if not self.running:
                self.decode_wake.clear()
                await self.decode_wake.wait()
                continue
            await asyncio.sleep(self.timing.decode_step_s(len(self.running)))
            now = time.time()
            done = []
            for r in self.running.values():
                r.tokens += 1
                if r.first_token_t is None:
                    r.first_token_t = now
                    self.h_ttft.observe("true" if r.stream else "false", now - r.created)
                else:
                    self.h_itl.observe("true" if r.stream else "false", now - r.last_token_t)
                r.last_token_t = now
                if r.tokens >= r.max_new:
                    done.append(r)
                r.progress.set()
            self.gen_window.append((now, len(self.running)))
            while self.gen_window and now - self.gen_window[0][0] > 2.0:
                self.gen_window.popleft()
            for r in done:
                self.running.pop(r.rid, None)
                self._finish(r, {"type": "length", "length": r.max_new})
                r.done.set()

    # ---------------------------------------------------------------- prefill side of PD
    async def _on_kv_conn(self, reader, writer) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 30)
            hello = json.loads(line)
            conn = KVConn(int(hello["room"]), hello.get("rid"), reader, writer)
        except Exception:
            writer.close()
            return
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
                del self.kv_conns[conn.room]
            writer.close()
            return
        await conn.released.wait()
        writer.close()

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
                        await r.json()
                        async with self.http.get(
                            base + "?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
                        ) as r2:
                            if r2.status == 200:
                                info = await r2.json()
                                self.routes[key] = (info["rank_ip"], int(info["rank_port"]))
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
        writer.write(json.dumps({"room": int(req.room), "rid": req.rid}).encode() + b"\n")
        await writer.drain()
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

    # ---------------------------------------------------------------- load report
    def phase_counts(self) -> dict:
        c = {"bootstrap": 0, "waiting": 0, "prefill": 0, "inflight": 0, "prealloc": 0, "transfer": 0, "running": 0}
        for r in self.reqs.values():
            if r.phase in c:
                c[r.phase] += 1
        return c

    def gen_throughput(self) -> float:
        if len(self.gen_window) < 2:
            return 0.0
        span = self.gen_window[-1][0] - self.gen_window[0][0]
        toks = sum(n for _, n in list(self.gen_window)[1:])
        return toks / span if span > 0 else 0.0

    def used_tokens(self) -> int:
        return sum(r.prompt_tokens + r.tokens for r in self.running.values())

    def load(self) -> dict:
        c = self.phase_counts()
        if self.mode == "prefill":
            running, waiting = c["prefill"], c["waiting"]
        else:
            running, waiting = c["running"], c["waiting"] + c["prefill"]
        total = self.timing.max_total_tokens
        used = self.used_tokens()
        waiting_tokens = sum(r.prompt_tokens for r in self.reqs.values() if r.phase == "waiting")
        return {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": waiting_tokens,
            "num_used_tokens": used,
            "num_total_tokens": total,
            "num_active_tokens": total,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": total,
            "max_running_requests": self.max_running,
            "token_usage": round(used / total, 4) if total else 0.0,
            "gen_throughput": round(self.gen_throughput(), 2),
            "cache_hit_rate": 0.0,
            "utilization": round(min(1.0, running / self.max_running), 4) if self.max_running else 0.0,
            "total_prefill_uncached_tokens": self.total_prefill_tokens,
            "total_prefill_busy_us": self.total_prefill_busy_us,
            "decode_moments": None,
            "memory": {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0, "token_capacity": total},
            "disaggregation": {
                "mode": self.mode,
                "prefill_bootstrap_queue_reqs": c["bootstrap"],
                "prefill_inflight_queue_reqs": c["inflight"],
                "decode_prealloc_queue_reqs": c["prealloc"],
                "decode_transfer_queue_reqs": c["transfer"],
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": round(self.kv_speed_gb_s, 4),
                "kv_transfer_latency_ms": round(self.kv_latency_ms, 3),
            },
            "queues": {"waiting": waiting, "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0},
        }
