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
from pdops.reads.observation import Seen
from pdops.reads.observe import observe
from pdops.reads.status import front_door_warnings
from pdops.record.local import StateDir
from tests.unit.recorded import lab_variant

REPO = Path(__file__).resolve().parents[3]


def lab_with(tmp_path: Path, name: str = "two", admission: bool = False, **gateway) -> Path:
    """The lab with pdops_gateway set to `gateway` (tests.unit.recorded.lab_variant)."""
    return lab_variant(tmp_path, name, gateway=gateway, admission=admission)


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
    from tests.unit.recorded import deployed as d

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

        return systemd.parse_by_id(self.show(host, units))

    def show(self, host, units):
        text = ""
        for u in units:
            active, pid = self.units.get((host, u), ("active", 100))
            text += (f"Id={u}\nLoadState=loaded\nActiveState={active}\nSubState={'running' if active == 'active' else 'failed'}"
                     f"\nMainPID={pid if active == 'active' else 0}\nNRestarts=0\nResult=success\nUnitFileState=enabled\n\n")
        return text

    def read_sections(self, host, commands):
        return {"units": (0, self.show(host, commands["units"].split()[5:])), "configs": (0, "")}

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
    # it starts from the revision's files, put back first (a hand edit that made it crash loop is not run again)
    from pdops.model.render import gateway_paths

    deliver = next(s for s in plan.steps if s.kind == "deliver")
    assert sorted((f.host, f.path) for f in deliver.params["files"]) == sorted(("lab02", p) for p in gateway_paths())
    kinds = [s.kind for s in plan.steps]
    assert kinds.index("deliver") < kinds.index("gateway")


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
    from pdops.reads.verify.host_state import parse_binds

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


def rtx_with(tmp_path, **admission):
    """The reference fleet (rtx6000d: real hardware, not the lab) with two gateways and `admission`."""
    import os

    doc = single_file_doc(REPO / "inventory" / "rtx6000d")
    v = doc["all"]["vars"]
    v["pdops_gateway"].pop("host", None)
    v["pdops_gateway"]["hosts"] = ["gpu01", "gpu02"]
    keys = tmp_path / "rtx.keys"
    keys.write_text("pdops-unit-case-key-" + "k" * 16 + "\n")
    os.chmod(keys, 0o600)
    v["pdops_admission"] = {"api_keys_file": str(keys), **admission}
    d = tmp_path / "rtx"
    d.mkdir(exist_ok=True)
    (d / "hosts.yml").write_text(yaml.safe_dump(doc))
    return load_inventory(d)


