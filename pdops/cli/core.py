"""Cluster operations: plan, render (and, as they land: deploy, status, drain, scale, rollback)."""

from __future__ import annotations

from pathlib import Path

from invoke import task

from pdops import planning
from pdops.cli import cli_errors

DEFAULT_INVENTORY = "inventory/lab"


@task(help={"topology": "NpMd, e.g. 8p4d (or a YAML file)", "inventory": "inventory dir or file"})
@cli_errors
def plan(c, topology, inventory=DEFAULT_INVENTORY):
    """Print the placement table for a topology; writes nothing, contacts no host."""
    inv, pl = planning.load_and_place(inventory, topology)
    print(planning.format_placement(inv, pl))


@task(help={"topology": "NpMd, e.g. 8p4d", "inventory": "inventory dir or file",
            "out": "build folder (default build/<cluster>/<topology>)"})
@cli_errors
def render(c, topology, inventory=DEFAULT_INVENTORY, out=None):
    """Render every host's files for a topology into a build folder, with a manifest of hashes."""
    inv, pl = planning.load_and_place(inventory, topology)
    path, files = planning.render_build(inv, pl, Path(out) if out else None)
    hosts = len({f.host for f in files})
    print(f"rendered {len(files)} files for {hosts} hosts ({pl.topology}, {inv.engine}) into {path}")
    print(f"manifest: {path / 'manifest.json'}")


@task
@cli_errors
def demo(c):
    """What `make demo` runs: the reference fleet's placement, then the lab (as it lands)."""
    inv, pl = planning.load_and_place("inventory/rtx6000d", "12p4d")
    print(f"== reference fleet {inv.cluster}: {len(inv.hosts)} hosts x {inv.hosts[0].gpu_count} "
          f"{inv.hosts[0].gpu_model}, profile {inv.profile.name} ({inv.profile.bundle.get('status')} bundle)")
    print(planning.format_placement(inv, pl))
    path, files = planning.render_build(inv, pl, None)
    print(f"\nrendered {len(files)} files into {path}")
