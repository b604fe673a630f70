"""Planning of topology changes and rollbacks: no host at all, only a state dir with revisions."""

from __future__ import annotations

import pytest

from pdops.ops import scale as sc
from pdops.errors import InvalidInput, Refused
from pdops.model.inventory import load_inventory, single_file_doc
from pdops.model.placement import Placement, place
from pdops.model.render import manifest, render_files
from pdops.record.local import StateDir
from pdops.model.topology import parse_topology

from tests.unit.recorded import REPO, deployed


@pytest.fixture
def state(tmp_path):
    return StateDir("test", tmp_path / "state")


def ids(insts):
    return [i.id for i in insts]


def caps(plan):
    return [plan.start_capacity] + [s.capacity for s in plan.steps]


def assert_capacity_floor(plan):
    old = plan.start_capacity
    new = (len(plan.target.role("prefill")), len(plan.target.role("decode")))
    for p, d in caps(plan):
        assert p >= min(old[0], new[0]) and d >= min(old[1], new[1]), caps(plan)


def test_8p4d_to_10p4d_adds_p09_p10_and_keeps_the_rest_identical(fleet, state):
    rev = deployed(fleet, state, "8p4d")
    plan = sc.plan_scale(fleet, parse_topology("10p4d"), state)
    assert ids(plan.added) == ["p09", "p10"] and plan.removed == []
    assert ids(plan.kept) == [f"p{n:02d}" for n in range(1, 9)] + ["d01", "d02", "d03", "d04"]
    new_mf = manifest(plan.files)
    old = Placement.from_dict(rev.placement)
    for inst in plan.kept:
        files = sc.instance_files(new_mf, inst.id)
        assert files and files == sc.instance_files(rev.manifest, inst.id)  # identical hashes
        assert plan.target.get(inst.id) == old.get(inst.id)  # same hosts, GPUs, ports
    # the added ones land on hosts nobody uses
    used = {h for i in old.instances for h in i.hosts}
    assert not {h for i in plan.added for h in i.hosts} & used
    assert [s.kind for s in plan.steps] == ["add", "add"]
    assert caps(plan) == [(8, 4), (9, 4), (10, 4)]
    text = plan.render()
    assert "added:   p09 (prefill) on gpu13 GPUs 0-7" in text and "p10 (prefill) on gpu14" in text
    assert "removed: none" in text and "36 rendered files identical to revision 1" in text


def test_8p4d_to_10p2d_adds_before_it_drains(fleet, state):
    deployed(fleet, state, "8p4d")
    plan = sc.plan_scale(fleet, parse_topology("10p2d"), state)
    assert ids(plan.added) == ["p09", "p10"] and ids(plan.removed) == ["d03", "d04"]
    assert [(s.kind, s.instance.id) for s in plan.steps] == [("add", "p09"), ("add", "p10"),
                                                             ("drain", "d03"), ("drain", "d04")]
    assert caps(plan) == [(8, 4), (9, 4), (10, 4), (10, 3), (10, 2)]
    assert_capacity_floor(plan)
    assert not plan.dip
    # the added prefills do not take the decodes' GPUs (free hosts exist)
    removed_hosts = {h for i in plan.removed for h in i.hosts}
    assert not {h for i in plan.added for h in i.hosts} & removed_hosts
    assert "prefix cache" not in plan.render()  # no prefill drained


def test_8p4d_to_12p4d_fills_the_fleet(fleet, state):
    deployed(fleet, state, "8p4d")
    plan = sc.plan_scale(fleet, parse_topology("12p4d"), state)
    assert ids(plan.added) == ["p09", "p10", "p11", "p12"] and not plan.removed
    assert len({h for i in plan.target.instances for h in i.hosts}) == 16
    assert_capacity_floor(plan)


def test_shrink_drains_the_highest_numbered_and_keeps_the_rest(fleet, state):
    deployed(fleet, state, "8p4d")
    plan = sc.plan_scale(fleet, parse_topology("4p2d"), state)
    assert not plan.added and ids(plan.removed) == ["p05", "p06", "p07", "p08", "d03", "d04"]
    assert ids(plan.kept) == ["p01", "p02", "p03", "p04", "d01", "d02"]
    assert all(s.kind == "drain" for s in plan.steps)
    assert caps(plan)[-1] == (4, 2)
    assert_capacity_floor(plan)
    assert "a drained prefill's prefix cache is lost" in plan.render()


@pytest.mark.parametrize("a,b,dip", [("1p1d", "2p1d", False), ("2p1d", "3p1d", False), ("3p1d", "2p1d", False),
                                     ("1p1d", "2p2d", False), ("2p2d", "3p1d", True), ("1p3d", "3p1d", True)])
def test_lab_changes_never_drop_a_role_below_min_old_new(lab_inv, state, a, b, dip):
    deployed(lab_inv, state, a)
    if dip:  # the 4 lab hosts are full: the new prefill needs a removed decode's host
        with pytest.raises(Refused, match="cannot add before it drains"):
            sc.plan_scale(lab_inv, parse_topology(b), state)
    plan = sc.plan_scale(lab_inv, parse_topology(b), state, allow_capacity_dip=dip)
    assert_capacity_floor(plan)
    assert bool(plan.dip) == dip
    assert str(plan.target.topology) == b
    assert [s.kind for s in plan.steps][0] == ("drain" if dip else plan.steps[0].kind)


