"""The lab's pure parts: validation, generated configs/scripts, parsers, inventory, output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdops import lab
from pdops.errors import InvalidInput, Refused
from pdops.model.inventory import single_file_doc

REPO = Path(__file__).resolve().parents[3]
SHIPPED = single_file_doc(REPO / "inventory" / "lab")


@pytest.fixture(autouse=True)
def _slot_0(monkeypatch):
    """These tests state slot 0's addresses and dirs, whichever xdist worker runs them."""
    monkeypatch.delenv(lab.SLOT_ENV, raising=False)
    monkeypatch.delenv(lab.LAB_DIR_ENV, raising=False)


def test_a_lab_slot_has_its_own_addresses_cgroup_group_and_dir(monkeypatch):
    monkeypatch.setenv(lab.SLOT_ENV, "2")
    assert lab.host_address(3) == "127.0.12.3" and lab.cgroup_group() == "pdops-lab2"
    assert lab.resolve_lab_dir() == Path("/srv/pdops-lab2")
    assert lab.is_lab_cgroup("/pdops-lab2/h1/x") and not lab.is_lab_cgroup("/pdops-lab/h1/x")
    monkeypatch.setenv(lab.SLOT_ENV, "0")
    assert not lab.is_lab_cgroup("/pdops-lab2/h1/x")  # slot 0 never takes another slot's tree for its own
    monkeypatch.setenv(lab.SLOT_ENV, "x")
    with pytest.raises(InvalidInput, match="PDOPS_LAB_SLOT"):
        lab.slot()


@pytest.mark.parametrize("n", [1, 4, 64, "16"])
def test_valid_host_counts(n):
    assert lab.validate_host_count(n) == int(n)


@pytest.mark.parametrize("n", [0, 65, -1, "four", "", None, True, 2.5])
def test_invalid_host_counts(n):
    with pytest.raises(InvalidInput, match="--hosts"):
        lab.validate_host_count(n)


def test_names_and_addresses():
    assert lab.host_name(1) == "lab01" and lab.host_name(64) == "lab64"
    assert lab.host_address(7) == "127.0.10.7"


@pytest.mark.parametrize("bad", ["/tmp", "/tmp/lab", "/var/tmp/x", "/run/pdops-lab", "/"])
def test_lab_dir_in_hidden_or_shared_places_is_refused(bad):
    with pytest.raises(InvalidInput, match="lab dir"):
        lab.resolve_lab_dir(bad)


def test_lab_dir_default_and_env(monkeypatch):
    monkeypatch.delenv("PDOPS_LAB_DIR", raising=False)
    assert lab.resolve_lab_dir() == Path("/srv/pdops-lab")
    monkeypatch.setenv("PDOPS_LAB_DIR", "/srv/other-lab")
    assert lab.resolve_lab_dir() == Path("/srv/other-lab")
    assert lab.inventory_path() == Path("/srv/other-lab/inventory/hosts.yml")
    assert lab.ssh_key_path() == Path("/srv/other-lab/ssh/lab_ed25519")
    monkeypatch.setenv("PDOPS_LAB_DIR", "/tmp/lab")
    with pytest.raises(InvalidInput):
        lab.inventory_path()


FINDMNT = '''TARGET="/sys/fs/cgroup/cpuset" FSTYPE="cgroup" OPTIONS="rw,relatime,cpuset"
TARGET="/sys/fs/cgroup/systemd" FSTYPE="cgroup" OPTIONS="rw,relatime,name=systemd"
TARGET="/sys/fs/cgroup/unified" FSTYPE="cgroup2" OPTIONS="rw,relatime"
'''


def test_parse_findmnt_pairs():
    mounts = lab.parse_findmnt_pairs(FINDMNT)
    assert [m.target for m in mounts] == [
        "/sys/fs/cgroup/cpuset", "/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified"]
    assert [m.is_cpuset for m in mounts] == [True, False, False]
    assert [m.is_systemd for m in mounts] == [False, True, False]
    assert lab.parse_findmnt_pairs("") == []


PROC_NET_TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 010A007F:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   1: 00000000:07E8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1
   2: 0100007F:9C40 0100007F:0016 01 00000000:00000000 00:00000000 00000000     0        0 3 1
