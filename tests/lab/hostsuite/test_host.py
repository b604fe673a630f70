"""testinfra suite for one lab host (or any pdops host): systemd, sshd, cgroups.

Run over SSH against an inventory, e.g.
    pytest tests/lab/hostsuite --hosts=ansible://all --ansible-inventory=<file>
"""

import uuid


def test_systemd_is_pid1_and_running(host):
    assert host.file("/proc/1/comm").content_string.strip() == "systemd"
    state = host.run("systemctl is-system-running").stdout.strip()
    assert state == "running", host.run("systemctl --failed --no-legend").stdout


def test_sshd_is_up(host):
    sshd = host.service("lab-sshd")
    assert sshd.is_running
    listening = host.run_test("ss -Hltn 'sport = :22'").stdout
    assert ":22" in listening, listening


def test_root_is_read_only_and_tmp_private(host):
    assert host.run("touch /etc/pdops-lab-write-test").rc != 0
    assert host.mount_point("/tmp").filesystem == "tmpfs"
    assert host.run("touch /etc/pdops/.w && rm /etc/pdops/.w").rc == 0


def test_systemd_run_unit_gets_own_cgroup(host):
    unit = f"pdops-hostsuite-{uuid.uuid4().hex[:8]}"
    host.run_test(f"systemd-run --unit={unit} --quiet sleep 300")
    try:
        show = host.run_test(f"systemctl show -p MainPID -p ControlGroup {unit}.service").stdout
        props = dict(line.split("=", 1) for line in show.split())
        pid, cgroup = props["MainPID"], props["ControlGroup"]
        assert cgroup == f"/system.slice/{unit}.service"
        assert int(pid) > 0
        for base in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd", "/sys/fs/cgroup"):
            procs = host.file(f"{base}{cgroup}/cgroup.procs")
            if procs.exists:
                assert pid in procs.content_string.split()
                break
        else:
            raise AssertionError(f"no cgroup.procs for {cgroup}")
    finally:
        host.run(f"systemctl stop {unit}.service")