def test_a_change_that_needs_gpus_of_removed_instances_requires_the_dip_flag(fleet, state):
    deployed(fleet, state, "12p4d")  # every GPU of the fleet in use
    with pytest.raises(Refused) as e:
        sc.plan_scale(fleet, parse_topology("10p6d"), state)
    msg = e.value.render()
    assert "--allow-capacity-dip" in msg
    assert "d05 (decode) needs gpu11 GPUs 0-7, held by p11" in msg and "gpu12 GPUs 0-7, held by p12" in msg
    plan = sc.plan_scale(fleet, parse_topology("10p6d"), state, allow_capacity_dip=True)
    assert [(s.kind, s.instance.id) for s in plan.steps] == [("drain", "p11"), ("add", "d05"),
                                                             ("drain", "p12"), ("add", "d06")]
    assert caps(plan) == [(12, 4), (11, 4), (11, 5), (10, 5), (10, 6)]
    assert len(plan.dip) == 2 and "15 instances" in plan.dip[0]
    assert "capacity dip (--allow-capacity-dip): d05 (decode) needs gpu11 GPUs 0-7" in plan.render()
    assert plan.target.get("d05").hosts == ("gpu11",)


def test_same_topology_is_a_noop_that_says_so(lab_inv, state):
    deployed(lab_inv, state, "2p1d")
    plan = sc.plan_scale(lab_inv, parse_topology("2p1d"), state)
    assert plan.noop and not plan.steps
    assert "no change: revision 1 is already 2p1d" in plan.render()
    with pytest.raises(Refused):
        sc.execute_scale(plan, state, pool=None, gateways=None)
    assert state.revision_numbers() == [1]


def test_target_too_big_for_the_inventory(lab_inv, state):
    deployed(lab_inv, state, "2p1d")
    with pytest.raises(InvalidInput) as e:
        sc.plan_scale(lab_inv, parse_topology("4p2d"), state)
    assert "room for 4" in e.value.message


def test_nothing_deployed_is_refused(lab_inv, state):
    with pytest.raises(Refused, match="no current revision"):
        sc.plan_scale(lab_inv, parse_topology("2p1d"), state)
    with pytest.raises(Refused, match="no current revision"):
        sc.plan_rollback(lab_inv, state)


def variant(repo, tmp_path, edit, name="inv"):
    """The lab inventory with `edit(doc, dir)` applied, as an operator would edit it."""
    import yaml

    doc = single_file_doc(repo / "inventory" / "lab")
    d = tmp_path / name
    d.mkdir()
    edit(doc, d)
    (d / "hosts.yml").write_text(yaml.safe_dump(doc))
    return load_inventory(d)


def with_bundle(**bundle):
    """An edit that points the inventory at a copy of the lab profile with other bundle values."""
    import yaml

    def edit(doc, d):
        prof = yaml.safe_load((REPO / "pdops" / "profiles" / "lab-sim.yml").read_text())
        prof["bundle"].update(bundle)
        (d / "bundle.yml").write_text(yaml.safe_dump(prof))
        doc["all"]["vars"]["pdops_profile"] = "bundle.yml"
    return edit


def test_a_gateway_setting_change_restarts_the_gateway_after_the_instances(lab_inv, state, tmp_path, repo):
    deployed(lab_inv, state, "2p1d")
    changed = variant(repo, tmp_path, lambda doc, d: doc["all"]["vars"]["pdops_gateway"].update(
        health_check_interval_secs=7))
    plan = sc.plan_scale(changed, parse_topology("3p1d"), state)
    assert ids(plan.added) == ["p03"] and not plan.replaced  # the engines' files do not change
    assert any("pdops-gateway.sh changed" in c for c in plan.gateway_restart)
    names = plan.plan.step_ids()
    assert names.index("register p03") < names.index("gateway-restart") < names.index("verify-running")
    assert "gateway: restarted after the instances" in plan.render()
    step = {s.name: s for s in plan.plan.steps}["gateway-restart"]
    assert step.params["admission_hosts"] == [] and "admission layer" not in step.description
    same = sc.plan_scale(changed, parse_topology("2p1d"), state)
    assert not same.noop and same.plan.step_ids()[-3:] == ["gateway-restart", "verify-running", "record"]


def test_a_bundle_change_replaces_every_instance_one_per_role_at_a_time(lab_inv, state, tmp_path, repo):
    rev = deployed(lab_inv, state, "2p2d")
    inv = variant(repo, tmp_path, with_bundle(max_running_requests=32))
    plan = sc.plan_apply(inv, parse_topology("2p2d"), state)
    assert ids(plan.replaced) == ["p01", "p02", "d01", "d02"] and not plan.added and not plan.removed
    assert plan.waves == [["p01", "d01"], ["p02", "d02"]]
    assert all("pdops-" in plan.why[i] and "changed" in plan.why[i] for i in plan.why)
    assert plan.min_capacity() == (1, 1)  # one per role out at once, never zero
    old = Placement.from_dict(rev.placement)
    for i in plan.target.role("prefill"):  # each replacement on the port its predecessor did not use
        assert i.bootstrap_port == old.get(i.id).bootstrap_port + 1 and i.http_port == old.get(i.id).http_port
    batches = [[s.name for s in b] for b in plan.plan.batches()]
    assert ["replace p01: leave-gateway", "replace d01: leave-gateway"] in batches
    assert ["start p01", "start d01"] in batches
    names = plan.plan.step_ids()
    assert names.index("replace p01: verify-stop") < names.index("deliver p01+d01") < names.index("start p01")
    assert names.index("register d01") < names.index("replace p02: leave-gateway")
    canary = next(s for s in plan.run if s.name == "canary p01+d01")
    assert sorted(canary.params["pairs"]) == [("p01", "d01"), ("p01", "d02"), ("p02", "d01")]
    assert names[-2:] == ["verify-running", "record"]
    # the first delivery holds the replaced instances' own files back until their wave
    assert next(s for s in plan.run if s.name == "deliver").params["hold"] == ["p01", "p02", "d01", "d02"]
    assert "--max-running-requests" in next(f.content for f in plan.files if f.path.endswith("pdops-p01.sh"))


