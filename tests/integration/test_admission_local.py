"""The admission layer live, as local processes on 127.0.0.1: real HAProxy (Debian's),
the real gateway (`smg`) and sims. No lab: every process is started here and killed by
its PID in a finally block. Streams are made long with PDOPS_SIM_DECODE_STEP_MS."""

import asyncio
from dataclasses import replace
import shutil
import signal
import time

import aiohttp
import pytest

from pdops.model.admission import AdmissionConfig, write_keys_map
from pdops.ops.audit import audit
from pdops.sim.testing import free_port, http, start_gateway, start_haproxy, start_sim, wait_until

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy not installed: scripts/setup-system.sh")

KEY_A = "pdops-test-key-AAAAAAAAAAAA"
KEY_B = "pdops-test-key-BBBBBBBBBBBB"
STEP_MS = "10"  # 10 ms per token: 300 tokens is a 3 s stream


@pytest.fixture(scope="module")
def cluster():
    """One prefill, one decode (metrics on), the real gateway with its default (no) admission."""
    env = {"PDOPS_SIM_DECODE_STEP_MS": STEP_MS}
    started = []
    try:
        p = start_sim(["--disaggregation-mode", "prefill", "--enable-metrics"], env)
        started.append(p)
        d = start_sim(["--disaggregation-mode", "decode", "--enable-metrics"], env)
        started.append(d)
        g = start_gateway([p], [d])
        started.append(g)
        yield p, d, g
    finally:
        for h in reversed(started):
            h.stop()


def _cfg(gw_port: int, *, cap: int, queue: int, queue_timeout_s: int = 30, overflow: int = 429,
         keys=(KEY_A,)) -> AdmissionConfig:
    return AdmissionConfig(host="local", listen_addr="127.0.0.1", port=free_port(), cap=cap, queue=queue,
                           queue_timeout_s=queue_timeout_s, overflow_status=overflow, api_keys_file="(test)",
                           gateways=(("gw1", "127.0.0.1", gw_port),), keys=tuple(keys))


def test_audit_passes_through_haproxy(cluster, tmp_path):
    """Cap 2, queue 4: at most 2 in flight at the decode, the 2 queued served in order,
    401 without a key (nothing reaches the decode), a cut stream aborts the decode."""
    _, d, g = cluster
    cfg = _cfg(g.port, cap=2, queue=4)
    hx = start_haproxy(cfg, tmp_path)
    try:
        rep = audit(cfg.url, [d.url], KEY_A, cap=2, queue=4, queue_timeout_s=30, overflow_status=429, tokens=300)
    finally:
        hx.kill_all()
    print(rep.format())
    assert rep.passed, rep.format()
    claims = {c.name: c for c in rep.claims}
    assert "peak in-flight at the decodes 2 " in claims["cap"].detail
    assert "2 queued and served" in claims["queue"].detail
    assert "running 2->1, aborted +1" in claims["cancel"].detail
    # the access log carries the request id and the key's id, never the key
    log = hx.log()
    assert "rid=audit-" in log and "key=k-" in log and KEY_A not in log


def test_queue_timeout_and_full_queue_give_the_configured_status(cluster, tmp_path):
    """Cap 2, queue 1, queue timeout 1 s, overflow 429: of 4 streams of 3 s, the third waits
    1 s and gets 429 (HAProxy's queue 503 mapped), the fourth finds the queue full: 429 at once."""
    _, d, g = cluster
    cfg = _cfg(g.port, cap=2, queue=1, queue_timeout_s=1, overflow=429)
    hx = start_haproxy(cfg, tmp_path)
    try:
        rep = audit(cfg.url, [d.url], KEY_A, cap=2, queue=1, queue_timeout_s=1, overflow_status=429, tokens=300)
    finally:
        hx.kill_all()
    print(rep.format())
    assert rep.passed, rep.format()
    assert "0 queued and served, 2 refused with 429" in {c.name: c for c in rep.claims}["queue"].detail


