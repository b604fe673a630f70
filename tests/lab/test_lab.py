"""The lab itself, booted for real: hosts answer real tools, are isolated, leave nothing behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pdops import lab as lab_api
from pdops.lab import hostfiles, machine
from pdops.errors import InvalidInput, Refused
from pdops.sim.testing import wait_until

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def _env():
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _inits(lab) -> dict[int, int | None]:
    """Recorded init PID of every lab host (None when not recorded)."""
    recs = {i: lab_api.read_record(lab_api.host_dir(lab.lab_dir, i)) for i in range(1, lab.n + 2)}
    return {i: (r or {}).get("init_pid") for i, r in recs.items()}


def _nothing_booted_beyond(lab, before: dict[int, int | None]):
    """The lab's hosts are untouched, and host n+1 has no record, cgroup or process."""
    extra = lab.n + 1
    assert _inits(lab) == before
    assert before[extra] is None
    assert extra not in lab_api.cgroup_indexes(lab_api.cgroup_mounts())
    assert lab_api.host_cgroup_pids(extra) == []


def test_status_shows_every_host_up(lab):
    statuses = lab_api.status()
    assert [(s.name, s.address) for s in statuses] == lab.hosts
    for s in statuses:
        assert s.up and s.sshd and s.systemd == "running" and s.pid, s
    lines = lab_api.format_status(statuses)
    assert len(lines) == lab.n and all("running" in ln for ln in lines)


def test_up_again_changes_nothing(lab):
    result = lab_api.up(lab.n)
    assert not result.changed
    assert all(s.note.startswith("already up") for s in result)


def test_inventory_is_read_by_ansible_inventory(lab):
    out = subprocess.run(
        ["ansible-inventory", "-i", str(lab.inventory), "--list"],
        capture_output=True, text=True, env=_env(), check=True,
    ).stdout
    for name, address in lab.hosts:
        assert name in out and address in out


def test_ansible_ping_reaches_every_host(lab):
    r = subprocess.run(
        ["ansible", "-i", str(lab.inventory), "all", "-m", "ping", "-f", str(lab.n)],
        capture_output=True, text=True, env=_env(), timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count('"ping": "pong"') == lab.n


def test_fabric_connects_to_each_host(lab):
    for name, _address in lab.hosts:
        with lab.connection(name) as c:
            assert c.run("hostname", hide=True).stdout.strip() == name
            pid = c.run("systemctl show -p MainPID --value lab-sshd", hide=True).stdout
            assert int(pid) > 0


def test_testinfra_host_suite(lab):
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(REPO / "tests" / "lab" / "hostsuite"),
         "--hosts=ansible://all", f"--ansible-inventory={lab.inventory}"],
        capture_output=True, text=True, env=_env(), cwd=REPO, timeout=300,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert f"{4 * lab.n} passed" in r.stdout


def test_same_unit_on_two_hosts_is_isolated(lab):
    if lab.n < 2:
        pytest.skip("needs 2 lab hosts")
    unit = f"pdops-iso-{uuid.uuid4().hex[:8]}"
    (h1, _), (h2, _) = lab.hosts[:2]
    with lab.connection(h1) as c1, lab.connection(h2) as c2:
        for c in (c1, c2):
            c.run(f"systemd-run --unit={unit} --quiet sleep 600", hide=True)
        pid2 = int(c2.run(f"systemctl show -p MainPID --value {unit}", hide=True).stdout)
        try:
            c1.run(f"systemctl stop {unit}", hide=True)
            assert c1.run(f"systemctl is-active {unit}", hide=True, warn=True).stdout.strip() != "active"
            assert c2.run(f"systemctl is-active {unit}", hide=True).stdout.strip() == "active"
            assert int(c2.run(f"systemctl show -p MainPID --value {unit}", hide=True).stdout) == pid2
        finally:
            c2.run(f"systemctl stop {unit}", hide=True, warn=True)


