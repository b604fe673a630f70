"""pdops reads an inventory exactly as Ansible does: for the shipped inventories and every
layout case in tests/data/inventory_layouts/ (group_vars per group, host_vars, host ranges,
INI, a child group overriding its parent, `all` overridden by a group), the variables pdops
validates equal `ansible-inventory --list`'s, host by host. The reference fleet renders the
same files from its single-file form and from its split group_vars form."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdops.model.inventory import ANSIBLE_CFG, inventory_files, load_inventory, read_with_ansible
from pdops.model.placement import place
from pdops.model.render import manifest, render_files
from pdops.model.topology import parse_topology

REPO = Path(__file__).resolve().parents[3]
LAYOUTS = REPO / "tests" / "data" / "inventory_layouts"
CASES = sorted(p.name for p in LAYOUTS.iterdir() if p.is_dir() and p.name != "common")
EXPECT = yaml.safe_load((LAYOUTS / "expect.yml").read_text())
SHIPPED = [REPO / "inventory" / "rtx6000d", REPO / "inventory" / "lab",
           REPO / "tests" / "data" / "inventory" / "rtx6000d-single"]


def ansible_inventory(files: list[Path]) -> dict:
    """{host: vars} as `ansible-inventory --list` prints them, with pdops's ansible.cfg."""
    exe = Path(sys.executable).parent / "ansible-inventory"
    env = {**os.environ, "ANSIBLE_CONFIG": str(ANSIBLE_CFG)}
    out = subprocess.run([str(exe), *[a for f in files for a in ("-i", str(f))], "--list"], env=env,
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return json.loads(out)["_meta"]["hostvars"]


def case_dir(name: str, tmp_path: Path) -> Path:
    d = tmp_path / name
    shutil.copytree(LAYOUTS / name, d)
    (d / "group_vars" / "all").mkdir(parents=True, exist_ok=True)
    shutil.copy(LAYOUTS / "common" / "cluster.yml", d / "group_vars" / "all" / "cluster.yml")
    return d


@pytest.mark.parametrize("name", CASES)
def test_each_layout_reads_as_ansible_reads_it(name, tmp_path):
    d = case_dir(name, tmp_path)
    files = inventory_files(d)
    ours = read_with_ansible(files).hostvars
    assert ours == ansible_inventory(files)
    inv = load_inventory(d)
    assert {h.name: [h.data_addr, h.gpu_count] for h in inv.hosts} == EXPECT[name]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_inventories_read_as_ansible_reads_them(path):
    files = inventory_files(path)
    assert read_with_ansible(files).hostvars == ansible_inventory(files)


def test_the_fleet_split_into_group_vars_renders_what_its_single_file_form_renders():
    split = load_inventory(REPO / "inventory" / "rtx6000d")
    single = load_inventory(REPO / "tests" / "data" / "inventory" / "rtx6000d-single")
    assert split.digest == single.digest  # same variables: not "the inventory changed"
    for topo in ("12p4d", "8p4d", "1p1d"):
        a = manifest(render_files(split, place(split, parse_topology(topo))))
        b = manifest(render_files(single, place(single, parse_topology(topo))))
        assert a == b, topo


def test_a_bad_value_names_the_file_it_came_from(tmp_path):
    d = case_dir("host_vars", tmp_path)
    (d / "host_vars" / "gpu02.yml").write_text("ansible_host: 127.0.20.2\npdops_data_addr: not-an-address\n")
    from pdops.errors import InvalidInput

    with pytest.raises(InvalidInput) as ei:
        load_inventory(d)
    assert ei.value.field == "hosts.gpu02.pdops_data_addr"
    assert f"(from {d / 'host_vars' / 'gpu02.yml'}:2)" in ei.value.message


def test_a_cluster_setting_that_differs_between_hosts_is_refused(tmp_path):
    d = case_dir("host_vars", tmp_path)
    with open(d / "host_vars" / "gpu02.yml", "a") as f:
        f.write("pdops_profile: glm-flash-80k\n")
    from pdops.errors import InvalidInput

    with pytest.raises(InvalidInput, match="pdops_profile: is 'lab-sim' for gpu01 but 'glm-flash-80k' for gpu02"):
        load_inventory(d)


def test_an_executable_inventory_file_is_never_run_as_a_script(tmp_path):
    d = case_dir("group_vars_per_group", tmp_path)
    marker = tmp_path / "ran"
    script = d / "hosts.yml"
    script.write_text(f"#!/bin/sh\ntouch {marker}\necho '{{}}'\n" + script.read_text())
    script.chmod(0o755)
    from pdops.errors import InvalidInput

    with pytest.raises(InvalidInput):
        load_inventory(d)
    assert not marker.exists()


def test_reading_leaves_the_environment_of_child_processes_alone():
    before = os.environ.get("ANSIBLE_CONFIG")
    load_inventory(REPO / "inventory" / "rtx6000d")
    assert os.environ.get("ANSIBLE_CONFIG") == before  # ansible run by a test or a tool gets its own config


def _copy_lab(tmp_path: Path) -> Path:
    d = tmp_path / "inv"
    shutil.copytree(REPO / "inventory" / "lab", d)
    return d


def test_a_second_read_of_the_same_files_does_not_import_ansible(tmp_path):
    """Ansible's reading is cached by the digest of every file it depends on: `inv plan` then
    costs Invoke's start-up and pdops's rules (bench/plan_speed.py). The cache file is 0600."""
    d = _copy_lab(tmp_path)
    env = {**os.environ, "PDOPS_CACHE_DIR": str(tmp_path / "cache")}
    code = (f"import sys; from pdops.model.inventory import load_inventory; inv = load_inventory({str(d)!r}); "
            "print(inv.cluster, 'ansible' in sys.modules)")
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert first.stdout.split()[1] == "True" and second.stdout.split() == [first.stdout.split()[0], "False"]
    [cached] = (tmp_path / "cache" / "inventory").glob("*.json")
    assert oct(cached.stat().st_mode & 0o777) == "0o600"


def test_an_edit_to_a_group_vars_file_is_read_again(tmp_path, monkeypatch):
    monkeypatch.setenv("PDOPS_CACHE_DIR", str(tmp_path / "cache"))
    d = _copy_lab(tmp_path)
    before = load_inventory(d)
    gv = d / "group_vars" / "all.yml"
    doc = yaml.safe_load(gv.read_text())
    doc["pdops_drain"]["budget_s"] = before.drain_budget_s + 7
    gv.write_text(yaml.safe_dump(doc))
    assert load_inventory(d).drain_budget_s == before.drain_budget_s + 7


def test_a_bad_value_read_from_the_cache_still_names_its_file(tmp_path, monkeypatch):
    """The cache holds Ansible's values, not where they came from: an error re-reads with Ansible
    so it names the file and line, as without the cache."""
    from pdops.errors import InvalidInput

    monkeypatch.setenv("PDOPS_CACHE_DIR", str(tmp_path / "cache"))
    d = case_dir("host_vars", tmp_path)
    (d / "host_vars" / "gpu02.yml").write_text("ansible_host: 127.0.20.2\npdops_data_addr: not-an-address\n")
    for _ in range(2):  # the second read's values come from the cache
        with pytest.raises(InvalidInput) as ei:
            load_inventory(d)
        assert f"(from {d / 'host_vars' / 'gpu02.yml'}:2)" in ei.value.message
    assert list((tmp_path / "cache" / "inventory").glob("*.json"))
