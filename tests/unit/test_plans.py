"""Plans as data, with no host: each file in tests/data/plans/ is (inventory, recorded revision,
request) -> the exact step ids the runner will walk, parallel groups as lists. Adding a case
is adding a file. The lab test (tests/lab/test_runner_lab.py) checks that a real run's
journal has the same ids."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdops import deploy as dep
from pdops import drain as dr
from pdops import scale as sc
from pdops.inventory import load_inventory
from pdops.placement import Placement, place
from pdops.render import manifest, render_files
from pdops.state import StateDir
from pdops.topology import Topology, parse_topology

REPO = Path(__file__).resolve().parents[2]
CASES = sorted((REPO / "tests" / "data" / "plans").glob("*.yml"))


def record(inv, state: StateDir, pl: Placement, cordoned=()) -> None:
    rev = state.write_revision(topology=str(pl.topology), inventory_hash=inv.digest, placement=pl.to_dict(),
                               manifest=manifest(render_files(inv, pl)),
                               instances={i.id: {"role": i.role, "worker_id": f"w-{i.id}"} for i in pl.instances},
                               outcome="deployed", extra={"cordoned": list(cordoned)} if cordoned else None)
    state.set_current(rev.number)


def make_plan(case: dict, state: StateDir):
    inv = load_inventory(REPO / "inventory" / case["inventory"])
    rec = case.get("recorded")
    if rec:
        pl = place(inv, parse_topology(rec["topology"]))
        record(inv, state, pl, rec.get("cordoned", ()))
        then = rec.get("then")
        if then and then["op"] == "drain":
            left = tuple(i for i in pl.instances if i.id != then["instance"])
            record(inv, state, Placement(Topology(sum(i.role == "prefill" for i in left),
                                                  sum(i.role == "decode" for i in left)), left))
    req = case["request"]
    if req["op"] == "deploy":
        return dep.plan_deploy(inv, parse_topology(req["topology"]), state).plan
    if req["op"] in ("drain", "stop"):
        return dr.plan_drain(inv, state, req["instance"], skip_gateway=req["op"] == "stop").plan
    if req["op"] == "scale":
        return sc.plan_scale(inv, parse_topology(req["topology"]), state).plan
    if req["op"] == "rollback":
        return sc.plan_rollback(inv, state).plan
    if req["op"] == "drain-host":
        return sc.plan_drain_host(inv, state, req["host"]).plan
    if req["op"] == "uncordon":
        return sc.plan_uncordon(inv, state, req["host"]).plan
    raise AssertionError(f"unknown op {req['op']}")


def grouped_ids(plan) -> list:
    """Step ids, a parallel batch as a list (compared as given: the planner's order)."""
    return [b[0].name if len(b) == 1 else [s.name for s in b] for b in plan.batches()]


@pytest.mark.parametrize("case_file", CASES, ids=[c.stem for c in CASES])
def test_plan_is_exactly_the_steps_in_the_case_file(case_file, tmp_path):
    case = yaml.safe_load(case_file.read_text())
    plan = make_plan(case, StateDir("lab", tmp_path / "state"))
    assert grouped_ids(plan) == case["steps"]


@pytest.mark.parametrize("case_file", CASES, ids=[c.stem for c in CASES])
def test_step_ids_are_unique_and_what_dry_run_prints(case_file, tmp_path):
    case = yaml.safe_load(case_file.read_text())
    plan = make_plan(case, StateDir("lab", tmp_path / "state"))
    ids = plan.step_ids()
    assert len(ids) == len(set(ids))
    printed = [ln.split(". ", 1)[1].split(" — ", 1)[0] for ln in plan.render().splitlines()
               if ln[:6].strip().rstrip(".").isdigit()]
    assert printed == ids
    # every step that waits says how long, and the runner enforces that same number
    for s in plan.steps:
        if s.kind in ("start", "register", "canary", "wait-empty", "leave-gateway", "gateway", "stop"):
            assert s.deadline and f"(within {s.deadline:g}s)" in s.line()


def test_every_step_kind_has_an_executor(tmp_path):
    known = set(sc.executors()) | {"record", "check-units", "kill-survivors", "verify-gone"}
    for case_file in CASES:
        plan = make_plan(yaml.safe_load(case_file.read_text()), StateDir("lab", tmp_path / case_file.stem))
        assert {s.kind for s in plan.steps} <= known, case_file.name


def test_a_scale_step_id_carries_the_instance_so_two_drains_are_told_apart(fleet, tmp_path):
    state = StateDir("t", tmp_path / "state")
    record(fleet, state, place(fleet, parse_topology("8p4d")))
    plan = sc.plan_scale(fleet, parse_topology("10p2d"), state).plan
    checks = [s for s in plan.steps if s.kind == "empty-check"]
    assert [(s.name, s.instance) for s in checks] == [
        ("drain d03: empty-check-1", "d03"), ("drain d03: empty-check-2", "d03"),
        ("drain d04: empty-check-1", "d04"), ("drain d04: empty-check-2", "d04")]
