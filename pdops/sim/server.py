"""The sim's HTTP server and process runtime: the app and its routes (handlers in `info_routes`
and `generate_routes`), the sim's admin routes and process faults, SIGTERM drain, children,
the prefill's bootstrap registration, and rank 0 of a multi-node engine (`follower` is the rest)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

from aiohttp import web

from pdops.sim import procs
from pdops.sim.bootstrap import BootstrapServer
from pdops.sim.engine import Engine
from pdops.model.sim_faults import Faults
from pdops.sim.generate_routes import GenerateRoutes, read_body
from pdops.sim.info_routes import InfoRoutes
from pdops.sim.timing import TimingModel

log = logging.getLogger("pdops.sim")
_OPEN_PATHS = ("/health", "/ready", "/metrics")


class SimServer(InfoRoutes, GenerateRoutes):
    """Rank 0 of a sim engine: SGLang's HTTP surface over an Engine, and the process around it."""

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
                "generation": self.engine.generation_digest,
                "generation_fields": self.engine.generation,
            }
        )

    async def sim_faults(self, request):
        if request.method == "POST":
            try:
                body = await read_body(request)
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
                    # the sim's own: this prefill's generation fields (pdops.model.generation), which a
                    # decode compares with its own before it takes KV from it
                    "pdops_generation": self.engine.generation,
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
