"""The shared record and lock (pdops.record) with the real host script, its state host being
this machine (LocalTransport): what two operators on two machines see of one cluster. The same
script over SSH is exercised against lab hosts in tests/lab/test_shared_record.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pdops.errors import InvalidInput, PdopsError, Refused, Unreachable
from pdops.record import SCRIPT, HostStore, LocalTransport, SharedRecord, lock_line, operations, push_local, unlock
from pdops.record.local import StateDir
from pdops.sim.testing import wait_until

REPO = Path(__file__).resolve().parents[3]


def rec(tmp_path, who: str, **kw) -> SharedRecord:
    """The record as operator `who` reads it: its own operator dir, the one shared state dir."""
    return SharedRecord("lab", tmp_path / who, HostStore("lab", "localhost", str(tmp_path / "shared"), LocalTransport()), **kw)


def deploy(r: SharedRecord, topology="1p1d", op="deploy") -> int:
    with r.lock(op, say=lambda s: None) as lk:
        rev = r.write_revision(topology=topology, inventory_hash="h", placement={}, manifest={}, instances={},
                               outcome="deployed", op_id=lk.op_id)
        r.set_current(rev.number)
        r.journal().step(lk.op_id, "verdict", "ok", {"revision": rev.number})
    return rev.number


def test_a_second_operator_sees_the_first_ones_revision_journal_operator_and_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("PDOPS_OPERATOR", "alice")
    n = deploy(rec(tmp_path, "alice"))
    monkeypatch.setenv("PDOPS_OPERATOR", "bob")
    bob = rec(tmp_path, "bob")
    assert bob.current() == n == 1
    (r,) = bob.history()
    assert (r.topology, r.operator, r.machine) == ("1p1d", "alice", os.uname().nodename)
    ops = operations(bob.journal())
    assert [(o["operation"], o["operator"], o["verdict"]) for o in ops] == [("deploy", "alice", "ok")]


def test_two_operators_at_once_exactly_one_holds_the_lock_the_other_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PDOPS_OPERATOR", "alice")
    alice = rec(tmp_path, "alice")
    with alice.lock("drain", say=lambda s: None):
        monkeypatch.setenv("PDOPS_OPERATOR", "bob")
        with pytest.raises(Refused) as e:
            rec(tmp_path, "bob").lock("scale").acquire()
        assert e.value.exit_code == 4
        assert "locked by alice on" in e.value.message and "'drain'" in e.value.message
        assert "alive" in e.value.message
    assert alice.lock_holder() is None  # what alice's own record says after her release, as a fresh read does
    assert rec(tmp_path, "carol").lock_holder() is None
    # freed on release: bob gets it now
    deploy(rec(tmp_path, "bob"))


def test_a_contender_between_the_holders_flock_and_its_record_still_names_the_holder(tmp_path, monkeypatch):
    """The holder takes the flock, then writes who it is. A contender arriving in between used to
    be refused naming nobody ('locked by None'): it now waits (bounded) for the holder's record."""
    import fcntl
    import importlib.util
    import threading

    deploy(rec(tmp_path, "alice"))  # the shared dir and its format file exist
    spec = importlib.util.spec_from_file_location("record_hostscript", REPO / "pdops" / "hostscripts" / "record.py")
    hs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hs)
    shared = tmp_path / "shared"
    fd = os.open(shared / "lock.flock", os.O_WRONLY | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken: the record is not written yet
    holder = {"operator": "alice", "machine": "m1", "operation": "drain", "op_id": "drain-x", "taken": "now",
              "state_pid": os.getpid(), "state_start": hs.proc_start(os.getpid()), "boot_id": hs.boot_id()}
    writer = threading.Timer(0.5, lambda: hs.atomic_write(str(shared / "lock"), json.dumps(holder)))
    writer.start()
    try:
        monkeypatch.setenv("PDOPS_OPERATOR", "bob")
        with pytest.raises(Refused) as e:
            rec(tmp_path, "bob").lock("scale").acquire()
    finally:
        writer.join()
        os.close(fd)
    assert "locked by alice on m1" in e.value.message and "'drain'" in e.value.message, e.value.message


def test_no_write_outside_the_lock(tmp_path):
    r = rec(tmp_path, "alice")
    with pytest.raises(PdopsError, match="outside the cluster lock"):
        r.journal().step("op", "x", "ok")
    with pytest.raises(PdopsError, match="outside the cluster lock"):
        r.write_revision(topology="1p1d", inventory_hash="h", placement={}, manifest={}, instances={})
    assert not (tmp_path / "shared" / "journal.jsonl").exists()


def test_a_plan_made_before_another_operation_is_refused_under_the_lock(tmp_path):
    alice, bob = rec(tmp_path, "alice"), rec(tmp_path, "bob")
    planned = bob.current()  # bob plans from "nothing deployed"
    deploy(alice)
    with bob.lock("deploy", say=lambda s: None):
        with pytest.raises(Refused, match="moved from revision None to 1"):
            bob.check_basis(planned)


HOLDER = """
import sys, time
from pdops.record import HostStore, LocalTransport, SharedRecord
r = SharedRecord("lab", sys.argv[1], HostStore("lab", "localhost", sys.argv[2], LocalTransport()))
lk = r.lock("drain", say=lambda s: None).acquire()
r.journal().step(lk.op_id, "wait-empty", "running", {"instance": "d02"})
print(lk.op_id, flush=True)
time.sleep(600)
"""


def _wait_pid_gone(pid: int, timeout: float = 30.0) -> None:
    wait_until(lambda: not os.path.exists(f"/proc/{pid}"), timeout, f"holder process {pid} gone", interval=0.05)


def test_sigkill_of_the_holder_frees_the_lock_and_the_next_operation_reports_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PDOPS_OPERATOR", "alice")
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "alice"), str(tmp_path / "shared")],
                         stdout=subprocess.PIPE, text=True, cwd=REPO)
    op = p.stdout.readline().strip()
    lock = json.loads((tmp_path / "shared" / "lock").read_text())
    p.kill()  # the operator's process dies mid-operation
    p.wait(10)
    _wait_pid_gone(lock["state_pid"])  # its lock process on the state host saw its input end
    monkeypatch.setenv("PDOPS_OPERATOR", "bob")
    left = unlock(rec(tmp_path, "bob"), force=False, reason=None)  # nothing to force: shown, exit 0
    assert not left["locked"] and "left by alice" in left["message"] and op in left["message"]
    assert lock_line(rec(tmp_path, "bob").lock_holder()).startswith("lock: free; left by alice")
    said: list[str] = []
    bob = rec(tmp_path, "bob")
    with bob.lock("drain", say=said.append) as lk:
        assert lk.interrupted["op_id"] == op
    assert len(said) == 1 and op in said[0] and "alice" in said[0] and "'wait-empty' (running)" in said[0]
    rows = {o["op_id"]: o for o in operations(bob.journal())}
    assert rows[op]["verdict"].startswith("interrupted") and rows[op]["operator"] == "alice"


