"""The lab's Ansible inventory: hosts 1..n in the shipped lab01's shape, written by `up` as
hosts.yml + group_vars/; `own_record`, which makes a copy of it a cluster of its own; and
`grown_fleet`, the reference fleet's inventory at any size, for planning at fleet size.
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import yaml

from pdops.lab.paths import address_prefix, host_address, host_name, inventory_path, repo_root
from pdops.model.inventory import single_file_doc


def own_record(doc: dict, where: Path) -> dict:
    """Make a derived lab inventory (the dict of its hosts.yml) a cluster of its own: this machine's
    dir `where/state`, and a state dir of its own on the state host (docs/state.md), so that it
    does not see, nor lock, the record of another test, bench or demo on the same lab hosts."""
    slug = f"{where.name}-{hashlib.sha256(str(Path(where).resolve()).encode()).hexdigest()[:10]}"
    doc["all"]["vars"]["pdops_state_dir"] = str(Path(where) / "state")
    doc["all"]["vars"]["pdops_state"] = {"dir": f"/var/lib/pdops/state/{slug}"}
    return doc


def inventory_doc(shipped: dict, n: int, key: Path, lab_dir: Path) -> dict:
    """The lab inventory for hosts 1..n, each in exactly the shipped lab01's shape."""
    doc = copy.deepcopy(shipped)
    all_ = doc["all"]
    template = all_["children"]["gpu_hosts"]["hosts"]["lab01"]
    hosts = {}
    for i in range(1, n + 1):
        h = copy.deepcopy(template)
        h["ansible_host"] = host_address(i)
        h["pdops_data_addr"] = host_address(i)
        hosts[host_name(i)] = h
    all_["children"]["gpu_hosts"]["hosts"] = hosts
    all_["vars"]["ansible_ssh_private_key_file"] = str(key)
    all_["vars"]["ansible_ssh_common_args"] = (
        "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"
    )
    all_["vars"]["pdops_lab_dir"] = str(lab_dir)
    return doc


def inventory_text(doc: dict, n: int) -> str:
    """The inventory as one file (every setting in hosts.yml)."""
    header = (
        f"# Lab inventory written by `inv lab.up --hosts {n}` (pdops.lab): {n} hosts on "
        f"{address_prefix()}1..{n}, 8 virtual GPUs each.\n"
    )
    return header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def inventory_files(doc: dict, n: int) -> dict[str, str]:
    """The inventory in Ansible's usual shape, {relative path: text}: hosts.yml with the hosts and
    their addresses, group_vars/all.yml with the cluster's settings, group_vars/gpu_hosts.yml with
    the GPUs and NICs every lab host has (they are all lab01's shape)."""
    hosts = doc["all"]["children"]["gpu_hosts"]["hosts"]
    first = next(iter(hosts.values()))
    per_host = {h: {k: v[k] for k in ("ansible_host", "pdops_data_addr")} for h, v in hosts.items()}
    shared = {k: v for k, v in first.items() if k not in ("ansible_host", "pdops_data_addr")}
    head = f"# Lab inventory written by `inv lab.up --hosts {n}` (pdops.lab): "
    dump = lambda d: yaml.safe_dump(d, sort_keys=False, default_flow_style=False)  # noqa: E731
    return {
        "hosts.yml": head + f"{n} hosts on {address_prefix()}1..{n}; settings in group_vars/.\n"
                     + dump({"all": {"children": {"gpu_hosts": {"hosts": per_host}}}}),
        "group_vars/all.yml": head + "the cluster's settings.\n" + dump(doc["all"]["vars"]),
        "group_vars/gpu_hosts.yml": head + "8 virtual GPUs and two NICs per host.\n" + dump(shared),
    }


def write_inventory(lab_dir: Path, n: int, key: Path) -> bool:
    """Write <lab>/inventory/ (hosts.yml + group_vars/) for hosts 1..n; False when it was already so."""
    shipped = single_file_doc(repo_root() / "inventory" / "lab")
    files = inventory_files(inventory_doc(shipped, n, key, lab_dir), n)
    root = inventory_path(lab_dir).parent
    changed = False
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.read_text() == text:
            continue
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
        changed = True
    return changed


def grown_fleet(where: Path, n: int, profile: dict | None = None) -> Path:
    """inventory/rtx6000d grown to n hosts gpu01..gpuN (its addresses, off this machine: for `plan`,
    `render` and pure planning only, never a target), written as `where`/hosts.yml; `profile`: a
    profile of its own (written beside it) instead of the shipped one. Returns `where`."""
    doc = single_file_doc(repo_root() / "inventory" / "rtx6000d")
    hosts = doc["all"]["children"]["gpu_hosts"]["hosts"]
    proto = dict(hosts["gpu01"])
    hosts.clear()
    for i in range(1, n + 1):
        hosts[f"gpu{i:02d}"] = {**proto, "ansible_host": f"10.20.{i // 250}.{i % 250 + 1}",
                                "pdops_data_addr": f"10.30.{i // 250}.{i % 250 + 1}"}
    where.mkdir(parents=True, exist_ok=True)
    if profile is not None:
        (where / "profile.yml").write_text(yaml.safe_dump(profile))
        doc["all"]["vars"]["pdops_profile"] = "profile.yml"
    (where / "hosts.yml").write_text(yaml.safe_dump(doc))
    return where
