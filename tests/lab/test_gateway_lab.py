"""The gateway's life on the lab (smg under systemd, sim engines): it comes back by itself after a
crash with every worker and without a drained one, and `inv deploy` of the live topology repairs
from what the hosts and the gateway report. (A reboot of every host: the soak's `reboot` operation,
tests/lab/test_soak_lab.py, runbook hosts-rebooted.md.)

Runbook exercised: docs/runbooks/gateway-crashed.md.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from pdops.facts import requestlog
from pdops.remote.gateway import GatewayClient
from pdops.model.inventory import load_inventory
from pdops.remote.loadgen import send
from pdops.model.placement import Placement
from pdops.model.render import GATEWAY_UNIT
from pdops.sim.testing import wait_until
from tests.lab.clusters import deployed, host_run, inv_cmd, record, waited

pytestmark = pytest.mark.lab

# 20 ms decode steps: a 100-token stream lasts about 2 s, so streams are in flight at any instant.
PROFILE = {"env": {"PDOPS_SIM_SHUTDOWN_POLL_S": "1", "PDOPS_SIM_DECODE_STEP_MS": "20"}}


@pytest.fixture(scope="module")
def cluster(lab, tmp_path_factory):
    with deployed(lab, tmp_path_factory.mktemp("gateway"), "2p2d", profile=PROFILE) as c:
        yield c.inv_dir


def _state(inv_dir):
    return record(inv_dir)


def _placement(inv_dir) -> Placement:
    return Placement.from_dict(_state(inv_dir).current_revision().placement)


def _gateway_pid(lab, inv) -> int:
    return int(host_run(lab, inv.gateway.first.host, f"systemctl show -p MainPID --value {GATEWAY_UNIT}").strip())


def _routable_urls(client: GatewayClient) -> set[str]:
    try:
        return {w.url for w in client.list_workers() if w.routable}
    except Exception:  # noqa: BLE001 - down or restarting: nothing routable
        return set()


def _running(url: str) -> int:
    from pdops.remote.hosts import http_json

    try:
        return http_json("GET", f"{url}/v1/loads", timeout=2)[1]["loads"][0]["num_running_reqs"]
    except Exception:  # noqa: BLE001 - not answering: nothing counted
        return 0


def _received_counts(lab, inst) -> Counter:
    """How many times each request ID reached this instance (its request log, every invocation)."""
    host, unit = inst.units[0]
    out = host_run(lab, host, f"journalctl -u {unit} -o cat --no-pager")
    n: Counter = Counter()
    for line in out.splitlines():
        if '"request.received"' in line:
            n[json.loads(line[line.find("{"):])["rid"]] += 1
    return n


def _open_on_prefills(lab, pl, prefix: str) -> set[str]:
    """Request IDs starting with `prefix` that a prefill's current process holds open (its request log)."""
    from pdops.reads.orphans import open_command

    out: set[str] = set()
    for p in pl.role("prefill"):
        host, unit = p.units[0]
        log = requestlog.parse(host_run(lab, host, open_command(unit, 600)).partition("\n")[2])
        out |= {r for r in log.open if r.startswith(prefix)}
    return out


