"""`inv history` and `inv diff A B`: pure reads of the state dir (no host is contacted)."""

from __future__ import annotations

from pdops.errors import InvalidInput
from pdops.model.placement import Placement
from pdops.record.local import Revision
from pdops.model.build import format_table
from pdops.reads.status import record_doc, record_lines


def _note(rev: Revision) -> str:
    x = rev.extra or {}
    if x.get("rollback_of"):
        s = x.get("scale") or {}
        return f"rollback to {x['rollback_of']} (from {s.get('from_revision')})"
    if x.get("scale"):
        s = x["scale"]
        parts = [f"scale from {s.get('from_revision')}"]
        if s.get("added"):
            parts.append("+" + ",".join(s["added"]))
        if s.get("removed"):
            parts.append("-" + ",".join(s["removed"]))
        return " ".join(parts)
    if x.get("halted") or x.get("scale_failed"):  # scale_failed: the error's text, in records before 2026-12
        return f"stopped midway from {x.get('from_revision')} towards {x.get('target')}"
    if x.get("drained"):
        return f"drain -{x['drained']}"
    return "deploy"


def _who(rev: Revision) -> tuple[str, str]:
    """(operator, machine); records from before the shared record wrote them as one `user@machine`."""
    if rev.machine:
        return rev.operator, rev.machine
    user, _, machine = rev.operator.partition("@")
    return user, machine or "-"


def history_rows(record) -> list[dict]:
    """One row per recorded revision, oldest first, with the current one marked."""
    cur = record.current()
    rows = []
    for rev in record.history():
        operator, machine = _who(rev)
        rows.append({"current": "*" if rev.number == cur else "", "revision": rev.number, "topology": rev.topology,
                     "created": rev.created, "operator": operator, "machine": machine, "outcome": rev.outcome,
                     "change": _note(rev), "op_id": rev.op_id or "-"})
    return rows


def format_history(record) -> str:
    rows = history_rows(record)
    head = record_lines(record_doc(record))
    where = getattr(record, "location", str(record.path))
    if not rows:
        return "\n".join(head + [f"{record.cluster}: no revision recorded yet (record: {where})"])
    return "\n".join(head + [format_table(rows), f"(* = current; record: {where})"])


def _read(record, n) -> Revision:
    try:
        num = int(n)
    except (TypeError, ValueError):
        raise InvalidInput("revision", f"{n!r} is not a revision number", fix="see `inv history`") from None
    return record.read_revision(num)


def diff_revisions(record, a, b) -> dict:
    """What changed from revision `a` to revision `b`: instances added/removed/moved, files per host."""
    ra, rb = _read(record, a), _read(record, b)
    pa, pb = Placement.from_dict(ra.placement), Placement.from_dict(rb.placement)
    ia, ib = {i.id: i for i in pa.instances}, {i.id: i for i in pb.instances}

    def where(i) -> str:
        return f"{'/'.join(i.hosts)} slot {i.slot} GPUs {','.join(map(str, i.head.gpus))} port {i.http_port}"

    instances = {
        "added": [{"instance": k, "role": ib[k].role, "where": where(ib[k])} for k in ib if k not in ia],
        "removed": [{"instance": k, "role": ia[k].role, "where": where(ia[k])} for k in ia if k not in ib],
        "moved": [{"instance": k, "from": where(ia[k]), "to": where(ib[k])} for k in ia if k in ib and ia[k] != ib[k]],
        "unchanged": [k for k in ia if k in ib and ia[k] == ib[k]],
    }
    files: dict[str, dict[str, list[str]]] = {}
    for host in sorted(set(ra.manifest) | set(rb.manifest)):
        fa, fb = ra.manifest.get(host, {}), rb.manifest.get(host, {})
        d = {"added": sorted(p for p in fb if p not in fa), "removed": sorted(p for p in fa if p not in fb),
             "changed": sorted(p for p in fa if p in fb and fa[p] != fb[p])}
        if any(d.values()):
            files[host] = d
    return {"a": {"revision": ra.number, "topology": ra.topology}, "b": {"revision": rb.number,
            "topology": rb.topology}, "inventory_changed": ra.inventory_hash != rb.inventory_hash,
            "instances": instances, "files": files}


def format_diff(d: dict) -> str:
    a, b = d["a"], d["b"]
    lines = [f"diff revision {a['revision']} ({a['topology']}) -> revision {b['revision']} ({b['topology']})"]
    if d["inventory_changed"]:
        lines.append("  inventory: changed (different digest)")
    ins = d["instances"]
    for r in ins["added"]:
        lines.append(f"  + {r['instance']} ({r['role']}) on {r['where']}")
    for r in ins["removed"]:
        lines.append(f"  - {r['instance']} ({r['role']}) on {r['where']}")
    for r in ins["moved"]:
        lines.append(f"  ~ {r['instance']} moved: {r['from']} -> {r['to']}")
    if not (ins["added"] or ins["removed"] or ins["moved"]):
        lines.append("  placement: no instance added, removed or moved")
    lines.append(f"  unchanged instances: {', '.join(ins['unchanged']) or 'none'}")
    if not d["files"]:
        lines.append("  files: identical")
    for host, f in d["files"].items():
        lines.append(f"  files on {host}:")
        lines += [f"    + {p}" for p in f["added"]]
        lines += [f"    - {p}" for p in f["removed"]]
        lines += [f"    ~ {p}" for p in f["changed"]]
    return "\n".join(lines)