"""


def test_parse_listeners_and_conflicts():
    listeners = lab.parse_listeners(PROC_NET_TCP)
    assert listeners == [("127.0.10.1", 22), ("0.0.0.0", 2024)]
    assert lab.address_conflicts("127.0.10.1", listeners) == [("127.0.10.1", 22)]
    assert lab.address_conflicts("127.0.10.2", listeners) == []
    assert lab.address_conflicts("127.0.10.2", [("0.0.0.0", 22)]) == [("0.0.0.0", 22)]


def test_parse_proc_cgroup_and_lab_paths():
    text = "9:name=systemd:/pdops-lab/h2/init.scope\n4:memory:/\n0::/pdops-lab/h2/init.scope\n"
    groups = lab.parse_proc_cgroup(text)
    assert groups["name=systemd"] == "/pdops-lab/h2/init.scope" and groups["memory"] == "/"
    assert lab.is_lab_cgroup("/pdops-lab/h2/init.scope")
    assert lab.is_lab_cgroup("/pdops-lab/h2/x", 2) and not lab.is_lab_cgroup("/pdops-lab/h21/x", 2)
    assert not lab.is_lab_cgroup("/pdops-labx/h1") and not lab.is_lab_cgroup("/")


def test_sshd_config():
    text = lab.sshd_config_text(3, Path("/srv/l/h3/key"), Path("/srv/l/ssh/lab_ed25519.pub"))
    for line in ["ListenAddress 127.0.10.3", "HostKey /srv/l/h3/key", "UsePAM no",
                 "AuthorizedKeysFile /srv/l/ssh/lab_ed25519.pub", "StrictModes no",
                 "Subsystem sftp /usr/lib/openssh/sftp-server"]:
        assert line in text.splitlines()


def test_units():
    units = lab.unit_texts(2, Path("/srv/l/h2/sshd_config"))
    assert f"Wants={lab.SSHD_UNIT}" in units[lab.LAB_TARGET]
    sshd = units[lab.SSHD_UNIT]
    assert "ExecStartPre=/bin/mkdir -p /run/sshd" in sshd
    assert "ExecStart=/usr/sbin/sshd -D -e -f /srv/l/h2/sshd_config" in sshd
    # the lab's boot starts nothing pdops enabled; the "enabled" boot starts what multi-user.target.wants holds
    from pdops.lab.hostfiles import ENABLED_UNIT

    assert ENABLED_UNIT not in units[lab.LAB_TARGET]
    real = lab.unit_texts(2, Path("/srv/l/h2/sshd_config"), "enabled")
    assert f"Wants={lab.SSHD_UNIT} {ENABLED_UNIT}" in real[lab.LAB_TARGET]
    assert "/etc/systemd/system/multi-user.target.wants/*" in real[ENABLED_UNIT]
    with pytest.raises(ValueError, match="boot mode 'multi-user' is not one of lab, enabled"):
        lab.unit_texts(2, Path("/srv/l/h2/sshd_config"), "multi-user")


def test_masks_cover_lab_md():
    for unit in ["systemd-tmpfiles-setup.service", "systemd-tmpfiles-setup-dev.service",
                 "systemd-tmpfiles-clean.timer", "systemd-sysctl.service",
                 "systemd-modules-load.service", "systemd-binfmt.service",
                 "systemd-remount-fs.service", "systemd-sysusers.service",
                 "systemd-udevd.service", "systemd-journal-flush.service",
                 "systemd-update-utmp.service", "systemd-logind.service", "getty.target",
                 "console-getty.service"]:
        assert unit in lab.MASKS


def _steps(script: str) -> list[str]:
    return [ln.split()[1] for ln in script.splitlines() if ln.startswith("step ")]


def test_inner_script_order_and_checks():
    script = lab.inner_script(1, Path("/srv/l/h1"), Path("/work/repo"))
    lines = script.splitlines()
    assert _steps(script) == [
        "private-mounts", "writable-binds", "read-only-root", "private-tmpfs", "cgroup-view",
        "hostname", "verify-read-only-root", "verify-private-tmp", "verify-masks",
        "verify-cgroup-namespace", "verify-no-generators", "verify-checkout", "boot-systemd"]
    assert "set -euo pipefail" in lines
    assert lines.index("mount --make-rprivate /") < lines.index("mount -o remount,bind,ro /")
    for d in ("/run", "/tmp", "/var/tmp", "/var/lib/systemd", "/var/log"):
        assert any(ln.startswith("mount -t tmpfs") and ln.endswith(" " + d) for ln in lines)
    for m in lab.MASKS:
        assert f"/etc/systemd/system/{m})\" = /dev/null" in script
    # systemd is the very last thing, and only after every verification.
    assert lines[-1].startswith("exec /lib/systemd/systemd --system --unit=lab.target")
    assert "export container=pdops-lab" in lines
    assert "stage-checkout" not in script


def test_inner_script_stages_a_checkout_under_tmp():
    script = lab.inner_script(1, Path("/srv/l/h1"), Path("/tmp/ci/repo"))
    steps = _steps(script)
    assert steps.index("stage-checkout") < steps.index("private-tmpfs") < steps.index("restore-checkout")
    assert "mount --bind /tmp/ci/repo /srv/l/h1/stage" in script
    assert "mount --bind /srv/l/h1/stage /tmp/ci/repo" in script


def test_outer_script_joins_cgroups_then_unshares():
    procs = ["/sys/fs/cgroup/systemd/pdops-lab/h1/cgroup.procs"]
    script = lab.outer_script(1, Path("/srv/l/h1"), procs, Path("/srv/l/h1/inner.sh"))
    lines = script.splitlines()
    assert f"echo $$ > {procs[0]}" in lines
    last = [ln for ln in lines if ln.startswith("exec /usr/bin/unshare")][0]
    for flag in ("--cgroup", "--pid", "--fork", "--mount", "--uts", "--mount-proc"):
        assert flag in last.split()
    assert lines.index(f"echo $$ > {procs[0]}") < lines.index(last)


def test_inventory_has_n_hosts_in_lab01_shape():
    doc = lab.inventory_doc(SHIPPED, 6, Path("/srv/l/ssh/lab_ed25519"), Path("/srv/l"))
    hosts = doc["all"]["children"]["gpu_hosts"]["hosts"]
    assert list(hosts) == [f"lab0{i}" for i in range(1, 7)]
    shipped01 = SHIPPED["all"]["children"]["gpu_hosts"]["hosts"]["lab01"]
    assert hosts["lab01"] == shipped01
    for i, (name, h) in enumerate(hosts.items(), start=1):
        assert set(h) == set(shipped01)
        assert h["ansible_host"] == h["pdops_data_addr"] == f"127.0.10.{i}"
        assert h["pdops_gpus"]["count"] == 8
    v = doc["all"]["vars"]
    for key, value in SHIPPED["all"]["vars"].items():
        assert v[key] == value
    assert v["ansible_ssh_private_key_file"] == "/srv/l/ssh/lab_ed25519"
    assert v["ansible_ssh_common_args"] == "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"
    assert v["pdops_lab_dir"] == "/srv/l"
    assert v["pdops_gateway"]["host"] == "lab01"
    # the shipped document is not modified
    assert len(SHIPPED["all"]["children"]["gpu_hosts"]["hosts"]) == 4


def test_inventory_text_is_read_by_ansible_inventory(tmp_path):
    doc = lab.inventory_doc(SHIPPED, 2, Path("/srv/l/ssh/lab_ed25519"), Path("/srv/l"))
    path = tmp_path / "hosts.yml"
    path.write_text(lab.inventory_text(doc, 2))
    assert yaml.safe_load(path.read_text()) == doc
    tool = Path(sys.executable).parent / "ansible-inventory"
    out = subprocess.run([str(tool), "-i", str(path), "--list"], capture_output=True,
                         text=True, check=True).stdout
    assert "127.0.10.2" in out and "lab_ed25519" in out


def test_the_written_lab_inventory_is_split_and_reads_as_the_single_file(tmp_path):
    """`inv lab.up` writes hosts.yml + group_vars/: Ansible (and pdops) read the same variables."""
    doc = lab.inventory_doc(SHIPPED, 3, Path("/srv/l/ssh/lab_ed25519"), Path("/srv/l"))
    for rel, text in lab.inventory_files(doc, 3).items():
        (tmp_path / "split" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "split" / rel).write_text(text)
    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "hosts.yml").write_text(lab.inventory_text(doc, 3))
    hosts_only = yaml.safe_load((tmp_path / "split" / "hosts.yml").read_text())
    assert set(hosts_only["all"]) == {"children"}  # addresses only; settings in group_vars/
    assert single_file_doc(tmp_path / "split") == single_file_doc(tmp_path / "single")


def test_format_status_and_summary():
    statuses = [
        lab.HostStatus(1, "lab01", "127.0.10.1", True, 4242, "running", True, "booted in 1.2s"),
        lab.HostStatus(2, "lab02", "127.0.10.2", False),
    ]
    lines = lab.format_status(statuses)
    assert len(lines) == 2
    assert lines[0].startswith("lab01") and "up" in lines[0] and "4242" in lines[0]
    assert "running" in lines[0] and "answering" in lines[0] and "booted in 1.2s" in lines[0]
    assert lines[1].startswith("lab02") and " down " in lines[1]
    assert lab.summary_line(statuses) == "2 lab host(s): 1 up, 1 down"


def test_missing_binary_names_the_debian_package():
    with pytest.raises(Refused) as err:
        lab.check_binaries({"/nonexistent/sshd": "openssh-server", "/bin/sh": "dash"})
    assert "openssh-server" in err.value.message
    assert err.value.fix.startswith("apt-get install -y openssh-server")
    lab.check_binaries({"/bin/sh": "dash"})


def test_needs_staging():
    assert lab.needs_staging(Path("/tmp/ci/repo"))
    assert not lab.needs_staging(Path("/work/main"))


def test_a_lab_the_kernels_inotify_limit_cannot_hold_is_refused_before_any_host_boots():
    """64 hosts need 4 inotify instances each (their systemd); Debian's 128 hold 32: refused, naming the
    sysctl and how many more fit, instead of 35 hosts hanging in their boot until the deadline."""
    from pdops.lab.machine import check_inotify

    with pytest.raises(Refused) as e:
        check_inotify(64, limit=128, in_use=8)
    assert "30 more host(s) fit" in e.value.message and "nothing booted" in e.value.message
    assert e.value.fix.startswith("sysctl -w fs.inotify.max_user_instances=1024")
    check_inotify(64, limit=1024, in_use=300)  # fits: no error
    check_inotify(0, limit=0, in_use=0)  # nothing to boot
