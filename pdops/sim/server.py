"""The sim's HTTP server and process runtime: SGLang's routes, SIGTERM drain, children."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time

from aiohttp import web

from pdops.sim import SIM_VERSION, procs
from pdops.sim.bootstrap import BootstrapServer
from pdops.sim.engine import Engine, Req
from pdops.sim.faults import Faults
from pdops.sim.timing import TimingModel

log = logging.getLogger("pdops.sim")
_OPEN_PATHS = ("/health", "/ready", "/metrics")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": str(status), "param": None, "code": status}, status=status)


class SimServer:
    def __init__(self, args, timing: TimingModel, faults: Faults, children: list, report_r: int | None):
        self.args = args
        self.timing = timing
        self.faults = faults
        self.children = children
        self.report_r = report_r
        self.engine = Engine(args, timing, faults)
        self.status = "Starting"
        self.gracefully_exit = False
        self.started = time.time()
        self.strays: list[int] = []
        self.peers: list = []  # multi-node: writers of joined ranks
        self.exit_code = 0
        self.stop = asyncio.Event()
        self.poll_s = float(os.environ.get("PDOPS_SIM_SHUTDOWN_POLL_S", "5"))
        self.sigterm_installed = False
        self.healthy_answers = 0  # for the unhealthy_after fault

    # ---------------------------------------------------------------- app
    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=64 << 20)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/ready", self.ready)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/v1/models", self.models)
        r.add_route("*", "/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/abort_request", self.abort_request)
        r.add_get("/_sim/state", self.sim_state)
        r.add_get("/_sim/faults", self.sim_faults)
        r.add_post("/_sim/faults", self.sim_faults)
        if self.args.enable_metrics:
            r.add_get("/metrics", self.metrics)
        return app

    @web.middleware
    async def _auth(self, request, handler):
        key = self.args.api_key
        if key and not request.path.startswith(_OPEN_PATHS) and request.method != "OPTIONS":
            if request.headers.get("Authorization", "") != f"Bearer {key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    # ---------------------------------------------------------------- probes and info
    def _healthy(self) -> bool:
        if self.gracefully_exit or self.status != "Up":
            return False
        n = self.faults.unhealthy_after
        if n is not None:
            if self.healthy_answers >= n:
                return False
            self.healthy_answers += 1
        return True

    async def health(self, request):
        return web.Response(status=200 if self._healthy() else 503)

    async def ready(self, request):
        return web.Response(status=200 if self._healthy() else 503)

    async def server_info(self, request):
        a = self.args
        info = dict(a.all)
        info.update(
            {
                "host": a.host,
                "port": a.port,
                "served_model_name": a.served_model_name,
                "tp_size": a.tp_size,
                "pp_size": a.pp_size,
                "dp_size": a.dp_size,
                "disaggregation_mode": a.mode,
                "disaggregation_bootstrap_port": a.bootstrap_port,
                "max_running_requests": self.engine.max_running,
                "launch_command": " ".join([sys.executable, "-m", "pdops.sim", *sys.argv[1:]]),
                "status": self.status,
                "max_total_num_tokens": self.timing.max_total_tokens,
                "startup_time": self.started,
                "internal_states": [{"last_gen_throughput": self.engine.gen_throughput(), "load": self.engine.load()["num_running_reqs"]}],
                "version": SIM_VERSION,
                "frontend": "python",
                "sim": True,
            }
        )
        if a.api_key:
            info["api_key"] = "<redacted>"
        return web.json_response(info)

    async def model_info(self, request):
        a = self.args
        return web.json_response(
            {
                "model_path": a.model_path,
                "served_model_name": a.served_model_name,
                "tokenizer_path": a.all.get("tokenizer_path") or a.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": a.all.get("weight_version", "default"),
                "load_format": a.all.get("load_format"),
                "disaggregation_mode": a.mode,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": None,
                "architectures": None,
            }
        )

    async def loads(self, request):
        from datetime import datetime, timezone

        load = self.engine.load()
        include = request.query.get("include")
        if include:
            inc = {s.strip() for s in include.split(",")}
            valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
            if not inc <= valid:
                return web.json_response({"detail": f"Invalid include sections: {inc - valid}"}, status=400)
            if "all" not in inc:
                for field, name in (("memory", "memory"), ("disaggregation", "disagg"), ("queues", "queues")):
                    if name not in inc:
                        load.pop(field)
        return web.json_response(
            {
                "timestamp": datetime.now(timezone.utc).isoformat(),
                "version": SIM_VERSION,
                "accelerator": None,
                "num_accelerators": self.args.tp_size * self.args.pp_size,
                "loads": [load],
            }
        )

    async def models(self, request):
        a = self.args
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": a.served_model_name,
                        "object": "model",
                        "created": int(self.started),
                        "owned_by": "sglang",
                        "root": a.model_path,
                        "max_model_len": a.context_length,
                    }
                ],
            }
        )

    async def metrics(self, request):
        e = self.engine
        a = self.args
        sl = f'model_name="{a.served_model_name}",engine_type="{a.engine_type}",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
        tl = f'model_name="{a.served_model_name}",engine_type="{a.engine_type}"'
        load = e.load()
        c = e.phase_counts()
        out = []

        def gauge(name, value, doc):
            out.append(f"# HELP sglang:{name} {doc}\n# TYPE sglang:{name} gauge\nsglang:{name}{{{sl}}} {float(value)}")

        def counter(name, values, doc, labels=tl, split=True):
            lines = [f"# HELP sglang:{name}_total {doc}", f"# TYPE sglang:{name}_total counter"]
            if split:
                for s, v in values.items():
                    lines.append(f'sglang:{name}_total{{{labels},is_streaming="{s}"}} {float(v)}')
            else:
                lines.append(f"sglang:{name}_total{{{labels}}} {float(values)}")
            out.append("\n".join(lines))

        def hist(name, h, doc):
            lines = [f"# HELP sglang:{name} {doc}", f"# TYPE sglang:{name} histogram"]
            for s, (buckets, total, count) in h.counts.items():
                for b, n in zip(h.BUCKETS, buckets):
                    le = "+Inf" if b == float("inf") else repr(float(b))
                    lines.append(f'sglang:{name}_bucket{{{tl},is_streaming="{s}",le="{le}"}} {float(n)}')
                lines.append(f'sglang:{name}_sum{{{tl},is_streaming="{s}"}} {total}')
                lines.append(f'sglang:{name}_count{{{tl},is_streaming="{s}"}} {float(count)}')
            out.append("\n".join(lines))

        gauge("num_running_reqs", load["num_running_reqs"], "The number of running requests.")
        gauge("num_queue_reqs", load["num_waiting_reqs"], "The number of requests in the waiting queue.")
        gauge("num_used_tokens", load["num_used_tokens"], "The number of used tokens.")
        gauge("token_usage", load["token_usage"], "The token usage.")
        gauge("gen_throughput", load["gen_throughput"], "The generation throughput (token/s).")
        gauge("num_prefill_bootstrap_queue_reqs", c["bootstrap"], "The number of requests in the prefill bootstrap queue.")
        gauge("num_prefill_inflight_queue_reqs", c["inflight"], "The number of requests in the prefill inflight queue.")
        gauge("num_decode_prealloc_queue_reqs", c["prealloc"], "The number of requests in the decode prealloc queue.")
        gauge("num_decode_transfer_queue_reqs", c["transfer"], "The number of requests in the decode transfer queue.")
        counter("prompt_tokens", e.c_prompt, "Number of prefill tokens processed.")
        counter("generation_tokens", e.c_gen, "Number of generation tokens processed.")
        counter("num_requests", e.c_requests, "Number of requests processed.")
        counter("num_aborted_requests", e.c_aborted, "Number of requests aborted.", split=False)
        counter("num_bootstrap_failed_reqs", e.c_bootstrap_failed, "Number of bootstrap failed requests.", labels=sl, split=False)
        counter("num_transfer_failed_reqs", e.c_transfer_failed, "Number of transfer failed requests.", labels=sl, split=False)
        hist("time_to_first_token_seconds", e.h_ttft, "Histogram of time to first token in seconds.")
        hist("e2e_request_latency_seconds", e.h_e2e, "Histogram of End-to-end request latency in seconds")
        hist("inter_token_latency_seconds", e.h_itl, "Histogram of inter-token latency in seconds.")
        return web.Response(text="\n".join(out) + "\n", content_type="text/plain", charset="utf-8")

    # ---------------------------------------------------------------- generation
    async def _body(self, request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError("request body is not JSON") from None
        if not isinstance(body, dict):
            raise ValueError("request body must be a JSON object")
        return body

    def _submit(self, body: dict, prompt_tokens: int, max_new: int, stream: bool) -> Req:
        return self.engine.submit(body, stream, prompt_tokens, max_new)

    async def generate(self, request):
        try:
            body = await self._body(request)
            if "input_ids" in body and body["input_ids"] is not None:
                ids = body["input_ids"]
                if not isinstance(ids, list) or (ids and isinstance(ids[0], list)):
                    raise ValueError("batch input_ids are not supported by the sim")
                n = len(ids)
            elif isinstance(body.get("text"), str):
                n = self.engine.count(body["text"])
            else:
                raise ValueError("Either text or input_ids should be provided (a single string; batches are not supported by the sim).")
            sp = body.get("sampling_params") or {}
            max_new = int(sp.get("max_new_tokens", 128) if sp.get("max_new_tokens") is not None else 128)
            stream = bool(body.get("stream"))
            req = self._submit(body, n, max_new, stream)
        except ValueError as e:
            return web.json_response({"error": {"message": str(e)}}, status=400)
        if stream:
            return await self._stream(request, req, lambda r, last: json.dumps(r.stream_chunk()))
        return await self._wait(req, lambda r: r.output())

    async def _wait(self, req: Req, render) -> web.Response:
        try:
            await req.done.wait()
        except asyncio.CancelledError:
            self.engine.abort(req)  # client disconnected
            raise
        fr = req.finish_reason or {}
        if fr.get("type") == "abort" and fr.get("status_code") and fr["status_code"] >= 400:
            return _error(fr["status_code"], fr.get("message", "Aborted"))
        return web.json_response(render(req))

    async def _stream(self, request, req: Req, render) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            sent = -1
            while True:
                await req.progress.wait()
                req.progress.clear()
                if req.tokens != sent or req.finished:
                    sent = req.tokens
                    await resp.write(b"data: " + render(req, req.finished).encode() + b"\n\n")
                if req.finished:
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionError):
            self.engine.abort(req)  # client disconnected
            raise
        return resp

    def _openai_prompt(self, body: dict, chat: bool) -> int:
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list):
                raise ValueError("messages must be a list")
            text = " ".join(m.get("content", "") if isinstance(m.get("content"), str) else "" for m in msgs)
            return self.engine.count(text)
        p = body.get("prompt")
        if isinstance(p, str):
            return self.engine.count(p)
        if isinstance(p, list) and all(isinstance(x, int) for x in p):
            return len(p)
        raise ValueError("prompt must be a string or a list of token ids (batches are not supported by the sim)")

    async def _openai(self, request, chat: bool):
        try:
            body = await self._body(request)
            n = self._openai_prompt(body, chat)
            mt = body.get("max_completion_tokens") if chat else None
            mt = mt if mt is not None else body.get("max_tokens")
            max_new = int(mt) if mt is not None else 128
            stream = bool(body.get("stream"))
            req = self._submit(body, n, max_new, stream)
        except ValueError as e:
            return web.json_response({"object": "error", "message": str(e), "type": "BadRequestError", "param": None, "code": 400}, status=400)
        model = body.get("model") or self.args.served_model_name
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())

        def finish(r):
            fr = r.finish_reason or {}
            return {"length": "length", "abort": "abort"}.get(fr.get("type"), "stop") if fr else None

        def usage(r):
            return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.tokens, "total_tokens": r.prompt_tokens + r.tokens}

        if stream:
            state = {"sent": 0}

            def chunk(r, last):
                words = r.text().split()
                delta = " ".join(words[state["sent"]:])
                if state["sent"] and delta:
                    delta = " " + delta
                state["sent"] = len(words)
                choice = {"index": 0, "finish_reason": finish(r) if last else None}
                if chat:
                    choice["delta"] = {"role": "assistant", "content": delta}
                else:
                    choice["text"] = delta
                d = {"id": r.rid, "object": obj + ".chunk" if chat else obj, "created": created, "model": model, "choices": [choice]}
                if last:
                    d["usage"] = usage(r)
                return json.dumps(d)

            return await self._stream(request, req, chunk)

        def full(r):
            choice = {"index": 0, "finish_reason": finish(r)}
            if chat:
                choice["message"] = {"role": "assistant", "content": r.text()}
            else:
                choice["text"] = r.text()
            return {"id": r.rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": usage(r)}

        return await self._wait(req, full)

    async def completions(self, request):
        return await self._openai(request, chat=False)

    async def chat(self, request):
        return await self._openai(request, chat=True)

    async def abort_request(self, request):
        try:
            body = await self._body(request)
        except ValueError:
            body = {}
        self.engine.abort_rid(str(body.get("rid") or ""), bool(body.get("abort_all")))
        return web.Response(status=200)

    # ---------------------------------------------------------------- sim admin
    async def sim_state(self, request):
        return web.json_response(
            {
                "pid": os.getpid(),
                "status": self.status,
                "gracefully_exit": self.gracefully_exit,
                "children": [{"pid": c.pid, "title": c.title, "exit_status": c.exit_status} for c in self.children],
                "strays": self.strays,
                "in_flight": sorted(self.engine.reqs),
                "kv_port": self.engine.kv_port,
                "faults": self.faults.as_dict(),
                "tokenizer": self.engine.counter.kind,
            }
        )

    async def sim_faults(self, request):
        if request.method == "POST":
            try:
                body = await self._body(request)
                self.faults.update(body)
            except (ValueError, TypeError) as e:
                return web.json_response({"error": str(e)}, status=400)
            self._apply_process_faults(body)
        return web.json_response(self.faults.as_dict())

    def _escape(self) -> None:
        try:
            with open("/proc/self/mountinfo") as f:
                targets = procs.escape_targets(f.read())
        except Exception as e:  # noqa: BLE001 - no cgroup mounts: the fault still holds the ports
            log.warning("escape_cgroup: cannot read the cgroup mounts (%s)", e)
            targets = []
        pid = procs.spawn_escaper(targets)
        self.strays.append(pid)
        log.info("escaped process left behind: pid %s (out of the unit's cgroup, holding the ports)", pid)

    def _apply_process_faults(self, changed: dict) -> None:
        if changed.get("stray_grandchild") and self.children:
            procs.send(self.children[0], b"s")
        if changed.get("escape_cgroup"):
            self._escape()
        if "crash_child" in changed and self.faults.crash_child is not None and self.children:
            asyncio.get_running_loop().call_later(self.faults.crash_child, procs.send, self.children[0], b"x")

    # ---------------------------------------------------------------- runtime
    def _on_report(self) -> None:
        try:
            data = os.read(self.report_r, 4096)
        except OSError:
            return
        for line in data.decode(errors="replace").splitlines():
            kind, _, pid = line.partition(" ")
            if kind == "stray" and pid.isdigit():
                self.strays.append(int(pid))
                log.info("stray grandchild left behind: pid %s", pid)

    def on_sigterm(self) -> None:
        if self.faults.ignore_sigterm:
            log.warning("SIGTERM received and ignored (fault ignore_sigterm)")
            return
        log.info("SIGTERM received. Draining requests and shutting down...")
        self.gracefully_exit = True

    def _install_sigterm(self) -> None:
        if not self.sigterm_installed:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.on_sigterm)
            self.sigterm_installed = True

    async def _watch_children(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            for c in procs.reap(self.children):
                if not c.expected_exit:
                    log.error("child %s (pid %d) exited unexpectedly with %s; killing the process tree", c.title, c.pid, c.exit_status)
                    self.exit_code = 1
                    self.stop.set()
                    return

    async def _sigterm_watchdog(self) -> None:
        while not self.gracefully_exit:
            await asyncio.sleep(self.poll_s)
        while True:
            if os.environ.get("SGL_FORCE_SHUTDOWN", "").lower() in ("1", "true", "yes"):
                log.error("Signal SIGTERM received while force shutdown flag set. Force exiting.")
                break
            remain = list(self.engine.reqs)
            log.info("Gracefully exiting... Remaining number of requests %d. Remaining requests %s.", len(remain), remain)
            if not remain:
                break
            await asyncio.sleep(self.poll_s)
        self.stop.set()

    async def _register_bootstrap(self) -> None:
        """Each prefill rank PUTs its KV endpoint to the bootstrap server, as SGLang's do."""
        a = self.args
        ip = os.environ.get("SGLANG_HOST_IP") or os.environ.get("HOST_IP") or a.host
        if ip in ("0.0.0.0", "::", ""):
            ip = "127.0.0.1"
        url = f"http://{a.host if a.host not in ('0.0.0.0', '::') else '127.0.0.1'}:{a.bootstrap_port}/route"
        for tp in range(a.tp_size):
            for pp in range(a.pp_size):
                body = {
                    "attn_tp_size": a.tp_size, "attn_tp_rank": tp, "attn_cp_size": 1, "attn_cp_rank": 0,
                    "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": a.pp_size, "pp_rank": pp,
                    "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": ip, "rank_port": self.engine.kv_port,
                    "page_size": a.all.get("page_size") or 1, "kv_cache_dtype": "auto",
                    "prefill_http_port": a.port,
                    "decode_allocation_policy": a.all.get("disaggregation_decode_allocation_policy") or "early",
                }
                for _ in range(50):
                    try:
                        async with self.engine.http.put(url, json=body) as r:
                            if r.status == 200:
                                break
                    except Exception:
                        pass
                    await asyncio.sleep(0.1)

    async def _accept_ranks(self) -> asyncio.AbstractServer | None:
        a = self.args
        if a.nnodes <= 1:
            return None
        host, _, port = a.dist_init_addr.rpartition(":")
        joined = asyncio.Event()

        async def on_rank(reader, writer):
            try:
                line = await asyncio.wait_for(reader.readline(), 30)
                log.info("node rank joined: %s", line.decode().strip())
            except Exception:
                writer.close()
                return
            self.peers.append(writer)
            if len(self.peers) >= a.nnodes - 1:
                joined.set()
            try:
                await reader.read()  # until the peer leaves
            except ConnectionError:
                pass

        server = await asyncio.start_server(on_rank, host.strip("[]") or "0.0.0.0", int(port), reuse_address=True)
        self._ranks_joined = joined
        return server

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        if self.report_r is not None:
            loop.add_reader(self.report_r, self._on_report)
        await self.engine.start()
        rank_server = await self._accept_ranks()
        app = self.build_app()
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.args.host, self.args.port, reuse_address=True)
            await site.start()
        except OSError as e:
            log.error("cannot bind %s:%s: %s", self.args.host, self.args.port, e)
            await runner.cleanup()
            await self.engine.close()
            return 1
        boot_runner = None
        if self.args.mode == "prefill":
            bs = BootstrapServer()
            boot_runner = web.AppRunner(bs.app, access_log=None)
            await boot_runner.setup()
            try:
                await web.TCPSite(boot_runner, self.args.host, self.args.bootstrap_port, reuse_address=True).start()
            except OSError as e:  # SGLang only logs this
                log.error("bootstrap server failed to bind port %s: %s", self.args.bootstrap_port, e)
            await self._register_bootstrap()
        tasks = [asyncio.create_task(self._watch_children()), asyncio.create_task(self._sigterm_watchdog())]
        if self.faults.stray_grandchild and self.children:
            procs.send(self.children[0], b"s")
        if self.faults.escape_cgroup:
            self._escape()
        if self.faults.crash_child is not None and self.children:
            loop.call_later(self.faults.crash_child, procs.send, self.children[0], b"x")
        log.info("sim %s listening on http://%s:%s (mode %s)", os.getpid(), self.args.host, self.args.port, self.args.mode)

        async def become_ready():
            if rank_server is not None:
                await self._ranks_joined.wait()
            await asyncio.sleep(self.timing.startup_s)
            self.status = "Up"
            # SGLang installs its SIGTERM handler with the first /generate, which its
            # warmup request is; --skip-server-warmup leaves it to the first real request.
            if not self.args.all.get("skip_server_warmup"):
                self._install_sigterm()
            else:
                await self.engine.seen_first_request.wait()
                self._install_sigterm()
            log.info("The server is fired up and ready to roll!")

        tasks.append(asyncio.create_task(become_ready()))
        await self.stop.wait()
        for t in tasks:
            t.cancel()
        procs.stop_children(self.children, timeout=15 if self.exit_code == 0 else 1)
        if self.engine.reqs or self.exit_code:
            # forced exit (SGL_FORCE_SHUTDOWN, a crashed child): like SGLang's
            # kill_process_tree, in-flight connections are cut, not answered
            logging.shutdown()
            os._exit(self.exit_code)
        for w in self.peers:
            w.close()
        if rank_server is not None:
            rank_server.close()
        await runner.cleanup()
        if boot_runner is not None:
            await boot_runner.cleanup()
        await self.engine.close()
        return self.exit_code


