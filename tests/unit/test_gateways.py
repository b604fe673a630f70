"""Two or more gateways (docs/gateway.md "Two or more gateways"): the inventory, what is rendered on
each gateway host, the steps that act on every gateway, what is observed of each, and what
`inv status` warns about the way in. Pure: no host, no gateway process."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from pdops.errors import InvalidInput
from pdops.facts.gateway import Worker
from pdops.model import membership
from pdops.model.inventory import load_inventory, single_file_doc
from pdops.model.placement import place
from pdops.model.render import GATEWAY_UNIT, render_files
from pdops.model.topology import parse_topology
from pdops.ops import deploy as dep
from pdops.ops import drain as dr
from pdops.ops import scale as sc
from pdops.reads.observe import Seen, observe
from pdops.reads.status import front_door_warnings
from pdops.record.local import StateDir

REPO = Path(__file__).resolve().parents[2]


def lab_with(tmp_path: Path, name: str = "two", admission: bool = False, **gateway) -> Path:
    import os

    doc = single_file_doc(REPO / "inventory" / "lab")
    gv = doc["all"]["vars"]["pdops_gateway"]
    gv.pop("host", None)
    gv.update(gateway)
    if admission:
        keys = tmp_path / f"{name}.keys"
        keys.write_text("pdops-unit-case-key-" + "k" * 16 + "\n")
        os.chmod(keys, 0o600)
        doc["all"]["vars"]["pdops_admission"] = {"api_keys_file": str(keys)}
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "hosts.yml").write_text(yaml.safe_dump(doc))
    return d


@pytest.fixture
def two(tmp_path):
    return load_inventory(lab_with(tmp_path, hosts=["lab01", "lab02"]))


def test_one_gateway_stays_the_default_and_several_are_named_in_order(two):
    one = load_inventory(REPO / "inventory" / "lab")
    assert one.gateway.hosts == ("lab01",) and one.gateway.step_host == "lab01" and one.gateway.on_each() == ""
    assert two.gateway.hosts == ("lab01", "lab02") and two.gateway.step_host is None
    assert two.gateway.urls == {"lab01": "http://127.0.10.1:30000", "lab02": "http://127.0.10.2:30000"}
    assert two.gateway.first.host == "lab01" and two.state.host == "lab01"  # the record's default host


@pytest.mark.parametrize("gateway, field, words", [
    ({"host": "lab01", "hosts": ["lab02"]}, "pdops_gateway", "both `host` and `hosts` are set"),
    ({"hosts": ["lab01", "lab01"]}, "pdops_gateway.hosts", "lab01 named more than once"),
    ({"hosts": ["lab01", "lab09"]}, "pdops_gateway.hosts", "'lab09' is not a host of this inventory"),
    ({"hosts": []}, "pdops_gateway.hosts", "is not a list of host names"),
    ({"hosts": "lab01"}, "pdops_gateway.hosts", "is not a list of host names"),
])
def test_a_bad_gateway_list_is_refused_before_anything_runs(tmp_path, gateway, field, words):
    with pytest.raises(InvalidInput) as e:
        load_inventory(lab_with(tmp_path, "bad", **gateway))
    assert e.value.field == field and words in e.value.message


def test_a_bad_host_in_a_big_inventory_names_the_closest_few_and_the_count(tmp_path):
    """A 256-host fleet: the fix names three hosts (the closest first) and how many there are,
    not every name."""
    doc = single_file_doc(REPO / "inventory" / "lab")
    hosts = doc["all"]["children"]["gpu_hosts"]["hosts"]
    proto = hosts["lab01"]
    hosts.clear()
    for n in range(1, 257):
        hosts[f"gpu{n:03d}"] = {**proto, "ansible_host": f"127.1.{n // 256}.{n % 256}",
                                "pdops_data_addr": f"127.1.{n // 256}.{n % 256}"}
    doc["all"]["vars"]["pdops_gateway"]["host"] = "gpu201x"  # a stray key after the name
    d = tmp_path / "big"
    d.mkdir()
    (d / "hosts.yml").write_text(yaml.safe_dump(doc))
    with pytest.raises(InvalidInput) as e:
        load_inventory(d)
    assert e.value.fix.startswith("use one of the 256 hosts of this inventory (closest: gpu201")
    assert e.value.fix.count("gpu") == 3


def test_each_gateway_host_gets_its_own_unit_listening_on_its_own_address(two):
    pl = place(two, parse_topology("1p1d"))
    files = render_files(two, pl)
    for node in two.gateway.nodes:
        mine = {f.path: f.content for f in files if f.host == node.host}
        script = mine["/opt/pdops/bin/pdops-gateway.sh"]
        assert f"--host {node.addr} --port 30000" in script and "--enable-mesh" not in script
        # its start-up list registers with it, not with the other gateway
        assert f"--gateway {node.url} " in mine[f"/etc/systemd/system/{GATEWAY_UNIT}"]
        assert membership.SCRIPT_PATH in mine


def test_a_deploy_starts_each_gateway_and_registers_with_each(two, tmp_path):
    plan = dep.plan_deploy(two, parse_topology("1p1d"), StateDir("lab", tmp_path / "s"))
    gws = [s for s in plan.steps if s.kind == "gateway"]
    assert [(s.name, s.host, s.params["gateway"]) for s in gws] == [("gateway lab01", "lab01", "lab01"),
                                                                    ("gateway lab02", "lab02", "lab02")]
    reg = next(s for s in plan.steps if s.name == "register p01")
    assert reg.host is None and "on each of the 2 gateways (lab01, lab02)" in reg.description
    assert "the 2 gateways' too" in next(s for s in plan.steps if s.kind == "verify-running").description


def deployed(inv, state, topo="1p1d"):
    from tests.unit.test_scale_plan import deployed as d

    return d(inv, state, topo)


def test_a_drain_leaves_every_gateway_before_its_empty_checks(two, tmp_path):
    state = StateDir("lab", tmp_path / "s")
    deployed(two, state, "2p1d")
    plan = dr.plan_drain(two, state, "p02")
    names = [s.name for s in plan.steps]
    leave = plan.steps[names.index("leave-gateway")]
    assert names.index("leave-gateway") < names.index("empty-check-1")
    assert "on each of the 2 gateways" in leave.description and "each gateway lists it draining" in leave.description
    assert "no gateway lists worker" in plan.steps[names.index("verify-stop")].description


def test_a_gateway_change_restarts_the_gateways_one_at_a_time(two, tmp_path, monkeypatch):
    """An smg upgrade changes every gateway's files: one gateway-restart step per gateway, in order
    (a gateway is out of the front door only while it restarts)."""
    import pdops.model.render as render

    state = StateDir("lab", tmp_path / "s")
    deployed(two, state, "1p1d")
    monkeypatch.setattr(render, "SMG_VERSION", "1.14.0")
    plan = sc.plan_scale(two, parse_topology("1p1d"), state)
    restarts = [s for s in plan.run if s.kind == "gateway-restart"]
    assert [(s.name, s.params["gateway"]) for s in restarts] == [("gateway-restart lab01", "lab01"),
                                                                 ("gateway-restart lab02", "lab02")]
    assert not plan.replaced  # an smg pin moves no engine


class Pool:
    """`systemctl show` and the start-up list, per host, as a world of two gateways answers."""

    def __init__(self, units, lists):
        self.units, self.lists = units, lists

    def unit_states(self, host, units):
        from pdops.facts import systemd

        text = ""
        for u in units:
            active, pid = self.units.get((host, u), ("active", 100))
            text += (f"Id={u}\nLoadState=loaded\nActiveState={active}\nSubState={'running' if active == 'active' else 'failed'}"
                     f"\nMainPID={pid if active == 'active' else 0}\nNRestarts=0\nResult=success\nUnitFileState=enabled\n\n")
        return systemd.parse_by_id(text)

    def run(self, host, command, timeout=60):
        import json
        import types

        return types.SimpleNamespace(stdout=json.dumps(self.lists.get(host)) + "\n", stderr="")


class Gateways:
    def __init__(self, per_host):
        self.per_host = per_host

    def client(self, host):
        from pdops.errors import Unreachable

        ws = self.per_host[host]

        class C:
            def list_workers(self):
                if isinstance(ws, str):
                    raise Unreachable(ws)
                return ws
        return C()


def world(inv, pl, *, lacks=(), down=()):
    units = {}
    for h in down:
        units[(h, GATEWAY_UNIT)] = ("failed", 0)
    lst = {"workers": [membership.entry(i) for i in pl.instances]}
    workers = {h: ("connection refused" if h in down else
                   [Worker(f"w-{h}-{i.id}", i.url, i.role, True, 0, i.bootstrap_port, status="ready")
                    for i in pl.instances if (h, i.id) not in lacks]) for h in inv.gateway.hosts}
    return Pool(units, {h: lst for h in inv.gateway.hosts}), Gateways(workers)


def test_a_gateway_that_lacks_a_worker_is_named_and_repaired_on_that_gateway(two, tmp_path):
    state = StateDir("lab", tmp_path / "s")
    deployed(two, state, "1p1d")
    p0 = dep.plan_deploy(two, parse_topology("1p1d"), state)
    pool, gws = world(two, p0.placement, lacks={("lab02", "d01")})
    obs = observe(two, p0.live, pool, gws)
    assert obs.findings() == ["d01: gateway lab02: not in its /workers"]
    seen = Seen.of(obs)
    assert seen.all_serving  # lab01 routes to it: it serves (the finding is repaired, not a lost instance)
    plan = dep.plan_reconcile(p0, obs)
    assert [s.name for s in plan.steps if s.kind == "register"] == ["register d01"]  # registers on each again


def test_one_gateway_down_is_started_alone_and_the_others_keep_serving(two, tmp_path):
    state = StateDir("lab", tmp_path / "s")
    deployed(two, state, "1p1d")
    p0 = dep.plan_deploy(two, parse_topology("1p1d"), state)
    pool, gws = world(two, p0.placement, down=("lab02",))
    obs = observe(two, p0.live, pool, gws)
    assert any(f.startswith(f"gateway {GATEWAY_UNIT} on lab02: failed/failed") for f in obs.findings())
    seen = Seen.of(obs)
    assert seen.not_serving == {} and set(seen.gateways_down) == {"lab02"}
    plan = dep.plan_reconcile(p0, obs)
    assert [(s.name, s.params["gateway"]) for s in plan.steps if s.kind == "gateway"] == [("gateway lab02", "lab02")]


def test_status_warns_about_a_single_way_in(two, tmp_path):
    one = load_inventory(REPO / "inventory" / "lab")
    [w] = front_door_warnings(one)
    assert w.startswith("single point of failure: one gateway (lab01) and no admission layer")
    [w] = front_door_warnings(two)
    assert "each client must be given every gateway URL" in w and "http://127.0.10.2:30000" in w
    adm = dataclasses.replace(two, admission=object())
    assert front_door_warnings(adm) == []
    assert front_door_warnings(dataclasses.replace(one, admission=object()))[0].startswith("single point of failure")


def test_verify_checks_the_admission_port_not_its_internal_socket():
    from pdops.reads.verify.checks import parse_binds

    text = "    bind 127.0.10.3:18082\n    bind abns@pdops-admission-127.0.10.3-18082\n    bind [::1]:8405\n"
    assert parse_binds(text) == [("127.0.10.3", 18082), ("::1", 8405)]


def test_behind_the_admission_layer_a_crashed_gateway_restarts_only_after_haproxy_marked_it_down(tmp_path):
    """smg answers at once after a start, with 503 "no available workers" until its start-up list is
    registered: a gateway that systemd restarted within HAProxy's detection window would be sent
    requests it refuses. With another gateway to serve, RestartSec outlasts inter x fall."""
    from pdops.model import admission as adm

    def restart_sec(inv_dir):
        inv = load_inventory(inv_dir)
        files = render_files(inv, place(inv, parse_topology("1p1d")))
        unit = next(f.content for f in files if f.path.endswith(GATEWAY_UNIT))
        return int(next(ln for ln in unit.splitlines() if ln.startswith("RestartSec=")).split("=")[1])

    detect_s = adm.CHECK_INTER_MS * adm.CHECK_FALL / 1000
    assert restart_sec(lab_with(tmp_path, "a", admission=True, hosts=["lab01", "lab02"])) > detect_s
    assert restart_sec(lab_with(tmp_path, "b", hosts=["lab01", "lab02"])) == 1  # no HAProxy to wait for
    assert restart_sec(lab_with(tmp_path, "c", admission=True, host="lab01")) == 1  # alone: back at once
