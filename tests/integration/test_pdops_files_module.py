"""playbooks/library/pdops_files.py run by real Ansible on this machine (connection local).

It replaced a loop of ansible.builtin.copy in deploy.yml: these tests hold it to what copy
gave (content, mode, owner, idempotent second run) plus what pdops needs (stale files
removed, secrets out of logs, a missing folder refused)."""

import base64
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pdops.remote.ansible import PLAYBOOKS, file_entry

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="writes root-owned files")


def run_module(args: dict, check: bool = False) -> dict:
    """`ansible localhost -m pdops_files` with the playbooks' library; its JSON result."""
    bindir = Path(sys.executable).parent
    env = {**os.environ, "ANSIBLE_LIBRARY": str(PLAYBOOKS / "library"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0"}
    cmd = [str(bindir / "ansible"), "localhost", "-c", "local", "-e", f"ansible_python_interpreter={sys.executable}",
           "-m", "pdops_files", "-a", json.dumps(args)] + (["--check"] if check else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    # the ad-hoc (minimal) callback: `localhost | CHANGED => {json}`
    _, sep, body = proc.stdout.partition("\nlocalhost | ")
    if not sep and proc.stdout.startswith("localhost | "):
        sep, body = True, proc.stdout[len("localhost | "):]
    assert sep and " => " in body, proc.stdout + proc.stderr
    status, doc = body.split(" => ", 1)
    res = json.loads(doc)
    res["_status"] = status.strip()  # SUCCESS, CHANGED or FAILED!
    res["_raw"] = proc.stdout + proc.stderr
    return res


def test_writes_modes_owner_then_second_run_changes_nothing(tmp_path):
    env_file, unit = tmp_path / "p01.env", tmp_path / "pdops-p01.service"
    secret = b"SGLANG_API_KEY=sk-very-secret-123\n"
    files = [file_entry(str(env_file), secret, 0o600), file_entry(str(unit), b"[Unit]\n", 0o644)]
    r = run_module({"files": files})
    assert r["changed"] and sorted(r["written"]) == sorted([str(env_file), str(unit)])
    assert env_file.read_bytes() == secret and stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644 and env_file.stat().st_uid == 0
    assert "sk-very-secret" not in r["_raw"]  # no_log: not in the result nor the invocation
    assert base64.b64encode(secret).decode() not in r["_raw"]
    again = run_module({"files": files})
    assert not again["changed"] and again["unchanged"] == 2 and again["written"] == []
    assert not list(tmp_path.glob(".pdops-*"))  # no temporary file left behind


def test_mode_drift_and_content_change_are_repaired_and_reported(tmp_path):
    f = tmp_path / "launch.sh"
    run_module({"files": [file_entry(str(f), b"#!/bin/sh\n", 0o755)]})
    f.chmod(0o777)
    r = run_module({"files": [file_entry(str(f), b"#!/bin/sh\n", 0o755)]})
    assert r["changed"] and r["written"] == [str(f)] and stat.S_IMODE(f.stat().st_mode) == 0o755
    r = run_module({"files": [file_entry(str(f), b"#!/bin/sh\nexec true\n", 0o755)]})
    assert r["changed"] and f.read_bytes().endswith(b"exec true\n")


def test_check_mode_reports_without_writing(tmp_path):
    f = tmp_path / "x.env"
    r = run_module({"files": [file_entry(str(f), b"A=1\n", 0o600)]}, check=True)
    assert r["changed"] and r["written"] == [str(f)] and not f.exists()


def test_stale_files_removed_and_absent_ones_fine(tmp_path):
    old = tmp_path / "pdops-p09.service"
    old.write_text("[Unit]\n")
    r = run_module({"files": [], "remove": [str(old), str(tmp_path / "never-there")]})
    assert r["changed"] and r["removed"] == [str(old)] and not old.exists()
    assert not run_module({"files": [], "remove": [str(old)]})["changed"]


def test_missing_folder_is_refused_and_nothing_written(tmp_path):
    ok, bad = tmp_path / "a.env", tmp_path / "nope" / "b.env"
    r = run_module({"files": [file_entry(str(bad), b"B=2\n", 0o600), file_entry(str(ok), b"A=1\n", 0o600)]})
    assert r["_status"] == "FAILED!" and "does not exist (prepare.yml" in r["msg"]
    assert not ok.exists() and not bad.parent.exists()


def test_directories_created_with_mode_and_repaired_then_unchanged(tmp_path):
    etc, lib = tmp_path / "etc-pdops", tmp_path / "var-lib-pdops"
    lib.mkdir(mode=0o777)
    lib.chmod(0o777)
    dirs = [{"path": str(etc), "mode": "0700"}, {"path": str(lib), "mode": "0750"}]
    r = run_module({"directories": dirs})
    assert r["changed"] and sorted(r["written"]) == sorted([str(etc), str(lib)])
    assert stat.S_IMODE(etc.stat().st_mode) == 0o700 and stat.S_IMODE(lib.stat().st_mode) == 0o750
    assert not run_module({"directories": dirs})["changed"]


def test_missing_engine_python_is_refused_by_name(tmp_path):
    py = tmp_path / "venv" / "bin" / "python"
    r = run_module({"directories": [{"path": str(tmp_path / "d"), "mode": "0755"}], "executables": [str(py)]})
    assert r["_status"] == "FAILED!" and f"{py} missing or not executable" in r["msg"]
    assert not (tmp_path / "d").exists()  # refused before changing anything
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n")
    assert run_module({"executables": [str(py)]})["_status"] == "FAILED!"  # not executable
    py.chmod(0o755)
    assert run_module({"executables": [str(py)]})["_status"] == "SUCCESS"


def test_bad_unit_name_or_second_missing_folder_refused_before_any_write(tmp_path):
    ok = tmp_path / "a.env"
    r = run_module({"files": [file_entry(str(ok), b"A=1\n", 0o600)], "units": ["../../etc/passwd"]})
    assert r["_status"] == "FAILED!" and "is not a unit name" in r["msg"] and not ok.exists()
    bad = tmp_path / "nope" / "b.env"
    r = run_module({"files": [file_entry(str(ok), b"A=1\n", 0o600), file_entry(str(bad), b"B=2\n", 0o600)]})
    assert r["_status"] == "FAILED!" and not ok.exists()  # the good one is not written either


def test_bad_unit_name_refused_before_folders_change(tmp_path):
    d = tmp_path / "etc-pdops"
    r = run_module({"directories": [{"path": str(d), "mode": "0700"}], "units": ["x;reboot"]})
    assert r["_status"] == "FAILED!" and "is not a unit name" in r["msg"] and not d.exists()