def test_a_wave_with_an_instance_observed_down_still_stops_and_verifies_the_other(lab_inv, state, tmp_path, repo):
    """A bundle change while d01 is down: the wave p01+d01 drains p01 in full (waits, empty checks) and
    d01 without waiting (nothing of it runs); both old processes are stopped and verified before their
    new files are delivered. (The two drains ran step by step side by side cut to the shorter one:
    p01's stop and verify-stop were dropped, and its new process was started beside the old.)"""
    from pdops.reads.observation import Seen

    deployed(lab_inv, state, "2p2d")
    inv = variant(repo, tmp_path, with_bundle(max_running_requests=32))
    seen = Seen({"d01": "units not running: lab04:pdops-d01.service failed/failed"}, frozenset({"d01"}))
    plan = sc.plan_apply(inv, parse_topology("2p2d"), state, seen=seen)
    names = plan.plan.step_ids()
    wave = names[:names.index("deliver p01+d01")]
    for step in ("leave-gateway", "record-identity", "stop", "verify-stop"):
        assert f"replace p01: {step}" in wave and f"replace d01: {step}" in wave, (step, wave)
    assert "replace p01: empty-check-2" in wave and "replace d01: wait-empty" not in names
    batches = [[s.name for s in b] for b in plan.plan.batches()]
    assert ["replace p01: stop", "replace d01: stop"] in batches  # still side by side, step for step
    assert ["replace p01: wait-empty"] in batches


def test_max_unavailable_two_replaces_a_role_in_one_wave_only_when_it_keeps_one_serving(state, tmp_path, repo):
    def edit(doc, d):
        with_bundle(chunked_prefill_size=4096)(doc, d)
    inv = variant(repo, tmp_path, edit)
    base = variant(repo, tmp_path, lambda doc, d: None, name="base")
    deployed(base, state, "3p1d")
    # the lone decode has no free slot to surge into: --force accepts it; prefills: at most 2 of 3 at once
    plan = sc.plan_apply(inv, parse_topology("3p1d"), state, max_unavailable=3, force=True)
    assert plan.waves == [["p01", "p02", "d01"], ["p03"]]
    assert plan.min_capacity() == (1, 0)
    plan = sc.plan_apply(inv, parse_topology("3p1d"), state, max_unavailable=1, force=True)
    assert plan.waves == [["p01", "d01"], ["p02"], ["p03"]] and plan.min_capacity() == (2, 0)


def test_a_single_instance_role_surges_into_a_free_slot(lab_inv, state, tmp_path, repo):
    deployed(lab_inv, state, "1p1d")
    inv = variant(repo, tmp_path, with_bundle(max_running_requests=16))
    plan = sc.plan_apply(inv, parse_topology("1p1d"), state)
    assert plan.surge == [("p01", "p02"), ("d01", "d02")]
    assert ids(plan.added) == ["p02", "d02"] and ids(plan.removed) == ["p01", "d01"] and not plan.replaced
    assert plan.min_capacity() == (1, 1)
    names = plan.plan.step_ids()
    assert names.index("register p02") < names.index("drain p01: leave-gateway")


def test_no_free_slot_to_surge_into_is_refused_before_any_host(lab_inv, state, tmp_path, repo):
    deployed(lab_inv, state, "2p2d")
    inv = variant(repo, tmp_path, with_bundle(max_running_requests=16))
    with pytest.raises(Refused, match="--max-unavailable 0.*no free slot"):
        sc.plan_apply(inv, parse_topology("2p2d"), state, max_unavailable=0)
    with pytest.raises(InvalidInput, match="max-unavailable"):
        sc.plan_apply(inv, parse_topology("2p2d"), state, max_unavailable=-1)


def test_a_lone_instance_with_no_room_to_surge_needs_force(fleet, state, tmp_path, repo):
    deployed(lab_inv_4(repo, tmp_path), state, "1p3d")
    inv = variant(repo, tmp_path, with_bundle(max_running_requests=16), name="b")
    with pytest.raises(Refused, match="no serving prefill"):
        sc.plan_apply(inv, parse_topology("1p3d"), state)
    plan = sc.plan_apply(inv, parse_topology("1p3d"), state, force=True)
    assert plan.min_capacity()[0] == 0 and "p01" in ids(plan.replaced)


def test_an_added_instance_serves_while_the_lone_old_one_is_replaced_in_place(state, tmp_path, repo):
    """1p2d with a bundle change, scaled to 2p2d on a 4-slot lab: no free slot is left for a surge,
    but p02 is added on free GPUs first, so p01 is replaced in place after p02 is registered and a
    prefill serves at every step (this was refused: 'no free slot to start a replacement first')."""
    deployed(lab_inv_4(repo, tmp_path), state, "1p2d")
    inv = variant(repo, tmp_path, with_bundle(max_running_requests=16), name="b")
    plan = sc.plan_apply(inv, parse_topology("2p2d"), state)
    assert ids(plan.added) == ["p02"] and sorted(ids(plan.replaced)) == ["d01", "d02", "p01"] and not plan.surge
    assert plan.min_capacity()[0] >= 1 and plan.min_capacity()[1] >= 1
    names = plan.plan.step_ids()
    assert names.index("register p02") < names.index("replace p01: leave-gateway"), names
    # (with nothing added first the lone prefill cannot keep serving: refused, as
    # test_a_lone_instance_with_no_room_to_surge_needs_force shows)


def lab_inv_4(repo, tmp_path):
    return variant(repo, tmp_path, lambda doc, d: None, name="a")


