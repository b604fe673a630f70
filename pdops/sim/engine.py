"""The sim's scheduler: request lifecycle, prefill compute, the decode batch, counters.

Phases a request goes through (they are the queues /v1/loads and /metrics report):

- null (no PD):  waiting -> prefill -> running (decode batch) -> done
- prefill role:  bootstrap (until the decode connects for the room) -> waiting ->
                 prefill -> inflight (KV leaving) -> done, finish length 0
- decode role:   prealloc (bootstrap: /route, connect) -> transfer (KV arriving) ->
                 waiting (for a batch slot) -> running -> done

The PD hand-off over TCP is `pd` (its wire protocol is there); what the engine reports is
`metrics`; a request is `request`.
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

from pdops.model.generation import digest, fields_from_parsed, versions_from_env
from pdops.model.sim_faults import Faults
from pdops.sim.memory import MemoryModel, oom_message, oom_traceback
from pdops.sim.metrics import Histogram, LoadReport
from pdops.sim.pd import KVConn, PdHandOff, PdTimeouts
from pdops.sim.request import FAKE_BOOTSTRAP_HOST, Req, RequestFailed
from pdops.sim.timing import TimingModel
from pdops.sim.tokens import Counter

log = logging.getLogger("pdops.sim")


class Engine(PdHandOff, LoadReport):
    """One sim engine's scheduler: submission, the request task, prefill compute, the decode batch."""

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
        self.peer_generations: dict[tuple, dict | None] = {}  # (host, port) -> that prefill's generation fields
        # what must match between a prefill and its decodes: its own flags and the pinned versions of
        # its env file (pdops.model.generation); compared at the PD handshake (pd)
        self.generation = fields_from_parsed(getattr(args, "all", None) or {}, versions_from_env(os.environ))
        self.generation_digest = digest(self.generation)
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
        # a prefill half aborted while it waits for its decode's bootstrap counts as a bootstrap failure
        # (real SGLang 0.5.23: `inv end-orphans` raised num_bootstrap_failed_reqs_total by one; docs/sim.md)
        waiting = self.mode == "prefill" and req.phase == "bootstrap"
        req.abort_reason = reason or RequestFailed("Aborted", status=None, kind="bootstrap" if waiting else None)
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
