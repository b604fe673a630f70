"""Process tree and identity (sample: tests/data/facts/procs.source)."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pdops.errors import Unverified
from pdops.facts import procs

DATA = Path(__file__).resolve().parents[2] / "data" / "facts"


def tree():
    return procs.parse((DATA / "procs_tree.jsonl").read_text())


def test_parse_recorded_tree():
    t = tree()
    assert set(t) == {7101, 7106, 7107}
    parent = t[7101]
    assert parent.cmdline[0] == "pdops-test-parent"
    assert parent.start_ticks == 45507
    assert parent.start_time == pytest.approx(1796033638 + 455.07)
    assert t[7107].cmdline == ("weird (name) x", "301")
    assert [p.pid for p in procs.descendants(t, 7101)] == [7106, 7107]
    assert procs.descendants(t, 7106) == []


def test_descendants_goes_deep_and_survives_cycles():
    t = dict(tree())
    t[7200] = procs.Proc(7200, 7106, 45600, 0.0, "x", ("x",))
    assert [p.pid for p in procs.descendants(t, 7101)] == [7106, 7107, 7200]


def test_same_process_gone_and_reused():
    t = tree()
    rec = t[7106].identity
    assert procs.same_process(rec, t)
    assert procs.identity_status(rec, {}) == procs.GONE
    reused = {7106: procs.Proc(7106, 1, 99999, 0.0, "python3", ("python3",), t[7106].boot_id)}
    assert procs.identity_status(rec, reused) == procs.REUSED
    assert not procs.same_process(rec, reused)
    assert not procs.same_process(rec, None)
    other_boot = {7106: procs.Proc(7106, 7101, 45508, 0.0, "sleep", (), "another-boot")}
    assert procs.identity_status(rec, other_boot) == procs.REUSED


def test_parse_needs_header():
    with pytest.raises(Unverified):
        procs.parse('{"pid": 1, "ppid": 0, "start": 1, "comm": "x", "argv": []}\n')
    with pytest.raises(Unverified):
        procs.parse("bash: python3: command not found\n")


def test_command_runs_here_and_finds_a_child_with_its_start_time():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cmd = procs.command([os.getpid(), child.pid])
        assert shlex.split(cmd)[-1] == str(child.pid)
        out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True).stdout
        t = procs.parse(out)
        assert set(t) == {os.getpid(), child.pid}
        assert t[child.pid].ppid == os.getpid()
        assert [p.pid for p in procs.descendants(t, os.getpid())] == [child.pid]
        local = procs.read_local(child.pid)
        assert local.start_ticks == t[child.pid].start_ticks
        recorded = t[child.pid].identity
    finally:
        child.kill()
        child.wait()
    after = procs.parse(subprocess.run(["sh", "-c", procs.command([child.pid])],
                                       capture_output=True, text=True, check=True).stdout)
    assert procs.identity_status(recorded, after) == procs.GONE
    assert procs.read_local(child.pid) is None


def test_read_local_handles_parens_in_comm(tmp_path):
    (tmp_path / "42").mkdir()
    fields = ["S", "7"] + ["0"] * 17 + ["12345"] + ["0"] * 10
    (tmp_path / "42" / "stat").write_text("42 (a) b) " + " ".join(fields) + "\n")
    (tmp_path / "42" / "cmdline").write_bytes(b"a) b\0--x\0")
    (tmp_path / "stat").write_text("cpu 1 2 3\nbtime 1700000000\n")
    p = procs.read_local(42, proc_root=str(tmp_path))
    assert (p.comm, p.ppid, p.start_ticks, p.cmdline) == ("a) b", 7, 12345, ("a) b", "--x"))