def test_shrinking_drains_one_and_growing_takes_the_lowest_free_id(lab_inv, state):
    from pdops.model.placement import place_change

    pl3 = place(lab_inv, parse_topology("3p1d"))
    # 3p1d holding p01, p03, p04 (p02 drained earlier): ids need not be contiguous
    p = {i.id: i for i in pl3.instances}
    from pdops.model.placement import make_instance, gpu_slots
    p04 = make_instance(lab_inv, "prefill", 4, gpu_slots(lab_inv)[1])
    holes = Placement(parse_topology("3p1d"), (p["p01"], p["p03"], p04, p["d01"]))
    deployed(lab_inv, state, "3p1d", pl=holes)
    plan = sc.plan_scale(lab_inv, parse_topology("2p1d"), state)
    assert ids(plan.removed) == ["p04"] and not plan.added and not plan.replaced
    grown = place_change(lab_inv, parse_topology("3p1d"), plan.target)
    assert [i.id for i in grown.role("prefill")] == ["p01", "p02", "p03"]


def test_kept_instance_whose_files_changed_is_replaced_naming_the_file(lab_inv, state):
    rev = deployed(lab_inv, state, "2p1d")
    # a revision recorded with other file contents for p01 (e.g. by another pdops version)
    mf = {h: dict(f) for h, f in rev.manifest.items()}
    path = next(p for p in mf["lab01"] if p.endswith("pdops-p01.env"))
    mf["lab01"][path] = {"sha256": "0" * 64, "mode": "0o600"}
    r2 = state.write_revision(topology=rev.topology, inventory_hash=rev.inventory_hash, placement=rev.placement,
                              manifest=mf, instances=rev.instances, outcome="deployed")
    state.set_current(r2.number)
    plan = sc.plan_scale(lab_inv, parse_topology("3p1d"), state)
    assert ids(plan.replaced) == ["p01"] and ids(plan.added) == ["p03"]
    assert "pdops-p01.env" in plan.why["p01"] and "replaced: p01" in plan.render()


def test_removing_a_host_that_holds_an_instance_is_refused_naming_it(lab_inv, state, tmp_path, repo):
    deployed(lab_inv, state, "2p2d")  # d02 on lab04
    inv = variant(repo, tmp_path, lambda doc, d: doc["all"]["children"]["gpu_hosts"]["hosts"].pop("lab04"))
    with pytest.raises(InvalidInput, match="d02 .*lab04.*no longer has") as e:
        sc.plan_apply(inv, parse_topology("2p2d"), state)
    assert "inv drain --host lab04" in e.value.render()


def test_a_host_added_to_the_inventory_can_be_scaled_onto(state, tmp_path, repo):
    def three(doc, d):
        doc["all"]["children"]["gpu_hosts"]["hosts"].pop("lab04")
    small = variant(repo, tmp_path, three, name="small")
    deployed(small, state, "2p1d")
    full = variant(repo, tmp_path, lambda doc, d: None, name="full")
    plan = sc.plan_apply(full, parse_topology("3p1d"), state)
    assert ids(plan.added) == ["p03"] and plan.target.get("p03").hosts == ("lab04",)
    assert not plan.replaced and ids(plan.kept) == ["p01", "p02", "d01"]


# ---------------------------------------------------------------- rollback

def test_rollback_without_previous_revision_is_refused(lab_inv, state):
    deployed(lab_inv, state, "2p1d")
    with pytest.raises(Refused) as e:
        sc.plan_rollback(lab_inv, state)
    assert "no deployed revision before revision 1" in e.value.message


def test_rollback_plans_the_way_back_to_the_recorded_placement(lab_inv, state):
    deployed(lab_inv, state, "3p1d")
    deployed(lab_inv, state, "2p1d", pl=place(lab_inv, parse_topology("2p1d"),
                                              Placement.from_dict(state.read_revision(1).placement)))
    plan = sc.plan_rollback(lab_inv, state)
    assert plan.rollback_of == 1 and ids(plan.added) == ["p03"] and not plan.removed
    assert plan.target == Placement.from_dict(state.read_revision(1).placement)
    assert "rollback to revision 1" in plan.render()
    # --to names a revision; the current one or an undeployed one is refused
    with pytest.raises(Refused, match="already current"):
        sc.plan_rollback(lab_inv, state, to=2)
    bad = deployed(lab_inv, state, "1p1d", outcome="failed", make_current=False)
    with pytest.raises(Refused, match="ended 'failed'"):
        sc.plan_rollback(lab_inv, state, to=bad.number)
    with pytest.raises(InvalidInput, match="no revision 9"):
        sc.plan_rollback(lab_inv, state, to=9)


def test_rollback_keeps_recorded_slots_even_where_placement_would_choose_others(fleet, state):
    # 8p4d -> 10p2d: p09/p10 take free hosts, d03/d04 are drained; rolling back restores d03/d04 exactly
    r1 = deployed(fleet, state, "8p4d")
    plan = sc.plan_scale(fleet, parse_topology("10p2d"), state)
    deployed(fleet, state, "10p2d", pl=plan.target)
    back = sc.plan_rollback(fleet, state)
    assert ids(back.added) == ["d03", "d04"] and ids(back.removed) == ["p09", "p10"]
    assert back.target == Placement.from_dict(r1.placement)
    assert [s.kind for s in back.steps] == ["add", "add", "drain", "drain"]


