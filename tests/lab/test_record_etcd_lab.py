"""The record on etcd (issue #36), on the lab: a three-member etcd on lab01-lab03 that pdops renders
and Ansible delivers (`inv state.etcd-up`), the record moved there from the SSH state host and back
(runbook docs/runbooks/record-to-etcd.md), and what its users must be able to trust of it: a drain
and a change with the record on etcd while a member is SIGKILLed; two operators from two machines
racing for the lock; a holder SIGKILLed, its lease expiring, the next change resuming; two members
down (changes refused, reads from the marked cache); a member's host rebooted (named by status, started
by one deploy); and the state host's record lost for good and
rebuilt from an operator's cache (runbook docs/runbooks/state-host-lost.md).

Two operator machines: alice and bob, each with its own PDOPS_OPERATOR and operator dir. The tests
run in this file's order, on one cluster (2p1d)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from pdops.model.inventory import load_inventory
from pdops.sim.testing import wait_until
from tests.lab.clusters import REPO, Load, deployed, inv_cmd, never_twice

pytestmark = pytest.mark.lab

MEMBERS = ["lab01", "lab02", "lab03"]
PROFILE = {"env": {"PDOPS_SIM_SHUTDOWN_POLL_S": "1", "PDOPS_SIM_STARTUP_S": "0"}}


@pytest.fixture(scope="module")
def cluster(lab, tmp_path_factory):
    root = tmp_path_factory.mktemp("etcd")
    ops = {n: {"PDOPS_OPERATOR": n, "PDOPS_STATE_DIR": str(root / f"laptop-{n}")} for n in ("alice", "bob")}

    def with_etcd(doc):  # a prefix of this cluster's own in the members' keyspace
        state = doc["all"]["vars"]["pdops_state"]
        state["etcd"] = {"members": MEMBERS, "prefix": "/pdops/" + state["dir"].rsplit("/", 1)[1] + "/"}

    with deployed(lab, root / "inv", "2p1d", profile=PROFILE, mutate=with_etcd, env=ops["alice"]) as c:
        yield c.inv_dir, ops


def run(inv_dir, env, *args, timeout=600):
    return inv_cmd(*args, "-i", str(inv_dir), env=env, timeout=timeout)


def ok(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def set_state(inv_dir, **kv):
    """Edit the inventory's pdops_state, as the runbooks say to."""
    path = inv_dir / "hosts.yml"
    doc = yaml.safe_load(path.read_text())
    doc["all"]["vars"]["pdops_state"].update(kv)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def record_of(inv_dir, who_dir):
    """The record as the operator machine with dir `who_dir` reads it now."""
    from pdops.record import SharedRecord, store_of

    inv = load_inventory(inv_dir)
    return SharedRecord(inv.cluster, who_dir, store_of(inv))


def member(lab, host: str, command: str) -> str:
    c = lab.connection(host)
    try:
        return c.run(command, hide=True).stdout.strip()
    finally:
        c.close()


def popen(inv_dir, env, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "invoke", *args, "-i", str(inv_dir)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env={**os.environ, **env})


def test_runbook_record_to_etcd_moves_the_record_and_every_command_names_its_store(cluster):
    """docs/runbooks/record-to-etcd.md, its commands in its order."""
    inv_dir, ops = cluster
    alice, bob = ops["alice"], ops["bob"]
    up = ok(run(inv_dir, alice, "state.etcd-up"))
    assert "verified: 3 members, one leader; a write read back through each" in up
    dry = ok(run(inv_dir, alice, "state.migrate", "--to", "etcd", "--dry-run"))
    assert "would copy 1 revisions (1 snapshots), current 1" in dry and "(now empty)" in dry
    out = ok(run(inv_dir, alice, "state.migrate", "--to", "etcd"))
    assert "verified: 1 revisions, 1 snapshots, current 1 and" in out and "with the source's sha256" in out
    # until the inventory says etcd, every command refuses the moved record, naming where it went
    moved = run(inv_dir, bob, "status")
    assert moved.returncode == 4 and "moved from lab01:" in moved.stderr and "backend: etcd" in moved.stderr
    set_state(inv_dir, backend="etcd")
    show = ok(run(inv_dir, bob, "state.show"))
    assert "record of lab: etcd http://" in show and "current: 1" in show
    status = ok(run(inv_dir, bob, "status"))
    assert "record: etcd http://" in status and "3/3 instances registered and healthy" in status
    hist = json.loads(ok(run(inv_dir, bob, "history", "--json")))
    assert [(r["revision"], r["topology"], r["operator"]) for r in hist] == [(1, "2p1d", "alice")]


