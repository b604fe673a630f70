from pathlib import Path

from pdops.facts import requestlog

DATA = Path(__file__).resolve().parents[2] / "data" / "facts" / "requestlog"


def test_open_requests_are_received_but_not_finished():
    log = requestlog.parse((DATA / "journal.txt").read_text())
    assert list(log.received) == ["req-a", "req-b", "req-c", "req-d"]
    assert log.open == ["req-b"]
    assert log.finished["req-a"] == "length" and log.finished["req-d"] == "abort"


def test_command_reads_only_the_current_invocation():
    cmd = requestlog.command("pdops-p01.service", "abc123")
    assert cmd == "journalctl -u pdops-p01.service _SYSTEMD_INVOCATION_ID=abc123 -o cat --no-pager"
    assert "'x; rm -rf /'" in requestlog.command("x; rm -rf /")


def test_sglangs_own_health_probes_are_not_requests():
    """Real SGLang 0.5.23 logs each /health as a generation with rid HEALTH_CHECK_<hex>; a PD decode logs
    it received and never finished. It is no client's request: never open work, never lost work."""
    from pdops.facts import requestlog

    lines = "\n".join([
        '[2026-12-05 02:46:48] {"timestamp": "t1", "event": "request.received", "rid": "HEALTH_CHECK_382be91b"}',
        '[2026-12-05 02:46:48] {"timestamp": "t2", "event": "request.received", "rid": "client-1"}',
    ])
    log = requestlog.parse(lines)
    assert log.open == ["client-1"] and "HEALTH_CHECK_382be91b" not in log.received