def test_two_admission_hosts_with_a_virtual_address_render_haproxy_and_keepalived_on_each(tmp_path):
    import os
    import shutil
    import subprocess

    from pdops.model import admission as adm
    from pdops.model.render import render_admission_files

    inv = rtx_with(tmp_path, hosts=["gpu01", "gpu02"], vip="10.30.0.100", vrrp_interface="bond0", vrrp_router_id=61)
    cfg = inv.admission
    assert cfg.hosts == ("gpu01", "gpu02") and cfg.vip == "10.30.0.100"
    files = {(f.host, f.path): f for f in render_admission_files(inv, cfg)}
    for h, prio, peer in (("gpu01", 150, cfg.addr_of("gpu02")), ("gpu02", 100, cfg.addr_of("gpu01"))):
        text = files[(h, adm.CONFIG_PATH)].content
        assert f"bind {cfg.addr_of(h)}:8080\n" in text and "bind 10.30.0.100:8080\n" in text
        assert f"abns@pdops-admission-{cfg.addr_of(h)}-8080" in text  # the permit's socket, per host
        kc = files[(h, adm.KEEPALIVED_CONFIG)].content
        assert f"priority {prio}\n" in kc and "virtual_router_id 61\n" in kc and "interface bond0\n" in kc
        assert "10.30.0.100/32 dev bond0" in kc and f"        {peer}\n" in kc and adm.UNIT in kc
        assert files[(h, adm.NONLOCAL_BIND_SYSCTL)].content.endswith("net.ipv4.ip_nonlocal_bind = 1\n")
        conf = tmp_path / f"keepalived-{h}.conf"
        # the parser also checks that the interface exists (and is not loopback): this machine's own
        conf.write_text(kc.replace("bond0", next(n for n in sorted(os.listdir("/sys/class/net")) if n != "lo")))
        exe = shutil.which("keepalived") or "/usr/sbin/keepalived"
        assert shutil.which(exe), "keepalived missing: bash scripts/setup-system.sh installs it (not started)"
        # keepalived's own parser (config test only: nothing runs, no address is touched)
        proc = subprocess.run([exe, "--config-test", "-f", str(conf)], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("admission, field, words", [
    ({"hosts": ["gpu01"], "vip": "10.30.0.100", "vrrp_interface": "bond0"}, "pdops_admission.vip",
     "needs two admission hosts"),
    ({"hosts": ["gpu01", "gpu02"], "vip": "10.30.0.100"}, "pdops_admission.vrrp_interface",
     "is not a network interface name"),
    ({"hosts": ["gpu01", "gpu02"], "vip": "not-an-ip", "vrrp_interface": "bond0"}, "pdops_admission.vip",
     "is not an IP address"),
    ({"host": "gpu01", "hosts": ["gpu02"]}, "pdops_admission", "both `host` and `hosts` are set"),
    ({"hosts": ["gpu01", "gpu01"]}, "pdops_admission.hosts", "named more than once"),
    ({"hosts": ["gpu01"], "vrrp_router_id": 5}, "pdops_admission.vrrp_router_id", "set without `vip`"),
])
def test_a_bad_front_door_pair_is_refused_before_anything_runs(tmp_path, admission, field, words):
    with pytest.raises(InvalidInput) as e:
        rtx_with(tmp_path, **admission)
    assert e.value.field == field and words in e.value.message


def test_the_lab_refuses_a_virtual_address(tmp_path):
    """Lab hosts share one network namespace: keepalived would put the address on this machine."""
    with pytest.raises(InvalidInput) as e:
        load_inventory(_lab_vip(tmp_path))
    assert e.value.field == "pdops_admission.vip" and "one network namespace" in e.value.message


def _lab_vip(tmp_path):
    d = lab_with(tmp_path, "vip", admission=True, hosts=["lab01", "lab02"])
    doc = yaml.safe_load((d / "hosts.yml").read_text())
    doc["all"]["vars"]["pdops_admission"].update(hosts=["lab01", "lab02"], vip="127.0.10.99", vrrp_interface="lo")
    (d / "hosts.yml").write_text(yaml.safe_dump(doc))
    return d


def test_every_admission_host_is_started_restarted_around_and_given_the_keys(tmp_path):
    """With two HAProxy, every runtime-API step acts on both, and each gets its own start and keys."""
    import os

    from pdops.ops import admission_keys

    d = lab_with(tmp_path, "two-adm", admission=True, hosts=["lab01", "lab02"])
    doc = yaml.safe_load((d / "hosts.yml").read_text())
    doc["all"]["vars"]["pdops_admission"]["hosts"] = ["lab01", "lab02"]
    (d / "hosts.yml").write_text(yaml.safe_dump(doc))
    inv = load_inventory(d)
    state = StateDir("lab", tmp_path / "s")
    plan = dep.plan_deploy(inv, parse_topology("1p1d"), state)
    assert [(s.name, s.params["host"]) for s in plan.steps if s.kind == "admission"] == [
        ("admission lab01", "lab01"), ("admission lab02", "lab02")]
    deployed(inv, state, "1p1d")
    keys_plan = admission_keys.plan_rotate_keys(inv, state)
    assert [s.name for s in keys_plan.steps] == ["check-unit lab01", "deliver lab01", "reload lab01", "verify lab01",
                                                 "check-unit lab02", "deliver lab02", "reload lab02", "verify lab02"]
    assert os.path.exists(inv.admission.api_keys_file)


def test_a_gateway_taken_out_of_the_inventory_is_retired_by_the_next_change(tmp_path):
    """A host no longer in pdops_gateway.hosts: the change stops and disables its gateway unit and
    removes its files (said, not done, when the host left the inventory too)."""
    state = StateDir("lab", tmp_path / "s")
    deployed(load_inventory(lab_with(tmp_path, "both", hosts=["lab01", "lab02"])), state, "1p1d")
    one = load_inventory(lab_with(tmp_path, "one", hosts=["lab01"]))
    plan = sc.plan_scale(one, parse_topology("1p1d"), state)
    [st] = [s for s in plan.run if s.kind == "retire-gateway"]
    assert (st.name, st.host, st.params) == ("retire-gateway lab02", "lab02", {"host": "lab02", "reachable": True})
    assert "gateway: lab02 leaves (no longer in pdops_gateway.hosts)" in plan.render()


def test_haproxy_not_as_deployed_is_a_finding_and_a_repair_step():
    """A change stopped between a drain and its ready leaves a gateway drained or at weight 0: verify
    names it, a deploy of the live topology opens the front door again."""
    import types

    from pdops.remote.haproxy import front_door_problems

    head = "# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status,weight"
    rows = ["gateways,gw-lab03,0,0,0,0,,0,0,0,,0,,0,0,0,0,UP,100", "gateways,gw-lab04,0,0,0,0,,0,0,0,,0,,0,0,0,0,DRAIN,0",
            "gateways,BACKEND,0,0,0,0,,0,0,0,,0,,0,0,0,0,UP,100"]

    class Pool:
        def run(self, host, command, timeout=60):
            return types.SimpleNamespace(stdout="\n".join([head] + rows) + "\n", stderr="")

    assert front_door_problems(Pool(), "lab03", ["lab03", "lab04"]) == [
        "HAProxy on lab03: gateway lab04 is DRAIN, weight 0 (deployed: UP, weight 100)"]
    assert front_door_problems(Pool(), "lab03", ["lab03", "lab05"])[0].startswith(
        "HAProxy on lab03 has no server for gateway lab05")


def test_two_admission_hosts_refuse_one_listen_address_for_both(tmp_path):
    with pytest.raises(InvalidInput) as e:
        rtx_with(tmp_path, hosts=["gpu01", "gpu02"], listen_addr="10.30.0.11")
    assert e.value.field == "pdops_admission.listen_addr" and "every admission host's address" in e.value.message


def test_taking_a_gateway_out_with_instance_changes_is_refused(tmp_path):
    from pdops.errors import Refused

    state = StateDir("lab", tmp_path / "s")
    deployed(load_inventory(lab_with(tmp_path, "both", hosts=["lab01", "lab02"])), state, "1p1d")
    with pytest.raises(Refused) as e:
        sc.plan_scale(load_inventory(lab_with(tmp_path, "one", hosts=["lab01"])), parse_topology("2p1d"), state)
    assert "takes gateway(s) lab02 out and changes instances at once" in e.value.message


def test_the_admission_layer_down_after_a_reboot_is_named_and_started_by_one_deploy(tmp_path):
    """After a reboot nothing starts HAProxy (fault 1 of the front-door issue): observe reads its unit
    beside the gateways', names it (not its runtime API, which is gone), and the deploy of the live
    topology starts it, then waits for it to see every gateway UP; `inv status` says which command."""
    from pdops.model.admission import UNIT as ADMISSION_UNIT
    from pdops.reads.status import format_status

    inv = load_inventory(lab_with(tmp_path, "adm-down", admission=True, hosts=["lab01", "lab02"]))
    state = StateDir("lab", tmp_path / "s")
    deployed(inv, state, "1p1d")
    p0 = dep.plan_deploy(inv, parse_topology("1p1d"), state)
    pool, gws = world(inv, p0.placement)
    adm = inv.admission.hosts[0]
    pool.units[(adm, ADMISSION_UNIT)] = ("inactive", 0)
    obs = observe(inv, p0.live, pool, gws)
    assert obs.admission_down == {adm: f"{ADMISSION_UNIT} inactive/failed"} and obs.front_door == []
    assert obs.findings() == [f"the admission layer on {adm} is not running ({ADMISSION_UNIT} inactive/failed): "
                              "the front door there turns every request away"]
    plan = dep.plan_reconcile(p0, obs)
    kinds = [(s.kind, s.host, s.params.get("restart")) for s in plan.steps if s.kind in ("admission", "front-door-ready")]
    assert kinds == [("admission", adm, False), ("front-door-ready", adm, None)]
    assert not [s for s in plan.steps if s.kind in ("start", "gateway")]  # nothing else was down
    text = format_status({"cluster": "lab", "revision": 1, "topology": "1p1d", "instances": [], "gateways": [],
                          "front_door": [],
                          "admission_down": obs.admission_findings()})
    assert f"front door closed: the admission layer on {adm} is not running ({ADMISSION_UNIT} inactive" in text
    assert "-> inv deploy --topology 1p1d (starts it)" in text and "not ok: front door" in text


def test_keepalived_down_where_a_virtual_address_is_rendered_is_named_and_restarted(tmp_path):
    """With a virtual address, the front door is HAProxy and keepalived on each admission host: a
    keepalived that is not running (the address held nowhere) is named with its unit, and the
    deploy's admission step there restarts it (start_admission restarts keepalived first)."""
    from pdops.model.admission import KEEPALIVED_UNIT

    inv = rtx_with(tmp_path, hosts=["gpu01", "gpu02"], vip="10.30.0.100", vrrp_interface="bond0", vrrp_router_id=61)
    state = StateDir("prod", tmp_path / "s")
    deployed(inv, state, "1p1d")
    p0 = dep.plan_deploy(inv, parse_topology("1p1d"), state)
    pool, gws = world(inv, p0.placement)
    pool.units[("gpu02", KEEPALIVED_UNIT)] = ("inactive", 0)
    obs = observe(inv, p0.live, pool, gws)
    assert obs.admission_down == {"gpu02": f"{KEEPALIVED_UNIT} inactive/failed"}, obs.admission_down
    plan = dep.plan_reconcile(p0, obs)
    assert [(s.kind, s.host) for s in plan.steps if s.kind == "admission"] == [("admission", "gpu02")]


def test_an_etcd_member_down_is_named_by_status_and_started_by_one_deploy(tmp_path):
    """The record on etcd members pdops runs (the front-door issue: every part pdops runs is observed and
    repaired by one deploy): a member whose unit does not run (a host booted the lab's way, a member that
    failed at boot) is read in the same round trip as the gateways' units, named by `inv status` with the
    one command, and the deploy of the live topology starts it and waits for one leader and a write read
    back through every member, before anything else (the record is written last). The record on the state
    host, or on an etcd the site runs: no member is read."""
    from pdops.model.etcd_member import UNIT as ETCD_UNIT
    from pdops.reads.observe import etcd_members_run
    from pdops.reads.status import format_status

    d = lab_with(tmp_path, "etcd", hosts=["lab01"])
    doc = yaml.safe_load((d / "hosts.yml").read_text())
    doc["all"]["vars"]["pdops_state"] = {"host": "lab01", "backend": "etcd",
                                         "etcd": {"members": ["lab01", "lab02", "lab03"]}}
    (d / "hosts.yml").write_text(yaml.safe_dump(doc))
    inv = load_inventory(d)
    assert etcd_members_run(inv) == ["lab01", "lab02", "lab03"]
    assert etcd_members_run(load_inventory(lab_with(tmp_path, "host", hosts=["lab01"]))) == []
    state = StateDir("lab", tmp_path / "s")
    deployed(inv, state, "1p1d")
    p0 = dep.plan_deploy(inv, parse_topology("1p1d"), state)
    pool, gws = world(inv, p0.placement)
    pool.units[("lab02", ETCD_UNIT)] = ("inactive", 0)
    obs = observe(inv, p0.live, pool, gws)
    assert obs.store_down == {"lab02": f"{ETCD_UNIT} inactive/failed"}
    assert obs.findings() == [f"the record's etcd member on lab02 is not running ({ETCD_UNIT} inactive/failed): the "
                              "record holds while a majority of the members runs"]
    plan = dep.plan_reconcile(p0, obs)
    assert [s.kind for s in plan.steps] == ["connect", "etcd-member-start", "etcd-check-quorum", "verify-running",
                                            "record-repair"]
    assert plan.steps[1].params == {"hosts": ["lab02"]}
    # with the gateway down too: the serving parts first (a member that cannot start keeps nothing down), the
    # record's store last before the record
    pool.units[("lab01", GATEWAY_UNIT)] = ("failed", 0)
    kinds = [s.kind for s in dep.plan_reconcile(p0, observe(inv, p0.live, pool, gws)).steps]
    assert kinds.index("gateway") < kinds.index("etcd-member-start") < kinds.index("etcd-check-quorum") \
        < kinds.index("record-repair"), kinds
    pool.units.pop(("lab01", GATEWAY_UNIT))
    text = format_status({"cluster": "lab", "revision": 1, "topology": "1p1d", "instances": [], "gateways": [],
                          "front_door": [], "store_down": obs.store_findings()})
    assert "record store degraded: the record's etcd member on lab02 is not running" in text, text
    assert "-> inv deploy --topology 1p1d (starts it)" in text and "not ok: record store" in text, text
    # every member down (the record read from this machine's cached copy): the banner's fix is the only one,
    # a deploy could not read the record
    text = format_status({"cluster": "lab", "revision": 1, "topology": "1p1d", "instances": [], "gateways": [],
                          "front_door": [], "store_down": obs.store_findings(),
                          "record": {"location": "etcd", "cached": {"fetched_at": "t", "reason": "r"},
                                     "banner": "READ-ONLY CACHED COPY ... -> start the etcd members ...", "lock": None}})
    assert "record store degraded" in text and "inv deploy" not in text, text
    # every member up: nothing said, nothing planned
    pool.units.pop(("lab02", ETCD_UNIT))
    obs = observe(inv, p0.live, pool, gws)
    assert obs.store_down == {} and dep.plan_reconcile(p0, obs).noop


def test_a_gateway_that_runs_other_files_gets_the_revisions_back_and_is_restarted_on_them(two, tmp_path):
    """A gateway whose process started from other files than the revision's (its files changed after it
    started and no restart followed; or it was restarted from files edited on its host): `inv status`
    names it, and the deploy of the live topology, which once restarted only gateways that were down
    (so the same finding came back after every deploy), puts the revision's gateway files back on that
    host only and restarts that gateway on them, one at a time, before it records."""
    from pdops.model.render import gateway_paths

    state = StateDir("lab", tmp_path / "s")
    rev = deployed(two, state, "1p1d")
    r2 = state.write_revision(topology=rev.topology, inventory_hash=rev.inventory_hash, placement=rev.placement,
                              manifest=rev.manifest, instances=rev.instances, outcome="deployed",
                              extra={"configs": {f"lab02:{GATEWAY_UNIT}": "the-revisions-id"}})
    state.set_current(r2.number)
    p0 = dep.plan_deploy(two, parse_topology("1p1d"), state)
    pool, gws = world(two, p0.placement)

    class Notes(type(pool)):
        def read_sections(self, host, commands):
            out = super().read_sections(host, commands)
            if host == "lab02":  # the note its launch script left: MainPID 100 (the stand-in's) started from another id
                out["configs"] = (0, f"{GATEWAY_UNIT} 100 another-id\n")
            return out
    pool = Notes(pool.units, pool.lists)
    obs = observe(two, p0.live, pool, gws)
    [finding] = obs.findings()
    assert finding.startswith(f"gateway {GATEWAY_UNIT} on lab02 runs files another-id, the revision's are the-revisions-id"), finding
    plan = dep.plan_reconcile(p0, obs)
    deliver = next(s for s in plan.steps if s.kind == "deliver")
    assert sorted((f.host, f.path) for f in deliver.params["files"]) == sorted(("lab02", p) for p in gateway_paths())
    assert [(s.kind, s.params.get("gateway")) for s in plan.steps if s.kind.startswith("gateway")] == \
        [("gateway-restart", "lab02")]
    kinds = [s.kind for s in plan.steps]
    assert kinds.index("deliver") < kinds.index("gateway-restart") < kinds.index("record-repair")
    assert not [s for s in plan.steps if s.kind in ("start", "register")]  # every instance serves
