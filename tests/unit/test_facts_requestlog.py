from pathlib import Path

from pdops.facts import requestlog

DATA = Path(__file__).resolve().parents[1] / "data" / "facts" / "requestlog"


def test_open_requests_are_received_but_not_finished():
    log = requestlog.parse((DATA / "journal.txt").read_text())
    assert list(log.received) == ["req-a", "req-b", "req-c", "req-d"]
    assert log.open == ["req-b"]
    assert log.finished["req-a"] == "length" and log.finished["req-d"] == "abort"


def test_command_reads_only_the_current_invocation():
    cmd = requestlog.command("pdops-p01.service", "abc123")
    assert cmd == "journalctl -u pdops-p01.service _SYSTEMD_INVOCATION_ID=abc123 -o cat --no-pager"
    assert "'x; rm -rf /'" in requestlog.command("x; rm -rf /")