async def run_follower(args, children) -> int:
    """A node with --node-rank >= 1: join rank 0 over TCP, serve no HTTP, exit with it."""
    host, _, port = args.dist_init_addr.rpartition(":")
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: log.info("SIGTERM received on node rank %d: ignored; exits when rank 0 exits", args.node_rank))
    deadline = time.monotonic() + float(args.all.get("dist_timeout") or 600)
    while True:
        try:
            reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
            break
        except OSError:
            if time.monotonic() > deadline:
                log.error("could not join rank 0 at %s", args.dist_init_addr)
                procs.stop_children(children, 1)
                return 1
            await asyncio.sleep(0.2)
    writer.write(f"node_rank {args.node_rank} pid {os.getpid()} {socket.gethostname()}\n".encode())
    await writer.drain()
    log.info("node rank %d joined rank 0 at %s", args.node_rank, args.dist_init_addr)

    async def watch():
        while True:
            await asyncio.sleep(0.2)
            for c in procs.reap(children):
                if not c.expected_exit:
                    return 1

    w = asyncio.create_task(watch())
    r = asyncio.create_task(reader.read())
    done, _ = await asyncio.wait({w, r}, return_when=asyncio.FIRST_COMPLETED)
    code = w.result() if w in done else 0
    w.cancel()
    r.cancel()
    log.info("rank 0 is gone; node rank %d exits", args.node_rank)
    procs.stop_children(children, 1)
    return code or 0
