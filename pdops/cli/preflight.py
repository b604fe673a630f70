"""`inv preflight`: host, GPU, RDMA, version and P x D pairing checks, before any change."""

from __future__ import annotations

from invoke import task
from invoke.exceptions import Exit

from pdops.cli import cli_errors
from pdops import record as rec

DEFAULT_INVENTORY = "inventory/lab"


@task(iterable=["skip_check"],
      help={"inventory": "inventory dir or file", "topology": "NpMd: check what this topology needs (and the P x D "
            "pairing); without it every host and instance slot", "json": "machine-readable output",
            "skip_check": "a check to skip (repeatable), e.g. --skip-check time"})
@cli_errors
def preflight(c, inventory=DEFAULT_INVENTORY, topology=None, json=False, skip_check=None):
    """Run every applicable check on every host in parallel; print host x check (pass/fail/skipped) and the P x D matrix.

    Exit status 0 when nothing failed, 4 (refused) when a check failed: each failure names its fix."""
    from pdops.steps import preflight as pf
    from pdops.remote.hosts import HostPool
    from pdops.model.inventory import load_inventory
    from pdops.model.placement import Placement
    from pdops.model.topology import parse_topology

    inv = load_inventory(inventory)
    skip = pf.validate_skip(skip_check)
    topo = parse_topology(topology) if topology else None
    previous = None
    if topo is not None:
        current = rec.open_record(inv, cached_ok=True).current_revision()  # read-only: the cache will do
        if current is not None:
            previous = Placement.from_dict(current.placement)
    with HostPool(inv) as pool:
        report = pf.run_preflight(inv, topo, pool, skip, previous=previous)
    print(report.to_json() if json else report.format_table())
    if not report.ok:
        raise Exit(code=4)
