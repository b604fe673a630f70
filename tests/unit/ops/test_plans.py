"""Plans as data, with no host: each file in tests/data/plans/ is (inventory, recorded revision,
observation, request) -> the exact step ids the runner will walk, parallel groups as lists, its rescue
steps (`rescue:`, what runs if a step fails) and its `always:` steps (what runs last, whatever the outcome).
`observed:` is what the hosts and the gateway report, where the operation decides from it:
repair's status rows (and `gateway:`, why it does not answer), a live deploy's units and workers, a stop's recorded survivors. Adding a
case is adding a file. The lab test (tests/lab/test_runner_lab.py) checks that a real run's
journal has the same ids."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdops.reads.observe import observe
from pdops.ops import deploy as dep
from pdops.ops import drain as dr
from pdops.ops import scale as sc
from pdops.model.inventory import load_inventory
from pdops.model.placement import Placement, place
from pdops.record.local import StateDir
from pdops.model.topology import Topology, parse_topology
from tests.unit.recorded import deployed

REPO = Path(__file__).resolve().parents[3]
CASES = sorted((REPO / "tests" / "data" / "plans").glob("*.yml"))


def record(inv, state: StateDir, pl: Placement, cordoned=()) -> None:
    deployed(inv, state, pl=pl, extra={"cordoned": list(cordoned)} if cordoned else None)


def status_doc(pl: Placement, observed: dict) -> dict:
    """`inv status`'s rows as repair reads them: every instance ok, registered and healthy unless
    the case observes otherwise ({instance: state}; `down` is unregistered and unhealthy)."""
    rows = []
    for i in pl.instances:
        st = observed.get(i.id, "ok")
        rows.append({"instance": i.id, "role": i.role, "state": st, "registered": st != "down",
                     "healthy": st == "ok", "reasons": [] if st == "ok" else [f"observed {st}"], "action": None})
    return {"instances": rows}


def with_admission(tmp: Path, state: StateDir):
    """The lab inventory with an admission layer (one 0600 key file), its record `state`."""
    import os

    from pdops.model.inventory import single_file_doc

    keys = tmp / "admission.keys"
    keys.write_text("pdops-plan-case-key-" + "k" * 16 + "\n")
    os.chmod(keys, 0o600)
    doc = single_file_doc(REPO / "inventory" / "lab")
    doc["all"]["vars"]["pdops_admission"] = {"api_keys_file": str(keys)}
    (tmp / "inv").mkdir(exist_ok=True)
    (tmp / "inv" / "hosts.yml").write_text(yaml.safe_dump(doc))
    return load_inventory(tmp / "inv")


def observed_world(inv, pl: Placement, observed: dict):
    """A pool and a gateway answering as the case observes: every unit active with its recorded
    MainPID and every worker ready, except `units_down` (inactive) and `workers_missing`."""
    import json
    import types

    from pdops.model import membership
    from pdops.facts import systemd
    from pdops.facts.gateway import Worker

    down = set(observed.get("units_down", ()))
    missing = set(observed.get("workers_missing", ()))
    pids = {(h, u): 100 + n for i in pl.instances for n, (h, u) in enumerate(i.units)}

    class Pool:
        def read_sections(self, host, commands):
            return {"units": (0, self.show(host, commands["units"].split()[5:])), "configs": (0, "")}

        def unit_states(self, host, units):
            return systemd.parse_by_id(self.show(host, units))

        def show(self, host, units):
            out = ""
            for u in units:
                iid = next((i.id for i in pl.instances if (host, u) in i.units), None)
                active = iid not in down
                out += (f"Id={u}\nLoadState=loaded\nActiveState={'active' if active else 'inactive'}\n"
                        f"SubState={'running' if active else 'dead'}\nMainPID={pids.get((host, u), 90) if active else 0}\n"
                        "NRestarts=0\nResult=success\nUnitFileState=enabled\n\n")
            return out

        def run(self, host, command, timeout=60):
            start = {"workers": [membership.entry(i) for i in pl.instances]}
            return types.SimpleNamespace(stdout=json.dumps(start) + "\n", stderr="")

    class Gateway:
        def list_workers(self):
            return [Worker(f"w-{i.id}", i.url, i.role, True, 0, i.bootstrap_port, status="ready")
                    for i in pl.instances if i.id not in missing]

        def client(self, host):  # every gateway of the case sees the same
            return self

    return Pool(), Gateway()


def seen_of(observed: dict, inv):
    """A change's observation (pdops.reads.observation.Seen) as a case writes it: `not_serving` {id: why},
    `down` (units not running: nothing to drain), `gateway` (why the first gateway does not answer),
    `gateway_active` (its unit is active, hung). None: not read."""
    from pdops.reads.observation import Seen

    if not observed:
        return None
    gw = inv.gateway.first.host
    return Seen(dict(observed.get("not_serving") or {}), frozenset(observed.get("down") or ()),
                {gw: observed["gateway"]} if observed.get("gateway") else {},
                frozenset({gw}) if observed.get("gateway") and observed.get("gateway_active") else frozenset())


def make_plan(case: dict, state: StateDir, tmp: Path | None = None, monkeypatch=None):
    inv = load_inventory(REPO / "inventory" / case["inventory"])
    if case.get("admission"):
        inv = with_admission(tmp, state)
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
    observed = case.get("observed") or {}
    if req["op"] == "deploy" and observed:
        p = dep.plan_deploy(inv, parse_topology(req["topology"]), state)
        pool, gateway = observed_world(inv, p.placement, observed)
        return dep.plan_reconcile(p, observe(p.inv, p.live, pool, gateway)).plan
    if req["op"] == "deploy":
        return dep.plan_deploy(inv, parse_topology(req["topology"]), state).plan
    if req["op"] in ("drain", "stop"):
        return dr.plan_drain(inv, state, req["instance"], skip_gateway=req["op"] == "stop").plan
    if req["op"] == "scale":
        return sc.plan_scale(inv, parse_topology(req["topology"]), state, seen=seen_of(observed, inv)).plan
    if req["op"] == "rollback":
        return sc.plan_rollback(inv, state, seen=seen_of(observed, inv)).plan
    if req["op"] == "drain-host":
        return sc.plan_drain_host(inv, state, req["host"], seen=seen_of(observed, inv)).plan
    if req["op"] == "uncordon":
        return sc.plan_uncordon(inv, state, req["host"]).plan
    if req["op"] == "repair":
        from pdops.ops import repair

        from pdops.reads.observation import Seen

        pl = Placement.from_dict(state.current_revision().placement)
        rows = {k: v for k, v in observed.items() if k != "gateway"}
        seen = Seen({k: f"observed {v}" for k, v in rows.items() if v != "ok"},
                    frozenset(k for k, v in rows.items() if v == "down"),
                    {inv.gateway.first.host: observed["gateway"]} if observed.get("gateway") else {})
        return repair.plan_repair(inv, state, req["instance"], status_doc(pl, rows), seen=seen).plan
    if req["op"] == "kill-survivors":
        survivors = [{"host": h, "pid": 4242, "start_ticks": 1234, "boot_id": "b", "cmdline": "sglang::scheduler",
                      "cgroup": "/pdops.slice", "ports": [30010]} for h in observed.get("survivors_on", ())]
        state.journal().step("stop-case", f"drain {req['instance']}: verify-stop", "failed",
                             {"instance": req["instance"], "survivors": survivors})
        return dr.plan_kill_survivors(inv, state, req["instance"]).plan
    if req["op"] == "probe":
        from pdops.ops import probe as pr

        bundle = tmp / "bundle.yml"
        bundle.write_text(yaml.safe_dump({"name": "case", "flags": req["flags"]}))
        pp = pr.plan_probe(inv, state, pr.load_bundle(bundle), spare=req.get("spare", False),
                           instances=req.get("instances"))
        return pp.plan
    if req["op"] == "admission-keys":
        from pdops.ops import admission_keys as admission_ops

        return admission_ops.plan_rotate_keys(inv, state)
    raise AssertionError(f"unknown op {req['op']}")


def grouped_ids(plan) -> list:
    """Step ids, a parallel batch as a list (compared as given: the planner's order)."""
    return [b[0].name if len(b) == 1 else [s.name for s in b] for b in plan.batches()]


@pytest.mark.parametrize("case_file", CASES, ids=[c.stem for c in CASES])
def test_plan_is_exactly_the_steps_in_the_case_file(case_file, tmp_path, monkeypatch):
    case = yaml.safe_load(case_file.read_text())
    plan = make_plan(case, StateDir("lab", tmp_path / "state"), tmp_path, monkeypatch)
    assert grouped_ids(plan) == case["steps"]
    assert [s.name for s in plan.rescue] == case.get("rescue", [])  # what runs if a step fails
    assert [s.name for s in plan.always] == case.get("always", [])  # what runs last whatever the outcome


@pytest.mark.parametrize("case_file", CASES, ids=[c.stem for c in CASES])
def test_step_ids_are_unique_and_what_dry_run_prints(case_file, tmp_path, monkeypatch):
    case = yaml.safe_load(case_file.read_text())
    plan = make_plan(case, StateDir("lab", tmp_path / "state"), tmp_path, monkeypatch)
    ids = plan.step_ids()
    assert len(ids) == len(set(ids))
    printed = [ln.split(". ", 1)[1].split(" — ", 1)[0] for ln in plan.render().splitlines()
               if ln[:6].strip().rstrip(".").isdigit()]
    assert printed == ids
    # every step that waits says how long, and the runner enforces that same number
    for s in plan.steps:
        if s.kind in ("start", "register", "canary", "wait-empty", "leave-gateway", "gateway", "stop"):
            assert s.deadline and f"(within {s.deadline:g}s)" in s.line()


def test_every_step_kind_has_an_executor(tmp_path, monkeypatch):
    from pdops.kinds import KINDS

    # the one table: no import of any operation is needed for its kinds to be known
    for case_file in CASES:
        (tmp_path / case_file.stem).mkdir()
        plan = make_plan(yaml.safe_load(case_file.read_text()), StateDir("lab", tmp_path / case_file.stem / "state"),
                         tmp_path / case_file.stem, monkeypatch)
        assert {s.kind for s in plan.all_steps()} <= set(KINDS), case_file.name  # nested steps included
        # what each step reads from an earlier one (Step.needs) is given by a step before it: the check
        # `walk` makes before anything runs, so a plan that would fail it is a unit-test failure here
        plan.check()


def test_the_table_of_kinds_binds_each_kind_to_a_function_and_declares_only_known_outputs():
    """pdops.kinds.KINDS, the one place kinds meet executors: each names a function that exists (resolved
    as a walk would), with the runner's signature, and gives and reads only names of pdops.outputs; each
    failure line a plan may name (pdops.kinds.FAILURE_LINES) is a function of the walk's context."""
    import inspect

    from pdops.kinds import FAILURE_LINES, KINDS
    from pdops.outputs import OUTPUTS, REPORTED
    from pdops.runner import executor, failure_line

    for kind, k in KINDS.items():
        fn = executor(kind)
        assert callable(fn), kind
        assert list(inspect.signature(fn).parameters)[:2] == ["ctx", "step"], (kind, k.executor)
        assert all(n.rstrip("?") in OUTPUTS for n in k.gives + k.needs), kind
    assert executor("no-such-kind") is None
    for name in FAILURE_LINES:
        assert list(inspect.signature(failure_line(name)).parameters) == ["ctx", "plan"], name
    assert set(REPORTED) <= set(OUTPUTS)


def test_no_module_is_imported_for_its_side_effect_of_binding_kinds():
    """An operation's package imports what it calls, nothing more: a kind's executor is imported by the
    runner when a walk first needs it (a fresh interpreter: importing pdops.ops.scale loads no repair)."""
    import subprocess
    import sys

    code = "import sys, pdops.ops.scale; print(' '.join(m for m in sys.modules if m.startswith('pdops.ops.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "pdops.ops.repair" not in out and "pdops.ops.probe" not in out, out


def test_a_scale_step_id_carries_the_instance_so_two_drains_are_told_apart(fleet, tmp_path):
    state = StateDir("t", tmp_path / "state")
    record(fleet, state, place(fleet, parse_topology("8p4d")))
    plan = sc.plan_scale(fleet, parse_topology("10p2d"), state).plan
    checks = [s for s in plan.steps if s.kind == "empty-check"]
    assert [(s.name, s.instance) for s in checks] == [
        ("drain d03: empty-check-1", "d03"), ("drain d03: empty-check-2", "d03"),
        ("drain d04: empty-check-1", "d04"), ("drain d04: empty-check-2", "d04")]


def test_a_repair_canaries_only_through_peers_that_serve(tmp_path, monkeypatch):
    case = yaml.safe_load((REPO / "tests/data/plans/repair_d01_with_p02_and_the_gateway_down_of_2p1d.yml").read_text())
    plan = make_plan(case, StateDir("lab", tmp_path / "state"), tmp_path, monkeypatch)
    assert next(s for s in plan.steps if s.name == "canary d01").params["pairs"] == [("p01", "d01")]
    case["observed"] = {"d01": "restarted"}  # p02 serves: both pairs
    plan = make_plan(case, StateDir("lab", tmp_path / "state2"), tmp_path, monkeypatch)
    assert next(s for s in plan.steps if s.name == "canary d01").params["pairs"] == [("p01", "d01"), ("p02", "d01")]


def test_a_deploy_that_adds_the_admission_layer_is_a_change_never_the_live_revision(tmp_path):
    """The live path (decide from observation, record the MainPIDs seen) is only for the live
    revision's own files: an admission layer added to the inventory renders new shared files, which
    the change planner's no-op does not count, so the deploy must not take the live path."""
    from pdops.ops import deploy as dep

    state = StateDir("lab", tmp_path / "state")
    plain = load_inventory(REPO / "inventory" / "lab")
    record(plain, state, place(plain, parse_topology("2p1d")))
    assert dep.plan_deploy(plain, parse_topology("2p1d"), state).live is not None  # same files: the live path
    p = dep.plan_deploy(with_admission(tmp_path, state), parse_topology("2p1d"), state)
    assert p.live is None, p.render()
