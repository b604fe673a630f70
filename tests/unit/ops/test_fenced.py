"""A change of generation is planned fenced (blue/green), or refused, never rolled in waves unless
asked (docs/changes.md "Generations"). Pure: the planner and its printed plan, no host."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdops.errors import Refused
from pdops.model.inventory import load_inventory
from pdops.model.placement import place
from pdops.model.topology import parse_topology
from pdops.ops import scale as sc
from pdops.record.local import StateDir
from tests.unit.recorded import deployed, lab_variant

REPO = Path(__file__).resolve().parents[3]


def inventory(tmp_path: Path, name: str, *, gateways=("lab03", "lab04"), admission=True, page_size=None,
              hosts: int = 4, mem=None):
    """The lab with its gateways on `gateways` (the admission layer on the first), `hosts` GPU hosts and
    the lab-sim bundle with `page_size` and `mem` (mem_fraction_static) where given."""
    def more_hosts(doc):
        hs = doc["all"]["children"]["gpu_hosts"]["hosts"]
        for n in range(5, hosts + 1):
            hs[f"lab{n:02d}"] = {**hs["lab01"], "ansible_host": f"127.0.10.{n}", "pdops_data_addr": f"127.0.10.{n}"}

    bundle = {k: v for k, v in (("page_size", page_size), ("mem_fraction_static", mem)) if v is not None}
    return load_inventory(lab_variant(tmp_path, name, gateway={"hosts": list(gateways)},
                                      admission=gateways[0] if admission else False, edit=more_hosts, bundle=bundle))


@pytest.fixture
def state(tmp_path):
    return StateDir("lab", tmp_path / "state")


def test_a_change_of_page_size_is_a_fenced_rollout_on_its_own_pool(tmp_path, state):
    deployed(inventory(tmp_path, "old"), state, "1p1d", snapshot=True)
    plan = sc.plan_scale(inventory(tmp_path, "new", page_size=32), parse_topology("1p1d"), state)
    assert plan.generation.changes and "page size unset -> 32" in plan.generation.diff
    assert plan.fence["gateway"] == "lab04" and plan.fence["others"] == ["lab03"]
    # the new pool: new ids on the free slots, nothing replaced in place, the old pool removed
    assert [(i.id, i.hosts) for i in plan.added] == [("p02", ("lab03",)), ("d02", ("lab04",))]
    assert [i.id for i in plan.removed] == ["p01", "d01"] and not plan.replaced and not plan.waves
    names = [s.name for s in plan.run]
    order = ["fence", "start p02", "canary new pool", "register p02", "shift 10%", "shift 50%", "shift 100%", "commit",
             "drain p01: leave-gateway", "drain d01: verify-stop", "join register p02", "front-door open", "front-door",
             "record"]
    assert [n for n in names if n in order] == order
    # after the commit the old pool drains side by side: each step of p01's drain beside the same of d01's
    batches = [[s.name for s in b] for b in plan.plan.batches()]
    subs = ("leave-gateway", "wait-empty", "empty-check-1", "empty-check-2", "record-identity", "stop", "verify-stop")
    drains = [b for b in batches if b[0].startswith("drain ")]
    assert drains == [[f"drain p01: {sub}", f"drain d01: {sub}"] for sub in subs], drains
    reg = next(s for s in plan.run if s.name == "register p02")
    assert reg.params["gateways"] == ["lab04"]  # the new generation on its own gateway only
    assert next(s for s in plan.run if s.name == "join register p02").params["gateways"] == ["lab03"]
    rescue = {s.name: s for s in plan.rescue}
    assert rescue["front-door back"].when == ("committed", False) and rescue["unfence"].when == ("committed", False)
    assert rescue["rescue join register p02"].when == ("committed", True)
    assert rescue["restore-check"].when == ("committed", False)  # never the old generation back after commit
    # the rest of the restore follows restore-check's outputs: nothing to canary or register after commit
    assert rescue["restore-canary"].when == ("restore", True)
    assert [s.when for s in plan.rescue if s.kind == "restore-register"] == [("restore_canaried", True, "p01"),
                                                                               ("restore_canaried", True, "d01")]
    # the front door goes back only if the fence happened; the new pool is kept only once committed;
    # after commit what of the old pool is not yet drained leaves the other gateways before the join
    assert rescue["front-door back"].params["only_if_fenced"] and rescue["undo-decide"].params["fenced"]
    # each instance of the new pool has its two ways back, each a plan walked only if undo-decide names it
    assert rescue["undo p02"].when == ("undo_drain", True, "p02") and rescue["undo-stop p02"].when == ("undo_stop", True, "p02")
    assert rescue["undo p02"].params["plan"].step_ids()[0] == "undo p02: leave-gateway"
    names = [s.name for s in plan.rescue]
    assert names.index("rescue leave old pool") < names.index("rescue join register p02")
    assert rescue["rescue leave old pool"].when == ("committed", True)
    text = plan.render()
    assert "generation: " in text and "page size unset -> 32" in text
    assert "rolled fenced (blue/green)" in text and "shift 50%" in text and "only if not committed" in text
    plan.plan.check()  # every step's needs are given by an earlier step


def test_a_change_that_keeps_the_generation_rolls_in_waves_and_says_why(tmp_path, state):
    deployed(inventory(tmp_path, "old"), state, "1p1d", snapshot=True)
    plan = sc.plan_scale(inventory(tmp_path, "new", mem=0.45), parse_topology("1p1d"), state)
    assert not plan.generation.changes and plan.fence is None
    assert plan.surge == [("p01", "p02"), ("d01", "d02")]  # a lone instance of its role surges, as before
    text = plan.render()
    assert "generation: unchanged" in text and "rolled in waves: the generation is unchanged" in text


def test_without_two_gateways_behind_the_admission_layer_it_is_refused_unless_unfenced(tmp_path, state):
    deployed(inventory(tmp_path, "old", gateways=("lab01",)), state, "1p1d", snapshot=True)
    new = inventory(tmp_path, "new", gateways=("lab01",), page_size=32)
    with pytest.raises(Refused) as e:
        sc.plan_scale(new, parse_topology("1p1d"), state)
    assert "alters the generation (page size unset -> 32)" in e.value.message and "1 gateway" in e.value.message
    assert "--unfenced" in e.value.fix
    plan = sc.plan_scale(new, parse_topology("1p1d"), state, unfenced=True)
    assert plan.fence is None and plan.surge == [("p01", "p02"), ("d01", "d02")]
    assert "although the generation changes (--unfenced)" in plan.render()


def test_too_few_free_slots_shrink_the_old_pool_only_with_a_capacity_dip(tmp_path, state):
    deployed(inventory(tmp_path, "old", hosts=5), state, "2p1d", snapshot=True)
    new = inventory(tmp_path, "new", hosts=5, page_size=32)
    with pytest.raises(Refused) as e:
        sc.plan_scale(new, parse_topology("2p1d"), state)
    assert "the old pool would shrink by p02 first" in e.value.message and "--allow-capacity-dip" in e.value.fix
    plan = sc.plan_scale(new, parse_topology("2p1d"), state, allow_capacity_dip=True)
    names = [s.name for s in plan.run]
    assert names.index("shrink p02: verify-stop") < names.index("fence") < names.index("start p03")
    assert plan.fence["shrink"] == ["p02"]
    # preflight checks the new pool on the slots free now; the one on p02's slot is checked by the shrink's
    # verified stop (p02 holds its ports by design until then: once refused there, `port ... is taken`)
    pre = next(s for s in plan.run if s.name == "preflight")
    p02 = plan.current_placement.get("p02")
    on_p02 = [i.id for i in plan.target.instances if (i.hosts, i.slot) == (p02.hosts, p02.slot)]
    assert on_p02 and not set(on_p02) & {i.id for i in pre.params["placement"].instances}
    assert f"not yet {', '.join(on_p02)}" in pre.description


def test_no_room_even_at_the_floor_is_refused(tmp_path, state):
    deployed(inventory(tmp_path, "old"), state, "2p1d", snapshot=True)
    with pytest.raises(Refused) as e:
        sc.plan_scale(inventory(tmp_path, "new", page_size=32), parse_topology("2p1d"), state, allow_capacity_dip=True)
    assert "frees too few" in e.value.message


def test_a_flag_sglang_rejects_is_refused_when_the_change_is_planned(tmp_path, state):
    """The generation is read through SGLang's own flag table: a profile whose command line SGLang
    would refuse is refused before anything runs, not found when the first wave fails to start."""
    from pdops.errors import InvalidInput

    deployed(inventory(tmp_path, "old"), state, "1p1d", snapshot=True)
    new = inventory(tmp_path, "new")
    prof = new.path / "profiles" / "p.yml"
    doc = yaml.safe_load(prof.read_text())
    doc["extra_args"] = ["--no-such-sglang-flag"]
    prof.write_text(yaml.safe_dump(doc))
    with pytest.raises(InvalidInput) as e:
        sc.plan_scale(load_inventory(new.path), parse_topology("1p1d"), state)
    assert "unrecognized arguments: --no-such-sglang-flag" in e.value.message


def test_the_new_pool_never_lands_on_gpus_the_old_pool_holds(tmp_path, state):
    """TP 8 -> 4 is a change of layout (a generation): slots of the new shape overlap the old ones."""
    deployed(inventory(tmp_path, "old"), state, "1p1d", snapshot=True)
    new = inventory(tmp_path, "new")
    prof = new.path / "profiles" / "p.yml"
    doc = yaml.safe_load(prof.read_text())
    doc["parallel"] = {"tp": 4, "ep": 4, "pp": 1}
    prof.write_text(yaml.safe_dump(doc))
    plan = sc.plan_scale(load_inventory(new.path), parse_topology("1p1d"), state)
    assert plan.fence and "prefill TP 8 -> 4" in "; ".join(plan.generation.diff)
    old = {(r.host, g) for i in plan.removed for r in i.ranks for g in r.gpus}
    assert all(not ({(r.host, g) for r in i.ranks for g in r.gpus} & old) for i in plan.added), \
        [(i.id, i.hosts, i.head.gpus) for i in plan.added]


def test_host_maintenance_refuses_a_pending_change_of_generation_naming_it_and_the_command_that_fences_it(
        tmp_path, state):
    """`inv drain --host` and `inv uncordon` move instances; with an inventory edit that changes the page
    size pending, they once rolled the new generation in waves (its canary failed `generation mismatch`,
    and the fix line blamed the NICs). Now refused, nothing changed, the fields and `inv deploy` named."""
    from pdops.errors import Refused

    rev = deployed(inventory(tmp_path, "old"), state, "2p1d", snapshot=True)
    new = inventory(tmp_path, "new", page_size=32)
    with pytest.raises(Refused) as e:
        sc.plan_drain_host(new, state, "lab02")
    assert "another generation" in e.value.message and "page size unset -> 32" in e.value.message
    assert f"inv deploy --topology {rev.topology}" in e.value.fix and "nothing was changed" in e.value.message
    # the same inventory as the revision: host maintenance plans as before
    plan = sc.plan_drain_host(inventory(tmp_path, "same"), state, "lab02")
    assert plan.cordoned == ["lab02"]
    assert state.current_revision().number == rev.number


def test_a_role_with_no_instance_now_is_added_back_without_a_generation_change(tmp_path, state):
    """Found on real SGLang in the lab: its only decode drained (1p0d), `inv deploy --topology 1p1d` was
    refused as a change of generation ("decode TP unset -> 1"); the kept prefill was started knowing
    nothing of a decode's layout. What the kept instances do say still counts."""
    from pdops.model.placement import Placement
    from pdops.model.topology import Topology

    one = inventory(tmp_path, "one", gateways=("lab01",), admission=False)
    prefills = tuple(i for i in place(one, parse_topology("1p1d")).instances if i.role == "prefill")
    pl = Placement(Topology(1, 0), prefills)  # what `inv drain --instance d01 --force` records
    deployed(one, state, pl=pl, snapshot=True)
    plan = sc.plan_scale(one, parse_topology("1p1d"), state)
    assert not plan.generation.changes and [i.id for i in plan.added] == ["d01"], plan.render()
    with pytest.raises(Refused) as e:
        sc.plan_scale(inventory(tmp_path, "paged", gateways=("lab01",), admission=False, page_size=32),
                      parse_topology("1p1d"), state)
    assert "alters the generation (page size unset -> 32)" in e.value.message