def test_rollback_refused_when_hosts_changed_naming_what(lab_inv, state, tmp_path, repo):
    r1 = deployed(lab_inv, state, "3p1d")
    # the previous revision was recorded with p03 on a host address that the inventory no longer has
    pl = r1.placement
    for i in pl["instances"]:
        if i["id"] == "p03":
            i["ranks"][0]["data_addr"] = "127.0.10.99"
    old = state.write_revision(topology="3p1d", inventory_hash=r1.inventory_hash, placement=pl, manifest=r1.manifest,
                               instances=r1.instances, outcome="deployed")
    cur = deployed(lab_inv, state, "2p1d", pl=place(lab_inv, parse_topology("2p1d"), Placement.from_dict(r1.placement)))
    assert cur.number == 3 and old.number == 2
    with pytest.raises(Refused) as e:
        sc.plan_rollback(lab_inv, state)
    msg = e.value.render()
    assert "rollback conditions no longer hold" in msg and "host lab03 of p03: data address 127.0.10.99 -> 127.0.10.3" in msg


def test_rollback_refused_when_rendered_files_changed_naming_them(lab_inv, state):
    r1 = deployed(lab_inv, state, "3p1d")
    mf = {h: dict(f) for h, f in r1.manifest.items()}
    unit = next(p for h in mf for p in mf[h] if p.endswith("pdops-p03.service"))
    mf["lab03"][unit] = {"sha256": "f" * 64, "mode": "0o644"}
    old = state.write_revision(topology="3p1d", inventory_hash=r1.inventory_hash, placement=r1.placement,
                               manifest=mf, instances=r1.instances, outcome="deployed")
    deployed(lab_inv, state, "2p1d", pl=place(lab_inv, parse_topology("2p1d"), Placement.from_dict(r1.placement)))
    with pytest.raises(Refused) as e:
        sc.plan_rollback(lab_inv, state, to=old.number)
    assert "p03: lab03:/etc/systemd/system/pdops-p03.service changed" in e.value.render()


def test_rollback_refused_when_the_inventory_differs_from_the_target(lab_inv, state):
    r1 = deployed(lab_inv, state, "3p1d")
    state.write_revision(topology="3p1d", inventory_hash="0" * 64, placement=r1.placement, manifest=r1.manifest,
                         instances=r1.instances, outcome="deployed")
    deployed(lab_inv, state, "2p1d", pl=place(lab_inv, parse_topology("2p1d"), Placement.from_dict(r1.placement)))
    with pytest.raises(Refused) as e:
        sc.plan_rollback(lab_inv, state)
    assert "inventory digest 000000000000 at revision 2, " in e.value.render()


def test_concurrent_operation_is_refused_before_any_host(lab_inv, state):
    deployed(lab_inv, state, "2p1d")
    plan = sc.plan_scale(lab_inv, parse_topology("3p1d"), state)
    with state.lock("drain", operator="alice@laptop"):
        with pytest.raises(Refused, match="alice@laptop"):
            sc.execute_scale(plan, state, say=lambda s: None, pool=None, gateways=None)
    assert state.current() == 1 and state.revision_numbers() == [1]


def test_drain_host_moves_its_instance_to_a_free_slot_first_and_cordons_it(lab_inv, state):
    deployed(lab_inv, state, "2p1d")  # p01 lab01, p02 lab02, d01 lab03; lab04 free
    plan = sc.plan_drain_host(lab_inv, state, "lab02")
    assert plan.surge == [("p02", "p03")] and ids(plan.added) == ["p03"] and ids(plan.removed) == ["p02"]
    assert plan.target.get("p03").hosts == ("lab04",) and plan.cordoned == ["lab02"]
    names = plan.plan.step_ids()
    assert names.index("register p03") < names.index("drain p02: leave-gateway")
    assert plan.min_capacity() == (2, 1) and "cordoned: lab02" in plan.render()
    # the record step records the move as the surge the dry run shows (it once recorded none: the surge was
    # set on the plan after its steps froze)
    [rec] = [s for s in plan.run if s.kind == "record-scale"]
    assert rec.params["change"].surge == (("p02", "p03"),)


def test_drain_host_without_room_shrinks_the_role_and_refuses_its_last_instance(lab_inv, state):
    deployed(lab_inv, state, "3p1d")  # every slot used
    plan = sc.plan_drain_host(lab_inv, state, "lab02")
    assert ids(plan.removed) == ["p02"] and not plan.added and str(plan.target.topology) == "2p1d"
    with pytest.raises(Refused, match="no serving decode"):
        sc.plan_drain_host(lab_inv, state, plan.target.get("d01").hosts[0])
    with pytest.raises(InvalidInput, match="unknown host"):
        sc.plan_drain_host(lab_inv, state, "lab09")


def test_a_cordoned_host_is_avoided_until_uncordoned(lab_inv, state):
    rev = deployed(lab_inv, state, "2p1d")
    r2 = state.write_revision(topology=rev.topology, inventory_hash=rev.inventory_hash, placement=rev.placement,
                              manifest=rev.manifest, instances=rev.instances, outcome="deployed",
                              extra={"cordoned": ["lab04"]})
    state.set_current(r2.number)
    with pytest.raises(InvalidInput, match="room for 4.*lab04 cordoned"):
        sc.plan_apply(lab_inv, parse_topology("3p1d"), state)
    un = sc.plan_uncordon(lab_inv, state, "lab04")
    assert un.cordoned == [] and un.plan.step_ids() == ["verify-running", "record"]
    with pytest.raises(Refused, match="not cordoned"):
        sc.plan_uncordon(lab_inv, state, "lab03")


