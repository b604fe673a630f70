"""Fixtures: sims and the real gateway, on free loopback ports, always killed by PID."""

from __future__ import annotations

import pytest

from pdops.sim.testing import start_gateway, start_sim

FAST = {"PDOPS_SIM_SHUTDOWN_POLL_S": "0.2"}


@pytest.fixture
def sims():
    """Factory: ``sims(args, env)`` starts a sim; all are stopped at teardown."""
    started = []

    def make(args=None, env=None, **kw):
        h = start_sim(args, {**FAST, **(env or {})}, **kw)
        started.append(h)
        return h

    try:
        yield make
    finally:
        for h in started:
            h.stop()


@pytest.fixture(scope="module")
def pd_cluster():
    """2 sim prefills + 1 sim decode behind the real gateway (sglang-router's smg)."""
    started = []
    try:
        env = {**FAST, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "10"}
        p1 = start_sim(["--disaggregation-mode", "prefill", "--enable-metrics"], env)
        started.append(p1)
        p2 = start_sim(["--disaggregation-mode", "prefill", "--enable-metrics"], env)
        started.append(p2)
        d = start_sim(["--disaggregation-mode", "decode", "--enable-metrics"], env)
        started.append(d)
        g = start_gateway([p1, p2], [d])
        started.append(g)
        yield {"prefills": [p1, p2], "decode": d, "gateway": g}
    finally:
        for h in reversed(started):
            h.stop()
