"""Gateway client against the REAL gateway binary (smg 1.13) with stub workers.

The stub worker only answers what the gateway probes at registration (/health,
/server_info, /model_info); the real engine stand-in (pdops.sim) is tested elsewhere.
Every process started here is stopped by its PID in a finally.
"""

import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pdops.errors import InvalidInput, Unreachable, Unverified
from pdops.remote.gateway import GatewayClient, deadline_in
from pdops.sim.testing import poll

SMG = Path(sys.executable).parent / "smg"
pytestmark = pytest.mark.contract


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StubWorker:
    """A minimal worker on 127.0.0.1 that the gateway accepts; seen_auth records headers."""

    def __init__(self, mode):
        mode_ = mode

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                p = self.path.split("?")[0]
                bodies = {
                    "/health": b"",
                    "/server_info": json.dumps({"model_path": "m", "disaggregation_mode": mode_,
                                                "tp_size": 1, "dp_size": 1}).encode(),
                    "/model_info": json.dumps({"model_path": "m", "is_generation": True}).encode(),
                }
                body = bodies.get(p)
                if body is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    if not SMG.exists():
        pytest.fail(f"{SMG} missing: install the pinned smg into the venv (make env)")
    port, prom = free_port(), free_port()
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(SMG), "launch", "--pd-disaggregation", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), "--disable-retries",
             "--health-check-interval-secs", "1", "--worker-startup-check-interval", "1"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        client = GatewayClient(f"http://127.0.0.1:{port}", timeout=3, poll_interval=0.1)

        def healthy() -> bool:
            if proc.poll() is not None:
                pytest.fail("smg exited:\n" + log.read_text()[-3000:])
            try:
                client.health()
                return True
            except Unreachable:
                return False

        if not poll(healthy, 30):
            pytest.fail("smg did not come up:\n" + log.read_text()[-3000:])
        yield client
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_empty_gateway_health_and_not_ready(gateway):
    assert gateway.health() is True
    r = gateway.readiness()
    assert r["ready"] is False and "insufficient" in r.get("reason", "")


def test_add_healthy_then_remove_and_gone(gateway):
    decode, prefill = StubWorker("decode"), StubWorker("prefill")
    try:
        did = gateway.add_worker(decode.url, "decode")
        # the same URL again while smg still probes it (409 "in progress"): the same worker
        assert gateway.add_worker(decode.url, "decode") == did
        pid = gateway.add_worker(prefill.url, "prefill", bootstrap_port=8998)
        seen = []
        w = gateway.wait_worker_healthy(decode.url, deadline_in(20), progress=seen.append)
        assert w.id == did and w.worker_type == "decode" and w.is_healthy and w.status == "ready"
        p = gateway.wait_worker_healthy(prefill.url, deadline_in(20))
        assert p.id == pid and p.bootstrap_port == 8998
        assert {x.id for x in gateway.list_workers()} >= {did, pid}
        assert gateway.add_worker(decode.url, "decode") == did  # and once it is listed
        assert sum(x.url == decode.url for x in gateway.list_workers()) == 1
        assert gateway.get_worker(did).url == decode.url
        assert gateway.readiness()["ready"] is True

        gateway.remove_worker(did)
        # smg: out of routing at once (draining), gone after its settle time
        assert gateway.wait_worker_out(did, deadline_in(5)) == "draining"
        assert gateway.get_worker(did).status == "draining"
        gateway.wait_worker_gone(did, deadline_in(20))
        assert gateway.get_worker(did) is None
        assert did not in {x.id for x in gateway.list_workers()}
        gateway.remove_worker(pid)
        gateway.wait_worker_gone(pid, deadline_in(20))
    finally:
        decode.stop()
        prefill.stop()


def test_unreachable_worker_is_never_healthy(gateway):
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    wid = gateway.add_worker(dead_url, "decode")
    assert wid
    msgs = []
    with pytest.raises(Unverified, match="not healthy"):
        gateway.wait_worker_healthy(dead_url, deadline_in(2), progress=msgs.append)
    assert msgs and "not listed" in msgs[0]
    assert all(w.url != dead_url for w in gateway.list_workers())
    # queued, probed again and again: pending, not routed
    assert gateway.get_worker(wid).status == "pending"


def test_remove_unknown_worker_is_unverified_with_status(gateway):
    with pytest.raises(Unverified) as ei:
        gateway.remove_worker("00000000-0000-0000-0000-000000000000")
    assert "404" in ei.value.message and "not found" in ei.value.evidence


def test_bad_worker_type_is_refused_before_any_request(gateway):
    with pytest.raises(InvalidInput):
        gateway.add_worker("http://x:1", "both")


def test_unreachable_gateway():
    with pytest.raises(Unreachable):
        GatewayClient(f"http://127.0.0.1:{free_port()}", timeout=1).list_workers()


def test_api_key_read_from_file_sent_as_bearer_and_never_shown(tmp_path):
    seen = {}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            seen["auth"] = self.headers.get("Authorization")
            body = b"denied: bad key"
            self.send_response(401)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        keyfile = tmp_path / "key"
        keyfile.write_text("s3cret-key\n")
        c = GatewayClient(f"http://127.0.0.1:{srv.server_address[1]}", api_key_file=str(keyfile))
        with pytest.raises(Unverified) as ei:
            c.list_workers()
        assert seen["auth"] == "Bearer s3cret-key"
        assert "401" in ei.value.message and "s3cret" not in ei.value.render()
        assert "s3cret" not in repr(c)
    finally:
        srv.shutdown()
        srv.server_close()
    with pytest.raises(InvalidInput):
        GatewayClient("http://x", api_key_file=str(tmp_path / "missing"))