def test_a_drain_under_load_completes_while_an_etcd_member_is_sigkilled(lab, cluster):
    """The member the drain's lock went through is SIGKILLed (by its unit's MainPID) mid-drain: the
    drain completes, no request is lost or replayed, and a second operator reads the same record."""
    inv_dir, ops = cluster
    url = load_inventory(inv_dir).gateway.first.url
    alice_rec = lambda: record_of(inv_dir, ops["alice"]["PDOPS_STATE_DIR"])  # noqa: E731
    before = set(o["op_id"] for o in json.loads(ok(run(inv_dir, ops["alice"], "journal", "--json"))))
    with Load(url, prefix="etcd-drain") as load:
        drain = popen(inv_dir, ops["alice"], "drain", "--instance", "p02", "--interval", "2")
        holder = wait_until(lambda: drain.poll() is not None or (alice_rec().lock_holder() or {}).get("etcd_endpoint"),
                            120, "the drain's lock")
        assert drain.poll() is None, drain.communicate()
        host = MEMBERS[[f"http://{lab.address(m)}:2379" for m in MEMBERS].index(holder)]
        pid = member(lab, host, "systemctl show -p MainPID --value pdops-etcd.service")
        member(lab, host, f"kill -9 {int(pid)}")  # the member the drain talks to, by its unit's MainPID
        out, err = drain.communicate(timeout=300)
    assert drain.returncode == 0, out + err
    load.assert_clean()
    never_twice(lab, inv_dir, "etcd-drain")
    wait_until(lambda: member(lab, host, "systemctl is-active pdops-etcd.service") == "active", 60,
               f"systemd to restart the member on {host}")
    mine = json.loads(ok(run(inv_dir, ops["alice"], "journal", "--json")))
    theirs = json.loads(ok(run(inv_dir, ops["bob"], "journal", "--json")))
    assert mine == theirs
    (op,) = [o for o in mine if o["op_id"] not in before]
    assert op["operation"] == "drain" and op["verdict"] == "ok"
    steps = ok(run(inv_dir, ops["bob"], "journal", "--op", op["op_id"]))
    assert " verdict" in steps and "lock.held" in steps
    assert record_of(inv_dir, ops["bob"]["PDOPS_STATE_DIR"]).current_revision().topology == "1p1d"


def test_two_operators_racing_for_the_lock_exactly_one_changes_the_cluster(cluster):
    """alice and bob each start `inv deploy --topology 2p1d` (p02 back) at once from their machines:
    one runs, the other is refused naming the holder (exit 4); one new revision."""
    inv_dir, ops = cluster
    before = record_of(inv_dir, ops["bob"]["PDOPS_STATE_DIR"]).current()
    a = popen(inv_dir, ops["alice"], "deploy", "--topology", "2p1d")
    b = popen(inv_dir, ops["bob"], "deploy", "--topology", "2p1d")
    (out_a, err_a), (out_b, err_b) = a.communicate(timeout=400), b.communicate(timeout=400)
    assert sorted([a.returncode, b.returncode]) == [0, 4], (out_a, err_a, out_b, err_b)
    winner, loser_err = ("alice", err_b) if a.returncode == 0 else ("bob", err_a)
    # refused at the lock while the winner held it, or (a slow start on a busy machine) after it,
    # because `current` moved since its plan: either way it changed nothing
    assert (f"is locked by {winner} on" in loser_err and "in etcd is alive" in loser_err) \
        or "`current` moved from revision" in loser_err, loser_err
    after = record_of(inv_dir, ops["alice"]["PDOPS_STATE_DIR"])
    assert after.current() == before + 1 and after.current_revision().operator == winner
    assert after.current_revision().topology == "2p1d"


def test_a_sigkilled_holders_lease_expires_and_the_next_change_resumes_its_drain(cluster):
    """alice's drain is SIGKILLed mid-way (her laptop dies): nothing releases the lock, so it is held
    until its lease runs out (30 s of silence); then bob's drain takes it, reports hers as interrupted
    and resumes."""
    inv_dir, ops = cluster
    bob_rec = lambda: record_of(inv_dir, ops["bob"]["PDOPS_STATE_DIR"])  # noqa: E731
    earlier = {o["op_id"] for o in json.loads(ok(run(inv_dir, ops["bob"], "journal", "--json")))}
    alice = popen(inv_dir, ops["alice"], "drain", "--instance", "p02", "--interval", "60")

    def passed_first_check():
        done = [r for r in bob_rec().journal().last_operations(1)
                if r["op_id"] not in earlier and r["step"] == "empty-check-1" and r["status"] == "ok"]
        return done[-1]["op_id"] if done else None

    op = wait_until(passed_first_check, 180, "alice's drain to pass its first empty check")
    alice.send_signal(signal.SIGKILL)
    alice.wait(30)
    killed = time.monotonic()
    refused = run(inv_dir, ops["bob"], "drain", "--instance", "p02", "--interval", "1")
    assert refused.returncode == 4 and "in etcd is alive" in refused.stderr, refused.stderr  # held until it expires
    wait_until(lambda: bob_rec().lock_holder()["holder_alive"] is False, 45, "alice's lease to expire")
    assert time.monotonic() - killed < 40
    out = ok(run(inv_dir, ops["bob"], "drain", "--instance", "p02", "--interval", "1"))
    assert f"note: the previous operation {op} ('drain' by alice on" in out
    assert "did not finish: its last journalled step is 'empty-check-1' (ok)" in out
    assert "already removed" in out  # resumed where hers stopped
    rows = {r["op_id"]: r for r in json.loads(ok(run(inv_dir, ops["alice"], "journal", "--json")))}
    assert rows[op]["verdict"].startswith("interrupted (found by drain-")


