"""Drain and verified stop on the lab, with the real gateway and sim engines under systemd.

One 2p2d cluster: drain d02 with 20 long streams in flight, then p02 while KV transfers
from it are in flight (with a stray grandchild in its cgroup), then a verified stop of an
engine that ignores SIGTERM; refusals change nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from pdops.facts import requestlog
from pdops.remote.hosts import http_json
from pdops.model.inventory import load_inventory
from pdops.remote.loadgen import send
from pdops.model.placement import Placement
from pdops.sim.testing import wait_until
from tests.lab.clusters import REPO, deployed, inv_cmd, record, sshd

pytestmark = pytest.mark.lab

# Decode steps of 20 ms: a 150-token stream lasts about 3 s. KV paced at 20 MB/s with 1 KiB
# per prompt token: a 20,000-token prompt's transfer takes about 1 s.
PROFILE = {"env": {"PDOPS_SIM_SHUTDOWN_POLL_S": "1", "PDOPS_SIM_DECODE_STEP_MS": "20",
                   "PDOPS_SIM_KV_BANDWIDTH_GBPS": "0.02", "PDOPS_SIM_KV_BYTES_PER_TOKEN": "1024"}}


@pytest.fixture(scope="module")
def cluster(lab, tmp_path_factory):
    # round_robin: both decodes get both kinds of request (smg's default policy keeps prompts
    # that share a prefix on one worker, and the test's prompts all do)
    with deployed(lab, tmp_path_factory.mktemp("drain"), "2p2d", profile=PROFILE,
                  mutate=lambda d: d["all"]["vars"]["pdops_gateway"].update(policy="round_robin")) as c:
        yield c.inv_dir


def _placement(inv_dir) -> Placement:
    return Placement.from_dict(record(inv_dir).current_revision().placement)


def _running(url: str, key: str = "running") -> int:
    status, doc = http_json("GET", f"{url}/v1/loads?include=all", timeout=5)
    load = doc["loads"][0]
    if key == "running":
        return load["num_running_reqs"]
    return load["disaggregation"][key]


def _received_on(lab, inst) -> set[str]:
    host, unit = inst.units[0]
    c = lab.connection(host)
    try:
        out = c.run(requestlog.command(unit), hide=True, warn=True).stdout
    finally:
        c.close()
    return set(requestlog.parse(out).received)


def _drain(inv_dir, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "invoke", "drain", "-i", str(inv_dir), *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)


def test_refusals_change_nothing(cluster):
    before = record(cluster).current()
    proc = inv_cmd("drain", "-i", str(cluster), "--instance", "p07")
    assert proc.returncode == 2 and "no instance 'p07'" in proc.stderr and "p01, p02, d01, d02" in proc.stderr
    assert record(cluster).current() == before


def test_drain_decode_with_20_streams_in_flight(lab, cluster):
    inv = load_inventory(cluster)
    d02 = _placement(cluster).get("d02")
    results: list = []
    plain: list = []
    t = threading.Thread(target=lambda: results.extend(send(
        inv.gateway.first.url, requests=20, concurrency=20, max_new_tokens=150, stream_every=1, rid_prefix="drain-d")))
    # and non-streaming ones (stream_every=0): both kinds must survive the removal
    t2 = threading.Thread(target=lambda: plain.extend(send(
        inv.gateway.first.url, requests=10, concurrency=10, max_new_tokens=150, stream_every=0, rid_prefix="drain-n")))
    t.start()
    t2.start()
    wait_until(lambda: _running(d02.url) > 0, 30, "streams on d02", interval=0.05)
    in_flight_on_d02 = _running(d02.url)
    drain = _drain(cluster, "--instance", "d02", "--interval", "1")
    lines = []
    for line in drain.stdout:
        lines.append(line)
        if "left the gateway" in line:
            break
    # the gateway no longer routes to d02: requests sent now must all land on d01
    late = send(inv.gateway.first.url, requests=8, concurrency=8, max_new_tokens=4, stream_every=2, rid_prefix="after-removal")
    out = "".join(lines) + drain.stdout.read()
    assert drain.wait(timeout=300) == 0, out
    t.join(timeout=120)
    t2.join(timeout=120)
    assert len(results) == 20 and all(r.ok and r.completion_tokens == 150 for r in results), \
        [r.to_dict() for r in results if not r.ok]
    assert len(plain) == 10 and all(r.ok and not r.stream and r.completion_tokens == 150 for r in plain), \
        [r.to_dict() for r in plain if not r.ok]
    drained_rids = _received_on(lab, d02)
    # both kinds were really on d02 (10 plain requests over 2 decodes: all on d01 is 1 in 1024)
    assert any(r.rid in drained_rids for r in results), "no stream was on d02"
    assert any(r.rid in drained_rids for r in plain), "no non-streaming request was on d02"
    assert all(r.ok for r in late)
    assert not {r.rid for r in late} & _received_on(lab, d02), "a request reached d02 after its removal"
    assert in_flight_on_d02 > 0
    assert "verified: no open request ID and all queues 0, twice" in out
    assert "verified: cgroup empty, every recorded PID gone or reused, ports closed" in out
    assert "not verified: GPU processes: skipped: no nvidia-smi on this host" in out
    state = record(cluster)
    rev = state.current_revision()
    assert rev.topology == "2p1d" and "d02" not in rev.instances
    assert rev.extra["rollback"]["restore"] == "d02"
    status = json.loads(inv_cmd("status", "-i", str(cluster), "--json").stdout)
    assert [r["instance"] for r in status["instances"]] == ["p01", "p02", "d01"]
    assert all(r["healthy"] for r in status["instances"])


def test_drain_prefill_with_kv_transfers_in_flight_and_a_stray(lab, cluster):
    inv = load_inventory(cluster)
    p02 = _placement(cluster).get("p02")
    status, _ = http_json("POST", f"{p02.url}/_sim/faults", {"stray_grandchild": True}, timeout=5)
    assert status == 200
    prompt = " ".join(["tok"] * 20000)
    results: list = []
    t = threading.Thread(target=lambda: results.extend(send(
        inv.gateway.first.url, requests=6, concurrency=6, prompt=prompt, max_new_tokens=8, stream_every=2,
        rid_prefix="drain-p")))
    t.start()
    wait_until(lambda: _running(p02.url, "prefill_inflight_queue_reqs") + _running(p02.url) > 0, 30,
               "KV transfers from p02", interval=0.05)
    drain = _drain(cluster, "--instance", "p02", "--interval", "1")
    out, _ = drain.communicate(timeout=300)
    t.join(timeout=120)
    assert drain.returncode == 0, out
    assert len(results) == 6 and all(r.ok for r in results), [r.to_dict() for r in results if not r.ok]
    assert "sglang::stray" in out and "stopped with the cgroup" in out
    assert "prefix cache is lost" in out


def test_stop_of_an_engine_that_ignores_sigterm_needs_sigkill(lab, cluster):
    p01 = _placement(cluster).get("p01")
    status, _ = http_json("POST", f"{p01.url}/_sim/faults", {"ignore_sigterm": True}, timeout=5)
    assert status == 200
    t0 = time.monotonic()
    proc = inv_cmd("stop", "-i", str(cluster), "--instance", "p01", timeout=300)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stop_timeout = load_inventory(cluster).stop_timeout_s
    assert elapsed >= stop_timeout  # systemd waited TimeoutStopSec before its SIGKILL
    assert "did not exit on SIGTERM; systemd's SIGKILL after TimeoutStopSec emptied the cgroup" in proc.stdout
    assert "verified: needed systemd's SIGKILL after TimeoutStopSec" in proc.stdout
    assert "cgroup empty" in proc.stdout


def test_draining_the_last_decode_is_refused(cluster):
    before = record(cluster).current()
    proc = inv_cmd("drain", "-i", str(cluster), "--instance", "d01")
    assert proc.returncode == 4 and "last decode instance" in proc.stderr and "--force" in proc.stderr
    assert record(cluster).current() == before


def test_ssh_lost_mid_drain_gives_a_clear_verdict_and_the_drain_resumes(lab, cluster):
    d01 = _placement(cluster).get("d01")
    host = d01.units[0][0]
    state = record(cluster)
    before = state.current()
    drain = _drain(cluster, "--instance", "d01", "--force", "--interval", "8")
    lines = []
    try:
        for line in drain.stdout:
            lines.append(line)
            if "empty-check 1 passed" in line:
                sshd(lab, host, "stop")  # the SSH session of the drain dies with it
                break
        out = "".join(lines) + drain.stdout.read()
        rc = drain.wait(timeout=120)
    finally:
        sshd(lab, host, "start")
    assert rc == 3, out
    assert "d01 is NOT recorded as stopped" in out and "Re-run the same command to resume" in out
    assert state.current() == before
    verdicts = [r for r in state.journal().records() if r["step"] == "verdict"]
    assert verdicts[-1]["status"] == "interrupted" and verdicts[-1]["evidence"]["last_completed_step"] == "empty-check-1"
    # resumed: the worker is already out of the gateway, the rest runs and is verified
    again = inv_cmd("drain", "-i", str(cluster), "--instance", "d01", "--force", "--interval", "1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already removed" in again.stdout and "verified: cgroup empty" in again.stdout
    assert "d01" not in state.current_revision().instances
