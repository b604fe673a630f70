"""cgroup facts on both layouts (samples: tests/data/facts/cgroup.source)."""

import subprocess
from pathlib import Path

import pytest

from pdops.errors import Unverified
from pdops.facts import cgroup

DATA = Path(__file__).resolve().parents[2] / "data" / "facts"
CG = "/system.slice/pdops-p01.service"


def layout(name):
    return cgroup.detect_layout(cgroup.parse_mountinfo((DATA / name).read_text()))


def test_mountinfo_parse_unescapes_and_splits_super_options():
    mounts = cgroup.parse_mountinfo((DATA / "mountinfo_unified.txt").read_text())
    by_point = {m.mount_point: m for m in mounts}
    assert by_point["/sys/fs/cgroup"].fstype == "cgroup2"
    assert "nsdelegate" in by_point["/sys/fs/cgroup"].super_options
    assert "/data/model store" in by_point


def test_layout_unified():
    lay = layout("mountinfo_unified.txt")
    assert lay.kind == cgroup.UNIFIED
    assert lay.procs_paths(CG) == ["/sys/fs/cgroup/system.slice/pdops-p01.service/cgroup.procs"]
    assert lay.events_path(CG) == "/sys/fs/cgroup/system.slice/pdops-p01.service/cgroup.events"


def test_layout_hybrid_reads_both_hierarchies():
    lay = layout("mountinfo_hybrid.txt")
    assert lay.kind == cgroup.HYBRID
    assert lay.procs_paths(CG) == [
        "/sys/fs/cgroup/unified/system.slice/pdops-p01.service/cgroup.procs",
        "/sys/fs/cgroup/systemd/system.slice/pdops-p01.service/cgroup.procs",
    ]
    assert lay.events_path(CG).startswith("/sys/fs/cgroup/unified/")


def test_layout_legacy_and_none():
    mounts = [m for m in cgroup.parse_mountinfo((DATA / "mountinfo_hybrid.txt").read_text())
              if m.fstype != "cgroup2"]
    lay = cgroup.detect_layout(mounts)
    assert lay.kind == cgroup.LEGACY and lay.events_path(CG) is None
    with pytest.raises(Unverified):
        cgroup.detect_layout([m for m in mounts if not m.fstype.startswith("cgroup")])


@pytest.mark.parametrize("bad", ["/", "relative/path", "/system.slice/../x"])
def test_refuses_root_or_odd_control_groups(bad):
    with pytest.raises(Unverified):
        layout("mountinfo_unified.txt").dirs(bad)


def test_proc_cgroup_hybrid_real_sample():
    pc = cgroup.parse_proc_cgroup((DATA / "proc_cgroup_hybrid.txt").read_text())
    assert pc.systemd == "/pdops-facts-capture.service"
    assert pc.unified == "/pdops-facts-capture.service"
    assert pc.controllers["memory"].startswith("/process_api/")
    assert pc.path == "/pdops-facts-capture.service"


def test_proc_cgroup_unified():
    pc = cgroup.parse_proc_cgroup((DATA / "proc_cgroup_unified.txt").read_text())
    assert pc.unified == CG and pc.systemd is None and pc.path == CG and pc.controllers == {}


def test_events_populated_and_empty_real_samples():
    assert cgroup.parse_events((DATA / "cgroup_events_populated.txt").read_text()).populated
    assert not cgroup.parse_events((DATA / "cgroup_events_empty.txt").read_text()).populated
    with pytest.raises(Unverified):
        cgroup.parse_events("")


def _fake_layout(tmp_path, kind="hybrid"):
    uni = tmp_path / "unified"
    sysd = tmp_path / "systemd"
    uni.mkdir()
    sysd.mkdir()
    return cgroup.CgroupLayout(kind, str(uni), str(sysd))


def _run(cmd, cwd=None):
    return subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True, cwd=cwd).stdout