def test_against_gateway_smg_holds_its_cap_but_not_the_rest(cluster):
    """smg 1.13's `--max-concurrent-requests 2 --queue-size 0` holds the cap for the whole life of
    each stream, even with a token refill of 1/s and streams 0.7 s apart (sglang-router 0.3.2
    let 4 in: docs/design/sglang.md); a queued request times out with 503 whatever overflow status is asked,
    and without --api-key anything gets in (docs/admission.md)."""
    p, d, _ = cluster
    g2 = start_gateway([p], [d], ["--max-concurrent-requests", "2", "--queue-size", "0",
                                  "--rate-limit-tokens-per-second", "1"])
    try:
        rep = audit(g2.url, [d.url], None, cap=2, queue=0, queue_timeout_s=1, overflow_status=429, tokens=400,
                    mode="gateway", stagger_s=0.7)
    finally:
        g2.stop()
    print(rep.format())
    claims = {c.name: c for c in rep.claims}
    assert claims["cap"].passed, claims["cap"].detail
    assert "peak in-flight at the decodes 2 " in claims["cap"].detail
    assert claims["cancel"].passed, claims["cancel"].detail
    assert not rep.passed and not claims["auth"].passed  # no key needed at the gateway
    g3 = start_gateway([p], [d], ["--max-concurrent-requests", "2", "--queue-size", "2", "--queue-timeout-secs", "1"])
    try:
        rep = audit(g3.url, [d.url], None, cap=2, queue=2, queue_timeout_s=1, overflow_status=429, tokens=400,
                    mode="gateway")
    finally:
        g3.stop()
    print(rep.format())
    claims = {c.name: c for c in rep.claims}
    assert claims["cap"].passed and not claims["queue"].passed
    assert "admission_queue_timeout" in "\n".join(claims["queue"].evidence)


def test_key_reload_during_10_streams_drops_none(cluster, tmp_path):
    """Revoke key A and add key B with a reload (USR2 to the master) while 10 streams are in
    flight: all 10 complete with every token, and the new key list is in force after."""
    _, d, g = cluster
    cfg = _cfg(g.port, cap=16, queue=0)
    hx = start_haproxy(cfg, tmp_path)
    tokens = 400

    async def stream(session, i):
        body = {"text": f"reload {i}", "stream": True, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
        async with session.post(cfg.url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY_A}"}) as r:
            assert r.status == 200
            chunks = [ln async for ln in r.content if ln.startswith(b"data:")]
        return chunks

    async def run():
        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(stream(session, i)) for i in range(10)]
            await asyncio.to_thread(wait_until, lambda: d.get("/v1/loads")[1]["loads"][0]["num_running_reqs"] == 10,
                                    10, "10 streams running at the decode")
            write_keys_map(tmp_path / "api-keys.map", (KEY_B,))
            hx.remember_children()
            hx.signal(signal.SIGUSR2)
            auth = {"Authorization": f"Bearer {KEY_B}"}
            await asyncio.to_thread(wait_until, lambda: http("GET", cfg.url + "/health", headers=auth)[0] == 200,
                                    10, "key B accepted after the reload")
            running_after_reload = d.get("/v1/loads")[1]["loads"][0]["num_running_reqs"]
            return await asyncio.gather(*tasks), running_after_reload

    try:
        t0 = time.monotonic()
        results, running = asyncio.run(run())
        old_key = http("GET", cfg.url + "/health", headers={"Authorization": f"Bearer {KEY_A}"})[0]
    finally:
        hx.kill_all()
    assert running == 10, "the reload must not cut a stream"
    assert [len(c) for c in results] == [tokens + 1] * 10  # every token chunk + [DONE]
    assert all(c[-1].strip() == b"data: [DONE]" for c in results)
    assert old_key == 401
    assert time.monotonic() - t0 < 30


