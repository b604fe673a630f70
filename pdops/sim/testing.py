"""Start sims and the real model gateway for tests, benchmarks and the demo.

Every process started here is stopped by its own PID (and its recorded children and
strays), never by name. Readiness is polled with deadlines.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from pdops.errors import Unreachable


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http(method: str, url: str, body=None, timeout: float = 10.0, headers: dict | None = None):
    """(status, parsed JSON or text) of one HTTP call; status 0 when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def _cpu_s() -> float:
    """CPU seconds this process (all its threads) and the children it waited for have used."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def poll(pred, timeout: float, interval: float = 0.1):
    """Call ``pred`` until it returns something true, for up to ``timeout`` seconds: that value, or
    the last (false) one at the deadline. The one polling loop of the tests and the lab: each wait
    ends when what it waits for is seen, never after a sleep that stands in for it. A check that
    costs CPU (an `inv status` subprocess, SSH with its crypto, parsing) is not repeated back to back:
    the pause before the next one is at least the CPU it used (at most 2 s), so that a wait keeps a core
    busy at most half the time (on a 2-core machine four test workers waiting at once would otherwise
    slow each other). A check that only waits on the network (a timeout) pauses ``interval``, so a
    recovery timed with :func:`waited` is not lengthened by the pause."""
    deadline = time.monotonic() + timeout
    while True:
        cpu0 = _cpu_s()
        v = pred()
        now = time.monotonic()
        if v or now >= deadline:
            return v
        time.sleep(min(max(interval, min(_cpu_s() - cpu0, 2.0)), deadline - now + interval))


def wait_until(pred, timeout: float, what: str, interval: float = 0.1):
    """:func:`poll` that fails at the deadline: Unreachable naming ``what`` and the last value."""
    v = poll(pred, timeout, interval)
    if not v:
        last = repr(v)
        raise Unreachable(f"timed out after {timeout:g}s waiting for {what} (last: "
                          f"{last if len(last) <= 300 else last[:300] + '...'})")
    return v


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _children_of(pid: int) -> list[int]:
    try:
        import psutil

        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:
        return []


@dataclass
class Proc:
    """A process we started, with everything it spawned that we have seen."""

    popen: subprocess.Popen
    log_path: str
    extra_pids: set = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def remember_children(self) -> list[int]:
        kids = _children_of(self.pid)
        self.extra_pids.update(kids)
        return kids

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill_all(self) -> None:
        """SIGKILL the process and every recorded descendant, by PID; reap it."""
        self.remember_children()
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in self.extra_pids:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass


def spawn(cmd: list[str], env: dict | None, name: str) -> Proc:
    fd, path = tempfile.mkstemp(prefix=f"pdops-{name}-", suffix=".log")
    full_env = dict(os.environ)
    full_env.update(env or {})
    p = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env)
    os.close(fd)
    return Proc(p, path)


def _flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


@dataclass
class SimHandle:
    proc: Proc
    host: str
    port: int
    bootstrap_port: int | None
    mode: str
    args: list[str]

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def get(self, path: str, timeout: float = 10.0):
        return http("GET", self.url + path, timeout=timeout)

    def post(self, path: str, body=None, timeout: float = 30.0):
        return http("POST", self.url + path, body, timeout=timeout)

    def state(self) -> dict:
        s, body = self.get("/_sim/state")
        if s == 200:
            self.proc.extra_pids.update(c["pid"] for c in body["children"])
            self.proc.extra_pids.update(body["strays"])
            return body
        return {}

    def wait_ready(self, timeout: float = 20.0) -> None:
        def ok():
            if not self.proc.alive():
                raise Unreachable(f"sim exited with {self.proc.popen.returncode}", evidence=self.proc.log()[-3000:])
            return self.get("/health", timeout=2)[0] == 200

        wait_until(ok, timeout, f"sim {self.url} /health")
        self.state()

    def terminate(self) -> None:
        """SIGTERM the main process only (what systemd KillMode=mixed does first)."""
        self.state()
        self.proc.signal(signal.SIGTERM)

    def stop(self) -> None:
        """Kill the sim and everything it started (children, strays), by PID."""
        if self.proc.alive():
            self.state()
        self.proc.kill_all()


def start_sim(args: list[str] | None = None, env: dict | None = None, *, ready: bool = True, timeout: float = 20.0) -> SimHandle:
    """Start ``python -m pdops.sim`` as a subprocess on free loopback ports.

    ``args`` are SGLang flags; --model-path, --host and --port (and, for a prefill,
    --disaggregation-bootstrap-port) are filled in when absent. Waits for /health unless
    ``ready`` is False. The caller must call ``.stop()`` (a fixture's finally).
    """
    args = list(args or [])
    if _flag(args, "--model-path") is None:
        args += ["--model-path", "sim-model"]
    host = _flag(args, "--host")
    if host is None:
        host = "127.0.0.1"
        args += ["--host", host]
    port = _flag(args, "--port")
    if port is None:
        port = str(free_port(host))
        args += ["--port", port]
    mode = _flag(args, "--disaggregation-mode") or "null"
    bport = _flag(args, "--disaggregation-bootstrap-port")
    if mode == "prefill" and bport is None:
        bport = str(free_port(host))
        args += ["--disaggregation-bootstrap-port", bport]
    e = {"PDOPS_SIM_STARTUP_S": "0.05"}
    e.update(env or {})
    proc = spawn([sys.executable, "-m", "pdops.sim", *args], e, "sim")
    h = SimHandle(proc, host, int(port), int(bport) if bport else None, mode, args)
    if ready:
        try:
            h.wait_ready(timeout)
        except BaseException:
            h.stop()
            raise
    return h


def smg_path() -> str:
    """The gateway binary of this environment (sglang-router's ``smg``)."""
    cand = os.path.join(os.path.dirname(sys.executable), "smg")
    if os.access(cand, os.X_OK):
        return cand
    found = shutil.which("smg")
    if not found:
        raise Unreachable("the model gateway `smg` (sglang-router) is not installed")
    return found


@dataclass
class GatewayHandle:
    proc: Proc
    host: str
    port: int
    prometheus_port: int

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def add_worker(self, url: str, worker_type: str, bootstrap_port: int | None = None) -> dict:
        body = {"url": url, "worker_type": worker_type}
        if bootstrap_port is not None:
            body["bootstrap_port"] = bootstrap_port
        s, r = http("POST", self.url + "/workers", body)
        if s not in (200, 202):
            raise Unreachable(f"gateway refused worker {url}: {s} {r}")
        return r

    def workers(self) -> list[dict]:
        s, r = http("GET", self.url + "/workers")
        return r.get("workers", []) if s == 200 and isinstance(r, dict) else []

    def wait_workers(self, urls: list[str], timeout: float = 30.0) -> None:
        """Wait until every url in ``urls`` is listed and healthy."""

        def ok():
            if not self.proc.alive():
                raise Unreachable("gateway exited", evidence=self.proc.log()[-3000:])
            healthy = {w["url"] for w in self.workers() if w.get("is_healthy")}
            return all(u in healthy for u in urls)

        wait_until(ok, timeout, f"gateway workers healthy: {urls}", interval=0.1)

    def stop(self) -> None:
        self.proc.kill_all()


def start_gateway(prefills=(), decodes=(), extra_args: list[str] | None = None, *, timeout: float = 30.0) -> GatewayHandle:
    """Start the real gateway (``smg launch --pd-disaggregation``) on free loopback ports.

    ``prefills``: SimHandles or (url, bootstrap_port) pairs; ``decodes``: SimHandles or
    urls. They are registered through ``POST /workers`` and awaited healthy. Retries
    are off (pdops renders ``--disable-retries``).
    """
    host = "127.0.0.1"
    port, prom = free_port(host), free_port(host)
    cmd = [smg_path(), "launch", "--pd-disaggregation", "--host", host, "--port", str(port),
           "--prometheus-host", host, "--prometheus-port", str(prom), "--disable-retries",
           "--health-check-interval-secs", "1", *(extra_args or [])]
    proc = spawn(cmd, None, "gateway")
    g = GatewayHandle(proc, host, port, prom)
    try:
        def up():
            if not proc.alive():
                raise Unreachable("gateway exited at start", evidence=proc.log()[-3000:])
            return http("GET", g.url + "/health", timeout=2)[0] in (200, 503)

        wait_until(up, timeout, "gateway /health", interval=0.1)
        urls = []
        for p in prefills:
            url, bp = (p.url, p.bootstrap_port) if isinstance(p, SimHandle) else p
            g.add_worker(url, "prefill", bp)
            urls.append(url)
        for d in decodes:
            url = d.url if isinstance(d, SimHandle) else d
            g.add_worker(url, "decode")
            urls.append(url)
        if urls:
            g.wait_workers(urls, timeout)
    except BaseException:
        g.stop()
        raise
    return g


def metric(handle: SimHandle, name: str, **labels) -> float:
    """Sum of the samples of ``name`` in the sim's /metrics whose labels match ``labels``."""
    s, text = handle.get("/metrics")
    if s != 200:
        raise Unreachable(f"{handle.url}/metrics answered {s}")
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        lab, _, value = line[len(name) + 1 :].rpartition("} ")
        pairs = dict(p.split("=", 1) for p in lab.split(",") if "=" in p)
        if all(pairs.get(k) == f'"{v}"' for k, v in labels.items()):
            total += float(value)
    return total


def write_haproxy_local(cfg, workdir: str | Path, *, stats_socket: str | None = None) -> Path:
    """Write config, key map and errorfile into `workdir` (no root, no systemd); returns the config.
    `stats_socket`: where HAProxy's runtime API listens (none by default)."""
    from pdops.model import admission as adm  # lazy: the admission model only for tests that run HAProxy
    from pdops.model.render import haproxy_config  # lazy: rendering (jinja2) only for those tests

    d = Path(workdir)
    d.mkdir(parents=True, exist_ok=True)
    kmap, err, conf = d / "api-keys.map", d / "overflow.http", d / "pdops-admission.cfg"
    adm.write_keys_map(kmap, cfg.keys)
    err.write_text(adm.overflow_response(cfg.overflow_status))
    conf.write_text(haproxy_config(cfg, keys_map_path=str(kmap), errorfile_path=str(err), user=None,
                                   stats_socket=stats_socket))
    return conf


def start_haproxy(cfg, workdir, timeout: float = 10.0, *, stats_socket: str | None = None) -> Proc:
    """Run the admission layer (`haproxy -Ws -f`, config from pdops.model.admission) as a local process;
    wait until it answers (401 without a key). Stop it with `.kill_all()`; reload with `.signal(SIGUSR2)`."""
    import shutil

    from pdops.model import admission as adm  # lazy: the admission model only for tests that run HAProxy

    conf = write_haproxy_local(cfg, workdir, stats_socket=stats_socket)
    adm.check_config(conf)
    proc = spawn([shutil.which("haproxy") or adm.HAPROXY_BIN, "-Ws", "-f", str(conf)], None, "haproxy")

    def up():
        if not proc.alive():
            raise Unreachable("haproxy exited at start", evidence=proc.log()[-3000:])
        return http("GET", cfg.url + "/health", timeout=2)[0] == 401

    try:
        wait_until(up, timeout, f"haproxy on {cfg.url}")
    except BaseException:
        proc.kill_all()
        raise
    return proc