def test_rollback_returns_to_the_recorded_files_even_after_the_inventory_was_edited(lab_inv, state, tmp_path, repo):
    from pdops.model.render import snapshot_of

    pl = place(lab_inv, parse_topology("2p2d"))
    r1 = deployed(lab_inv, state, pl=pl, snapshot=True)
    edited = variant(repo, tmp_path, with_bundle(max_running_requests=16))
    change = sc.plan_apply(edited, parse_topology("2p2d"), state)
    r2 = state.write_revision(topology="2p2d", inventory_hash=edited.digest, placement=change.target.to_dict(),
                              manifest=manifest(change.files), instances={i.id: {"role": i.role} for i in pl.instances},
                              outcome="deployed", snapshot=snapshot_of(edited, change.files))
    state.set_current(r2.number)
    back = sc.plan_rollback(edited, state)  # the inventory on disk still names the new bundle
    assert back.rollback_of == r1.number and ids(back.replaced) == ["p01", "p02", "d01", "d02"]
    assert manifest(back.files) == r1.manifest  # revision 1's files, not a rendering of the edited inventory
    assert back.rollback_inventory_hash == lab_inv.digest
    # what the record step records (the facts it was compiled with): the target revision's inventory digest,
    # not the edited inventory's on disk (it once was: the digest was set on the plan after its steps froze)
    [rec] = [s for s in back.run if s.kind == "record-scale"]
    assert rec.params["change"].rollback_inventory_hash == lab_inv.digest != edited.digest
    assert back.target == pl  # and its placement (prefills back on their first bootstrap ports)


def test_a_prefill_re_added_on_a_slot_takes_the_port_its_last_prefill_did_not_use(lab_inv, state):
    from pdops.model.placement import last_bootstrap_ports, slot_name

    full = place(lab_inv, parse_topology("3p1d"))
    p03 = full.get("p03")
    two = Placement(parse_topology("2p1d"), tuple(i for i in full.instances if i.id != "p03"))
    # revision 2p1d after p03 was drained: the slot remembers p03's port
    rev = deployed(lab_inv, state, "2p1d", pl=two)
    r2 = state.write_revision(topology="2p1d", inventory_hash=rev.inventory_hash, placement=rev.placement,
                              manifest=rev.manifest, instances=rev.instances, outcome="deployed",
                              extra={"last_bootstrap": last_bootstrap_ports({}, full)})
    state.set_current(r2.number)
    plan = sc.plan_scale(lab_inv, parse_topology("3p1d"), state)
    new = plan.target.get("p03")
    assert slot_name(new) == slot_name(p03) and new.bootstrap_port == p03.bootstrap_port + 1
    assert f"--disaggregation-bootstrap-port {new.bootstrap_port}" in next(
        f.content for f in plan.files if f.path.endswith("pdops-p03.sh"))


def test_an_sglang_upgrade_rolls_every_instance(lab_inv, state, monkeypatch):
    deployed(lab_inv, state, "2p2d")
    import pdops.model.commands as commands

    monkeypatch.setattr(commands, "SGLANG_VERSION", "0.5.24")
    plan = sc.plan_apply(lab_inv, parse_topology("2p2d"), state)
    assert ids(plan.replaced) == ["p01", "p02", "d01", "d02"] and not plan.gateway_restart
    assert plan.waves == [["p01", "d01"], ["p02", "d02"]]


def test_a_gateway_upgrade_restarts_the_gateway_alone(lab_inv, state, monkeypatch):
    deployed(lab_inv, state, "2p2d")
    import pdops.model.render as render

    monkeypatch.setattr(render, "SMG_VERSION", "1.14.0")
    plan = sc.plan_apply(lab_inv, parse_topology("2p2d"), state)
    assert not plan.replaced and any("gateway" in c for c in plan.gateway_restart)


def test_a_multi_node_instance_is_replaced_as_a_whole(fleet, state):
    import dataclasses

    two_node = dataclasses.replace(fleet, profile=dataclasses.replace(fleet.profile, tp=8, pp=2))
    deployed(two_node, state, "2p2d")
    bundle = dict(two_node.profile.bundle, max_running_requests=7)
    changed = dataclasses.replace(two_node, profile=dataclasses.replace(two_node.profile, bundle=bundle))
    plan = sc.plan_apply(changed, parse_topology("2p2d"), state)
    p01 = plan.target.get("p01")
    assert p01.nnodes == 2 and ids(plan.replaced) == ["p01", "p02", "d01", "d02"]
    run = {s.name: s for s in plan.run}
    # every rank's unit is drained and stopped with the instance, every rank's files delivered in its wave
    assert run["replace p01: stop"].params["instance"] == "p01"
    own = sc.instance_files(manifest(plan.files), "p01")
    assert {h for h, _ in own} == set(p01.hosts) and any("-r1." in p for _, p in own)
    assert all(f"{h}:{u}" in run["start p01"].description for h, u in p01.units)


def test_an_admission_cap_change_is_a_graceful_reload_at_the_end(state, tmp_path, repo):
    kf = tmp_path / "keys"
    kf.write_text("pdops-key-one-0123456789\n")
    kf.chmod(0o600)
    base = variant(repo, tmp_path, lambda doc, d: doc["all"]["vars"].update(
        pdops_admission={"api_keys_file": str(kf), "cap": 16}), name="base")
    deployed(base, state, "2p1d")
    more = variant(repo, tmp_path, lambda doc, d: doc["all"]["vars"].update(
        pdops_admission={"api_keys_file": str(kf), "cap": 24}), name="more")
    plan = sc.plan_apply(more, parse_topology("2p1d"), state)
    assert not plan.replaced and not plan.gateway_restart and plan.admission_reload
    assert plan.plan.step_ids()[-4:] == ["admission-check", "admission-reload", "verify-running", "record"]
    assert "admission layer: reloaded gracefully" in plan.render()