class _Gateway:
    """A stand-in gateway for HAProxy's backend: 200 to anything, stopped and started again on one port.
    `served` counts the POSTs it answered (clients' requests), not HAProxy's health checks (GETs of
    /readiness, which arrive on HAProxy's own timer and would make a count depend on timing)."""

    def __init__(self, port: int):
        self.port, self.server, self.posts = port, None, []

    @property
    def served(self) -> int:
        return len(self.posts)

    def start(self) -> None:
        import http.server
        import threading

        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _ok(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "POST":
                    owner.posts.append(self.path)
                body = b'{"text": "ok"}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _ok

            def log_message(self, *a):
                pass

        http.server.ThreadingHTTPServer.allow_reuse_address = True
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _gw_status(sock) -> str:
    """HAProxy's own word for the gateway server (UP, DOWN, ...), from `show stat` on its runtime API."""
    import subprocess

    from pdops.model.admission import runtime_command

    out = subprocess.run(runtime_command("show stat", str(sock)), shell=True, capture_output=True, text=True,
                         check=True).stdout
    lines = [ln for ln in out.splitlines() if ln.strip()]
    head = lines[0].lstrip("# ").split(",")
    for ln in lines[1:]:
        row = dict(zip(head, ln.split(",")))
        if row.get("pxname") == "gateways" and row.get("svname") == "gw-gw1":
            return row["status"]
    raise AssertionError(out)


def test_reloads_under_back_to_back_requests_turn_none_away(tmp_path):
    """A key change reloads HAProxy (USR2: a new worker, the old one soft-stops). Four clients
    send requests back to back, reusing their connections when HAProxy lets them, through 20
    reloads: every request is answered 200. Measured on HAProxy 2.6 before the fix: 9 answered
    "model gateway down" (the stopping worker's backend counts no server, so the down rule fired)
    and 17 broken connections (the stopping worker closed idle kept-alive connections a client was
    sending on)."""
    import collections
    import http.client
    import threading

    port = free_port()
    gw = _Gateway(port)
    gw.start()
    cfg = _cfg(port, cap=4, queue=4)
    hx = start_haproxy(cfg, tmp_path)
    answers: collections.Counter = collections.Counter()
    stop = threading.Event()

    def client():
        conn = None
        while not stop.is_set():
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(cfg.listen_addr, cfg.port, timeout=10)
                conn.request("POST", "/generate", body=b'{"text": "x"}',
                             headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"})
                r = conn.getresponse()
                answers[f"{r.status} {r.read()[:70]!r}"] += 1
            except (OSError, http.client.HTTPException) as e:
                answers[f"error {type(e).__name__}"] += 1
                conn.close()
                conn = None

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(20):
            wait_until(lambda n=gw.served: gw.served > n + 20, 10, "requests served between reloads")
            hx.signal(signal.SIGUSR2)
        wait_until(lambda n=gw.served: gw.served > n + 100, 10, "requests served after the last reload")
    finally:
        stop.set()
        for t in threads:
            t.join(15)
        hx.kill_all()
        gw.stop()
    print(dict(answers))
    assert set(answers) == {"200 b'{\"text\": \"ok\"}'"}, dict(answers)


def test_the_only_gateways_stand_in_takes_over_while_the_gateway_is_out_and_no_check_is_paused(tmp_path):
    """What a change's gateway-restart does with one gateway behind the admission layer, on real
    HAProxy, with the exact runtime commands pdops sends: the rendered stand-in server starts in
    MAINT (disabled); set ready, HAProxy's own check brings it UP; the gateway set to drain then
    takes no new request while the stand-in serves them all, even with the gateway stopped (its
    check keeps running: DOWN, and nobody minds); back ready and UP, the stand-in drained and put in
    MAINT again. At no point is a health check paused, and every request is served."""
    import subprocess

    from pdops.model.admission import server_state_command, standby_server
    from pdops.remote.haproxy import gateway_stats

    port, sport = free_port(), free_port()
    gw, standby = _Gateway(port), _Gateway(sport)
    gw.start()
    cfg = replace(_cfg(port, cap=4, queue=4), standby=("gw1", "127.0.0.1", sport))
    sock = tmp_path / "admin.sock"
    hx = start_haproxy(cfg, tmp_path / "haproxy", stats_socket=str(sock))
    auth = {"Authorization": f"Bearer {KEY_A}"}

    class Local:  # the admission host's shell, here
        def run(self, host, command, timeout=15):
            return subprocess.run(command.replace("/run/pdops-admission/admin.sock", str(sock)), shell=True,
                                  capture_output=True, text=True, check=True, timeout=timeout)

    def stats():
        return gateway_stats(Local(), "local")

    def send(n):
        return [http("POST", cfg.url + "/generate", {"text": "hi"}, timeout=30, headers=auth)[0] for _ in range(n)]

    def api(host, state):
        return Local().run("local", server_state_command(host, state)).stdout.strip()

    try:
        wait_until(lambda: stats()["gw1"].up, 15, "HAProxy to see the gateway UP")
        assert stats()[standby_server("gw1")].status == "MAINT"  # rendered disabled
        assert send(3) == [200] * 3 and standby.served == 0
        standby.start()
        assert api(standby_server("gw1"), "ready") == ""
        wait_until(lambda: stats()[standby_server("gw1")].up, 15, "HAProxy to see the stand-in UP")
        assert api("gw1", "drain") == ""
        before = gw.served
        gw.stop()  # the restart: its check keeps running and fails; the stand-in carries the requests
        assert send(6) == [200] * 6 and standby.served == 6 and gw.served == before
        wait_until(lambda: stats()["gw1"].status in ("DOWN", "DRAIN (DOWN)") or "DOWN" in stats()["gw1"].status,
                   20, "HAProxy's running check to see the stopped gateway")
        assert send(2) == [200] * 2
        gw.start()
        assert api("gw1", "ready") == ""
        wait_until(lambda: stats()["gw1"].up, 15, "the gateway UP again")
        assert api(standby_server("gw1"), "drain") == ""
        served = standby.served
        assert send(4) == [200] * 4 and standby.served == served  # the drained stand-in takes none
        assert api(standby_server("gw1"), "maint") == ""
        assert stats()[standby_server("gw1")].status == "MAINT"
    finally:
        hx.kill_all()
        for g in (gw, standby):
            if g.server is not None:
                try:
                    g.stop()
                except Exception:  # noqa: BLE001 - already stopped
                    pass


def test_two_admission_hosts_each_route_over_both_gateways_and_survive_one_gateway_gone(tmp_path):
    """The front door's pair (docs/gateway.md "The front door itself"): two HAProxy processes, one
    per admission host (here 127.0.0.1 and 127.0.0.2 on one machine), each with the cap and keys and
    both gateways behind it. Each answers on its own address and routes over both gateways; with one
    gateway stopped, both go on serving every request (a refused connection is tried on the other
    gateway). What the lab cannot show: keepalived moving the virtual address between them (one
    network namespace); its config is checked by keepalived's own parser in tests/unit."""
    import dataclasses

    from pdops.model.admission import gateway_server

    g1, g2 = _Gateway(free_port()), _Gateway(free_port())
    g1.start()
    g2.start()
    port = free_port()
    cfg = AdmissionConfig(host="adm1", listen_addr="127.0.0.1", port=port, cap=4, queue=4, queue_timeout_s=30,
                          overflow_status=429, api_keys_file="(test)",
                          gateways=(("gw1", "127.0.0.1", g1.port), ("gw2", "127.0.0.1", g2.port)), keys=(KEY_A,),
                          others=(("adm2", "127.0.0.2"),))
    other = dataclasses.replace(cfg, host="adm2", listen_addr="127.0.0.2", others=(("adm1", "127.0.0.1"),))
    assert cfg.hosts == ("adm1", "adm2") and other.url == f"http://127.0.0.2:{port}"
    auth = {"Authorization": f"Bearer {KEY_A}"}
    procs = []
    try:
        procs.append(start_haproxy(cfg, tmp_path / "a", stats_socket=str(tmp_path / "a.sock")))
        procs.append(start_haproxy(other, tmp_path / "b", stats_socket=str(tmp_path / "b.sock")))
        for sock in ("a.sock", "b.sock"):
            wait_until(lambda s=sock: all(_status_of(tmp_path / s, gateway_server(h)).startswith("UP")
                                          for h in ("gw1", "gw2")), 15, "both gateways UP in HAProxy")
        for url in (cfg.url, other.url):
            assert [http("POST", url + "/generate", {"text": "x"}, headers=auth, timeout=5)[0]
                    for _ in range(6)] == [200] * 6
        assert g1.served >= 2 and g2.served >= 2, (g1.served, g2.served)  # each HAProxy spreads over both
        g1.stop()
        before = g2.served
        for url in (cfg.url, other.url):
            assert [http("POST", url + "/generate", {"text": "x"}, headers=auth, timeout=10)[0]
                    for _ in range(4)] == [200] * 4
        assert g2.served - before == 8
    finally:
        for p in procs:
            p.kill_all()
        g2.stop()


def _status_of(sock, server: str) -> str:
    import subprocess

    from pdops.model.admission import runtime_command

    out = subprocess.run(runtime_command("show stat", str(sock)), shell=True, capture_output=True, text=True,
                         check=True).stdout
    lines = [ln for ln in out.splitlines() if ln.strip()]
    head = lines[0].lstrip("# ").split(",")
    px, sv = server.split("/")
    for ln in lines[1:]:
        row = dict(zip(head, ln.split(",")))
        if row.get("pxname") == px and row.get("svname") == sv:
            return row["status"]
    raise AssertionError(out)
