"""One lab cluster, two operators on "two laptops" (each its own PDOPS_OPERATOR and its own
operator dir, PDOPS_STATE_DIR, as two machines would have): the record and the lock live on the
state host (the gateway host, lab01), reached over SSH. Runbook: docs/runbooks/stale-lock.md."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from pdops.remote.gateway import GatewayClient
from pdops.model.inventory import load_inventory
from pdops.sim.testing import wait_until
from tests.lab.clusters import REPO, deployed, derived_inventory, inv_cmd, record, sshd

PROFILE = {"env": {"PDOPS_SIM_SHUTDOWN_POLL_S": "1"}}


@pytest.fixture(scope="module")
def cluster(lab, tmp_path_factory):
    root = tmp_path_factory.mktemp("shared")
    ops = {name: {"PDOPS_OPERATOR": name, "PDOPS_STATE_DIR": str(root / f"laptop-{name}")} for name in ("alice", "bob")}
    with deployed(lab, root / "inv", "2p2d", profile=PROFILE, env=ops["alice"]) as c:
        yield c.inv_dir, ops


def _drain(inv_dir, env, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "invoke", "drain", "-i", str(inv_dir), *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            env={**os.environ, **env})


def test_the_second_operator_sees_the_first_ones_revision_journal_and_who_did_it(cluster):
    inv_dir, ops = cluster
    h = inv_cmd("history", "--json", "-i", str(inv_dir), env=ops["bob"])
    assert h.returncode == 0, h.stderr
    (row,) = json.loads(h.stdout)
    assert (row["revision"], row["topology"], row["operator"], row["machine"]) == (
        1, "2p2d", "alice", socket.gethostname())
    j = inv_cmd("journal", "--json", "-i", str(inv_dir), env=ops["bob"])
    assert j.returncode == 0, j.stderr
    (op,) = json.loads(j.stdout)
    assert (op["operation"], op["operator"], op["verdict"]) == ("deploy", "alice", "ok")
    steps = inv_cmd("journal", "--op", op["op_id"], "-i", str(inv_dir), env=ops["bob"])
    assert "lock.held" in steps.stdout and " canary" in steps.stdout and " verdict" in steps.stdout
    s = inv_cmd("status", "-i", str(inv_dir), env=ops["bob"])
    assert s.returncode == 0 and "4/4 instances registered and healthy" in s.stdout, s.stdout + s.stderr
    assert "record: lab01:/var/lib/pdops/state/" in s.stdout


def test_concurrent_drains_from_two_machines_exactly_one_runs(cluster):
    inv_dir, ops = cluster
    a = _drain(inv_dir, ops["alice"], "--instance", "p02", "--force", "--interval", "3")
    b = _drain(inv_dir, ops["bob"], "--instance", "d01", "--force", "--interval", "3")
    (out_a, err_a), (out_b, err_b) = a.communicate(timeout=300), b.communicate(timeout=300)
    rcs = sorted([a.returncode, b.returncode])
    assert rcs == [0, 4], (out_a, err_a, out_b, err_b)
    winner, loser_err = ("alice", err_b) if a.returncode == 0 else ("bob", err_a)
    assert f"is locked by {winner} on {socket.gethostname()} running 'drain'" in loser_err, loser_err
    revs = record(inv_dir).history()
    assert [r.number for r in revs] == [1, 2] and revs[1].operator == winner


def test_a_holder_killed_mid_drain_frees_the_lock_and_the_next_operation_reports_it(cluster):
    inv_dir, ops = cluster
    before = record(inv_dir).current()
    earlier = set(record(inv_dir).journal().operations())
    alice = _drain(inv_dir, ops["alice"], "--instance", "d02", "--force", "--interval", "60")

    def alice_op():
        recs = record(inv_dir).journal().records()
        done = [r for r in recs if r["step"] == "empty-check-1" and r["status"] == "ok" and r["op_id"] not in earlier]
        return done[-1]["op_id"] if done else None

    op = wait_until(alice_op, 60, "alice's drain to pass its first empty check")
    alice.send_signal(signal.SIGKILL)  # her laptop dies mid-operation
    alice.wait(30)
    wait_until(lambda: not (record(inv_dir).lock_holder() or {}).get("holder_alive"), 30,
               "the lock process on lab01 to end with alice's SSH session")
    bob = inv_cmd("drain", "-i", str(inv_dir), "--instance", "d02", "--force", "--interval", "1", env=ops["bob"])
    assert bob.returncode == 0, bob.stdout + bob.stderr
    assert f"note: the previous operation {op} ('drain' by alice on {socket.gethostname()}" in bob.stdout
    assert "did not finish: its last journalled step is 'empty-check-1' (ok)" in bob.stdout
    assert "already removed" in bob.stdout  # resumed: alice's drain had taken d02 out of the gateway
    rows = {r["op_id"]: r for r in json.loads(inv_cmd("journal", "--json", "-i", str(inv_dir),
                                                      env=ops["alice"]).stdout)}
    assert rows[op]["verdict"].startswith("interrupted (found by drain-") and rows[op]["operator"] == "alice"
    assert record(inv_dir).current() == before + 1


def test_state_host_unreachable_refuses_with_exit_3_and_changes_nothing(lab, cluster):
    inv_dir, ops = cluster
    inv = load_inventory(inv_dir)
    rec = record(inv_dir)
    before, left = rec.current(), rec.current_revision()
    p01 = left.instances["p01"]
    gw = GatewayClient(inv.gateway.first.url, api_key_file=inv.gateway.api_key_file)
    workers_before = sorted(w.url for w in gw.list_workers())
    sshd(lab, "lab01", "stop")
    try:
        proc = inv_cmd("drain", "-i", str(inv_dir), "--instance", "p01", "--force", env=ops["bob"])
        st = inv_cmd("status", "-i", str(inv_dir), env=ops["bob"])
        hist = inv_cmd("history", "-i", str(inv_dir), env=ops["bob"])
    finally:
        sshd(lab, "lab01", "start")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.startswith("unreachable: the cluster's record is on lab01:/var/lib/pdops/state/"), proc.stderr
    assert "Nothing was changed" in proc.stderr and "plan:" not in proc.stdout
    assert hist.returncode == 0, hist.stdout + hist.stderr
    # status read what it could: lab01's systemd not at all (unknown, exit 1), the gateway's /workers yes
    assert st.returncode == 1, st.stdout + st.stderr
    assert "p01 unknown:" in st.stdout and "-> check SSH to lab01" in st.stdout
    assert "gateway unknown:" in st.stdout and "not registered" not in st.stdout
    for shown in (st, hist):
        assert "READ-ONLY CACHED COPY of the record" in shown.stdout
    assert f"revision {before}" in st.stdout
    # nothing changed: the record, the gateway's workers, p01's unit and its MainPID
    assert record(inv_dir).current() == before
    assert sorted(w.url for w in gw.list_workers()) == workers_before and p01["url"] in workers_before
    host, unit = p01["units"][0]
    c = lab.connection(host)
    try:
        pid = c.run(f"systemctl show -p MainPID --value {unit}", hide=True).stdout.strip()
    finally:
        c.close()
    assert pid == str(p01["main_pids"][f"{host}:{unit}"])


def test_the_state_dir_on_the_state_host_is_root_only(lab, cluster):
    inv_dir, _ = cluster
    d = load_inventory(inv_dir).state.dir
    c = lab.connection("lab01")
    try:
        out = c.run(f"find {d} -printf '%m %u %y %p\\n'", hide=True).stdout.split("\n")
    finally:
        c.close()
    rows = [ln.split(" ", 3) for ln in out if ln]
    assert rows and all(u == "root" for _, u, _, _ in rows)
    assert all(m == ("700" if y == "d" else "600") for m, _, y, _ in rows), rows


def test_a_record_kept_on_one_laptop_is_pushed_to_the_state_host_once(lab, tmp_path):
    """A cluster whose record is only in an operator machine's dir (as before the shared record):
    refused with the offer to push; pushed over SSH; then another machine reads it."""
    from pdops.record.local import StateDir

    lab.ensure_up()
    inv_dir = derived_inventory(lab, tmp_path / "inv")
    alice = {"PDOPS_OPERATOR": "alice", "PDOPS_STATE_DIR": str(tmp_path / "laptop-alice")}
    old = StateDir("lab", tmp_path / "laptop-alice")
    for n, topo in enumerate(("1p1d", "2p1d"), 1):
        r = old.write_revision(topology=topo, inventory_hash="h", placement={}, manifest={}, instances={},
                               outcome="deployed", op_id=f"deploy-old-{n}", operator="alice@laptop-a")
        doc = json.loads(old.revision_file(r.number).read_text())
        del doc["machine"]  # as an older pdops wrote it: `user@machine` in one field
        old.revision_file(r.number).write_text(json.dumps(doc))
        old.set_current(r.number)
        old.journal().step(f"deploy-old-{n}", "verdict", "ok", {"revision": r.number})
    refused = inv_cmd("history", "-i", str(inv_dir), env=alice)
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert "is only on this machine" in refused.stderr and "inv state.push" in refused.stderr
    pushed = inv_cmd("state.push", "-i", str(inv_dir), env=alice)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert "now holds revisions 1..2 (current 2) and 2 journal lines" in pushed.stdout
    assert old.revision_numbers() == []  # moved aside on the laptop, once read back equal
    bob = {"PDOPS_OPERATOR": "bob", "PDOPS_STATE_DIR": str(tmp_path / "laptop-bob")}
    h = inv_cmd("history", "--json", "-i", str(inv_dir), env=bob)
    assert h.returncode == 0, h.stderr
    assert [(r["revision"], r["topology"], r["operator"], r["machine"], r["current"]) for r in json.loads(h.stdout)] \
        == [(1, "1p1d", "alice", "laptop-a", ""), (2, "2p1d", "alice", "laptop-a", "*")]
    ops = {r["op_id"]: r for r in json.loads(inv_cmd("journal", "--json", "-i", str(inv_dir), env=bob).stdout)}
    assert ops["deploy-old-2"]["verdict"] == "ok"
    assert any(r["operation"] == "state-push" and r["operator"] == "alice" for r in ops.values())