def test_a_silent_holder_loses_the_lock_after_its_lease(tmp_path):
    d = tmp_path / "shared"
    p = subprocess.Popen(["python3", "-c", SCRIPT, "hold", "--dir", str(d), "--cluster", "lab", "--holder",
                          json.dumps({"operator": "alice", "op_id": "drain-1"}), "--lease", "0.5"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert json.loads(p.stdout.readline())["ok"]
    assert p.wait(30) == 0  # nothing said for 0.5 s: it gives up by itself (stdin still open)
    p.stdin.close()
    recs = [json.loads(x) for x in (d / "journal.jsonl").read_text().splitlines()]
    assert [(r["op_id"], r["step"]) for r in recs] == [("drain-1", "lock.lease-expired")]
    deploy(rec(tmp_path, "bob"))  # free again


def test_unlock_shows_the_holder_and_force_takes_it_over_journalled(tmp_path, monkeypatch):
    monkeypatch.setenv("PDOPS_OPERATOR", "alice")
    alice = rec(tmp_path, "alice")
    lk = alice.lock("drain", say=lambda s: None).acquire()
    monkeypatch.setenv("PDOPS_OPERATOR", "bob")
    with pytest.raises(Refused, match="locked by alice") as e:
        unlock(rec(tmp_path, "bob"), force=False, reason=None)
    assert '"state_pid"' in e.value.evidence
    with pytest.raises(InvalidInput, match="--reason"):
        unlock(rec(tmp_path, "bob"), force=True, reason=" ")
    res = unlock(rec(tmp_path, "bob"), force=True, reason="alice's laptop died mid-drain")
    assert res["ended"] and "took the lock of cluster 'lab' over from alice" in res["message"]
    with pytest.raises(Unreachable, match="lost the cluster lock"):  # alice's next write
        alice.journal().step(lk.op_id, "stop", "ok")
    lk.release()
    recs = rec(tmp_path, "bob").journal().records()
    forced = [r for r in recs if r["step"] == "lock.unlock-forced"]
    assert len(forced) == 1 and forced[0]["evidence"]["reason"] == "alice's laptop died mid-drain"
    assert forced[0]["evidence"]["by"]["operator"] == "bob"
    assert forced[0]["evidence"]["previous_holder"]["operator"] == "alice"
    assert not any(r["step"] == "stop" for r in recs)
    deploy(rec(tmp_path, "bob"))


def test_the_state_dir_and_its_files_are_root_only(tmp_path):
    deploy(rec(tmp_path, "alice"))
    d = tmp_path / "shared"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for p in d.rglob("*"):
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))
    cache = tmp_path / "alice" / "cache"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE((cache / "record.json").stat().st_mode) == 0o600


