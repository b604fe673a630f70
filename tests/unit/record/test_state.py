"""State: revisions and the current pointer, the journal, the cluster lock."""

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading

import pytest

from pdops.record import local as st
from pdops.errors import InvalidInput, Refused
from pdops.facts import procs


def make_rev(sd, topo="2p1d", **kw):
    return sd.write_revision(
        topology=topo, inventory_hash="sha256:ab", placement={"p01": {"host": "h1", "gpus": [0, 1]}},
        manifest={"/etc/systemd/system/pdops-p01.service": "0" * 64},
        instances={"p01": {"hosts": ["h1"], "units": ["pdops-p01.service"], "worker_ids": ["w-1"]}},
        operator="oncall@laptop", **kw)


def test_default_dir_from_env_then_var_lib(monkeypatch, tmp_path):
    monkeypatch.setenv("PDOPS_STATE_DIR", str(tmp_path / "x"))
    assert st.StateDir("prod").path == tmp_path / "x"
    monkeypatch.delenv("PDOPS_STATE_DIR")
    assert str(st.StateDir("prod").path) == "/var/lib/pdops-operator/prod"
    with pytest.raises(InvalidInput):
        st.StateDir("../etc")


def test_revisions_numbered_and_current_moves_only_explicitly(tmp_path):
    sd = st.StateDir("lab", tmp_path)
    assert sd.current() is None and sd.history() == []
    r1 = make_rev(sd)
    assert r1.number == 1 and (tmp_path / "revisions/0001/revision.json").is_file()
    assert sd.current() is None  # writing a revision does not move current
    sd.set_current(1)
    r2 = make_rev(sd, topo="3p1d")
    assert r2.number == 2 and sd.current() == 1
    sd.set_current(2)
    assert sd.current_revision().topology == "3p1d"
    assert [r.topology for r in sd.history()] == ["2p1d", "3p1d"]
    got = sd.read_revision(1)
    assert got.instances["p01"]["worker_ids"] == ["w-1"] and got.operator == "oncall@laptop"
    assert got.manifest and got.placement["p01"]["gpus"] == [0, 1] and got.created
    with pytest.raises(InvalidInput):
        sd.set_current(7)


def test_outcome_and_previous_for_rollback(tmp_path):
    sd = st.StateDir("lab", tmp_path)
    make_rev(sd, outcome="deployed")
    make_rev(sd, outcome="failed")
    make_rev(sd)
    sd.set_outcome(3, "deployed")
    sd.set_current(3)
    assert sd.read_revision(3).outcome == "deployed"
    assert sd.previous().number == 1  # 2 failed: not a rollback target


def _crash_after_revision(path):
    sd = st.StateDir("lab", path)
    make_rev(sd, topo="9p9d")
    os._exit(1)  # dies before set_current


def test_current_survives_crash_between_revision_and_pointer(tmp_path):
    sd = st.StateDir("lab", tmp_path)
    make_rev(sd)
    sd.set_current(1)
    p = multiprocessing.get_context("fork").Process(target=_crash_after_revision, args=(tmp_path,))
    p.start()
    p.join(30)
    assert p.exitcode == 1
    assert sd.current() == 1 and sd.current_revision().topology == "2p1d"
    assert sd.revision_numbers() == [1, 2]
    # a half-written revision (dir claimed, no file) is ignored, and its number is not reused
    (tmp_path / "revisions" / "0003").mkdir()
    assert sd.revision_numbers() == [1, 2]
    assert make_rev(sd).number == 4
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".current*"))


def test_concurrent_writers_get_distinct_numbers(tmp_path):
    sd = st.StateDir("lab", tmp_path)
    nums, lock = [], threading.Lock()

    def w():
        n = make_rev(sd).number
        with lock:
            nums.append(n)

    ts = [threading.Thread(target=w) for _ in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert sorted(nums) == list(range(1, 9))


def test_journal_appends_lines_and_reads_an_operation_back(tmp_path):
    j = st.StateDir("lab", tmp_path).journal()
    j.step("op-a", "plan", "ok", {"steps": 3})
    j.step("op-b", "lock", "ok")
    j.step("op-a", "stop p07", "failed", {"exit": 1, "host": "h3"})
    lines = (tmp_path / "journal.jsonl").read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(ln)["ts"] for ln in lines)
    steps = j.read("op-a")
    assert [s["step"] for s in steps] == ["plan", "stop p07"]
    assert steps[1]["evidence"] == {"exit": 1, "host": "h3"} and steps[1]["status"] == "failed"
    assert j.operations() == ["op-a", "op-b"]
    with open(tmp_path / "journal.jsonl", "a") as f:
        f.write('{"torn": ')  # crash mid-line
    assert len(j.records()) == 3


