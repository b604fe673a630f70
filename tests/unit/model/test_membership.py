"""The gateway's start-up worker list (pdops.model.membership): the host script run for real, here.

The command pdops sends over SSH runs in a local shell; `register` runs against the REAL smg
with pdops.sim engines, as the gateway unit's ExecStartPost does after every start.
"""

import json
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdops.model import membership, render
from pdops.remote.gateway import GatewayClient, deadline_in
from pdops.model.inventory import load_inventory
from pdops.model.placement import place
from pdops.sim.testing import free_port, start_gateway, start_sim
from pdops.model.topology import parse_topology

REPO = Path(__file__).resolve().parents[3]
FAST = {"PDOPS_SIM_SHUTDOWN_POLL_S": "0.2"}


class LocalPool:
    """Runs what pdops would send to the gateway host in a local shell, with the list moved to tmp."""

    def __init__(self, path):
        self.path, self.commands = str(path), []

    def run(self, host, command, timeout=60):
        command = command.replace(membership.PATH, self.path)
        self.commands.append((host, command))
        r = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout, check=True)
        return types.SimpleNamespace(stdout=r.stdout, stderr=r.stderr)


@pytest.fixture
def lab():
    inv = load_inventory(REPO / "inventory" / "lab")
    return inv, place(inv, parse_topology("2p2d"))


def test_update_adds_and_removes_atomically_and_concurrently(lab, tmp_path):
    inv, pl = lab
    pool = LocalPool(tmp_path / "gateway-workers.json")
    assert membership.read(pool, inv.gateway.first.host) is None
    p1, p2, d1, d2 = (pl.get(i) for i in ("p01", "p02", "d01", "d02"))
    with ThreadPoolExecutor(4) as ex:  # registrations run in parallel groups: none may be lost
        list(ex.map(lambda i: membership.update(pool, inv, add=[i]), [p1, p2, d1, d2]))
    doc = membership.read(pool, inv.gateway.first.host)
    assert membership.listed_ids(doc) == ["d01", "d02", "p01", "p02"]
    [e] = [w for w in doc["workers"] if w["instance"] == "p01"]
    assert e == {"instance": "p01", "url": p1.url, "worker_type": "prefill", "bootstrap_port": p1.bootstrap_port}
    assert "bootstrap_port" not in [w for w in doc["workers"] if w["instance"] == "d01"][0]
    doc = membership.update(pool, inv, remove=["p02"], revision=7)
    assert membership.listed_ids(doc) == ["d01", "d02", "p01"] and doc["revision"] == 7
    assert oct((tmp_path / "gateway-workers.json").stat().st_mode & 0o777) == "0o644"
    # a fresh deploy restarts the gateway with no workers: an old list must not register any
    assert membership.listed_ids(membership.update(pool, inv, clear=True)) == []
    assert all(h == inv.gateway.first.host for h, _ in pool.commands)
    assert not list(tmp_path.glob("*.tmp"))


def test_the_gateway_unit_registers_the_list_after_every_start(lab):
    inv, pl = lab
    files = {f.path: f for f in render.render_files(inv, pl) if f.host == inv.gateway.first.host}
    unit = files[f"{render.UNIT_DIR}/{render.GATEWAY_UNIT}"].content
    line = next(ln for ln in unit.splitlines() if ln.startswith("ExecStartPost="))
    assert line == ("ExecStartPost=-" + f"{inv.gateway.python} {membership.SCRIPT_PATH} register --file "
                    f"{membership.PATH} --gateway {inv.gateway.first.url} --wait-s 45")
    assert {"RestartSec=1", "StartLimitIntervalSec=60", "StartLimitBurst=10"} <= set(unit.splitlines())
    script = files[membership.SCRIPT_PATH]
    assert script.content == membership.SCRIPT and script.mode == 0o755
    # the gateway runs from its own environment: not the engine's (no torch, no SGLang there)
    launch = files[f"{render.BIN_DIR}/pdops-gateway.sh"].content
    assert f"exec {inv.gateway.python.removesuffix('python')}smg launch" in launch
    assert inv.gateway.python != inv.engine_python


def test_register_queues_the_listed_workers_and_smg_admits_a_late_engine(tmp_path):
    """What ExecStartPost does after a gateway (re)start: every listed worker back, none other;
    a worker whose engine is not up yet is queued and turns ready once it answers."""
    p = start_sim(["--disaggregation-mode", "prefill"], FAST)
    d = start_sim(["--disaggregation-mode", "decode"], FAST)
    drained = start_sim(["--disaggregation-mode", "decode"], FAST)
    late_port = free_port()
    late = None
    g = start_gateway([], [], ["--worker-startup-check-interval", "1"])
    try:
        doc = {"workers": [
            {"instance": "p01", "url": p.url, "worker_type": "prefill", "bootstrap_port": p.bootstrap_port},
            {"instance": "d01", "url": d.url, "worker_type": "decode"},
            {"instance": "d03", "url": f"http://127.0.0.1:{late_port}", "worker_type": "decode"}]}
        wl = tmp_path / "gateway-workers.json"
        wl.write_text(json.dumps(doc))
        r = subprocess.run([sys.executable, "-c", membership.SCRIPT, "register", "--file", str(wl),
                            "--gateway", g.url, "--wait-s", "10"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "3 of 3 worker(s) queued or listed" in r.stdout
        client = GatewayClient(g.url, timeout=3, poll_interval=0.1)
        client.wait_worker_healthy(p.url, deadline_in(20))
        client.wait_worker_healthy(d.url, deadline_in(20))
        assert drained.url not in {w.url for w in client.list_workers()}  # not listed: not registered
        late = start_sim(["--disaggregation-mode", "decode", "--port", str(late_port)], FAST)
        w = client.wait_worker_healthy(late.url, deadline_in(30))
        assert w.status == "ready"
        # run again (a second start of the unit): nothing is registered twice
        r = subprocess.run([sys.executable, "-c", membership.SCRIPT, "register", "--file", str(wl),
                            "--gateway", g.url], capture_output=True, text=True, timeout=60)
        assert r.stdout.count("already listed") == 3
        assert len(client.list_workers()) == 3
    finally:
        for h in (g, p, d, drained, late):
            if h:
                h.stop()


def test_register_without_a_list_or_a_gateway(tmp_path):
    r = subprocess.run([sys.executable, "-c", membership.SCRIPT, "register", "--file", str(tmp_path / "none.json"),
                        "--gateway", "http://127.0.0.1:1"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "nothing to register" in r.stdout
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps({"workers": [{"instance": "d01", "url": "http://127.0.0.1:2", "worker_type": "decode"}]}))
    r = subprocess.run([sys.executable, "-c", membership.SCRIPT, "register", "--file", str(wl),
                        "--gateway", f"http://127.0.0.1:{free_port()}", "--wait-s", "0.5"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "did not answer /health" in r.stderr
