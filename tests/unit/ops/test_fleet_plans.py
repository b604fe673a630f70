"""Plans at fleet size (issue #35): a deploy's and a rolling change's steps grow linearly with the
instances, so no per-host work hides inside a per-instance loop. Pure planning on the reference
fleet's inventory grown to N hosts (addresses off this machine: nothing is contacted)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdops.lab import grown_fleet
from pdops.model.inventory import load_inventory
from pdops.model.topology import parse_topology
from pdops.ops import deploy as dep
from pdops.record.local import StateDir
from tests.unit.recorded import deployed

REPO = Path(__file__).resolve().parents[3]


def grown(tmp_path: Path, n: int, mem_fraction: float | None = None):
    """inventory/rtx6000d with n hosts; its profile's mem_fraction_static set when given."""
    prof = None
    if mem_fraction is not None:
        prof = yaml.safe_load((REPO / "pdops/profiles/deepseek-flash-160k.yml").read_text())
        prof["bundle"]["mem_fraction_static"] = mem_fraction
    return load_inventory(grown_fleet(tmp_path / f"fleet{n}-{mem_fraction}", n, prof))


def topology(n: int):
    return parse_topology(f"{n - n // 4}p{n // 4}d")


def deploy_steps(tmp_path: Path, n: int) -> int:
    plan = dep.plan_deploy(grown(tmp_path, n), topology(n), StateDir("fleet", tmp_path / f"s{n}"))
    return len(plan.steps)


def change_steps(tmp_path: Path, n: int) -> int:
    """Steps of a rolling change of every instance (the profile's mem_fraction_static), 2 per wave."""
    inv = grown(tmp_path, n)
    state = StateDir("fleet", tmp_path / f"c{n}")
    deployed(inv, state, str(topology(n)))
    plan = dep.plan_deploy(grown(tmp_path, n, 0.77), topology(n), state, max_unavailable=2)
    assert plan.change is not None and len(plan.change.replaced) == n
    return len(list(plan.change.plan.all_steps()))


@pytest.mark.parametrize("count", [deploy_steps, change_steps], ids=["deploy", "rolling change"])
def test_a_plans_steps_grow_linearly_with_the_fleet(tmp_path, count):
    """Steps at 16, 32 and 64 hosts lie on one line: each added host adds the same steps."""
    s16, s32, s64 = (count(tmp_path, n) for n in (16, 32, 64))
    assert s64 - s32 == 2 * (s32 - s16), (s16, s32, s64)
    # a rolling change: each added host's wave, and its rescue printed in full (the two ways its new
    # instance is undone, each a plan of its own, and its restore register): 23 steps a host
    assert (s32 - s16) / 16 <= 24, f"{(s32 - s16) / 16} steps per added host"


def test_a_rolling_changes_first_delivery_leaves_the_replaced_instances_files_to_their_waves(tmp_path):
    """The first `deliver` of a change that replaces every instance sends no engine's file: each goes out
    in its wave, after the old process stopped, so a process not yet replaced never runs beside files it
    was not started from; and a host whose other files are as recorded is not touched by it (here: the
    profile changes only the engines' files, so the first delivery has nothing to send)."""
    inv = grown(tmp_path, 16)
    state = StateDir("fleet", tmp_path / "s")
    deployed(inv, state, str(topology(16)))
    change = dep.plan_deploy(grown(tmp_path, 16, 0.77), topology(16), state, max_unavailable=2).change
    steps = list(change.plan.all_steps())
    first = next(s for s in steps if s.kind == "deliver")
    waves = [s for s in steps if s.kind == "deliver-wave"]
    engine_files = {(f.host, f.path) for f in change.files if "pdops-p" in f.path or "pdops-d" in f.path}
    assert engine_files and not engine_files & {(f.host, f.path) for f in first.params["files"]}
    assert {(f.host, f.path) for w in waves for f in w.params["files"]} >= engine_files
    assert first.params["files"] == []


def test_the_first_delivery_of_a_change_still_sends_an_added_instance_and_enables_no_held_unit(tmp_path):
    """12p4d -> 13p4d with a new profile on 17 hosts: p13 is added (its files and unit go out in the
    first delivery, on its host), the 16 others are replaced (none of their files, none of their units
    in the first delivery's placement: each wave enables its own)."""
    inv = grown(tmp_path, 17)
    state = StateDir("fleet", tmp_path / "s")
    deployed(inv, state, str(topology(16)))
    change = dep.plan_deploy(grown(tmp_path, 17, 0.77), parse_topology("13p4d"), state, max_unavailable=2).change
    assert [i.id for i in change.added] == ["p13"] and len(change.replaced) == 16
    first = next(s for s in change.plan.all_steps() if s.kind == "deliver")
    p13 = change.target.get("p13")
    sent = {(f.host, f.path) for f in first.params["files"]}
    assert {(f.host, f.path) for f in change.files if f.host == p13.head.host and "p13" in f.path} <= sent
    assert {i.id for i in first.params["placement"].instances} == {"p13"}


def test_a_drain_on_64_hosts_reads_the_units_of_four_instances_and_its_plan_says_so(tmp_path):
    """What a drain observes does not grow with the fleet: its instance and three others of its role
    (their units: one of them serving is proof for the floor); the plan names that basis."""
    from pdops.cli.core import near
    from pdops.ops.drain import plan_drain
    from pdops.reads.observation import Seen

    inv = grown(tmp_path, 64)
    state = StateDir("fleet", tmp_path / "s")
    rev = deployed(inv, state, str(topology(64)))
    assert near(rev, "p07") == {"p07", "p01", "p02", "p03"} and near(rev, "d16") == {"d16", "d01", "d02", "d03"}
    plan = plan_drain(inv, state, "p07", seen=Seen(basis="systemd read for p01, p02, p03, p07; each other ..."))
    assert "observed: systemd read for p01, p02, p03, p07" in plan.render()