def test_gateway_sigkill_under_load_comes_back_with_every_worker_and_replays_nothing(lab, cluster):
    """Runbook "the gateway crashed": nobody types a command; the in-flight requests are lost, counted."""
    import threading

    inv = load_inventory(cluster)
    pl = _placement(cluster)
    client = GatewayClient(inv.gateway.first.url, timeout=2, poll_interval=0.1)
    urls = {i.url for i in pl.instances}
    assert _routable_urls(client) == urls
    rows: list = []
    t = threading.Thread(target=lambda: rows.extend(send(
        inv.gateway.first.url, duration=14, concurrency=6, max_new_tokens=100, stream_every=1, timeout=30,
        rid_prefix="gwkill")))
    t.start()  # rows arrive when the load ends: streams on the decodes say it is flowing
    wait_until(lambda: sum(_running(d.url) for d in pl.role("decode")) >= 4, 20, "streams running at the decodes")
    pid = _gateway_pid(lab, inv)
    killed_at = time.time()
    host_run(lab, inv.gateway.first.host, f"kill -KILL {pid}")  # by the unit's MainPID, as a crash would
    back_s = waited(lambda: _routable_urls(client) == urls, 60, "every worker routable again")
    t.join(timeout=60)
    new_pid = _gateway_pid(lab, inv)
    print(f"\ngateway SIGKILL -> every worker of revision routable again: {back_s:.1f}s "
          f"(MainPID {pid} -> {new_pid}, RestartSec=1, ExecStartPost re-registration)")
    assert new_pid != pid
    assert back_s < 30, f"the gateway took {back_s:.1f}s to serve every worker again"
    in_flight = [r for r in rows if r.start < killed_at and (r.end or 0) > killed_at]
    lost = [r for r in in_flight if not r.ok]
    assert in_flight and lost, "no request was in flight at the kill"
    assert all(r.status in ("error", "aborted", "timeout") or r.status.startswith("http_") for r in lost)
    recovered_at = killed_at + back_s
    after = [r for r in rows if r.start > recovered_at + 0.5]
    assert after and all(r.ok for r in after), [r.to_dict() for r in after if not r.ok][:3]
    print(f"requests: {len(rows)} sent, {len(in_flight)} in flight at the kill ({len(lost)} lost), "
          f"{sum(not r.ok for r in rows)} failed in all, {len(after)} after recovery all ok")
    # none replayed: every request ID reached each engine at most once
    for inst in pl.instances:
        counts = _received_counts(lab, inst)
        twice = {rid: n for rid, n in counts.items() if rid.startswith("gwkill") and n > 1}
        assert not twice, f"{inst.id} received these request IDs more than once: {twice}"
    # decided from observation: every worker is back, but the gateway is not the recorded process:
    # verify names it, one deploy ends the prefill halves it cut and records the new MainPID
    proc = inv_cmd("verify", "-i", str(cluster))
    assert proc.returncode == 5 and f"gateway {GATEWAY_UNIT} restarted: MainPID {new_pid}, recorded {pid}" \
        in proc.stderr, proc.stdout + proc.stderr
    proc = inv_cmd("deploy", "--topology", "2p2d", "-i", str(cluster))
    assert proc.returncode == 0 and "plan: repair revision" in proc.stdout and "end-orphans" in proc.stdout, \
        proc.stdout + proc.stderr
    assert _open_on_prefills(lab, pl, "gwkill") == set(), "a prefill still holds a half the gateway's crash cut"
    proc = inv_cmd("deploy", "--topology", "2p2d", "-i", str(cluster))
    assert proc.returncode == 0 and "no change" in proc.stdout and "observed:" in proc.stdout, proc.stdout
    proc = inv_cmd("verify", "-i", str(cluster))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_verify_fails_and_deploy_repairs_what_it_observes(lab, cluster):
    from pdops.sim.testing import start_sim

    inv = load_inventory(cluster)
    pl = _placement(cluster)
    state = _state(cluster)
    before = state.current()
    client = GatewayClient(inv.gateway.first.url, timeout=2, poll_interval=0.1)
    # a worker the revision does not know, routed to by the gateway: verify fails naming it
    stray = start_sim(["--disaggregation-mode", "decode"], {"PDOPS_SIM_SHUTDOWN_POLL_S": "0.2"})
    try:
        wid = client.add_worker(stray.url, "decode")
        client.wait_worker_healthy(stray.url, time.monotonic() + 20)
        proc = inv_cmd("verify", "-i", str(cluster))
        assert proc.returncode == 5 and f"{stray.url}" in proc.stderr and "does not know" in proc.stderr, \
            proc.stdout + proc.stderr
        client.remove_worker(wid)
        client.wait_worker_gone(wid, time.monotonic() + 20)
    finally:
        stray.stop()
    # d01's unit stopped by hand; p01's engine killed (systemd restarts it: a new MainPID)
    d01, p01 = pl.get("d01"), pl.get("p01")
    (dh, du), (ph, pu) = d01.units[0], p01.units[0]
    host_run(lab, dh, f"systemctl stop {du}")
    old = int(host_run(lab, ph, f"systemctl show -p MainPID --value {pu}").strip())
    host_run(lab, ph, f"kill -KILL {old}")

    def restarted():
        active = host_run(lab, ph, f"systemctl is-active {pu}").strip()
        pid = int(host_run(lab, ph, f"systemctl show -p MainPID --value {pu}").strip() or 0)
        return active == "active" and pid not in (0, old)

    wait_until(restarted, 30, "p01 restarted by systemd (Restart=on-failure)", interval=0.5)
    proc = inv_cmd("verify", "-i", str(cluster))
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert f"d01: unit {dh}:{du} inactive/dead" in proc.stderr
    assert f"p01: {ph}:{pu} MainPID" in proc.stderr and f"recorded {old}" in proc.stderr
    assert state.current() == before  # verify reads, never records
    plan = inv_cmd("deploy", "--topology", "2p2d", "-i", str(cluster), "--dry-run")
    assert plan.returncode == 0 and "plan: repair revision" in plan.stdout, plan.stdout + plan.stderr
    assert "start d01" in plan.stdout and "canary" in plan.stdout and "register d01" in plan.stdout
    assert "start p01" not in plan.stdout  # running (restarted): canaried, not started
    assert state.current() == before
    proc = inv_cmd("deploy", "--topology", "2p2d", "-i", str(cluster))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "repaired revision" in proc.stdout and f"d01: unit {dh}:{du} inactive/dead" in proc.stdout
    assert "canary ok through" in proc.stdout and "p01 x d01" in proc.stdout
    rev = state.current_revision()
    assert rev.number == before + 1 and rev.extra["repair_of"] == before and rev.topology == "2p2d"
    new = int(host_run(lab, ph, f"systemctl show -p MainPID --value {pu}").strip())
    assert rev.instances["p01"]["main_pids"] == {f"{ph}:{pu}": new}
    assert _routable_urls(client) == {i.url for i in pl.instances}
    proc = inv_cmd("verify", "-i", str(cluster))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_gateway_restarted_from_files_no_revision_recorded_gets_the_revisions_back_from_one_deploy(lab, cluster):
    """The gateway's files on its host changed by a change that recorded nothing (here: its launch script's
    health check interval and its env file's config id edited by hand, as a change interrupted after its
    delivery leaves them), then the gateway crashed and systemd started it from them. `inv status` names
    the gateway running other files than the revision's; the deploy of the live topology, which once
    left such a gateway as it was (restarting only gateways that were down), puts the revision's gateway
    files back and restarts it on them: `inv verify` 0, every worker routable."""
    from pdops.model.render import gateway_paths

    inv = load_inventory(cluster)
    pl = _placement(cluster)
    gw = inv.gateway.first.host
    _, _, script, env = gateway_paths()
    host_run(lab, gw, f"sed -i 's/--health-check-interval-secs [0-9]*/--health-check-interval-secs 7/' {script} && "
                      f"sed -i 's/^PDOPS_CONFIG=.*/PDOPS_CONFIG=unrecorded-change/' {env}")
    old = _gateway_pid(lab, inv)
    host_run(lab, gw, f"kill -KILL {old}")
    wait_until(lambda: _gateway_pid(lab, inv) not in (0, old), 30, "systemd to start the gateway again", interval=0.5)
    st = inv_cmd("status", "-i", str(cluster))
    assert st.returncode == 1 and "runs files unrecorded-change, the revision's are" in st.stdout, st.stdout + st.stderr
    proc = inv_cmd("deploy", "--topology", "2p2d", "-i", str(cluster))
    assert proc.returncode == 0 and "plan: repair revision" in proc.stdout, proc.stdout + proc.stderr
    assert "gateway-restart" in proc.stdout and "gateway restarted in" in proc.stdout, proc.stdout
    assert "unrecorded-change" not in host_run(lab, gw, f"cat {env}")
    assert "--health-check-interval-secs 7" not in host_run(lab, gw, f"cat {script}")
    client = GatewayClient(inv.gateway.first.url, timeout=2, poll_interval=0.1)
    assert _routable_urls(client) == {i.url for i in pl.instances}
    v = inv_cmd("verify", "-i", str(cluster))
    assert v.returncode == 0, v.stdout + v.stderr