def test_max_unavailable_0_surges_every_replacement_through_one_free_slot(lab_inv, state, tmp_path, repo):
    rev = deployed(lab_inv, state, "2p1d")  # p01 lab01, p02 lab02, d01 lab03; lab04 free
    inv = variant(repo, tmp_path, with_bundle(max_running_requests=16))
    plan = sc.plan_apply(inv, parse_topology("2p1d"), state, max_unavailable=0)
    assert plan.surge == [("p01", "p03"), ("p02", "p04"), ("d01", "d02")] and not plan.replaced and not plan.dip
    t = plan.target
    assert [t.get(i).hosts for i in ("p03", "p04", "d02")] == [("lab04",), ("lab01",), ("lab02",)]
    old_p01 = Placement.from_dict(rev.placement).get("p01")
    assert t.get("p04").bootstrap_port == old_p01.bootstrap_port + 1  # not the port p01 had there
    names = plan.plan.step_ids()
    assert names.index("register p03") < names.index("drain p01: leave-gateway") < names.index("start p04")
    assert names.index("register p04") < names.index("drain p02: leave-gateway") < names.index("start d02")
    assert names.index("register d02") < names.index("drain d01: leave-gateway")
    assert plan.min_capacity() == (2, 1)  # never below what serves now


def test_a_gateway_restart_behind_the_admission_layer_keeps_the_gateway_in_service_in_its_plan(state, tmp_path,
                                                                                               repo):
    """The dry run says what the restart does to the admission layer (the only gateway: a stand-in first,
    make before break, no health check paused), and the step carries the host whose HAProxy it tells
    (nothing decided at run time)."""
    kf = tmp_path / "keys"
    kf.write_text("pdops-key-one-0123456789\n")
    kf.chmod(0o600)

    def with_admission(interval):
        return lambda doc, d: (doc["all"]["vars"].update(pdops_admission={"api_keys_file": str(kf)}),
                               doc["all"]["vars"]["pdops_gateway"].update(health_check_interval_secs=interval))

    base = variant(repo, tmp_path, with_admission(5), name="base")
    deployed(base, state, "2p1d")
    plan = sc.plan_apply(variant(repo, tmp_path, with_admission(7), name="changed"), parse_topology("2p1d"), state)
    step = {s.name: s for s in plan.plan.steps}["gateway-restart"]
    assert step.params["admission_hosts"] == [base.admission.host]
    assert "make before break" in step.description and "No health check is paused" in step.description
    assert f"stand-in smg from the new files on {base.gateway.standby(base.gateway.hosts[0]).url}" in step.description
    assert base.gateway.standby(base.gateway.hosts[0]).port == base.gateway.port - 1


def test_a_floor_already_broken_is_said_not_refused(lab_inv, state):
    """3p1d fills the 4-host lab; replacing the lone decode has no free slot to surge into: refused
    while d01 serves. Observed down (nothing serves decode now), the same change is the way back: the
    plan says so and brings d01 up first, with no wait for a process that does not run."""
    from pdops.reads.observation import Seen

    deployed(lab_inv, state, "3p1d")
    with pytest.raises(Refused, match="replacing d01 would leave no serving decode"):
        sc.plan_apply(lab_inv, parse_topology("3p1d"), state, replace_ids={"d01": "a template change"})
    seen = Seen({"d01": "units not running: lab04:pdops-d01.service failed/failed"}, frozenset({"d01"}))
    plan = sc.plan_apply(lab_inv, parse_topology("3p1d"), state, replace_ids={"d01": "a template change"}, seen=seen)
    assert plan.broken == ["no decode serves now (d01 observed not serving): this change brings d01 up first"]
    assert plan.start_capacity == (3, 0)
    names = [s.name for s in plan.run]
    assert "replace d01: verify-stop" in names and not any("wait-empty" in n for n in names), names
    assert "floor: no decode serves now" in plan.render()


def test_an_instance_that_does_not_serve_goes_first_and_costs_no_capacity(lab_inv, state):
    """2p2d with d01 down: `inv scale --topology 2p2d` replaces d01 (and nothing else); a decode
    serves at every step; d02 is never taken out."""
    from pdops.reads.observation import Seen

    deployed(lab_inv, state, "2p2d")
    assert sc.plan_scale(lab_inv, parse_topology("2p2d"), state).noop
    seen = Seen({"d01": "units not running"}, frozenset({"d01"}))
    plan = sc.plan_scale(lab_inv, parse_topology("2p2d"), state, seen=seen)
    assert ids(plan.replaced) == ["d01"] and ids(plan.kept) == ["p01", "p02", "d02"]
    assert caps(plan) == [(2, 1), (2, 1), (2, 2)]
    assert not any(s.name.startswith("replace d02") for s in plan.run)


def test_a_serving_instance_is_replaced_after_the_one_that_does_not_serve(lab_inv, state):
    """Both decodes are replaced by a change; d02 is observed out of the gateway: it goes in the
    first wave, so d01 keeps serving until d02 is back."""
    from pdops.reads.observation import Seen

    deployed(lab_inv, state, "2p2d")
    seen = Seen({"d02": "not in the gateway's /workers"})
    plan = sc.plan_apply(lab_inv, parse_topology("2p2d"), state, replace_ids={"d01": "x", "d02": "y"}, seen=seen)
    assert plan.waves == [["d02"], ["d01"]]
    assert min(c[1] for c in caps(plan)) == 1  # a decode serves throughout
    # d02 runs (only the gateway lost it): its drain still waits for its in-flight work
    assert "replace d02: wait-empty" in [s.name for s in plan.run]


def test_a_gateway_that_does_not_answer_is_started_first_and_waited_for(lab_inv, state):
    from pdops.reads.observation import Seen

    deployed(lab_inv, state, "2p2d")
    seen = Seen({"d01": "units not running"}, frozenset({"d01"}),
                gateways_down={lab_inv.gateway.first.host: "pdops-gateway.service failed/failed"})
    plan = sc.plan_scale(lab_inv, parse_topology("2p2d"), state, seen=seen)
    gw = plan.run[1]
    assert (plan.run[0].name, gw.name, gw.kind) == ("connect", "gateway", "gateway")
    assert gw.params == {"gateway": lab_inv.gateway.first.host, "restart": False, "clear_list": False, "unlist": ["d01"],
                         "wait_for": {i.id: i.url for i in plan.current_placement.instances if i.id != "d01"}}
    assert "the gateway does not answer (pdops-gateway.service failed/failed): started first" in plan.render()


