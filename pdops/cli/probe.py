"""`inv probe`: try a candidate parameter bundle with a few long requests (pdops.ops.probe)."""

from __future__ import annotations

import json

from invoke import task

from pdops.cli import cli_errors, print_verdict, seconds
from pdops import record as rec

DEFAULT_INVENTORY = "inventory/lab"


def _int(value, flag: str, default: int | None):
    from pdops.errors import InvalidInput

    if value is None or value == "":
        return default
    try:
        return int(str(value))
    except ValueError:
        raise InvalidInput(flag, f"{value!r} is not a whole number", fix=f"e.g. {flag} 4") from None


@task(help={"inventory": "inventory dir or file",
            "bundle": "YAML file of SGLang flags: {name: T3, flags: {chunked-prefill-size: 16384}}",
            "instances": "a serving pair to probe, e.g. p01,d01 (it leaves the gateway for the probe)",
            "spare": "start a spare prefill x decode pair on free GPUs for the probe instead",
            "requests": "how many long requests (default 4)", "concurrency": "how many at once (default: all)",
            "workload": "INPUT/OUTPUT tokens per request, e.g. 380k/7000 (default: the profile's workload)",
            "timeout": "seconds each request may take (default 1800)",
            "keep": "with --instances: keep the bundle on the pair as a new revision if every request is ok",
            "dry_run": "print the plan only",
            "list": "print the probe table (with --json: as JSON; --csv FILE: as CSV)",
            "json": "with --list: JSON", "csv": "with --list: write the table to this CSV file",
            "note": "the probe to add a reading to: --note T3 --reading \"...\"",
            "reading": "with --note: your reading of that probe (free text, kept in the journal)"})
@cli_errors
def probe(c, inventory=DEFAULT_INVENTORY, bundle=None, instances=None, spare=False, requests=None, concurrency=None,
          workload=None, timeout=None, keep=False, dry_run=False, list_=False, json_=False, csv=None, note=None,
          reading=None):
    """Apply a candidate bundle to a pair, send a few long requests from the ledgered client, keep the
    outcome per request and the failure signatures, restore the baseline; --list shows the probe table."""
    from pdops.ops import probe as pr
    from pdops.errors import InvalidInput
    from pdops.remote.hosts import connections
    from pdops.model.inventory import load_inventory

    if note is not None:
        pr.check_note(note, reading)
        inv = load_inventory(inventory)
        added = pr.add_note(rec.open_record(inv), note, reading)
        print(f"probe {added['evidence']['probe']}: reading added: {added['evidence']['note']}")
        return
    if list_:
        inv = load_inventory(inventory)
        rows = pr.probe_table(rec.open_record(inv).journal())
        if csv:
            from pathlib import Path

            Path(csv).write_text(pr.table_csv(rows))
            print(f"{len(rows)} probe(s) written to {csv}")
        if json_:
            print(json.dumps(rows, indent=2, sort_keys=True, default=str))
        elif not csv:
            print(pr.render_table(rows))
        return
    if not bundle:
        raise InvalidInput("--bundle", "no bundle file given", fix="inv probe --bundle T3.yml --spare")
    b = pr.load_bundle(bundle)
    n_req = _int(requests, "--requests", 4)
    n_conc = _int(concurrency, "--concurrency", None)
    tmo = seconds(timeout, "--timeout")
    pr.check_options(instances=instances, spare=spare, requests=n_req, concurrency=n_conc, keep=keep)
    inv = load_inventory(inventory)
    pr.parse_workload(workload, inv.profile)  # all of it before the record is read (over SSH)
    record = rec.open_record(inv)
    plan = pr.plan_probe(inv, record, b, instances=instances, spare=spare, requests=n_req, concurrency=n_conc,
                         workload=workload, keep=keep, timeout_s=tmo)
    print(plan.render())
    if dry_run:
        return
    with connections(inv) as conns:
        doc = pr.execute_probe(plan, **conns)
    print_verdict(*pr.probe_verdict(doc))
