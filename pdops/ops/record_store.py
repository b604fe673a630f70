"""Operations on where the record lives (docs/state.md): `inv state.etcd-up` (the etcd members
pdops runs itself), `inv state.migrate --to etcd|host` (the whole record copied between the two
stores, proved by counts and digests, the source marked as moved) and `inv state.restore
--from-cache` (the newest revisions rebuilt from an operator's cache when the state host is lost
for good). Each is one declared plan walked by the runner, every step journalled."""

from __future__ import annotations

import hashlib
import json
import time

from pdops.errors import InvalidInput, PdopsError, Refused, Unreachable, Unverified
from pdops.facts import q
from pdops.model.etcd_member import DATA_ROOT, UNIT, UNIT_PATH, member_units
from pdops.record.etcdstore import TXN_BYTES
from pdops.record.journal import now_iso, parse_lines
from pdops.record.local import StateDir, default_machine, default_operator, local_dir, new_op_id
from pdops.remote import ansible
from pdops.remote import etcd as E
from pdops.plans import Outcome, Plan, Step
from pdops.runner import RunContext, Say
from pdops.ops.operate import run_operation

OTHER = {"etcd": "host", "host": "etcd"}


# ---------------------------------------------------------------- the record, whole

def read_whole(record) -> dict:
    """Every revision (with its rollback snapshot), `current`, and every journal line of `record`;
    torn journal lines (a crash mid-write on the state host) are counted, not copied."""
    snap = record.snapshot()
    revs = {int(n): d for n, d in (snap.get("revisions") or {}).items()}
    snaps = {n: record.revision_snapshot(n) for n in sorted(revs)}
    raw = record.journal()._lines()
    good = [ln for ln in raw if parse_lines([ln])]
    return {"revisions": revs, "snapshots": snaps, "current": snap.get("current"), "journal": good,
            "torn": len(raw) - len(good), "lock": snap.get("lock"), "moved": snap.get("moved")}


def digest(whole: dict) -> dict:
    """Counts and sha256 digests a copy must match (canonical JSON of each part)."""
    def sha(obj) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()

    revs = {str(n): d for n, d in sorted(whole["revisions"].items())}
    snaps = {str(n): s for n, s in sorted(whole["snapshots"].items()) if s is not None}
    return {"revisions": len(revs), "revisions_sha256": sha(revs), "snapshots": len(snaps),
            "snapshots_sha256": sha(snaps), "current": whole["current"], "journal_lines": len(whole["journal"]),
            "journal_sha256": hashlib.sha256("\n".join(whole["journal"]).encode()).hexdigest()}


def contained(older: dict, newer: dict) -> bool:
    """Every revision of `older` is in `newer`, the same, and `older`'s current one of them: an
    earlier copy of the same record (a migration before, or one cut short). Its journal may end with
    lines `newer` lacks (that migration's own last steps, journalled in its source after the copy)."""
    return all(newer["revisions"].get(n) == d for n, d in older["revisions"].items()) \
        and (older["current"] is None or older["current"] in newer["revisions"])


def copy_into(session, whole: dict, numbers: list[int] | None = None) -> None:
    """Write `whole` (or only revisions `numbers`, without the journal) through a held lock's session."""
    for n in numbers if numbers is not None else sorted(whole["revisions"]):
        req = {"op": "put-revision", "doc": whole["revisions"][n], "number": n}
        if whole["snapshots"].get(n) is not None:
            req["snapshot"] = whole["snapshots"][n]
        session.request(req)
    if whole["current"] is not None:
        session.request({"op": "set-current", "number": whole["current"]})
    lines = whole["journal"] if numbers is None else []
    for i in range(0, len(lines), 500):
        session.request({"op": "journal", "lines": lines[i:i + 500]})


# ---------------------------------------------------------------- migrate

