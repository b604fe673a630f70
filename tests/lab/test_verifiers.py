"""Every verifier pdops claims, shown failing on the lab (issue: verifiers shown failing).

Each test makes the failure happen for real (a sim fault from docs/sim.md, or work sent
straight to an instance) and asserts that the operation does not call it verified, names
the evidence, and exits with the documented status:

- health gate: an instance that never turns healthy (`unhealthy_after=0`): deploy exit 7;
- canary: one prefill whose KV transfers fail (`fail_transfer`): deploy exit 7 naming exactly
  that pair, nothing registered;
- registration: an instance the gateway never sees healthy (`unhealthy_after=1`): exit 7,
  nothing left registered;
- the verdict: checks that were skipped are listed as not verified, never as verified;
- empty checks: work arriving between the two checks: drain exit 8, instance not stopped;
- stop: a process that left the unit's cgroup and holds the ports (`escape_cgroup`): drain
  exit 5 naming PID, command line, cgroup and ports; `inv stop --kill-survivors` ends exactly
  it and verifies; the drain then resumes (docs/runbooks/stop-survivors.md).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading

import pytest

from pdops.remote.gateway import GatewayClient
from pdops.remote.hosts import http_json
from pdops.model.inventory import load_inventory
from pdops.model.placement import Placement
from pdops.sim.testing import wait_until
from tests.lab.clusters import REPO, deployed, derived_inventory, inv_cmd, record, stop_all

pytestmark = pytest.mark.lab

PROFILE = {"env": {"PDOPS_SIM_SHUTDOWN_POLL_S": "1", "PDOPS_SIM_DECODE_STEP_MS": "20"}}


def _vars(**extra):
    def mutate(doc):
        doc["all"]["vars"].update(extra)
    return mutate


def _workers(inv_dir) -> list:
    gw = load_inventory(inv_dir).gateway.first
    return GatewayClient(gw.url).list_workers()


def _verdict_lines(out: str, kind: str) -> list[str]:
    return [ln.strip()[len(kind) + 2:] for ln in out.splitlines() if ln.strip().startswith(kind + ": ")]


@pytest.fixture(scope="module")
def fresh(lab, tmp_path_factory):
    lab.ensure_up()
    stop_all(lab)
    yield tmp_path_factory.mktemp("verifiers")
    stop_all(lab)


def test_health_gate_an_instance_that_never_turns_healthy(lab, fresh):
    inv = derived_inventory(lab, fresh / "never-healthy", profile=PROFILE,
                            mutate=_vars(pdops_sim_faults={"d01": "unhealthy_after=0"}, pdops_start_timeout_s=8))
    proc = inv_cmd("deploy", "--topology", "1p1d", "-i", str(inv))
    out = proc.stdout + proc.stderr
    workers = _workers(inv)
    stop_all(lab)
    assert proc.returncode == 7, out
    assert "d01 did not answer" in proc.stderr and "/health within 8s" in proc.stderr
    assert "p01" not in proc.stderr.split("did not start:")[1].splitlines()[0]  # only d01 is named
    assert "verdict: deployed" not in proc.stdout
    assert record(inv).current() is None
    assert workers == []  # nothing registered: the canary and registration never ran


def test_canary_names_exactly_the_pair_whose_transfer_fails_and_registers_nothing(lab, fresh):
    inv = derived_inventory(lab, fresh / "canary", profile=PROFILE,
                            mutate=_vars(pdops_sim_faults={"p02": "fail_transfer"}))
    proc = inv_cmd("deploy", "--topology", "2p1d", "-i", str(inv))
    out = proc.stdout + proc.stderr
    workers = _workers(inv)
    stop_all(lab)
    assert proc.returncode == 7, out
    assert "canary failed for p02 x d01" in proc.stderr
    assert "p01 x d01" not in proc.stderr  # the working pair is not blamed
    assert workers == []  # canaries run before registration: nothing unverified is registered
    state = record(inv)
    assert state.current() is None
    canary = [r for r in state.journal().records() if r["step"] == "canary"]
    assert canary and canary[-1]["status"] == "failed" and "p02 x d01" in canary[-1]["evidence"]["error"]
    assert not [r for r in state.journal().records() if r["step"] == "register"]


def test_registration_the_gateway_never_shows_healthy(lab, fresh):
    inv = derived_inventory(lab, fresh / "register", profile=PROFILE,
                            mutate=_vars(pdops_sim_faults={"d01": "unhealthy_after=1"}, pdops_register_timeout_s=8))
    proc = inv_cmd("deploy", "--topology", "1p1d", "-i", str(inv))
    out = proc.stdout + proc.stderr
    workers = _workers(inv)
    stop_all(lab)
    assert proc.returncode == 7, out
    assert "d01 not registered healthy" in proc.stderr
    assert "not healthy in the gateway by the deadline" in proc.stderr
    assert workers == [], [w.url for w in workers]  # p01 was registered, then removed: no revision describes it
    state = record(inv)
    assert state.current() is None
    undo = [r for r in state.journal().records() if r["step"] == "undo-register"]
    assert undo and any(x.startswith("p01") for x in undo[-1]["evidence"]["removed"])


# ---------------------------------------------------------------- one live 2p2d cluster

@pytest.fixture(scope="module")
def cluster(lab, fresh):
    with deployed(lab, fresh / "live", "2p2d", profile=PROFILE, args=("--skip-check", "disk")) as (inv, proc):
        yield inv, proc.stdout


def test_verdict_lists_skipped_checks_as_not_verified_never_as_verified(cluster):
    _, out = cluster
    verified, unverified = _verdict_lines(out, "verified"), _verdict_lines(out, "not verified")
    assert "preflight disk: skipped by the operator (--skip-check)" in unverified
    # the lab has no nvidia-smi: the GPU check did not run, so it is not verified
    assert any(u.startswith("preflight gpu: skipped on") and "nvidia-smi" in u for u in unverified), unverified
    assert not any("disk" in v or "nvidia" in v for v in verified), verified
    assert any(v.startswith("a canary generation through each of 4 prefill x decode pair(s)") for v in verified), verified
    assert not any("skipped" in v for v in verified), verified


def _placement(inv_dir) -> Placement:
    return Placement.from_dict(record(inv_dir).current_revision().placement)


def _direct_request(p, d, tokens: int) -> tuple:
    """A generation sent straight to one prefill and one decode (not through the gateway)."""
    rid = f"direct-{d.id}-{random.getrandbits(32):08x}"
    body = {"text": "direct work", "rid": rid, "stream": False,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
            "bootstrap_host": p.head.data_addr, "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": random.getrandbits(62)}
    out: dict = {}
    ts = [threading.Thread(target=lambda u=u, k=k: out.__setitem__(k, http_json("POST", f"{u}/generate", body,
                                                                                  timeout=60)))
          for k, u in (("prefill", p.url), ("decode", d.url))]
    for t in ts:
        t.start()
    return rid, ts, out


def test_empty_check_2_catches_work_that_arrived_after_check_1(lab, cluster):
    inv, _ = cluster
    pl = _placement(inv)
    p01, d02 = pl.get("p01"), pl.get("d02")
    state = record(inv)
    before = state.current()
    drain = subprocess.Popen([sys.executable, "-m", "invoke", "drain", "-i", str(inv), "--instance", "d02",
                              "--interval", "4"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, stdin=subprocess.DEVNULL)
    lines, threads = [], []
    for line in drain.stdout:
        lines.append(line)
        if "empty-check 1 passed" in line:
            _, threads, _ = _direct_request(p01, d02, 400)  # 400 x 20 ms: still running at check 2
            break
    out = "".join(lines) + drain.stdout.read()
    rc = drain.wait(timeout=120)
    for t in threads:
        t.join(timeout=60)
    assert rc == 8, out
    assert "empty check 2 (4s after check 1) found work" in out and "NOT stopped" in out
    assert state.current() == before
    units = [u for _, u in d02.units]
    c = lab.connection(d02.units[0][0])
    try:
        active = c.run(f"systemctl is-active {units[0]}", hide=True, warn=True).stdout.strip()
    finally:
        c.close()
    assert active == "active"  # not stopped
    assert d02.url not in [w.url for w in _workers(inv)]  # and still out of the gateway
    checks = [r for r in state.journal().records() if r["step"] == "empty-check-2"]
    assert checks[-1]["status"] == "failed" and checks[-1]["evidence"]["open_rids"]
    # the direct work is done: the same command resumes and finishes the drain
    again = inv_cmd("drain", "-i", str(inv), "--instance", "d02", "--interval", "1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "d02" not in state.current_revision().instances


def test_stop_with_an_escaped_process_holding_the_ports_is_not_verified_until_it_is_ended(lab, cluster):
    inv, _ = cluster
    p02 = _placement(inv).get("p02")
    state = record(inv)
    before = state.current()
    status, faults = http_json("POST", f"{p02.url}/_sim/faults", {"escape_cgroup": True}, timeout=5)
    assert status == 200 and faults["escape_cgroup"] is True
    _, sim = http_json("GET", f"{p02.url}/_sim/state", timeout=5)
    escaped = sim["strays"][-1]

    proc = inv_cmd("drain", "-i", str(inv), "--instance", "p02", "--interval", "1", timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 5, out
    assert "the stop is NOT verified" in proc.stderr
    survivor = [ln for ln in proc.stderr.splitlines() if f"survivor: PID {escaped} " in ln]
    assert survivor, proc.stderr
    assert "sglang::scheduler_escaped" in survivor[0] and "cgroup /pdops-sim-escaped" in survivor[0]
    assert str(p02.http_port) in survivor[0] and str(p02.bootstrap_port) in survivor[0]
    assert f"ports still listening: [{p02.http_port}, {p02.bootstrap_port}]" in proc.stderr
    assert "verdict: p02 drained" not in proc.stdout
    assert state.current() == before  # not recorded as drained
    assert p02.url not in [w.url for w in _workers(inv)]  # stays out of the gateway
    rec = [r for r in state.journal().records() if r["step"] == "verify-stop"][-1]
    assert rec["status"] == "failed" and [s["pid"] for s in rec["evidence"]["survivors"]] == [escaped]

    # the documented command ends exactly that process, by PID and start time, and verifies again
    dry = inv_cmd("stop", "-i", str(inv), "--instance", "p02", "--kill-survivors", "--dry-run")
    assert dry.returncode == 0 and f"SIGKILL PID {escaped} only if its start time" in dry.stdout, dry.stdout
    kill = inv_cmd("stop", "-i", str(inv), "--instance", "p02", "--kill-survivors")
    assert kill.returncode == 0, kill.stdout + kill.stderr
    assert f"PID {escaped}: killed" in kill.stdout
    assert "verified: every recorded PID gone or reused" in kill.stdout
    assert "not verified: GPU processes: skipped" in kill.stdout
    c = lab.connection(p02.units[0][0])
    try:
        ss = c.run("ss -Hltn", hide=True).stdout
    finally:
        c.close()
    addr = p02.head.data_addr  # lab hosts share one network namespace: look at p02's address
    assert f"{addr}:{p02.http_port} " not in ss and f"{addr}:{p02.bootstrap_port} " not in ss, ss
    # nothing left to kill: a second call is refused
    again = inv_cmd("stop", "-i", str(inv), "--instance", "p02", "--kill-survivors")
    assert again.returncode == 4 and "nothing to end" in again.stderr
    # and the drain resumes and records the new revision
    resumed = inv_cmd("drain", "-i", str(inv), "--instance", "p02", "--interval", "1")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "1 survivor(s) the last unverified stop recorded are gone now" in resumed.stdout
    rev = state.current_revision()
    assert "p02" not in rev.instances and rev.number != before
    status = json.loads(inv_cmd("status", "-i", str(inv), "--json").stdout)
    assert "p02" not in [r["instance"] for r in status["instances"]]
    assert all(r["healthy"] for r in status["instances"])


def test_start_is_not_verified_when_another_process_answers_on_the_instances_port(lab, cluster):
    """The start's health gate took any 200 at the instance's URL for the instance (found by the front-door
    soak: a rollback started d01 on the port p01 still held; p01's process answered d01's /health and its
    canary). Here a stray sim holds a decode's address and port while the decode's unit is down: the deploy of the
    live topology starts the unit (a repair would stop it first, and its verified stop names the stray on the
    port), which cannot bind, and the stray answers /health. The start is not verified: the deploy stops,
    naming the stray's PID and command line, and registers nothing. Once the stray is stopped (by its unit), and
    the decode's unit the failed start left restarting, the same command starts the decode and verifies it."""
    from tests.lab.clusters import host_run

    inv, _ = cluster
    d02 = [i for i in _placement(inv).instances if i.role == "decode"][-1]  # the earlier tests drained some
    host, unit = d02.units[0]
    stray = "pdops-stray-decode"  # a pdops-* name: stop_all ends it at the module's end whatever happens here
    host_run(lab, host, f"systemctl stop {unit}")
    host_run(lab, host, f"systemd-run --unit {stray} --setenv=PYTHONPATH={REPO} {REPO}/.venv/bin/python -m pdops.sim "
                        f"--model-path stray --host {d02.head.data_addr} --port {d02.http_port} "
                        "--disaggregation-mode decode")

    def stray_healthy() -> bool:
        try:
            return http_json("GET", f"{d02.url}/health", timeout=2)[0] == 200
        except Exception:  # noqa: BLE001 - not up yet
            return False
    wait_until(stray_healthy, 30, f"the stray sim answering on {d02.id}'s port")
    pid = int(host_run(lab, host, f"systemctl show -p MainPID --value {stray}").strip())
    topology = record(inv).current_revision().topology
    proc = inv_cmd("deploy", "--topology", topology, "-i", str(inv))
    out = proc.stdout + proc.stderr
    host_run(lab, host, f"systemctl stop {stray}")
    assert proc.returncode != 0, out
    assert f"{d02.id}: {d02.url}/health answered, but not from {unit}: port {d02.http_port} on {host} is held by " \
           f"PID {pid} (" in out, out
    assert "pdops.sim" in out and "--model-path stray" in out, out
    j = record(inv).journal()
    steps = {r["step"]: r["status"] for r in j.read(j.operations()[-1])}
    assert steps.get(f"start {d02.id}") == "failed" and f"register {d02.id}" not in steps, steps  # nothing registered
    # the failed start left the decode's unit restarting (Restart=on-failure): stopped here, so that the next
    # deploy starts it itself, not finds it started again by systemd once the port is free (a fresh run did)
    host_run(lab, host, f"systemctl stop {unit}")
    again = inv_cmd("deploy", "--topology", topology, "-i", str(inv))
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"port {d02.http_port} held by {unit} (PID" in again.stdout, again.stdout
