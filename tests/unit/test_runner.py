"""Runner base pieces: Step, run_parallel, run_remote (with invoke's local Context as the connection)."""

import socket
import threading

import pytest
from invoke import Context

from pdops.errors import RemoteCommandFailed, Unreachable
from pdops.runner import Step, failures, run_parallel, run_remote, succeeded


class LocalConn(Context):
    """invoke's local Context has the same run() as a Fabric Connection; give it a host."""

    host = "local-test"


def test_step_prints_host_and_budget():
    assert str(Step("stop", "h3", "systemctl stop pdops-p07.service", 120)) == \
        "[h3] stop: systemctl stop pdops-p07.service (within 120s)"
    assert str(Step("plan", None, "compute")) == "plan: compute"


def test_run_remote_ok_and_failure_carries_evidence():
    assert run_remote(LocalConn(), "echo hello").stdout.strip() == "hello"
    with pytest.raises(RemoteCommandFailed) as ei:
        run_remote(LocalConn(), "echo out; echo err >&2; exit 7")
    e = ei.value
    assert (e.host, e.returncode, e.command) == ("local-test", 7, "echo out; echo err >&2; exit 7")
    assert "out" in e.output and "err" in e.output and "err" in e.render()


def test_run_remote_timeout_is_a_failure_not_a_hang():
    with pytest.raises(RemoteCommandFailed) as ei:
        run_remote(LocalConn(), "sleep 30", timeout=0.5)
    assert ei.value.returncode == 124


class DeadConn:
    host = "h-dead"

    def run(self, *a, **kw):
        raise socket.timeout("timed out")


def test_run_remote_connection_failure_is_unreachable():
    with pytest.raises(Unreachable, match="h-dead"):
        run_remote(DeadConn(), "true")


def test_run_parallel_collects_every_outcome_and_runs_concurrently():
    hosts = ["h1", "h2", "h3", "h4"]
    barrier = threading.Barrier(len(hosts), timeout=10)  # deadlocks unless all run at once

    def work(h):
        barrier.wait()
        if h == "h2":
            raise RemoteCommandFailed(h, "x", 1, "boom")
        return run_remote(LocalConn(), f"echo {h}").stdout.strip()

    res = run_parallel(hosts, work, max_workers=4)
    assert list(res) == hosts
    assert res["h1"] == "h1" and res["h4"] == "h4"
    assert isinstance(res["h2"], RemoteCommandFailed)
    assert set(failures(res)) == {"h2"} and set(succeeded(res)) == {"h1", "h3", "h4"}
    assert run_parallel([], work) == {}
