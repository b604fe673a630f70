"""The shared record and its lock: `inv journal`, `inv unlock`, `inv state.push`, `inv state.show`."""

from __future__ import annotations

from invoke import task

from pdops.cli import cli_errors
from pdops import record as rec

DEFAULT_INVENTORY = "inventory/lab"


def _record(inventory, **kw):
    from pdops.model.inventory import load_inventory

    return rec.open_record(load_inventory(inventory or DEFAULT_INVENTORY), **kw)


@task(help={"inventory": "inventory dir or file", "op": "one operation's steps (an op id from the list)",
            "last": "how many operations to list (default 20)", "json": "machine-readable output"})
@cli_errors
def journal(c, inventory=None, op=None, last="20", json=False):
    """The operation journal: one row per operation (who, which machine, how it ended), or --op ID's steps."""
    import json as _json

    from pdops.errors import InvalidInput
    from pdops.model.build import format_table
    from pdops.record import operations

    if not str(last).isdigit() or int(last) < 1:
        raise InvalidInput("--last", f"{last!r} is not a positive number of operations", fix="e.g. --last 50")
    state = _record(inventory)
    j = state.journal()
    if op:
        steps = j.read(op)
        if not steps:
            raise InvalidInput("--op", f"no operation {op!r} in the journal on {state.location}",
                               fix="see `inv journal` for operation ids")
        if json:
            print(_json.dumps(steps, indent=2))
            return
        for s in steps:
            ev = _json.dumps(s.get("evidence") or {}, sort_keys=True, default=str)
            print(f"{s.get('ts')}  {s.get('status'):<11} {s.get('step')}  {ev[:400]}")
        return
    n = int(last)
    rows = operations(j, last=n)[-n:]
    if json:
        print(_json.dumps(rows, indent=2))
        return
    print(format_table(rows) if rows else "no operation journalled yet")
    print(f"(journal: {state.location}, the last {n} operations)")


@task(help={"inventory": "inventory dir or file", "force": "take the lock over (needs --reason)",
            "reason": "why (journalled with who did it)"})
@cli_errors
def unlock(c, inventory=None, force=False, reason=None):
    """Show who holds the cluster lock and the evidence; with --force --reason, take it over."""
    from pdops.record import unlock as do_unlock

    res = do_unlock(_record(inventory), force=force, reason=reason)
    print(res["message"])


@task(help={"inventory": "inventory dir or file", "dry_run": "say what would be copied; change nothing"})
@cli_errors
def push(c, inventory=None, dry_run=False):
    """Move this machine's record of the cluster (from before the shared record) to the state host."""
    from pdops.record import push_local

    print(push_local(_record(inventory), dry_run=dry_run)["message"])


@task(help={"inventory": "inventory dir or file", "json": "machine-readable output"})
@cli_errors
def show(c, inventory=None, json=False):
    """Where the record lives, who holds the lock, what this machine keeps (cache, an unpushed record)."""
    import json as _json

    from pdops.record import lock_line

    state = _record(inventory, cached_ok=True)
    state._check_local_record = False
    doc = {"location": state.location, "current": state.current(), "revisions": state.revision_numbers(),
           "lock": state.lock_holder(), "cached": state.cached, "cache_file": str(state.cache_file),
           "local_record": state.local_record().revision_numbers(), "local_dir": str(state.path)}
    if json:
        print(_json.dumps(doc, indent=2, default=str))
        return
    print(f"record of {state.cluster}: {doc['location']}" + (" (READ-ONLY CACHED COPY)" if doc["cached"] else ""))
    print(f"  current: {doc['current']}; revisions: {', '.join(map(str, doc['revisions'])) or 'none'}")
    print(f"  {lock_line(doc['lock'])}")
    print(f"  this machine: {doc['local_dir']} (cache {doc['cache_file']})")
    if doc["local_record"]:
        print(f"  this machine also holds a record of its own (revisions {doc['local_record']}): `inv state.push`")
