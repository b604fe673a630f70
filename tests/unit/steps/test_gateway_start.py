"""Starting one gateway (pdops.steps.actions.start_gateway) on recorded host answers (no host): a
gateway that did not start is a failed deploy naming the unit's state and its journal, whichever way
systemd reported it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdops.errors import DeployFailed, RemoteCommandFailed, Unreachable
from pdops.steps.actions import start_gateway

NODE = SimpleNamespace(host="lab01", url="http://127.0.0.1:30000")
JOURNAL = "smg: error: Address already in use (os error 98)\npdops-gateway.service: Main process exited, status=1/FAILURE"


class Pool:
    def __init__(self, *, job_fails: bool, unit: str):
        self.job_fails, self.unit, self.commands = job_fails, unit, []

    def run(self, host, command, timeout=60):
        self.commands.append(command)
        if "systemctl restart" in command and self.job_fails:
            raise RemoteCommandFailed(host, command, 1, "Job for pdops-gateway.service failed because the control "
                                                        "process exited with error code.")
        return SimpleNamespace(stdout="{}")

    def unit_states(self, host, units):
        load, active, sub = self.unit.split("/") if self.unit.count("/") == 2 else ("loaded", *self.unit.split("/"))
        return {u: SimpleNamespace(load_state=load, active_state=active, sub_state=sub,
                                   main_pid=4242 if active == "active" else None)
                for u in units}

    def journal_tail(self, host, unit, lines=30):
        return JOURNAL


class Gateway:
    """The gateway's /health: refused `refusals` times, then answering."""

    def __init__(self, refusals: float = float("inf")):
        self.refusals = refusals

    def client(self, host):
        return self

    def health(self):
        if self.refusals > 0:
            self.refusals -= 1
            raise Unreachable("connection refused")


@pytest.mark.parametrize("job_fails, unit", [(True, "failed/failed"), (False, "failed/failed")],
                         ids=["the start job failed (smg exited during ExecStartPost)",
                              "the job passed, then the unit failed"])
def test_a_gateway_that_exits_at_its_start_fails_the_deploy_with_its_journal(monkeypatch, job_fails, unit):
    import pdops.steps.actions as actions

    monkeypatch.setattr(actions.membership, "update_one", lambda *a, **k: {})
    pool = Pool(job_fails=job_fails, unit=unit)
    with pytest.raises(DeployFailed) as err:
        start_gateway(None, pool, Gateway(), NODE, lambda s: None, restart=True, deadline_s=30)
    assert err.value.exit_code == 7
    assert err.value.message.startswith("gateway pdops-gateway.service on lab01 did not answer "
                                        "http://127.0.0.1:30000/health (unit loaded/failed/failed")
    assert ("`systemctl restart` exited 1" in err.value.message) == job_fails
    assert "Address already in use" in err.value.evidence


def test_a_start_job_that_failed_once_is_waited_out_while_systemd_starts_it_again(monkeypatch):
    """The cause was gone by systemd's next start (Restart=on-failure): the gateway answers within the
    step's deadline, so the deploy goes on, as it does when the unit failed after its job."""
    import pdops.steps.actions as actions

    monkeypatch.setattr(actions.membership, "update_one", lambda *a, **k: {})
    monkeypatch.setattr(actions.time, "sleep", lambda s: None)
    pool = Pool(job_fails=True, unit="activating/auto-restart")
    gw = Gateway(refusals=3)

    def answered_after_restart(host, units):
        return Pool(job_fails=False, unit="active/running" if gw.refusals == 0 else "activating/auto-restart"
                    ).unit_states(host, units)

    pool.unit_states = answered_after_restart
    said = []
    ev = start_gateway(None, pool, gw, NODE, said.append, restart=True, deadline_s=30)
    assert ev["main_pid"] == 4242 and said == ["  gateway up on lab01: http://127.0.0.1:30000 (MainPID 4242)"]


def test_a_start_job_that_failed_on_a_unit_systemd_cannot_find_fails_at_once_with_what_systemctl_said(monkeypatch):
    import pdops.steps.actions as actions

    monkeypatch.setattr(actions.membership, "update_one", lambda *a, **k: {})

    def waited(s):
        raise AssertionError("waited for a unit systemd cannot find")

    def systemctl(host, command, timeout=60):
        raise RemoteCommandFailed(host, command, 5, "Failed to restart pdops-gateway.service: Unit "
                                                    "pdops-gateway.service not found.")

    monkeypatch.setattr(actions.time, "sleep", waited)
    pool = Pool(job_fails=True, unit="not-found/inactive/dead")
    pool.run = systemctl
    with pytest.raises(DeployFailed, match=r"\(unit not-found/inactive/dead; `systemctl restart` exited 5: Failed to "
                                           r"restart pdops-gateway.service: Unit pdops-gateway.service not found.\)"):
        start_gateway(None, pool, Gateway(), NODE, lambda s: None, restart=True, deadline_s=30)