def test_write_to_etc_from_a_host_fails(lab):
    name = lab.hosts[0][0]
    probe = f"/etc/pdops-lab-probe-{uuid.uuid4().hex[:8]}"
    with lab.connection(name) as c:
        r = c.run(f"touch {probe}", hide=True, warn=True)
        assert r.failed and "Read-only" in r.stderr
        assert c.run("touch /etc/pdops/.probe && rm /etc/pdops/.probe", hide=True, warn=True).ok
    assert not Path(probe).exists()


@pytest.mark.parametrize("bad", [0, 65, -1, "four"])
def test_bad_host_count_boots_nothing(lab, bad):
    before = _inits(lab)
    with pytest.raises(InvalidInput, match="--hosts"):
        lab_api.up(bad)
    _nothing_booted_beyond(lab, before)


def test_address_bound_by_another_process_is_refused(lab):
    before = _inits(lab)
    address = lab_api.host_address(lab.n + 1)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, 22))
        s.listen()
        with pytest.raises(Refused, match=address.replace(".", r"\.")):
            lab_api.up(lab.n + 1)
    _nothing_booted_beyond(lab, before)


@pytest.mark.parametrize("binary,package", [("sshd", "openssh-server"), ("systemd", "systemd")])
def test_missing_binary_names_the_package(lab, monkeypatch, binary, package):
    before = _inits(lab)
    required = {
        (f"/nonexistent/pdops-lab/{binary}" if Path(b).name == binary else b): p
        for b, p in lab_api.REQUIRED_BINARIES.items()
    }
    monkeypatch.setattr(machine, "REQUIRED_BINARIES", required)  # check_binaries reads it there
    with pytest.raises(Refused, match=package) as err:
        lab_api.up(lab.n + 1)
    assert f"apt-get install -y {package}" in err.value.fix
    _nothing_booted_beyond(lab, before)


def test_failed_safety_step_is_named_and_host_not_booted(lab, monkeypatch):
    before = _inits(lab)
    monkeypatch.setattr(hostfiles, "PRIVATE_TMPFS", hostfiles.PRIVATE_TMPFS + ("/nonexistent-pdops-lab",))
    with pytest.raises(Refused, match="safety step private-tmpfs") as err:
        lab_api.up(lab.n + 1)
    assert lab_api.host_name(lab.n + 1) in err.value.message
    _nothing_booted_beyond(lab, before)


def test_lab_dir_under_tmp_is_refused():
    with pytest.raises(InvalidInput, match="/tmp"):
        lab_api.up(1, "/tmp/pdops-lab-here")


# Destructive: takes the lab down and brings it back. Keep last in this module.
def test_lifecycle_keeps_tmp_leaves_nothing_and_recovers_from_kill(lab):
    canary = Path(f"/tmp/pdops-lab-canary-{uuid.uuid4().hex}")
    canary.write_text("must survive lab.up and lab.down\n")
    try:
        stopped = lab_api.down()
        assert all(not s.up for s in stopped) and len(stopped) >= lab.n
        assert lab_api.lab_processes() == []
        assert lab_api.lab_cgroup_dirs() == []
        assert canary.read_text().startswith("must survive")

        result = lab_api.up(lab.n)
        assert sorted(result.booted) == list(range(1, lab.n + 1))
        assert all(s.up and s.systemd == "running" for s in result)
        assert canary.exists()

        # Kill one host abruptly by its recorded PID: the next `up` cleans it and reboots it.
        victim = min(2, lab.n)
        rec = lab_api.read_record(lab_api.host_dir(lab.lab_dir, victim))
        os.kill(rec["init_pid"], signal.SIGKILL)
        wait_until(lambda: not lab_api.record_alive(rec), 10, f"host {victim}'s systemd gone after its SIGKILL")
        result = lab_api.up(lab.n)
        assert result.booted == [victim] and result.cleaned == [victim]
        assert all(s.up for s in result)

        # Kill one abruptly again: `down` cleans it with the rest.
        rec = lab_api.read_record(lab_api.host_dir(lab.lab_dir, 1))
        os.kill(rec["init_pid"], signal.SIGKILL)
        lab_api.down()
        assert lab_api.lab_processes() == []
        assert lab_api.lab_cgroup_dirs() == []
        assert canary.exists()
    finally:
        canary.unlink(missing_ok=True)
        lab.ensure_up()
