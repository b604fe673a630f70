"""Deploy end to end on the lab: real systemd + sshd hosts, real Ansible and Fabric, the real
gateway binary, sim engines. Faults first (each on a fresh state dir), then the live cluster."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
import yaml

from tests.lab.clusters import deployed, derived_inventory, inv_cmd, record, stop_all

from pdops.remote import ansible
from pdops.remote.gateway import GatewayClient
from pdops.model.inventory import load_inventory
from pdops.remote.loadgen import send

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def fresh(lab, tmp_path_factory):
    lab.ensure_up()
    root = tmp_path_factory.mktemp("deploy")
    yield root
    stop_all(lab)


def test_unit_that_fails_to_start_stops_the_deploy_with_its_journal(lab, fresh):
    inv = derived_inventory(lab, fresh / "bad-unit", profile={"extra_args": ["--no-such-sglang-flag"]})
    proc = inv_cmd("deploy", "--topology", "1p1d", "-i", str(inv))
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert "deploy failed" in proc.stderr and "did not start" in proc.stderr
    assert "no-such-sglang-flag" in proc.stderr  # the journal tail is in the error
    assert "current revision unchanged: none" in proc.stderr
    state = record(inv)
    assert state.current() is None
    # nothing that was not verified was registered
    gw = load_inventory(inv).gateway.first
    assert GatewayClient(gw.url).list_workers() == []
    verdict = [r for r in state.journal().records() if r["step"] == "verdict"]
    assert verdict and verdict[-1]["status"] == "failed"


def test_unreachable_host_changes_nothing(lab, fresh):
    def move_lab02(doc):
        hv = doc["all"]["children"]["gpu_hosts"]["hosts"]["lab02"]
        hv["ansible_host"] = hv["pdops_data_addr"] = "127.0.10.201"
    inv = derived_inventory(lab, fresh / "unreachable", mutate=move_lab02)
    proc = inv_cmd("deploy", "--topology", "2p1d", "-i", str(inv))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "cannot reach lab02" in proc.stderr
    assert record(inv).current() is None
    assert "] render" not in proc.stdout and "] deliver" not in proc.stdout  # stopped before delivering anything


def test_gateway_port_taken_is_refused_then_unreachable_gateway_fails_named(lab, fresh):
    gw = load_inventory(lab.inventory).gateway.first
    stop_all(lab)
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind((gw.addr, gw.port))  # another process holds the gateway's port
    blocker.listen(1)
    try:
        inv = derived_inventory(lab, fresh / "gateway")
        refused = inv_cmd("deploy", "--topology", "1p1d", "-i", str(inv))
        # an operator who skips the port check meets a gateway that never answers
        forced = inv_cmd("deploy", "--topology", "1p1d", "-i", str(inv), "--skip-check", "ports")
    finally:
        blocker.close()
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert f"port 30000 (gateway) on {lab.address('lab01')} is taken" in refused.stderr and "no host was changed" in refused.stderr
    assert "] render" not in refused.stdout and "] deliver" not in refused.stdout
    assert forced.returncode == 7, forced.stdout + forced.stderr
    assert "gateway pdops-gateway.service on lab01 did not answer" in forced.stderr
    state = record(inv)
    assert state.current() is None
    pre = [r for r in state.journal().records() if r["step"] == "preflight"]
    assert pre and pre[-1]["evidence"]["skipped_by_operator"]["checks"] == ["ports"]


@pytest.fixture(scope="module")
def live(lab, fresh):
    with deployed(lab, fresh / "live", "2p1d") as (inv, proc):
        yield inv, proc


def test_deploy_2p1d_serves_200_requests_through_the_gateway(live):
    inv_dir, proc = live
    assert "verdict: deployed 2p1d as revision 1" in proc.stdout
    assert "canary ok through 2 prefill x decode pair(s)" in proc.stdout
    assert "verified: a canary generation through each of 2 prefill x decode pair(s): p01 x d01, p02 x d01" \
        in proc.stdout
    inv = load_inventory(inv_dir)
    rows = send(inv.gateway.first.url, requests=200, concurrency=16, max_new_tokens=8, stream_every=2)
    assert len(rows) == 200
    bad = [r.to_dict() for r in rows if not r.ok]
    assert not bad, bad[:3]
    assert sum(r.stream for r in rows) == 100
    assert all(r.completion_tokens == 8 for r in rows)


def test_status_shows_three_healthy_registered_instances(live):
    inv_dir, _ = live
    proc = inv_cmd("status", "-i", str(inv_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["revision"] == 1 and doc["topology"] == "2p1d"
    assert [r["instance"] for r in doc["instances"]] == ["p01", "p02", "d01"]
    for r in doc["instances"]:
        assert r["healthy"] and r["registered"] and r["worker_id"] == r["recorded_worker_id"]
        assert r["units"][0]["state"] == "active/running" and r["units"][0]["main_pid"]
        assert r["state"] == "ok" and r["action"] is None, r
    assert doc["gateways"][0]["unit_state"] == "active/running" and doc["gateways"][0]["workers"] == 3
    assert doc["gateways"][0]["state"] == "ok" and doc["ok"] is True
    text = inv_cmd("status", "-i", str(inv_dir)).stdout
    assert "3/3 instances registered and healthy; all ok" in text


def test_verify_passes_on_every_host_in_one_round_trip_each(live):
    inv_dir, _ = live
    proc = inv_cmd("verify", "-i", str(inv_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # units, cgroup, memlock, env-0600 and ports on each engine host, the gateway on its host; no
    # admission layer in the lab inventory, and the sandbox's memlock: skipped, each with its reason
    assert re.search(r"verify \S+: \d+ check\(s\) passed on \d+ host\(s\), \d+ skipped \(", proc.stdout), proc.stdout
    assert "admission: this revision renders no admission unit on this gateway host" in proc.stdout, proc.stdout
    assert "memlock: virtual hardware" in proc.stdout, proc.stdout


def test_redeploying_the_same_topology_is_a_noop(live):
    inv_dir, _ = live
    proc = inv_cmd("deploy", "--topology", "2p1d", "-i", str(inv_dir))
    assert proc.returncode == 0, proc.stderr
    # decided from what runs, not from the record: the verdict names what was observed
    assert "no change: revision 1 (2p1d) is live with identical rendered files; observed: 3 unit(s) of 3 " \
           "instance(s) active with their recorded MainPIDs, each process started from this revision's files, 3 " \
           "worker(s) healthy and ready" in proc.stdout, proc.stdout
    assert record(inv_dir).revision_numbers() == [1]


def test_a_different_topology_is_planned_as_a_change(live):
    inv_dir, _ = live
    proc = inv_cmd("deploy", "--topology", "1p1d", "-i", str(inv_dir), "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "from revision 1 (2p1d) to 1p1d" in proc.stdout and "removed: p02" in proc.stdout
    assert "drain p02: leave-gateway" in proc.stdout
    assert record(inv_dir).revision_numbers() == [1]  # a dry run changes nothing


def test_a_gateway_setting_change_is_planned_as_a_gateway_restart(live, tmp_path):
    inv_dir, _ = live
    doc = yaml.safe_load((inv_dir / "hosts.yml").read_text())
    doc["all"]["vars"]["pdops_gateway"]["health_check_interval_secs"] = 7
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "hosts.yml").write_text(yaml.safe_dump(doc))
    proc = inv_cmd("deploy", "--topology", "2p1d", "-i", str(changed), "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gateway: restarted after the instances" in proc.stdout and "pdops-gateway.sh" in proc.stdout
    assert "replaced:" not in proc.stdout  # the engines' files do not change
    assert "] connect" not in proc.stdout and record(inv_dir).revision_numbers() == [1]


def test_a_concurrent_operation_is_refused(lab, live, fresh):
    other = derived_inventory(lab, fresh / "concurrent")
    state = record(other)
    with state.lock("drain", operator="alice@laptop"):
        proc = inv_cmd("deploy", "--topology", "2p1d", "-i", str(other))
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "alice@laptop" in proc.stderr and "drain" in proc.stderr
    assert "] connect" not in proc.stdout  # refused before touching any host
    assert state.current() is None


def test_ansible_playbooks_are_idempotent(live):
    """prepare.yml and deploy.yml run again on the live cluster report no change."""
    from pdops.steps.actions import deliver
    from pdops.model.placement import Placement
    from pdops.model.render import render_files

    inv_dir, _ = live
    inv = load_inventory(inv_dir)
    state = record(inv_dir)
    rev = state.current_revision()
    pl = Placement.from_dict(rev.placement)
    files = render_files(inv, pl)
    said: list[str] = []
    ev = deliver(inv, pl, files, Path(rev.extra["build"]), None, said.append)
    assert ev["changed"] == 0, (ev, said)
    assert set(ev["hosts"]) == {"lab01", "lab02", "lab03"}
    # prepare.yml alone (as an operator runs it on a host), folders task included
    res = ansible.run_playbook(inv, "prepare.yml", {"pdops_engine_python": inv.engine_python},
                               ["lab01", "lab02", "lab03"])
    assert res.changed == 0 and set(res.recap) == {"lab01", "lab02", "lab03"}, res.output[-2000:]
    assert all(r.ok >= 1 for r in res.recap.values()), res.output[-2000:]  # the folder task ran
