import dataclasses

import pytest

from pdops.errors import InvalidInput
from pdops.model.placement import Placement, place, placement_table
from pdops.model.topology import Topology, parse_topology


def _no_collisions(pl):
    gpus, ports = set(), set()
    for inst in pl.instances:
        for r in inst.ranks:
            for g in r.gpus:
                assert (r.host, g) not in gpus, f"GPU {r.host}:{g} used twice"
                gpus.add((r.host, g))
            for p in (inst.http_port, inst.bootstrap_port, inst.dist_init_port):
                if p is not None:
                    assert (r.host, p) not in ports, f"port {r.host}:{p} used twice"
                    ports.add((r.host, p))


def test_12p4d_fills_the_reference_fleet(fleet):
    pl = place(fleet, parse_topology("12p4d"))
    assert [i.id for i in pl.role("prefill")] == [f"p{n:02d}" for n in range(1, 13)]
    assert [i.id for i in pl.role("decode")] == ["d01", "d02", "d03", "d04"]
    assert len({i.hosts for i in pl.instances}) == 16
    assert all(i.head.gpus == tuple(range(8)) for i in pl.instances)
    assert all(i.bootstrap_port for i in pl.role("prefill")) and not any(i.bootstrap_port for i in pl.role("decode"))
    _no_collisions(pl)


def test_growing_keeps_every_existing_instance_in_place(fleet):
    old = place(fleet, parse_topology("8p4d"))
    new = place(fleet, parse_topology("10p4d"), previous=old)
    for inst in old.instances:
        assert new.get(inst.id) == inst
    added = {i.id for i in new.instances} - {i.id for i in old.instances}
    assert added == {"p09", "p10"}
    assert not set(new.get("p09").hosts) & {h for i in old.instances for h in i.hosts}
    _no_collisions(new)


def test_shrinking_keeps_the_survivors_in_place(fleet):
    old = place(fleet, parse_topology("10p4d"))
    new = place(fleet, parse_topology("8p2d"), previous=old)
    assert {i.id for i in new.instances} == {f"p{n:02d}" for n in range(1, 9)} | {"d01", "d02"}
    for inst in new.instances:
        assert old.get(inst.id) == inst


def test_placement_round_trips_through_a_revision_record(fleet):
    pl = place(fleet, parse_topology("8p4d"))
    assert Placement.from_dict(pl.to_dict()) == pl


def test_small_instances_share_a_host_without_collisions(fleet):
    prof = dataclasses.replace(fleet.profile, tp=2, ep=2, pp=1)
    inv = dataclasses.replace(fleet, profile=prof)
    pl = place(inv, Topology(6, 2))
    assert [i.hosts for i in pl.instances[:4]] == [("gpu01",)] * 4
    assert [i.head.gpus for i in pl.instances[:4]] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert len({i.http_port for i in pl.instances[:4]}) == 4
    _no_collisions(pl)


def test_tp8_pp8_is_one_instance_on_eight_hosts(fleet):
    prof = dataclasses.replace(fleet.profile, tp=8, pp=8)
    inv = dataclasses.replace(fleet, profile=prof)
    pl = place(inv, Topology(1, 1))
    p = pl.get("p01")
    assert p.nnodes == 8 and p.hosts == tuple(f"gpu{n:02d}" for n in range(1, 9))
    assert [r.node_rank for r in p.ranks] == list(range(8))
    assert p.dist_init_port is not None
    assert pl.get("d01").hosts == tuple(f"gpu{n:02d}" for n in range(9, 17))
    assert p.units[0] == ("gpu01", "pdops-p01-r0.service")
    with pytest.raises(InvalidInput, match="room for 2"):
        place(inv, Topology(2, 1))


def test_unknown_instance_is_named(fleet):
    pl = place(fleet, parse_topology("2p1d"))
    with pytest.raises(InvalidInput, match="no instance 'p07'"):
        pl.get("p07")


def test_table_has_the_operator_columns(fleet):
    rows = placement_table(place(fleet, parse_topology("1p1d")))
    assert rows[0]["instance"] == "p01" and rows[0]["bootstrap"] == 8998 and rows[1]["bootstrap"] == "-"
    assert set(rows[0]) >= {"instance", "role", "hosts", "ranks", "gpus", "http", "bootstrap", "dist_init"}
