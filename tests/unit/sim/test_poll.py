"""The tests' one polling loop (pdops.sim.testing.poll, wait_until), on a clock the test drives."""

from __future__ import annotations

import pytest

from pdops.errors import Unreachable
from pdops.sim import testing


class Clock:
    """time.monotonic and time.sleep of pdops.sim.testing, on a clock that moves only when told, and the
    CPU seconds its checks use (`cpu`)."""

    def __init__(self):
        self.now, self.cpu, self.sleeps = 0.0, 0.0, []

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.sleeps.append(round(s, 6))
        self.now += s


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(testing, "time", c)
    monkeypatch.setattr(testing, "_cpu_s", lambda: c.cpu)
    return c


def test_a_cheap_check_is_repeated_at_the_interval_and_the_first_true_value_returned(clock):
    calls = []
    assert testing.poll(lambda: calls.append(1) or (len(calls) == 4 and "seen"), 10, interval=0.1) == "seen"
    assert clock.sleeps == [0.1, 0.1, 0.1]


def test_a_check_that_costs_cpu_waits_as_long_as_the_cpu_it_used_before_the_next(clock):
    def inv_status():  # two seconds of wall time each, 1.5 of them CPU (an `inv status`), never true
        clock.now += 2.0
        clock.cpu += 1.5
        return False

    assert testing.poll(inv_status, 9, interval=0.1) is False
    # checks at 0-2, 3.5-5.5, 7-9: each followed by a pause as long as the CPU it used; the deadline ends it
    assert clock.sleeps == [1.5, 1.5]
    assert clock.now == pytest.approx(9.0)


def test_a_check_that_only_waits_on_the_network_keeps_the_interval(clock):
    def health_timeout():  # a 2 s connect timeout, no CPU to speak of
        clock.now += 2.0
        return False

    assert testing.poll(health_timeout, 5, interval=0.1) is False
    assert clock.sleeps == [0.1, 0.1]


def test_wait_until_names_what_it_waited_for_and_the_last_value(clock):
    with pytest.raises(Unreachable, match=r"timed out after 1s waiting for the decode's port \(last: 0\)"):
        testing.wait_until(lambda: 0, 1, "the decode's port", interval=0.25)
    assert clock.now == pytest.approx(1.0)