def plan_migrate(inv, to: str, source, target) -> Plan:
    steps = [
        Step("read-source", None, f"read every revision, its rollback snapshot, `current` and every journal line "
             f"from {source.location}" + ("; a line over what one etcd request carries is refused" if to == "etcd" else ""),
             None, kind="record-read", params={"record": source, "etcd": to == "etcd"}),
        Step("check-target", None, f"{target.location} holds no record, or an earlier copy of this one (each of its "
             "revisions the same in the source, its current one of them): that copy is set aside (kept on a state "
             "host, its keys deleted in etcd; journal lines only it holds are counted in this step's evidence); "
             "anything else is refused", 120, kind="record-check-target",
             params={"record": target}),
        Step("copy", None, f"write the revisions (with snapshots), `current` and the journal lines to {target.location}, "
             "under its lock", None, kind="record-copy", params={"record": target}),
        Step("verify-copy", None, f"read {target.location} back: counts and sha256 of revisions, snapshots, current and "
             "journal equal the source's", None, kind="record-verify-copy", params={"record": target}),
        Step("mark-moved", None, f"mark {source.location} as moved to {target.location}: it gives no lock from now on, "
             "and a read of it names where the record went", 60, kind="record-mark-moved",
             params={"record": source, "to": target.location, "backend": to}),
    ]
    return Plan("state-migrate", f"plan: move the record of {inv.cluster} from {source.location} to "
                f"{target.location}, holding the lock of both", steps,
                notes=["a failure before mark-moved leaves the source as it was, still the record (nothing to undo); "
                       "the target's partial copy is an earlier copy, set aside by the next run",
                       f"then set pdops_state.backend: {to} in the inventory (docs/runbooks/record-to-etcd.md)"],
                head={"from": source.location, "to": target.location, "backend": to})


def too_big(whole: dict) -> list[str]:
    """Journal lines etcd cannot take (one request carries at most TXN_BYTES of values)."""
    return [ln for ln in whole["journal"] if len(ln.encode("utf-8")) > TXN_BYTES]


def do_record_read(ctx: RunContext, step: Step) -> Outcome:
    whole = read_whole(step.params["record"])
    big = too_big(whole) if step.params.get("etcd") else []
    if big:
        raise Refused(f"{len(big)} journal line(s) of {step.params['record'].location} are larger than one etcd "
                      f"request carries (the largest {max(len(x) for x in big)} bytes): nothing was copied",
                      fix="keep the record on the state host; report the operation that wrote them (a pdops bug)",
                      evidence="\n".join(x[:300] for x in big[:3]))
    ctx.give(step, "source_record", whole)
    d = digest(whole)
    ctx.say(f"  source: {d['revisions']} revisions ({d['snapshots']} with snapshots), current {d['current']}, "
            f"{d['journal_lines']} journal lines" + (f", {whole['torn']} torn line(s) not copied" if whole["torn"] else ""))
    return Outcome(evidence={**d, "torn_lines": whole["torn"]})


def do_record_check_target(ctx: RunContext, step: Step) -> Outcome:
    target, src = step.params["record"], ctx.get(step, "source_record")
    there = read_whole(target)
    if not there["revisions"] and not there["journal"]:
        return Outcome.noop(f"{target.location} holds no record")
    if not contained(there, src):
        raise Refused(f"{target.location} already holds a record that is not an earlier copy of the source's",
                      fix="compare both (`inv state.show`, `inv history`); pdops will not guess which is right. "
                          "Nothing was changed",
                      evidence=json.dumps({"target": digest(there), "source": digest(src)}, indent=2))
    ans = target._session.request({"op": "set-aside"})
    known = set(src["journal"])
    extra = [ln for ln in there["journal"] if ln not in known]
    ctx.say(f"  set aside the earlier copy in {target.location}: {ans.get('aside') or 'its keys deleted'}"
            + (f" ({len(extra)} of its journal lines are not in the source)" if extra else ""))
    ops_only = sorted({r.get("op_id") for r in parse_lines(extra)} - {None})
    return Outcome(evidence={"earlier_copy": digest(there), "set_aside": ans.get("aside"), "moved": ans.get("moved"),
                             "lines_only_in_earlier_copy": len(extra), "their_operations": ops_only[:50],
                             "their_sha256": hashlib.sha256("\n".join(extra).encode()).hexdigest()},
                   verified=[f"{target.location}'s earlier copy is contained in the source's record"])


def do_record_copy(ctx: RunContext, step: Step) -> Outcome:
    src, target = ctx.get(step, "source_record"), step.params["record"]
    t0 = time.monotonic()
    copy_into(target._session, src)
    return Outcome(evidence={"revisions": len(src["revisions"]), "journal_lines": len(src["journal"]),
                             "took_s": round(time.monotonic() - t0, 2)})


