"""systemd facts: systemctl show blocks and the journal tail (samples: tests/data/facts/systemd.source)."""

import shlex
from pathlib import Path

import pytest

from pdops.errors import Unverified
from pdops.facts import systemd

DATA = Path(__file__).resolve().parents[2] / "data" / "facts"


def test_command_quotes_units_and_asks_every_property():
    cmd = systemd.command("pdops-p01.service", "evil; rm -rf /")
    argv = shlex.split(cmd)
    assert argv[:2] == ["systemctl", "show"]
    assert argv[-1] == "evil; rm -rf /"  # one quoted argument, not a second command
    props = argv[argv.index("-p") + 1].split(",")
    for p in ("Id", "MainPID", "ControlGroup", "ExecMainStartTimestampMonotonic", "NRestarts",
              "LimitMEMLOCK", "UnitFileState", "FragmentPath", "Result"):
        assert p in props
    assert "--no-pager" in argv


def test_command_needs_a_unit():
    with pytest.raises(ValueError):
        systemd.command()


def test_parse_three_blocks_in_order():
    units = systemd.parse((DATA / "systemctl_show_units.txt").read_text())
    assert [u.id for u in units] == ["pdops-p01.service", "pdops-p99.service", "pdops-d01.service"]
    p01, p99, d01 = units
    assert p01.is_active and p01.sub_state == "running"
    assert p01.main_pid == 41234
    assert p01.control_group == "/system.slice/pdops-p01.service"
    assert p01.exec_main_start_monotonic_us == 523118774012
    assert p01.memlock_unlimited and p01.limit_memlock is None
    assert p01.fragment_path == "/etc/systemd/system/pdops-p01.service"
    assert p01.unit_file_state == "enabled"

    assert not p99.exists and p99.main_pid is None and p99.control_group is None
    assert p99.limit_memlock == 8388608 and not p99.memlock_unlimited
    assert p99.fragment_path is None

    assert d01.active_state == "failed" and d01.result == "exit-code"
    assert d01.n_restarts == 3 and d01.is_stopped and not d01.is_active


def test_parse_by_id_and_single_block_without_trailing_newline():
    text = "Id=a.service\nMainPID=7\nActiveState=active"
    assert systemd.parse_by_id(text)["a.service"].main_pid == 7


def test_parse_rejects_garbage():
    with pytest.raises(Unverified):
        systemd.parse("Failed to connect to bus: No such file or directory\n")


def test_journal_tail_and_empty():
    cmd = systemd.journal_command("pdops-d01.service", 40)
    assert shlex.split(cmd) == ["journalctl", "-u", "pdops-d01.service", "-n", "40", "--no-pager"]
    tail = systemd.parse_journal((DATA / "journal_tail.txt").read_text(), "pdops-d01.service")
    assert len(tail.lines) == 5 and "CUDA out of memory" in tail.text
    empty = systemd.parse_journal((DATA / "journal_empty.txt").read_text())
    assert empty.empty
