"""Bad input to a change on a live cluster is refused while planning, from the record alone (no
host is reached), naming the field and the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from pdops.ops import scale as sc
from pdops.errors import InvalidInput, Refused
from pdops.model.inventory import load_inventory
from pdops.record.local import StateDir
from pdops.model.topology import parse_topology
from tests.unit.recorded import REPO, deployed, edited



@pytest.fixture
def live(lab_inv, tmp_path):
    """A record whose current revision is 2p2d on the lab (no host behind it)."""
    state = StateDir("lab", tmp_path / "state")
    deployed(lab_inv, state, "2p2d")
    return state


def add_host(gpus: int):
    def edit(doc):
        hosts = doc["all"]["children"]["gpu_hosts"]["hosts"]
        h = dict(hosts["lab04"], ansible_host="127.0.10.5", pdops_data_addr="127.0.10.5")
        h["pdops_gpus"] = dict(h.get("pdops_gpus") or doc["all"]["vars"].get("pdops_gpus") or {}, count=gpus)
        hosts["lab05"] = h
    return edit


def test_a_new_host_whose_gpus_do_not_fit_the_tp_is_refused_at_load(tmp_path):
    with pytest.raises(InvalidInput) as e:
        load_inventory(edited(tmp_path, add_host(4)))
    msg = e.value.render()
    assert "lab05" in msg and "fix:" in msg


def test_a_profile_change_that_makes_pd_heterogeneous_is_refused_at_load(tmp_path):
    prof = yaml.safe_load((REPO / "pdops" / "profiles" / "lab-sim.yml").read_text())
    prof["roles"] = {"decode": {"parallel": {"tp": 4, "pp": 1}}}
    d = edited(tmp_path, lambda doc: doc["all"]["vars"].update(pdops_profile="p.yml"))
    (d / "p.yml").write_text(yaml.safe_dump(prof))
    with pytest.raises(InvalidInput, match="heterogeneous P/D: decode has tp=4") as e:
        load_inventory(d)
    assert "fix:" in e.value.render()


def test_a_port_plan_that_collides_is_refused_at_load(tmp_path):
    def edit(doc):
        doc["all"]["vars"]["pdops_ports"]["stride"] = 1
    with pytest.raises(InvalidInput, match="pdops_ports.stride"):
        load_inventory(edited(tmp_path, edit))


def test_removing_a_host_in_use_names_the_instance_and_the_command(live, tmp_path):
    inv = load_inventory(edited(tmp_path, lambda doc: doc["all"]["children"]["gpu_hosts"]["hosts"].pop("lab03")))
    with pytest.raises(InvalidInput) as e:
        sc.plan_apply(inv, parse_topology("2p2d"), live)
    msg = e.value.render()
    assert "d01" in msg and "lab03" in msg and "inv drain --host lab03" in msg


def test_no_room_to_surge_with_max_unavailable_0_is_refused(live, tmp_path):
    prof = yaml.safe_load((REPO / "pdops" / "profiles" / "lab-sim.yml").read_text())
    prof["bundle"]["max_running_requests"] = 8
    d = edited(tmp_path, lambda doc: doc["all"]["vars"].update(pdops_profile="p.yml"))
    (d / "p.yml").write_text(yaml.safe_dump(prof))
    with pytest.raises(Refused) as e:
        sc.plan_apply(load_inventory(d), parse_topology("2p2d"), live, max_unavailable=0)
    assert "--max-unavailable 0" in e.value.render() and "fix: add a host" in e.value.render()


@pytest.mark.parametrize("value", ["-1", "one", "1.5"])
def test_max_unavailable_that_is_not_a_count_is_refused_before_anything(value):
    proc = subprocess.run([sys.executable, "-m", "invoke", "deploy", "--topology", "2p2d", "--max-unavailable", value,
                           "-i", str(REPO / "inventory" / "lab")], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--max-unavailable" in proc.stderr and "fix:" in proc.stderr and "connect" not in proc.stdout