def test_a_world_writable_state_dir_is_refused_and_nothing_written(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(InvalidInput, match="writable by others") as e:
        rec(tmp_path, "alice").lock("deploy").acquire()
    assert e.value.exit_code == 2
    assert list(d.iterdir()) == []


def test_a_record_of_a_newer_pdops_or_another_cluster_is_refused(tmp_path):
    d = tmp_path / "shared"
    d.mkdir(mode=0o700)
    (d / "format.json").write_text(json.dumps({"format": 2, "cluster": "lab"}))
    with pytest.raises(Refused, match="written by a newer pdops"):
        rec(tmp_path, "alice").current()
    with pytest.raises(Refused, match="written by a newer pdops"):
        rec(tmp_path, "alice").lock("deploy").acquire()
    assert sorted(p.name for p in d.iterdir()) == ["format.json"]
    (d / "format.json").write_text(json.dumps({"format": 1, "cluster": "prod-a"}))
    with pytest.raises(InvalidInput, match="cluster 'prod-a'"):
        rec(tmp_path, "alice").current()


class Down(LocalTransport):
    def call(self, args, timeout=60):
        raise Unreachable("localhost cannot be reached over SSH: [Errno 111] Connection refused")

    def open_session(self, args):
        raise Unreachable("localhost cannot be reached over SSH: [Errno 111] Connection refused")


def test_state_host_unreachable_changes_refused_reads_from_the_marked_cache(tmp_path):
    deploy(rec(tmp_path, "alice"))
    assert rec(tmp_path, "alice").current() == 1  # a read: the cache now holds revision 1
    down = SharedRecord("lab", tmp_path / "alice", HostStore("lab", "localhost", str(tmp_path / "shared"), Down()))
    with pytest.raises(Unreachable, match="cannot be reached") as e:
        down.current()
    assert e.value.exit_code == 3 and "no change runs from this machine's cached copy" in e.value.fix
    cached = SharedRecord("lab", tmp_path / "alice", HostStore("lab", "localhost", str(tmp_path / "shared"), Down()), cached_ok=True)
    assert cached.current() == 1 and "READ-ONLY CACHED COPY" in cached.cache_banner()
    assert "the state host localhost cannot be reached" in cached.cache_banner()
    assert cached.cache_banner().endswith("-> bring the state host localhost back"), cached.cache_banner()
    with pytest.raises(Unreachable, match="no change runs from the cached copy"):
        cached.lock("drain").acquire()
    nobody = SharedRecord("lab", tmp_path / "bob", HostStore("lab", "localhost", str(tmp_path / "shared"), Down()), cached_ok=True)
    with pytest.raises(Unreachable, match="no cached copy"):
        nobody.current()


def _legacy(tmp_path, who="alice", topologies=("1p1d", "2p1d")) -> StateDir:
    """A record from before the shared one: in the operator machine's own dir."""
    local = StateDir("lab", tmp_path / who)
    for t in topologies:
        r = local.write_revision(topology=t, inventory_hash="h", placement={}, manifest={}, instances={},
                                 outcome="deployed", op_id=f"deploy-{t}", operator="alice@laptop-a")
        local.set_current(r.number)
        local.journal().step(f"deploy-{t}", "verdict", "ok", {})
    return local


def test_a_record_only_on_this_machine_is_refused_until_pushed_then_moved(tmp_path):
    _legacy(tmp_path)
    with pytest.raises(Refused, match="only on this machine") as e:
        rec(tmp_path, "alice").current()
    assert "inv state.push" in e.value.fix and "2p1d" in e.value.evidence
    assert not (tmp_path / "shared").exists()  # a read creates nothing
    dry = push_local(rec(tmp_path, "alice"), dry_run=True)
    assert dry["message"].startswith("would copy revisions 1..2 (current 2) and 2 journal lines")
    assert not (tmp_path / "shared").exists() and StateDir("lab", tmp_path / "alice").revision_numbers() == [1, 2]
    res = push_local(rec(tmp_path, "alice"), say=lambda s: None)
    assert res["pushed"] == 2 and res["journal_lines"] == 2 and res["current"] == 2
    assert "revisions 1..2 (current 2) and 2 journal lines" in res["message"]
    r = rec(tmp_path, "alice")
    assert r.current() == 2 and [x.topology for x in r.history()] == ["1p1d", "2p1d"]
    assert StateDir("lab", tmp_path / "alice").revision_numbers() == []  # moved aside
    assert (Path(res["moved_aside_to"]) / "revisions" / "0002" / "revision.json").is_file()
    steps = [x["step"] for x in r.journal().records()]
    assert steps.count("verdict") == 2 and "state.push" in steps
    assert push_local(rec(tmp_path, "alice"))["pushed"] == 0


def test_two_records_that_disagree_are_both_shown_and_nothing_is_guessed(tmp_path):
    deploy(rec(tmp_path, "bob"), "3p1d")  # the shared record: bob's 3p1d
    _legacy(tmp_path)  # alice's laptop: 1p1d, 2p1d
    with pytest.raises(Refused, match="disagree") as e:
        rec(tmp_path, "alice").current()
    assert "3p1d" in e.value.evidence and "2p1d" in e.value.evidence
    with pytest.raises(Refused, match="differ"):
        push_local(rec(tmp_path, "alice"), dry_run=True)
    with pytest.raises(Refused, match="differ") as e:
        push_local(rec(tmp_path, "alice"), say=lambda s: None)
    assert "3p1d" in e.value.evidence and "2p1d" in e.value.evidence
    assert [x.topology for x in rec(tmp_path, "bob").history()] == ["3p1d"]  # nothing touched
    assert StateDir("lab", tmp_path / "alice").revision_numbers() == [1, 2]


@pytest.mark.parametrize("args,expect", [
    (["unlock", "--force"], "--reason: missing"),
    (["unlock", "--force", "--reason", "  "], "--reason: missing"),
    (["journal", "--last", "0"], "--last: '0' is not a positive number"),
])
def test_operator_mistakes_on_the_record_commands_contact_no_host(args, expect, tmp_path):
    """Against an inventory whose hosts do not exist: exit 2 with the field, never 3 (unreachable)."""
    proc = subprocess.run([sys.executable, "-m", "invoke", *args, "-i", str(REPO / "inventory" / "rtx6000d")],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PDOPS_STATE_DIR": str(tmp_path)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("invalid input: ") and expect in proc.stderr