def test_procs_command_reads_subtree_of_both_hierarchies(tmp_path):
    lay = _fake_layout(tmp_path)
    for root, pids in ((lay.unified_root, "101\n102\n"), (lay.systemd_root, "101\n")):
        d = Path(root + CG)
        (d / "child").mkdir(parents=True)
        (d / "cgroup.procs").write_text(pids)
        (d / "child" / "cgroup.procs").write_text("205\n" if root == lay.unified_root else "")
    res = cgroup.parse_procs(_run(cgroup.procs_command(lay, CG)))
    assert res.pids == {101, 102, 205}
    assert len(res.present) == 2 and res.gone == ()
    assert not res.empty


def test_procs_command_reads_a_removed_directory_as_empty(tmp_path):
    lay = _fake_layout(tmp_path)
    out = _run(cgroup.procs_command(lay, CG))  # systemd removed the dir after a clean stop
    res = cgroup.parse_procs(out)
    assert res.empty and len(res.gone) == 2 and res.present == ()


def test_procs_command_quotes_paths(tmp_path):
    lay = _fake_layout(tmp_path)
    weird = "/system.slice/x; touch pwned.service"
    res = cgroup.parse_procs(_run(cgroup.procs_command(lay, weird), cwd=tmp_path))
    assert not (tmp_path / "pwned.service").exists()
    assert res.gone[0].endswith("/x; touch pwned.service")


def test_parse_procs_rejects_output_without_header():
    with pytest.raises(Unverified):
        cgroup.parse_procs("")
    with pytest.raises(Unverified):
        cgroup.parse_procs("PDOPS-CGROUP present /x\nPermission denied\n")


@pytest.mark.parametrize("sample, roots", [("mountinfo_unified.txt", ["/sys/fs/cgroup"]),
                                           ("mountinfo_hybrid.txt", ["/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd"])])
def test_the_host_side_reader_finds_the_cgroup2_and_name_systemd_mounts(sample, roots):
    awk = cgroup._ROOTS_AWK.replace("/proc/self/mountinfo", str(DATA / sample))
    got = subprocess.run(["bash", "-c", awk], capture_output=True, text=True, check=True).stdout.split()
    assert sorted(got) == sorted(roots)


def test_units_cgroup_processes_and_their_table_are_read_in_one_command(tmp_path):
    """Each unit's cgroup found on the host (its ControlGroup from systemd under every root), a unit
    without one (not running, or a ControlGroup that is not its own) read as gone, and the process table
    asked for exactly the PIDs found (plus the 0 that keeps the list from meaning "every process")."""
    own = tmp_path / "u" / "pdops.slice" / "pdops-p01.service"
    (own / "sub").mkdir(parents=True)
    (own / "cgroup.procs").write_text("140\n141\n")
    (own / "sub" / "cgroup.procs").write_text("150\n")
    (tmp_path / "u" / "x").mkdir()
    (tmp_path / "u" / "x" / "cgroup.procs").write_text("999\n")  # what `/pdops.slice/../x` would reach
    cmd = cgroup.units_procs_command(["pdops-p01.service", "pdops-d01.service", "bad.service"], "echo TREE-ARGS")
    cmd = cmd.replace(cgroup._ROOTS_AWK, f"echo {tmp_path}/u {tmp_path}/s")
    fake = ('systemctl() { case "$5" in pdops-p01.service) echo /pdops.slice/pdops-p01.service ;; '
            'bad.service) echo /pdops.slice/../x ;; *) echo ;; esac; }; ')
    out = subprocess.run(["bash", "-c", fake + cmd], capture_output=True, text=True, check=True).stdout
    by_unit, tree = cgroup.parse_units_procs(out)
    assert by_unit["pdops-p01.service"].pids == {140, 141, 150}
    assert by_unit["pdops-p01.service"].present == (str(own),)
    assert by_unit["pdops-d01.service"].pids == frozenset() and by_unit["bad.service"].pids == frozenset()
    assert sorted(tree.split()[1:]) == ["0", "140", "141", "150"]
