"""Helpers the unit tests share (not a test module): the repository, the lab inventory edited in a
copy, and a revision recorded as `inv deploy` records it, without any host."""

from __future__ import annotations

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


def edited(tmp_path: Path, edit) -> Path:
    """The lab inventory as one file, changed by `edit(doc)`, in tmp_path/edited."""
    doc = single_file_doc(REPO / "inventory" / "lab")
    edit(doc)
    d = tmp_path / "edited"
    d.mkdir(exist_ok=True)
    (d / "hosts.yml").write_text(yaml.safe_dump(doc))
    return d
