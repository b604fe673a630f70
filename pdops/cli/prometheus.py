"""`inv prometheus.*`: the Prometheus target file, rules and Grafana dashboard for a cluster."""

from __future__ import annotations

from pathlib import Path

from invoke import task

from pdops.cli import cli_errors
from pdops import record as rec

DEFAULT_INVENTORY = "inventory/lab"


def _emit(text: str, out: str | None, what: str) -> None:
    if not out:
        print(text, end="" if text.endswith("\n") else "\n")
        return
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(p)
    print(f"wrote {what} to {p}")


@task(help={"inventory": "inventory dir or file", "out": "write the file here (default: print it)",
            "deliver": "also write it where pdops writes it after every change (this machine's copy and "
                       "pdops_prometheus's host)"})
@cli_errors
def targets(c, inventory=DEFAULT_INVENTORY, out=None, deliver=False):
    """The file_sd target file of the current revision (engines, gateway, admission; labels cluster,
    instance, role, host, revision). pdops rewrites it after every deploy, scale, rollback, drain, repair."""
    from pdops.steps import targets as tg
    from pdops.errors import Refused
    from pdops.model.inventory import load_inventory
    from pdops.model.placement import Placement

    inv = load_inventory(inventory)
    rev = rec.open_record(inv, cached_ok=True).current_revision()
    if rev is None:
        raise Refused("nothing is deployed (no current revision): no target to list", fix="`inv deploy` first")
    pl = Placement.from_dict(rev.placement)
    if deliver:
        from pdops.remote.hosts import HostPool

        with HostPool(inv) as pool:
            ev = tg.publish(pool, inv, rev.number, pl)
        print(f"wrote the targets of revision {rev.number} to {ev.get('delivered') or ev['targets_file']}")
        return
    _emit(tg.targets_text(tg.targets(inv, rev.number, pl)), out, f"the targets of revision {rev.number}")


@task(help={"inventory": "inventory dir or file", "out": "write the file here (default: print it)"})
@cli_errors
def rules(c, inventory=DEFAULT_INVENTORY, out=None):
    """Recording and alert rules for PD clusters (TTFT threshold: the profile's slo.ttft_p99_s)."""
    from pdops.ops import prometheus as obs
    from pdops.model.inventory import load_inventory

    _emit(obs.rules_text(load_inventory(inventory)), out, "the rules")


@task(help={"inventory": "inventory dir or file", "out": "write the file here (default: print it)"})
@cli_errors
def dashboard(c, inventory=DEFAULT_INVENTORY, out=None):
    """The Grafana dashboard (JSON, importable as is; cluster and revision are its variables)."""
    import json

    from pdops.ops import prometheus as obs

    from pdops.model.inventory import load_inventory

    _emit(json.dumps(obs.dashboard(load_inventory(inventory)), indent=2) + "\n", out, "the dashboard")


@task(help={"inventory": "inventory dir or file"})
@cli_errors
def scrape_config(c, inventory=DEFAULT_INVENTORY):
    """The scrape job to add to the fleet's prometheus.yml (file_sd over the target file; keys by file)."""
    import yaml

    from pdops.ops import prometheus as obs

    from pdops.model.inventory import load_inventory

    print(yaml.safe_dump(obs.scrape_config(load_inventory(inventory)), sort_keys=False), end="")