def test_lock_refuses_second_holder_naming_it(tmp_path):
    sd = st.StateDir("lab", tmp_path)
    with sd.lock("drain p07", operator="alice@h") as first:
        holder = first.holder()
        assert holder.pid == os.getpid() and holder.operation == "drain p07"
        assert holder.start_ticks == procs.read_local(os.getpid()).start_ticks
        with pytest.raises(Refused) as ei:
            sd.lock("scale 10p2d", operator="bob@h").acquire()
        assert "alice@h" in ei.value.message and "drain p07" in ei.value.message
    assert not (tmp_path / "lock").exists()
    with sd.lock("scale 10p2d"):
        pass


def test_two_threads_contend_exactly_one_wins(tmp_path):
    sd = st.StateDir("lab", tmp_path)
    barrier = threading.Barrier(6)
    results, lock = [], threading.Lock()
    release = threading.Event()

    def contend(i):
        barrier.wait()
        try:
            lk = sd.lock(f"op{i}").acquire()
        except Refused:
            with lock:
                results.append("refused")
            return
        with lock:
            results.append("won")
        release.wait(10)
        lk.release()

    ts = [threading.Thread(target=contend, args=(i,)) for i in range(6)]
    [t.start() for t in ts]
    while len(results) < 6 and any(t.is_alive() for t in ts):
        [t.join(0.05) for t in ts]
        if results.count("refused") == 5:
            break
    release.set()
    [t.join(10) for t in ts]
    assert sorted(results) == ["refused"] * 5 + ["won"]


_HOLD = """
import sys, time
from pdops.record import local as state
sd = state.StateDir("lab", sys.argv[1])
with sd.lock("deploy 8p4d", operator="carol@h"):
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_two_processes_contend(tmp_path):
    sd = st.StateDir("lab", tmp_path)
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"  # readiness by the child's own word
        with pytest.raises(Refused, match="carol@h"):
            sd.lock("drain p01").acquire()
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(30)
    assert child.returncode == 0
    with sd.lock("drain p01"):
        pass


def _write_lock(tmp_path, **over):
    me = procs.read_local(os.getpid())
    rec = dict(pid=os.getpid(), start_ticks=me.start_ticks, boot_id=me.boot_id,
               host=socket.gethostname(), operator="dave@h", operation="deploy", op_id="op-x",
               since="2026-01-01T00:00:00Z", token="t")
    rec.update(over)
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "lock").write_text(json.dumps(rec))


def test_stale_lock_from_dead_pid_is_taken_over_with_a_note(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    _write_lock(tmp_path, pid=dead.pid, start_ticks=1)
    sd = st.StateDir("lab", tmp_path)
    with sd.lock("drain p07", op_id="op-new") as lk:
        assert lk.took_over.pid == dead.pid
        assert lk.holder().pid == os.getpid()
    notes = sd.journal().read("op-new")
    assert notes[0]["step"] == "lock.takeover" and notes[0]["evidence"]["stale_holder"]["operator"] == "dave@h"


def test_stale_lock_from_reused_pid_is_detected(tmp_path):
    me = procs.read_local(os.getpid())
    _write_lock(tmp_path, start_ticks=me.start_ticks - 1)  # our pid, but another start time
    with st.StateDir("lab", tmp_path).lock("drain") as lk:
        assert lk.took_over is not None


def test_live_lock_on_another_host_is_never_taken(tmp_path):
    _write_lock(tmp_path, pid=999999, host="other-operator-box")
    with pytest.raises(Refused, match="other-operator-box"):
        st.StateDir("lab", tmp_path).lock("drain").acquire()


def test_unreadable_lock_is_replaced_with_note(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "lock").write_text("")
    sd = st.StateDir("lab", tmp_path)
    with sd.lock("drain", op_id="op-z"):
        pass
    assert sd.journal().read("op-z")[0]["evidence"]["reason"] == "unreadable lock file"


def test_release_does_not_remove_someone_elses_lock(tmp_path):
    sd = st.StateDir("lab", tmp_path)
    lk = sd.lock("drain").acquire()
    _write_lock(tmp_path, token="someone-else")
    lk.release()
    assert (tmp_path / "lock").exists()