def do_record_verify_copy(ctx: RunContext, step: Step) -> Outcome:
    src, target = ctx.get(step, "source_record"), step.params["record"]
    target._snap = None
    want, got = digest(src), digest(read_whole(target))
    if want != got:
        raise Unverified(f"the copy in {target.location} differs from the source's record; the source is not marked "
                         "and stays the record", evidence=json.dumps({"source": want, "copy": got}, indent=2))
    return Outcome(evidence=got, verified=[
        f"{got['revisions']} revisions, {got['snapshots']} snapshots, current {got['current']} and "
        f"{got['journal_lines']} journal lines read back from {target.location} with the source's sha256"])


def do_record_mark_moved(ctx: RunContext, step: Step) -> Outcome:
    doc = {"to": step.params["to"], "backend": step.params["backend"], "by": default_operator(),
           "machine": default_machine(), "at": now_iso(), "op_id": ctx.op}
    step.params["record"]._session.request({"op": "mark-moved", "doc": doc})
    return Outcome(evidence=doc, verified=[f"{step.params['record'].location} marked as moved: it gives no lock"])


def migrate(inv, to: str, open_record, say: Say = print, *, dry_run: bool = False) -> dict:
    """`inv state.migrate --to etcd|host`: copy the whole record to the other store and prove it."""
    if to not in OTHER:
        raise InvalidInput("--to", f"{to!r} is neither etcd nor host", fix="--to etcd, or --to host to move back")
    if inv.state is None or inv.state.etcd is None:  # either way, one side is etcd
        raise InvalidInput("pdops_state.etcd", f"missing: there is no etcd to migrate {'to' if to == 'etcd' else 'from'}",
                           fix="name it (docs/runbooks/record-to-etcd.md) and run `inv state.etcd-up` if pdops runs it")
    source, target = open_record(inv, backend=OTHER[to]), open_record(inv, backend=to)
    source.allow_moved = target.allow_moved = True
    plan = plan_migrate(inv, to, source, target)
    say(plan.render())  # before anything is read or written
    if dry_run:
        src, there = read_whole(source), read_whole(target)
        if src["moved"]:
            raise Refused(f"{source.location} was moved already: {src['moved']}", fix="nothing to migrate")
        d = digest(src)
        big = too_big(src) if to == "etcd" else []
        if big:
            raise Refused(f"{len(big)} journal line(s) of {source.location} are larger than one etcd request carries: "
                          "the migration would be refused", fix="keep the record on the state host; nothing was changed")
        fate = ("empty" if not there["revisions"] and not there["journal"] else
                "an earlier copy of this record: it would be set aside" if contained(there, src) else
                "a different record: the migration would be refused")
        return {"plan": plan, "message": f"would copy {d['revisions']} revisions ({d['snapshots']} snapshots), current "
                f"{d['current']} and {d['journal_lines']} journal lines from {source.location} to {target.location} "
                f"(now {fate}); nothing was changed"}
    op = new_op_id("state-migrate")
    with source.lock("state-migrate", op_id=op, say=say):
        with target.lock("state-migrate", op_id=op, say=say, migrating=True) as tlk:
            got: dict = {}

            def finish(ctx: RunContext, verdict: dict) -> None:
                got.update(digest(ctx.output("source_record")))
                target.journal().step(op, "lock.held", "ok", {k: tlk.holder.get(k) for k in (
                    "operator", "machine", "operation", "client_pid", "since")})
                target.journal().step(op, "state.migrated", "ok", {"from": source.location, **got})
                verdict.update(copied=got, to=target.location)

            # both locks held here: the source's (whose journal the walk writes) and the target's
            verdict = run_operation(plan, inv, source, say, pool=None, gateways=None, op=op, lock_held=True,
                                    finish=finish)
    return {"op": op, "plan": plan, "verdict": verdict, "copied": got, "to": target.location,
            "message": f"the record of {inv.cluster} is now in {target.location} ({got['revisions']} revisions, "
                       f"{got['journal_lines']} journal lines, digests equal); {source.location} is marked as moved. "
                       f"Set pdops_state.backend: {to} in the inventory now"}


# ---------------------------------------------------------------- restore from the cache