def test_two_members_down_refuse_changes_and_reads_come_from_the_marked_cache(lab, cluster):
    inv_dir, ops = cluster
    before = record_of(inv_dir, ops["alice"]["PDOPS_STATE_DIR"]).current()
    ok(run(inv_dir, ops["alice"], "status"))  # alice's cache is fresh
    for host in MEMBERS[1:]:
        member(lab, host, "systemctl stop pdops-etcd.service")
    try:
        change = run(inv_dir, ops["alice"], "deploy", "--topology", "2p1d")
        assert change.returncode == 3, change.stdout + change.stderr
        assert "etcd" in change.stderr and "Nothing was changed" in change.stderr
        status = run(inv_dir, ops["alice"], "status")
        assert "READ-ONLY CACHED COPY" in status.stdout + status.stderr, status.stdout + status.stderr
        hist = run(inv_dir, ops["alice"], "history")
        assert hist.returncode == 0 and "READ-ONLY CACHED COPY" in hist.stdout + hist.stderr
    finally:
        ok(run(inv_dir, ops["alice"], "state.etcd-up"))  # starts the stopped members, checks quorum
    assert record_of(inv_dir, ops["bob"]["PDOPS_STATE_DIR"]).current() == before


def test_a_members_host_rebooted_the_labs_way_is_named_by_status_and_one_deploy_starts_the_member(lab, cluster):
    """A member's host powered off and booted the lab's way (nothing pdops installed starts; on a real
    host the enabled unit would): the record holds on the two others. `inv status` names the member that
    does not run and the one command (exit 1); that `inv deploy` starts it with whatever else on the host
    is down, waits for one leader and a write read back through every member, and records the repair:
    `inv status` 0, the member active."""
    from pdops import lab as lab_api

    inv_dir, ops = cluster
    host = MEMBERS[-1]
    topology = record_of(inv_dir, ops["alice"]["PDOPS_STATE_DIR"]).current_revision().topology
    lab_api.down(lab.lab_dir, hosts=[int(host.removeprefix("lab"))])
    lab.ensure_up()
    st = run(inv_dir, ops["alice"], "status")
    assert st.returncode == 1, st.stdout + st.stderr
    assert (f"record store degraded: the record's etcd member on {host} is not running (pdops-etcd.service "
            "inactive/dead)") in st.stdout, st.stdout
    assert f"-> inv deploy --topology {topology} (starts it)" in st.stdout, st.stdout
    assert "record store" in st.stdout.splitlines()[-2], st.stdout
    out = ok(run(inv_dir, ops["alice"], "deploy", "--topology", topology))
    assert "plan: repair revision" in out and "etcd-members" in out and "etcd-quorum" in out, out
    assert "3 members, one leader; a write read back through each" in out, out
    assert member(lab, host, "systemctl is-active pdops-etcd.service") == "active"
    st = ok(run(inv_dir, ops["bob"], "status"))
    assert "all ok" in st and "record store" not in st, st


def test_runbook_record_to_etcd_and_back_to_the_state_host(cluster):
    """The runbook's way back: every revision and journal line returns to the state host."""
    inv_dir, ops = cluster
    n = record_of(inv_dir, ops["bob"]["PDOPS_STATE_DIR"]).current()
    out = ok(run(inv_dir, ops["bob"], "state.migrate", "--to", "host"))
    assert "set aside the earlier copy" in out and f"current {n}" in out
    set_state(inv_dir, backend="host")
    status = ok(run(inv_dir, ops["alice"], "status"))
    assert "record: lab01:/var/lib/pdops/state/" in status
    assert record_of(inv_dir, ops["alice"]["PDOPS_STATE_DIR"]).current() == n


def test_runbook_state_host_lost_rebuilds_the_record_from_an_operators_cache(lab, cluster):
    """docs/runbooks/state-host-lost.md: lab01's state dir is gone for good; the record moves to a new
    state host (lab02) and is rebuilt from bob's cache; `inv verify` shows the hosts run it."""
    inv_dir, ops = cluster
    bob = ops["bob"]
    ok(run(inv_dir, bob, "status"))  # bob's machine read the record last
    want = record_of(inv_dir, bob["PDOPS_STATE_DIR"])
    n, revs = want.current(), want.revision_numbers()
    member(lab, "lab01", f"rm -rf {load_inventory(inv_dir).state.dir}")  # the disk is lost
    set_state(inv_dir, host="lab02")
    show = ok(run(inv_dir, bob, "state.show"))
    assert "current: None" in show and "kept: it holds revisions" in show
    dry = ok(run(inv_dir, bob, "state.restore", "--from-cache", "--dry-run"))
    assert "cannot be restored: the journal" in dry
    out = ok(run(inv_dir, bob, "state.restore", "--from-cache"))
    assert "not restored: the journal" in out and f"current {n}" in out
    ok(run(inv_dir, bob, "verify"))
    hist = json.loads(ok(run(inv_dir, ops["alice"], "history", "--json")))
    assert [r["revision"] for r in hist] == revs
