"""The record's operator commands: push a local record to the state host, unlock, list operations."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict

from pdops.errors import InvalidInput, Refused, Unverified
from pdops.runner import Say
from pdops.record.journal import Journal, now_iso
from pdops.record.local import StateDir, default_machine, default_operator, new_op_id

from pdops.record.shared import SharedRecord, describe_holder, record_summary, revision_docs


def _push_conflict(record: SharedRecord, local: StateDir, mine: dict, cur, theirs: dict) -> None:
    """Refuse when the shared record already holds something other than this machine's."""
    if theirs and (theirs != revision_docs({str(n): d for n, d in mine.items()}) or record.current() != cur):
        raise Refused(f"the shared record on {record.location} already holds revisions that differ from this "
                      f"machine's ({local.path}); pdops will not guess which is right",
                      fix="compare both with what runs (`inv status`); nothing was changed",
                      evidence=record_summary(f"this machine ({local.path})", mine, cur) + "\n"
                      + record_summary(f"the state host ({record.location})", theirs, record.current()))


def push_local(record: SharedRecord, say: Say = print, *, dry_run: bool = False) -> dict:
    """`inv state.push`: move this machine's record to the state host, under the cluster lock.
    Refuses when the shared record holds something else; the local record is moved aside only
    once the shared one reads back equal to it. `dry_run`: say what it would do, change nothing."""
    local = record.local_record()
    nums = local.revision_numbers()
    if not nums:
        return {"pushed": 0, "message": f"nothing to push: no record of '{record.cluster}' in {local.path}"}
    mine = {n: asdict(local.read_revision(n)) for n in nums}
    cur = local.current()  # read before the local copy is moved aside
    record._check_local_record = False
    if dry_run:
        theirs = revision_docs(record.snapshot().get("revisions") or {})
        _push_conflict(record, local, mine, cur, theirs)
        lines = local.journal()._lines()
        return {"pushed": 0, "message": (
            f"would copy revisions {nums[0]}..{nums[-1]} (current {cur}) and {len(lines)} journal lines from "
            f"{local.path} to {record.location}" + (" (it holds the same revisions already)" if theirs else "")
            + f", under the cluster lock; then move {local.path}'s copy aside\n"
            + record_summary(f"this machine ({local.path})", mine, cur))}
    with record.lock("state-push", say=say) as lk:
        sess = record._session
        theirs = revision_docs(record.snapshot().get("revisions") or {})
        _push_conflict(record, local, mine, cur, theirs)
        lines = local.journal()._lines()
        if not theirs:
            for n in nums:
                sess.request({"op": "put-revision", "doc": mine[n], "number": n})
            if cur is not None:
                sess.request({"op": "set-current", "number": cur})
            good = [ln for ln in lines if _is_record(ln)]
            for i in range(0, len(good), 200):
                sess.request({"op": "journal", "lines": good[i:i + 200]})
        after = record.refresh()
        if revision_docs(after.get("revisions") or {}) != revision_docs({str(n): d for n, d in mine.items()}) \
                or after.get("current") != cur:
            raise Unverified(f"the record read back from {record.location} differs from this machine's; the local "
                             f"record in {local.path} is left where it is")
        aside = local.path / f"pushed-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        aside.mkdir(mode=0o700)
        for name in ("revisions", "current", "journal.jsonl", "lock", "lock.flock"):
            if (local.path / name).exists():
                shutil.move(str(local.path / name), str(aside / name))
        ev = {"from_machine": default_machine(), "local_dir": str(local.path), "revisions": nums,
              "current": cur, "journal_lines": len(lines), "already_there": bool(theirs),
              "moved_aside_to": str(aside)}
        record.journal().step(lk.op_id, "state.push", "ok", ev)
    return {"pushed": len(nums), **ev,
            "message": (f"the shared record on {record.location} now holds revisions {nums[0]}..{nums[-1]} "
                        f"(current {cur}) and {len(lines)} journal lines; this machine's copy is "
                        f"in {aside}")}


def _is_record(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False  # a torn line from a crash mid-write


def unlock(record: SharedRecord, *, force: bool, reason: str | None, say: Say = print) -> dict:
    """`inv unlock`: show who holds the lock and the evidence; with --force --reason, end the
    holder's process on the state host (by recorded PID and start time), clear the lock and
    journal who did it and why."""
    if force and (not reason or not reason.strip()):  # before any host is contacted
        raise InvalidInput("--reason", "missing", fix="say why, e.g. --reason 'alice's laptop died mid-drain'")
    holder = record.lock_holder()
    if not force:
        if holder is None:
            return {"locked": False, "message": f"cluster '{record.cluster}' is not locked"}
        if holder.get("holder_alive") is False:
            return {"locked": False, "message": f"cluster '{record.cluster}' is not locked; the lock was left by "
                    f"{describe_holder(holder)}. The next change takes it and journals that operation as "
                    f"interrupted; `inv journal --op {holder.get('op_id')}` shows how far it got"}
        raise Refused(f"cluster '{record.cluster}' is locked by {describe_holder(holder)}",
                      fix="if that operation is dead (its operator's machine gone, its lock process hung): "
                          "`inv unlock --force --reason '...'`; nothing was changed",
                      evidence=json.dumps(holder, indent=2, sort_keys=True))
    by = {"operator": default_operator(), "machine": default_machine(), "at": now_iso()}
    op = new_op_id("unlock")
    ans = record.answer(record.store.unlock(by, reason, op))
    was, ended = ans.get("was"), ans.get("ended")
    if not was:
        msg = f"cluster '{record.cluster}' was not locked; the forced unlock is journalled ({op})"
    else:
        how = ("" if not ended else f", revoking its lease {ended['lease']} in etcd (its next write fails)"
               if "lease" in ended else f", ending its lock process {ended['pid']} on {record.store.host}")
        msg = (f"took the lock of cluster '{record.cluster}' over from {describe_holder(was)}{how}"
               + f", and released it; journalled as {op} with your reason")
    return {"locked": bool(was), "was": was, "ended": ended, "op_id": op, "message": msg}


def operations(journal: Journal, last: int | None = None) -> list[dict]:
    """One row per operation in the journal (its last `last` operations, read alone where the
    store allows): when, what, who (operator and machine), how it ended."""
    rows: dict[str, dict] = {}
    for r in (journal.records() if last is None else journal.last_operations(last)):
        op = r.get("op_id") or "-"
        row = rows.setdefault(op, {"op_id": op, "started": r.get("ts"), "operation": op.split("-")[0],
                                   "operator": "-", "machine": "-", "steps": 0, "verdict": "no verdict"})
        row["steps"] += 1
        if r.get("step") == "lock.held":
            ev = r.get("evidence") or {}
            row.update(operation=ev.get("operation") or row["operation"], operator=ev.get("operator") or "-",
                       machine=ev.get("machine") or "-")
        if r.get("step") == "verdict":
            row["verdict"] = r.get("status")
        if r.get("step") == "lock.interrupted":
            prev = ((r.get("evidence") or {}).get("previous_holder") or {}).get("op_id")
            if prev in rows and rows[prev]["verdict"] == "no verdict":
                rows[prev]["verdict"] = f"interrupted (found by {op})"
        row["last_step"] = r.get("step")
    return list(rows.values())