def read_cache(record) -> dict:
    """This machine's cached copy of the record, and the newest revision's snapshot where kept
    (read before anything reads the store: see SharedRecord._write_cache)."""
    try:
        doc = json.loads(record.cache_file.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        raise Refused(f"this machine has no cached copy of {record.cluster}'s record ({record.cache_file})",
                      fix="run this on an operator machine that read the record before it was lost "
                          "(`inv state.show` there names its cache); nothing was changed") from None
    if doc.get("cluster", record.cluster) != record.cluster:
        raise Refused(f"the cached copy in {record.cache_file} is cluster {doc.get('cluster')!r}'s, not "
                      f"{record.cluster!r}'s", fix="run this with the inventory of that cluster; nothing was changed")
    snap = doc.get("snapshot") or {}
    revs = {int(n): d for n, d in (snap.get("revisions") or {}).items()}
    kept = None
    try:
        kept = json.loads(record.snapshot_cache.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        pass
    snaps = {n: None for n in revs}
    if kept and int(kept.get("number", -1)) in revs:
        snaps[int(kept["number"])] = kept["snapshot"]
    return {"revisions": revs, "snapshots": snaps, "current": snap.get("current"), "journal": [],
            "fetched_at": doc.get("fetched_at"), "location": doc.get("location")}


def plan_restore(inv, record, cache: dict) -> Plan:
    revs = sorted(cache["revisions"])
    with_snap = [n for n, s in cache["snapshots"].items() if s is not None]
    steps = [
        Step("check-empty", None, f"{record.location} holds no revision (a new state host, or the lost one's "
             "disk replaced); a record there is refused", 60, kind="record-check-empty", params={"record": record}),
        Step("restore", None, f"write revisions {revs[0]}..{revs[-1]} and `current` {cache['current']} from this "
             f"machine's cache (fetched {cache['fetched_at']} from {cache['location']})"
             + (f", with revision {with_snap[0]}'s rollback snapshot" if with_snap else ", without rollback snapshots"),
             None, kind="record-restore", params={"record": record, "cache": cache}),
        Step("verify-restore", None, f"read {record.location} back: the revisions and `current` equal the cache's", 60,
             kind="record-verify-restore", params={"record": record, "cache": cache}),
    ]
    lost = ["the journal (every operation before this restore)"]
    no_snap = [n for n in revs if n not in with_snap]
    if no_snap:
        lost.append(f"the rollback snapshots of revisions {', '.join(map(str, no_snap))} (a rollback to them is refused)")
    return Plan("state-restore", f"plan: rebuild the record of {inv.cluster} in {record.location} from this machine's "
                "cached copy, under the cluster lock", steps,
                notes=[f"cannot be restored: {x}" for x in lost]
                + ["then `inv verify`: that the hosts run the restored revision is for it to show"],
                head={"to": record.location, "revisions": revs, "current": cache["current"], "not_restored": lost})


def do_record_check_empty(ctx: RunContext, step: Step) -> Outcome:
    rec = step.params["record"]
    there = rec.refresh()
    if there.get("revisions"):
        raise Refused(f"{rec.location} holds a record already (revisions {', '.join(sorted(there['revisions']))}): "
                      "nothing to restore", fix="`inv history` reads it; restore only into an empty store. "
                                                 "Nothing was changed")
    return Outcome(verified=[f"{rec.location} held no revision"])


def do_record_restore(ctx: RunContext, step: Step) -> Outcome:
    rec, cache = step.params["record"], step.params["cache"]
    copy_into(rec._session, cache, numbers=sorted(cache["revisions"]))
    return Outcome(evidence={"revisions": sorted(cache["revisions"]), "current": cache["current"],
                             "snapshots": [n for n, s in cache["snapshots"].items() if s is not None]})


def do_record_verify_restore(ctx: RunContext, step: Step) -> Outcome:
    rec, cache = step.params["record"], step.params["cache"]
    back = rec.refresh()
    got = {int(n): d for n, d in (back.get("revisions") or {}).items()}
    if got != cache["revisions"] or back.get("current") != cache["current"]:
        raise Unverified(f"the revisions read back from {rec.location} differ from the cache's")
    return Outcome(evidence={"revisions": sorted(got), "current": back.get("current")},
                   verified=[f"revisions {', '.join(map(str, sorted(got)))} and current {back.get('current')} read back "
                             f"from {rec.location} equal to the cache"])


def restore_from_cache(inv, record, say: Say = print, *, dry_run: bool = False) -> dict:
    """`inv state.restore --from-cache`: rebuild the record in its (new, empty) store from this
    machine's cache. The journal cannot be restored, and is said so."""
    cache = read_cache(record)
    if not cache["revisions"]:
        raise Refused(f"the cached copy in {record.cache_file} holds no revision", fix="nothing to restore")
    plan = plan_restore(inv, record, cache)
    say(plan.render())
    if dry_run:
        return {"plan": plan, "message": "nothing was changed"}
    op = new_op_id("state-restore")
    def finish(ctx: RunContext, verdict: dict) -> None:
        verdict.setdefault("unverified", []).extend(f"not restored: {x}" for x in plan.head["not_restored"])
        verdict["unverified"].append("that the hosts run the restored revision: run `inv verify`")
        ctx.journal.step(op, "state.restored", "ok", {"from_cache": str(record.cache_file), **{
            k: cache[k] for k in ("fetched_at", "location", "current")}, "revisions": sorted(cache["revisions"]),
            "not_restored": plan.head["not_restored"]})

    with record.lock("state-restore", op_id=op, say=say, restoring=True):  # a lock of its own kind: held here
        verdict = run_operation(plan, inv, record, say, pool=None, gateways=None, op=op, lock_held=True,
                                finish=finish)
    return {"op": op, "plan": plan, "verdict": verdict,
            "message": f"restored revisions {', '.join(map(str, sorted(cache['revisions'])))} (current "
                       f"{cache['current']}) of {inv.cluster} into {record.location} from this machine's cache"}


# ---------------------------------------------------------------- the etcd members pdops runs

def plan_etcd_up(inv) -> Plan:
    units = member_units(inv)
    if not units:
        raise InvalidInput("pdops_state.etcd.members", "none: pdops runs no etcd member for this inventory",
                           fix="name three inventory hosts (members: [...]), or name an existing etcd's endpoints")
    hosts = [u.host for u in units]
    steps = [
        Step("check-members", None, f"each of {', '.join(hosts)}: {UNIT} not running, or running this very unit "
             "(pdops never reconfigures a running member)", 60, kind="etcd-check-members", params={"units": units}),
        Step("deliver", None, f"etcd.yml puts {UNIT_PATH} and {DATA_ROOT} (0700) on {', '.join(hosts)}; the unit "
             "verified, enabled, not started", 300, kind="etcd-deliver", params={"units": units}),
        Step("start", None, f"systemctl start --no-block {UNIT} on each member not running (a member waits "
             "for its peers)", 60, kind="etcd-start", params={"hosts": hosts}),
        Step("check-quorum", None, f"every member answers its status with one leader, and a write is read back "
             f"through each of {', '.join(inv.state.etcd.endpoints)}", 120, kind="etcd-check-quorum",
             params={"endpoints": list(inv.state.etcd.endpoints)}),
    ]
    return Plan("state-etcd-up", f"plan: run the record's etcd ({len(hosts)} members) on {', '.join(hosts)}", steps,
                notes=["touches only the etcd members' unit and data dir; no engine or gateway",
                       "if a step fails, nothing is undone (what was delivered or started stays); running it "
                       "again repeats nothing done: Ansible changes only what differs, and running members are not "
                       "started again"])


def do_etcd_check_members(ctx: RunContext, step: Step) -> Outcome:
    running, same = [], []
    for u in step.params["units"]:
        st = ctx.pool.unit_states(u.host, [UNIT])[UNIT]
        if st.active_state in ("active", "activating", "reloading"):
            sha = ctx.pool.run(u.host, f"sha256sum {q(UNIT_PATH)} 2>/dev/null || true").stdout.split()
            if not sha or sha[0] != u.sha256:
                raise Refused(f"{UNIT} runs on {u.host} from another unit file than pdops renders now",
                              fix="pdops does not reconfigure a running etcd member; change members by etcd's own "
                                  "member add/remove, or stop the old one first. Nothing was changed")
            same.append(u.host)
        running.append((u.host, st.active_state))
    ctx.give(step, "etcd_running", same)
    return Outcome(evidence={"states": dict(running), "running_this_unit": same})


def do_etcd_deliver(ctx: RunContext, step: Step) -> Outcome:
    units = step.params["units"]
    res = ansible.run_playbook(ctx.inv, "etcd.yml", {
        "pdops_files": {u.host: [ansible.file_entry(u.path, u.content.encode(), u.mode)] for u in units},
        "pdops_units": {u.host: [UNIT] for u in units}, "pdops_etcd_data_root": DATA_ROOT}, [u.host for u in units])
    return Outcome(evidence={"changed": res.changed}, verified=[f"{UNIT} in place and enabled on "
                                                                 f"{', '.join(u.host for u in units)}"])


def do_etcd_start(ctx: RunContext, step: Step) -> Outcome:
    todo = [h for h in step.params["hosts"] if h not in (ctx.get(step, "etcd_running") or [])]
    if not todo:
        return Outcome.noop("every member runs already")
    for h in todo:
        ctx.pool.run(h, f"systemctl start --no-block {q(UNIT)}")
    return Outcome(evidence={"started": todo})


def do_etcd_check_quorum(ctx: RunContext, step: Step) -> Outcome:
    eps = step.params["endpoints"]
    deadline = ctx.deadline(step) - 5
    leaders: dict = {}
    while True:
        leaders, errors = {}, []
        for ep in eps:
            c = E.Etcd([ep], timeout=2.0)
            try:
                leaders[ep] = c.status(ep).get("leader")
            except PdopsError as e:
                errors.append(f"{ep}: {e.message}")
            finally:
                c.close()
        if not errors and len(set(leaders.values())) == 1 and all(leaders.values()):
            break
        if time.monotonic() > deadline:
            raise Unverified("the etcd members did not agree on a leader", evidence="\n".join(errors) or str(leaders))
        time.sleep(0.5)
    key, val = f"/pdops-health/{ctx.op}", now_iso()
    c = E.Etcd(eps)
    try:
        c.txn([], [E.put(key, val)])
        for ep in eps:
            one = E.Etcd([ep])
            got = one.range(key).get(key)
            one.close()
            if got is None or got.text != val:
                raise Unverified(f"a write was not read back through {ep}")
        c.txn([], [E.delete(key)])
    finally:
        c.close()
    return Outcome(evidence={"leader": next(iter(leaders.values())), "members": eps},
                   verified=[f"{len(eps)} members, one leader; a write read back through each"])


def do_etcd_member_start(ctx: RunContext, step: Step) -> Outcome:
    for h in step.params["hosts"]:  # a member that hit its start limit refuses `start` until reset
        ctx.pool.run(h, f"systemctl reset-failed {q(UNIT)} || true; systemctl start --no-block {q(UNIT)}")
    return Outcome(evidence={"started": step.params["hosts"]})


def etcd_up(inv, say: Say = print, *, pool, journal_record) -> dict:
    """Deliver, start and check the members. `journal_record`: where the operation is journalled (the
    state host's record; the etcd record cannot be, before its members run)."""
    plan = plan_etcd_up(inv)
    op = new_op_id("state-etcd-up")
    # no cluster lock: the record it would be taken in is not running yet
    verdict = run_operation(plan, inv, journal_record, say, pool=pool, gateways=None, op=op, lock_held=True)
    return {"op": op, "plan": plan, "verdict": verdict}


def operate_etcd_up(inv, record, say: Say = print, *, pool) -> dict:
    """`inv state.etcd-up` whole: under the cluster lock, journalled in `record`. When the record is in
    the etcd this brings up, no lock can be taken by anyone: the operation is journalled on this
    machine instead (said)."""
    try:
        lock = record.lock("state-etcd-up").acquire()
    except Unreachable as e:
        if record.store.kind != "etcd":
            raise
        where = StateDir(inv.cluster, local_dir(inv) / "etcd-up")
        say(f"note: {e.message}; journalled on this machine in {where.path}")
        return etcd_up(inv, say, pool=pool, journal_record=where)
    try:
        return etcd_up(inv, say, pool=pool, journal_record=record)
    finally:
        lock.release()


__all__ = ["digest", "etcd_up", "migrate", "operate_etcd_up", "plan_etcd_up", "plan_migrate", "plan_restore", "read_whole",
           "restore_from_cache"]