def test_a_drained_instance_stays_out_after_a_gateway_restart(lab, cluster):
    inv = load_inventory(cluster)
    pl = _placement(cluster)
    client = GatewayClient(inv.gateway.first.url, timeout=2, poll_interval=0.1)
    proc = inv_cmd("drain", "-i", str(cluster), "--instance", "d02", "--interval", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    keep = {i.url for i in pl.instances if i.id != "d02"}
    host_run(lab, inv.gateway.first.host, f"systemctl restart {GATEWAY_UNIT}")
    wait_until(lambda: _routable_urls(client) == keep, 30, "the three kept workers routable")
    assert {w.url for w in client.list_workers()} == keep
    wl = json.loads(host_run(lab, inv.gateway.first.host, "cat /etc/pdops/gateway-workers.json"))
    assert sorted(w["instance"] for w in wl["workers"]) == ["d01", "p01", "p02"]
    # the start-up registration's own lines in the unit's journal (ExecStartPost), after the restart
    log = host_run(lab, inv.gateway.first.host, f"journalctl -u {GATEWAY_UNIT} -o cat --no-pager | grep '^pdops: '")
    last = log.split("nothing to register")[-1].rsplit("worker(s) queued or listed", 1)
    assert len(last) == 2 and last[0].rstrip().endswith("3 of 3"), log[-2000:]
    after_restart = log.strip().splitlines()[-4:]
    assert not any(pl.get("d02").url in ln for ln in after_restart), after_restart
    assert all(r.ok for r in send(inv.gateway.first.url, requests=6, concurrency=3, max_new_tokens=4, rid_prefix="kept"))
