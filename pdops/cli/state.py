"""The shared record and its lock: `inv journal`, `inv unlock`, `inv state.push`, `inv state.show`,
and where the record lives: `inv state.etcd-up`, `inv state.migrate`, `inv state.restore`."""

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
    record = _record(inventory)
    j = record.journal()
    if op:
        steps = j.read(op)
        if not steps:
            raise InvalidInput("--op", f"no operation {op!r} in the journal on {record.location}",
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
    print(f"(journal: {record.location}, the last {n} operations)")


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

    record = _record(inventory, cached_ok=True)
    record._check_local_record = False
    record.allow_moved = True
    doc = {"location": record.location, "store": record.store.kind, "current": record.current(),
           "revisions": record.revision_numbers(), "lock": record.lock_holder(), "moved": record.snapshot().get("moved"),
           "cached": record.cached, "cache_file": str(record.cache_file),
           "local_record": record.local_record().revision_numbers(), "local_dir": str(record.path)}
    if json:
        print(_json.dumps(doc, indent=2, default=str))
        return
    print(f"record of {record.cluster}: {doc['location']}" + (" (READ-ONLY CACHED COPY)" if doc["cached"] else ""))
    if doc["moved"]:
        print(f"  MOVED to {doc['moved'].get('to')} at {doc['moved'].get('at')} by {doc['moved'].get('by')}: set "
              f"pdops_state.backend: {doc['moved'].get('backend')}")
    print(f"  current: {doc['current']}; revisions: {', '.join(map(str, doc['revisions'])) or 'none'}")
    print(f"  {lock_line(doc['lock'])}")
    print(f"  this machine: {doc['local_dir']} (cache {doc['cache_file']})")
    if record.cache_error:
        print(f"  note: {record.cache_error}")
    if doc["local_record"]:
        print(f"  this machine also holds a record of its own (revisions {doc['local_record']}): `inv state.push`")


@task(help={"inventory": "inventory dir or file", "to": "etcd, or host (back to the SSH state host)",
            "dry_run": "say what would be copied; change nothing"})
@cli_errors
def migrate(c, inventory=None, to=None, dry_run=False):
    """Copy the whole record (revisions, snapshots, current, journal) to etcd (or back to the state
    host), prove the copy by counts and digests, and mark the source as moved. Refused while locked."""
    from pdops.cli import print_verdict
    from pdops.errors import InvalidInput
    from pdops.model.inventory import load_inventory
    from pdops.ops.record_store import migrate as do_migrate

    if to not in ("etcd", "host"):
        raise InvalidInput("--to", f"{to!r} is neither etcd nor host", fix="--to etcd (or --to host to move back)")
    inv = load_inventory(inventory or DEFAULT_INVENTORY)
    res = do_migrate(inv, to, rec.open_record, dry_run=dry_run)  # prints its plan first
    if dry_run:
        print(res["message"])
        return
    print_verdict(res["message"], res["verdict"])


@task(help={"inventory": "inventory dir or file", "from_cache": "rebuild from this machine's cached copy",
            "dry_run": "print the plan; change nothing"})
@cli_errors
def restore(c, inventory=None, from_cache=False, dry_run=False):
    """Rebuild the record in its (new, empty) store from this machine's cached copy when the state
    host is lost for good; says what cannot be restored (the journal)."""
    from pdops.cli import print_verdict
    from pdops.errors import InvalidInput
    from pdops.model.inventory import load_inventory
    from pdops.ops.record_store import restore_from_cache

    if not from_cache:
        raise InvalidInput("--from-cache", "missing", fix="the one source pdops restores from: --from-cache")
    inv = load_inventory(inventory or DEFAULT_INVENTORY)
    res = restore_from_cache(inv, rec.open_record(inv), dry_run=dry_run)  # prints its plan first
    if dry_run:
        print(res["message"])
        return
    print_verdict(res["message"], res["verdict"])


@task(help={"inventory": "inventory dir or file", "dry_run": "print the plan; change nothing"})
@cli_errors
def etcd_up(c, inventory=None, dry_run=False):
    """Run the record's etcd on the inventory's pdops_state.etcd.members: render each member's unit,
    deliver it with Ansible, start the members, check they elect one leader."""
    from pdops.cli import print_verdict
    from pdops.model.inventory import load_inventory
    from pdops.ops.record_store import operate_etcd_up, plan_etcd_up
    from pdops.remote.hosts import connections

    inv = load_inventory(inventory or DEFAULT_INVENTORY)
    print(plan_etcd_up(inv).render())
    if dry_run:
        return
    with connections(inv) as conns:
        res = operate_etcd_up(inv, rec.open_record(inv), pool=conns["pool"])
    print_verdict(f"etcd members of {inv.cluster} up (op {res['op']})", res["verdict"])
