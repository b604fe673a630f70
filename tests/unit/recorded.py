"""Helpers the unit tests share (not a test module): the repository, the lab inventory varied in a
copy (several gateways, the admission layer, a bundle, any edit), and a revision recorded as `inv
deploy` records it, without any host."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from pdops.model.inventory import single_file_doc
from pdops.model.placement import Placement, place
from pdops.model.render import manifest, render_files, snapshot_of
from pdops.model.topology import parse_topology
from pdops.record.local import StateDir

REPO = Path(__file__).resolve().parents[2]


def deployed(inv, state: StateDir, topo: str | None = None, pl: Placement | None = None, outcome="deployed",
             make_current=True, *, snapshot: bool = False, instances: dict | None = None, **record):
    """Record a revision as `inv deploy` (or a scale) records it, without any host: the placement of
    `topo` (or `pl`), the manifest of its rendered files, each instance's role and worker id (or
    `instances`), with `snapshot` the inventory's snapshot a rollback and a generation read, and the
    rest of `record` as given (extra, operator, op_id). The one recorded revision of the unit tests."""
    pl = pl or place(inv, parse_topology(topo))
    files = render_files(inv, pl)
    rev = state.write_revision(topology=str(pl.topology), inventory_hash=inv.digest, placement=pl.to_dict(),
                               manifest=manifest(files),
                               instances={i.id: {"role": i.role, "worker_id": f"w-{i.id}"} for i in pl.instances}
                               if instances is None else instances,
                               outcome=outcome, snapshot=snapshot_of(inv, files) if snapshot else None, **record)
    if make_current:
        state.set_current(rev.number)
    return rev


def lab_variant(tmp_path: Path, name: str = "edited", *, gateway: dict | None = None, admission: bool | str = False,
                edit=None, bundle: dict | None = None) -> Path:
    """The lab inventory as one file in tmp_path/name, the one way the unit tests vary it: `gateway`
    updates pdops_gateway (`{"hosts": ["lab01", "lab02"]}`: two gateways); `admission` puts the
    admission layer in front (on that host when it is a name), with an API keys file of one key, 0600
    as an operator keeps it; `edit(doc)` changes anything else; `bundle` updates the bundle of a copy
    of the lab-sim profile."""
    doc = single_file_doc(REPO / "inventory" / "lab")
    v = doc["all"]["vars"]
    d = tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    if gateway:
        v["pdops_gateway"].pop("host", None)
        v["pdops_gateway"].update(gateway)
    if admission:
        keys = tmp_path / f"{name}.keys"
        keys.write_text("pdops-unit-case-key-" + "k" * 16 + "\n")
        os.chmod(keys, 0o600)
        v["pdops_admission"] = {**({"host": admission} if isinstance(admission, str) else {}),
                                "api_keys_file": str(keys)}
    if bundle is not None:
        prof = yaml.safe_load((REPO / "pdops" / "profiles" / "lab-sim.yml").read_text())
        prof["bundle"].update(bundle)
        (d / "profiles").mkdir(exist_ok=True)
        (d / "profiles" / "p.yml").write_text(yaml.safe_dump(prof))
        v["pdops_profile"] = "profiles/p.yml"
    if edit is not None:
        edit(doc)
    (d / "hosts.yml").write_text(yaml.safe_dump(doc))
    return d


def edited(tmp_path: Path, edit) -> Path:
    """The lab inventory as one file, changed by `edit(doc)`, in tmp_path/edited."""
    return lab_variant(tmp_path, "edited", edit=edit)
