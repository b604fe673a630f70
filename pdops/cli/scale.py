"""Topology changes and revisions: scale, rollback, history, diff."""

from __future__ import annotations

from invoke import task

from pdops.cli import cli_errors
from pdops.cli.core import run_change, whole_cluster
from pdops import record as rec

DEFAULT_INVENTORY = "inventory/lab"


@task(help={"inventory": "inventory dir or file", "topology": "target NpMd, e.g. 10p2d",
            "dry_run": "print the plan only",
            "allow_capacity_dip": "accept a plan that must drain before it can add (GPUs to free first)",
            "skip_check": "a preflight check to skip (repeatable; recorded in the journal)",
            "max_unavailable": "instances per role out at once while replacing (default 1; 0: surge every one)",
            "force": "accept a plan that leaves a role with no serving instance at some step",
            "unfenced": "roll a change of generation in waves anyway (requests pairing old and new fail)"},
      iterable=["skip_check"])
@cli_errors
def scale(c, inventory=None, topology=None, dry_run=False, allow_capacity_dip=False, skip_check=None,
          max_unavailable=None, force=False, unfenced=False):
    """The same planned change as `inv deploy --topology T` of a live cluster: keep, replace, add, drain, record."""
    from pdops.ops import scale as sc
    from pdops.model.inventory import load_inventory
    from pdops.model.topology import parse_topology

    topo = parse_topology(topology)
    mu = whole_cluster(max_unavailable, "--max-unavailable")
    inv = load_inventory(inventory or DEFAULT_INVENTORY)
    record = rec.open_record(inv)
    run_change(inv, record, lambda seen: sc.plan_scale(inv, topo, record, allow_capacity_dip=allow_capacity_dip,
                                                      skip_checks=set(skip_check or ()), max_unavailable=mu,
                                                      force=force, seen=seen, unfenced=unfenced), dry_run)


@task(help={"inventory": "inventory dir or file", "to": "revision number (default: the previous deployed one)",
            "dry_run": "print the plan only",
            "allow_capacity_dip": "accept a plan that must drain before it can add (GPUs to free first)",
            "skip_check": "a preflight check to skip (repeatable; recorded in the journal)",
            "max_unavailable": "instances per role out at once while replacing (default 1)",
            "force": "accept a plan that leaves a role with no serving instance at some step"},
      iterable=["skip_check"])
@cli_errors
def rollback(c, inventory=None, to=None, dry_run=False, allow_capacity_dip=False, skip_check=None,
             max_unavailable=None, force=False):
    """Return to the previous revision (or --to N), its recorded files and placement, as a rolling change."""
    from pdops.ops import scale as sc
    from pdops.model.inventory import load_inventory

    mu = whole_cluster(max_unavailable, "--max-unavailable")
    inv = load_inventory(inventory or DEFAULT_INVENTORY)
    record = rec.open_record(inv)
    run_change(inv, record, lambda seen: sc.plan_rollback(inv, record, to, allow_capacity_dip=allow_capacity_dip,
                                                         skip_checks=set(skip_check or ()), max_unavailable=mu,
                                                         force=force, seen=seen), dry_run)


@task(help={"inventory": "inventory dir or file", "json": "machine-readable output"})
@cli_errors
def history(c, inventory=None, json=False):
    """Recorded revisions: topology, time, operator, outcome; the current one marked."""
    import json as _json

    from pdops.reads.history import format_history, history_rows
    from pdops.model.inventory import load_inventory

    record = rec.open_record(load_inventory(inventory or DEFAULT_INVENTORY), cached_ok=True)
    print(_json.dumps(history_rows(record), indent=2) if json else format_history(record))


@task(help={"inventory": "inventory dir or file", "a": "revision number", "b": "revision number",
            "json": "machine-readable output"},
      positional=["a", "b"])
@cli_errors
def diff(c, a=None, b=None, inventory=None, json=False):
    """What changed between revisions A and B: instances added/removed/moved, files per host."""
    import json as _json

    from pdops.errors import InvalidInput
    from pdops.reads.history import diff_revisions, format_diff
    from pdops.model.inventory import load_inventory

    if a is None or b is None:
        raise InvalidInput("diff", "needs two revision numbers", fix="e.g. `inv diff 3 4` (see `inv history`)")
    record = rec.open_record(load_inventory(inventory or DEFAULT_INVENTORY), cached_ok=True)
    d = diff_revisions(record, a, b)
    print(_json.dumps(d, indent=2) if json else format_diff(d))