# ---------------------------------------------------------------- a drain's floor counts what serves now


def test_a_drain_floor_counts_only_what_serves_now(lab_inv, state):
    """2p1d with p02 observed down: draining p01 would leave no prefill serving (refused, naming
    p02); the record alone would have allowed it. Draining p02 itself costs nothing that serves:
    allowed, and not waited for (its units do not run)."""
    from pdops.ops import drain as dr
    from pdops.reads.observation import Seen

    deployed(lab_inv, state, "2p1d")
    assert dr.plan_drain(lab_inv, state, "p01")  # the record alone: p02 serves
    seen = Seen({"p02": "units not running: lab02:pdops-p02.service failed/failed"}, frozenset({"p02"}))
    with pytest.raises(Refused, match=r"p01 is the last prefill instance of lab that serves.*p02 observed not serving"):
        dr.plan_drain(lab_inv, state, "p01", seen=seen)
    plan = dr.plan_drain(lab_inv, state, "p02", seen=seen)
    names = [s.name for s in plan.steps]
    assert names == ["leave-gateway", "record-identity", "stop", "verify-stop", "record"], names
    assert any("observed: p02 does not serve" in n for n in plan.notes)


def test_the_last_decode_that_does_not_serve_may_be_drained(lab_inv, state):
    from pdops.ops import drain as dr
    from pdops.reads.observation import Seen

    deployed(lab_inv, state, "2p1d")
    with pytest.raises(Refused, match="last decode instance"):
        dr.plan_drain(lab_inv, state, "d01")
    seen = Seen({"d01": "units not running"}, frozenset({"d01"}))
    assert dr.plan_drain(lab_inv, state, "d01", seen=seen).instance.id == "d01"


def test_a_stop_plans_from_what_it_observes_too(lab_inv, state):
    """`inv stop` of an instance observed down says so, and keeps no gateway step and no floor."""
    from pdops.ops import drain as dr
    from pdops.reads.observation import Seen

    deployed(lab_inv, state, "2p1d")
    seen = Seen({"d01": "units not running: lab03:pdops-d01.service failed/failed"}, frozenset({"d01"}))
    plan = dr.plan_drain(lab_inv, state, "d01", skip_gateway=True, seen=seen)
    assert [s.name for s in plan.steps] == ["record-identity", "stop", "verify-stop"]
    note = next(n for n in plan.notes if n.startswith("observed: d01 does not serve"))
    assert "the verified stop reads what is left of it" in note and "leave the gateway" not in note


def test_a_rollback_records_every_file_the_cluster_runs_the_admission_layers_too(state, tmp_path, repo):
    """A snapshot keeps no admission file (its key map holds keys). A rollback's files once came from the
    snapshot alone, so its revision's manifest lacked HAProxy's files and a later deploy compared against
    a record that was not the truth. Every file a deploy delivers is in the rollback's plan."""

    kf = tmp_path / "keys"
    kf.write_text("pdops-key-one-0123456789\n")
    kf.chmod(0o600)

    def with_admission(bundle):
        return lambda doc, d: (doc["all"]["vars"].update(pdops_admission={"api_keys_file": str(kf)}),
                               with_bundle(max_running_requests=bundle)(doc, d))

    def recorded(inv):
        deployed(inv, state, "2p1d", snapshot=True)
        return render_files(inv, place(inv, parse_topology("2p1d")))

    files = recorded(variant(repo, tmp_path, with_admission(64), name="old"))
    assert any(f.path.endswith("pdops-admission.cfg") for f in files)
    new = variant(repo, tmp_path, with_admission(32), name="new")
    recorded(new)
    plan = sc.plan_rollback(new, state, force=True)  # the lone decode's replacement is not the point here
    delivered = {(f.host, f.path) for f in files}
    planned = {(f.host, f.path) for f in plan.files}
    assert delivered - planned == set(), sorted(delivered - planned)
    assert delivered == planned


def test_a_rollback_that_moves_an_instance_onto_the_slot_another_holds_now_is_refused(lab_inv, state):
    """Found by the front-door soak: revision 68 had d01 on a slot that p01, added later, holds now; `inv
    rollback` replaced d01 onto it in its wave while p01 still ran (p01 was to be removed after), p01's
    process answered d01's /health and canary, the canary timed out, and the undo could not prove d01
    stopped. Such a move is refused before anything runs, naming both and the way round."""
    from pdops.model.placement import gpu_slots, make_instance

    slots = gpu_slots(lab_inv)  # lab01..lab04, one TP8 slot each

    def recorded(pl):
        return deployed(lab_inv, state, pl=pl, snapshot=True)

    p01 = make_instance(lab_inv, "prefill", 1, slots[0])
    first = recorded(Placement(parse_topology("1p1d"), (p01, make_instance(lab_inv, "decode", 1, slots[1]))))
    recorded(Placement(parse_topology("2p1d"), (p01, make_instance(lab_inv, "prefill", 2, slots[1]),
                                                make_instance(lab_inv, "decode", 1, slots[2]))))
    with pytest.raises(Refused) as e:
        sc.plan_rollback(lab_inv, state)
    assert "d01 moves to lab02 http://" in e.value.message and "p02 hold(s) now" in e.value.message, e.value.message
    assert f"then run `inv rollback --to {first.number}` again" in e.value.fix, e.value.fix
    assert state.current_revision().number == first.number + 1  # nothing recorded
