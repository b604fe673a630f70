"""The tests' one polling loop (pdops.sim.testing.poll, wait_until), on a clock the test drives."""

from __future__ import annotations

import pytest

from pdops.errors import Unreachable
from pdops.sim import testing


class Clock:
    """time.monotonic and time.sleep of pdops.sim.testing, on a clock that moves only when told."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.sleeps.append(round(s, 6))
        self.now += s


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(testing, "time", c)
    return c


def test_a_cheap_check_is_repeated_at_the_interval_and_the_first_true_value_returned(clock):
    calls = []
    assert testing.poll(lambda: calls.append(1) or (len(calls) == 4 and "seen"), 10, interval=0.1) == "seen"
    assert clock.sleeps == [0.1, 0.1, 0.1]


def test_a_check_that_costs_waits_as_long_as_it_took_before_the_next(clock):
    def ssh_check():  # two seconds of work each time, never true
        clock.now += 2.0
        return False

    assert testing.poll(ssh_check, 9, interval=0.1) is False
    # checks at 0-2, 4-6, 8-10: each followed by a pause as long as itself, the deadline (9) ends it
    assert clock.sleeps == [2.0, 2.0]
    assert clock.now == pytest.approx(10.0)


def test_wait_until_names_what_it_waited_for_and_the_last_value(clock):
    with pytest.raises(Unreachable, match=r"timed out after 1s waiting for the decode's port \(last: 0\)"):
        testing.wait_until(lambda: 0, 1, "the decode's port", interval=0.25)
    assert clock.now == pytest.approx(1.0)
