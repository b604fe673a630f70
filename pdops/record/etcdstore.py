"""The record in etcd (docs/state.md, "The record on etcd"): the same record as on a state host,
as keys under the cluster's prefix P, and the lock a key under a lease.

    P/format                       {"format": 1, "cluster": C}: another cluster or a newer format is refused
    P/lock                         who holds the lock, attached to the holder's lease (gone when it expires)
    P/holder                       the same, without a lease: left behind by a holder that never
                                   released, it is the evidence of an interrupted operation
    P/current                      the number of the revision in force
    P/rev/00000001                 one revision document
    P/snap/00000001                its rollback snapshot: {sha256, bytes, parts: [sha256, ...]}
    P/blob/<sha256>                one part of a snapshot (at most PART_BYTES; parts are shared)
    P/journal/n                    the number of journal lines
    P/journal/line/000000000001    one journal line
    P/journal/op/<op id>/<seq>     the same line, under its operation (`inv journal --op`)
    P/journal/opn/<op id>          the operation's ordinal; P/journal/ops holds how many there are
    P/journal/ord/000000000001     the op id of each ordinal (`inv journal --last N`)
    P/journal/tag/<tag>/<seq>      the same line, under each of its tags (pdops.record.journal.journal_tags)
    P/moved                        set when the record was migrated elsewhere: no lock is given

Every write under the lock is a transaction that first compares P/lock's create revision with the
one this operation took it at: a holder whose lease expired (or was revoked by `inv unlock
--force`) writes nothing, `current` included. Reads of a range are by key, ascending, with a
limit (never sorted by etcd, which would read the whole range first), so the last 50 operations
cost the same with 10 or 100,000 journal lines.
"""

from __future__ import annotations

import hashlib
import json
import time

from pdops.errors import PdopsError, Unverified
from pdops.record.etcdkeys import (FORMAT, MAX_TXN_OPS, MOVED_FORMAT, PAGE, PART_BYTES, REF, RETRY_S, TXN_BYTES,
                                   key_segment, rev_key, seq_key)
from pdops.record.etcdlock import EtcdSession, LockLost, lock_still_ours
from pdops.record.journal import journal_tags, now_iso
from pdops.remote import etcd as E


class EtcdStore:
    """One cluster's record under `setting.prefix` in the etcd cluster of `setting`."""

    kind = "etcd"

    def __init__(self, cluster: str, setting, client: E.Etcd | None = None):
        self.cluster = cluster
        self.setting = setting
        self.p = setting.prefix
        self.etcd = client or E.Etcd(list(setting.endpoints), ca=setting.ca, cert=setting.cert, key=setting.key,
                                     down_fix=self.bring_back if setting.members else None)

    @property
    def location(self) -> str:
        return f"etcd {','.join(self.setting.endpoints)} {self.p}"

    @property
    def name(self) -> str:
        return f"etcd ({len(self.setting.endpoints)} endpoints)"

    @property
    def bring_back(self) -> str:
        """What a fix line tells the operator to do when no member answers: where pdops runs the members
        (`members`), the command that starts them."""
        if self.setting.members:
            return (f"start the etcd members pdops runs on {', '.join(self.setting.members)}: `inv state.etcd-up` "
                    f"(their units are enabled; on the lab's default boot, or where one failed at boot, nothing "
                    f"else starts them), then run this again")
        return f"bring {self.name} back"

    # -- reading
    def _check_format(self, kv: E.KV | None, moved: E.KV | None = None) -> dict | None:
        if kv is None:
            return None
        doc = json.loads(kv.value)
        if not isinstance(doc.get("format"), int):
            return {"ok": False, "error": "format", "message": f"{self.p}format is not a pdops record format key"}
        if doc["format"] == MOVED_FORMAT and moved is not None:
            pass
        elif doc["format"] > FORMAT:
            return {"ok": False, "error": "newer", "message": f"the record under {self.p} was written by a newer "
                    f"pdops (record format {doc['format']}; this pdops reads format {FORMAT})"}
        if doc.get("cluster") != self.cluster:
            return {"ok": False, "error": "cluster",
                    "message": f"the record under {self.p} is cluster {doc.get('cluster')!r}'s, not {self.cluster!r}'s"}
        return None

    def _lock_doc(self, lock: E.KV | None, holder: E.KV | None) -> dict | None:
        if lock is None and holder is None:
            return None
        doc = json.loads((lock or holder).value)
        doc["holder_alive"] = lock is not None
        if lock is not None and lock.lease:
            try:
                left = self.etcd.time_to_live(lock.lease)
                if left >= 0:
                    doc["last_seen_s"] = round(float(doc.get("lease_s", 30)) - left, 1)
            except PdopsError:
                pass
        return doc

    def read(self) -> dict:
        p = self.p
        res = self.etcd.read(E.get(p + "format"), E.get(p + "lock"), E.get(p + "holder"), E.get(p + "current"),
                             E.get(p + "rev/", prefix=True), E.get(p + "moved"))
        fmt = res.range(0).get(p + "format")
        bad = self._check_format(fmt, res.range(5).get(p + "moved"))
        if bad:
            return bad
        cur = res.range(3).get(p + "current")
        revs = {str(int(kv.key.rsplit("/", 1)[1])): json.loads(kv.value) for kv in res.range(4).kvs}
        moved = res.range(5).get(p + "moved")
        return {"ok": True, "exists": fmt is not None, "current": int(cur.text) if cur else None, "revisions": revs,
                "lock": self._lock_doc(res.range(1).get(p + "lock"), res.range(2).get(p + "holder")),
                "moved": json.loads(moved.value) if moved else None}

    def revision_snapshot(self, n: int) -> dict:
        kv = self.etcd.range(self.p + "snap/" + rev_key(n)).get(self.p + "snap/" + rev_key(n))
        if kv is None:
            return {"ok": True, "snapshot": None}
        head = json.loads(kv.value)
        parts = self.etcd.read(*(E.get(self.p + "blob/" + h) for h in head["parts"]))
        data = b""
        for i, h in enumerate(head["parts"]):
            part = parts.range(i).get(self.p + "blob/" + h)
            if part is None or hashlib.sha256(part.value).hexdigest() != h:
                raise Unverified(f"{self.location}: part {i} of revision {n}'s snapshot is missing or damaged")
            data += part.value
        if hashlib.sha256(data).hexdigest() != head["sha256"]:
            raise Unverified(f"{self.location}: revision {n}'s snapshot does not match its digest")
        return {"ok": True, "snapshot": json.loads(data)}

    def _lines_under(self, key: str) -> list[str]:
        out, start = [], key
        end = E.prefix_end(key)
        while True:
            r = self.etcd.range(start, end=end, limit=PAGE)
            out += self._resolve([kv.value.decode("utf-8") for kv in r.kvs])
            if not r.more or not r.kvs:
                return out
            start = r.kvs[-1].key + "\0"

    def _resolve(self, values: list[str]) -> list[str]:
        """Lines, with each copy stored as a reference (a line too big to copy) read from its key."""
        refs = [v[len(REF):] for v in values if v.startswith(REF)]
        if not refs:
            return values
        got = {}
        for i in range(0, len(refs), MAX_TXN_OPS):
            res = self.etcd.read(*(E.get(k) for k in refs[i:i + MAX_TXN_OPS]))
            for j, k in enumerate(refs[i:i + MAX_TXN_OPS]):
                kv = res.range(j).get(k)
                got[k] = kv.value.decode("utf-8") if kv else "{}"
        return [got[v[len(REF):]] if v.startswith(REF) else v for v in values]

    def journal(self, *, op_id: str | None = None, last_ops: int | None = None, tag: str | None = None,
                everything: bool = False) -> dict:
        p = self.p + "journal/"
        if op_id is not None:
            return {"ok": True, "lines": self._lines_under(p + f"op/{key_segment(op_id)}/")}
        if tag is not None:
            return {"ok": True, "lines": self._lines_under(p + f"tag/{key_segment(tag)}/")}
        if last_ops is not None:
            ops = self.etcd.range(p + "ops").get(p + "ops")
            total = int(ops.text) if ops else 0
            first = max(1, total - int(last_ops) + 1)
            ords = self.etcd.range(p + "ord/" + seq_key(first), end=p + "ord/" + seq_key(total + 1)).kvs if total else []
            ids = [kv.text for kv in ords]
            lines: list[str] = []
            for i in range(0, len(ids), MAX_TXN_OPS):
                res = self.etcd.read(*(E.get(p + f"op/{key_segment(x)}/", prefix=True) for x in ids[i:i + MAX_TXN_OPS]))
                for j in range(len(ids[i:i + MAX_TXN_OPS])):
                    lines += self._resolve([kv.value.decode("utf-8") for kv in res.range(j).kvs])
            return {"ok": True, "lines": lines}
        if not everything:
            raise ValueError("a journal read names what it reads (op_id, last_ops, tag) or says everything")
        return {"ok": True, "lines": self._lines_under(p + "line/")}

    @staticmethod
    def journal_request(*, op_id=None, last_ops=None, tag=None) -> dict:
        return {"op": "journal-query", "op_id": op_id, "last_ops": last_ops, "tag": tag}

    # -- writing
    def txn(self, compare: list[dict], ops: list[dict], failure: list[dict], applied) -> E.TxnResult:
        """A write transaction that survives a member's loss: when no answer came back (the member
        died or lost its leader mid-request), `applied()` reads whether it took effect, and if not it
        is sent again, to another member, until RETRY_S have passed."""
        deadline = time.monotonic() + RETRY_S
        unsure = False  # an earlier send may have been committed
        while True:
            if unsure:
                try:
                    if applied():
                        return E.TxnResult(True, 0, [])
                except E.EtcdUnavailable:  # read again, never write without knowing
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
                    continue
            try:
                res = self.etcd.txn(compare, ops, failure)
            except E.EtcdUnavailable as e:
                if time.monotonic() > deadline:
                    raise
                unsure = unsure or e.maybe_applied
                time.sleep(0.2)
                continue
            if not res.succeeded and unsure and applied():
                return E.TxnResult(True, 0, [])  # its compare failed on our own earlier, committed send
            return res

    def append_journal(self, lines: list[str], guard: list[dict]) -> None:
        """Append `lines` in order, in transactions that also check `guard` (the lock, for an
        operation's own lines). A transaction that loses a race with another writer is tried again;
        one whose guard fails raises :class:`LockLost`."""
        p = self.p + "journal/"
        todo = list(lines)
        while todo:
            recs = [json.loads(x) for x in todo]
            op_ids = list(dict.fromkeys(r.get("op_id") or "-" for r in recs))
            res = self.etcd.read(E.get(p + "n"), E.get(p + "ops"), *(E.get(p + f"opn/{key_segment(o)}") for o in op_ids))
            n_kv, ops_kv = res.range(0).get(p + "n"), res.range(1).get(p + "ops")
            n, nops = (int(n_kv.text) if n_kv else 0), (int(ops_kv.text) if ops_kv else 0)
            first = n + 1
            known = {o for i, o in enumerate(op_ids) if res.range(2 + i).get(p + f"opn/{key_segment(o)}") is not None}
            compare = [*guard, E.cmp_modified(p + "n", n_kv.mod_revision if n_kv else 0),
                       E.cmp_modified(p + "ops", ops_kv.mod_revision if ops_kv else 0)]
            ops: list[dict] = []
            taken = size = 0
            for line, rec in zip(todo, recs):
                o = rec.get("op_id") or "-"
                tags = journal_tags(rec)
                size_of = len(line.encode("utf-8"))
                if size_of > TXN_BYTES:
                    raise Unverified(f"a journal line of {size_of} bytes ({rec.get('step')}) is over what one etcd "
                                     f"request carries ({TXN_BYTES} bytes): not written",
                                     fix="a pdops bug to report (its evidence should be smaller)")
                key = p + "line/" + seq_key(n + 1)
                copy = line if size_of * (2 + len(tags)) <= TXN_BYTES // 2 else REF + key  # big: copies refer to it
                mine = [E.put(key, line), E.put(p + f"op/{key_segment(o)}/" + seq_key(n + 1), copy)]
                mine += [E.put(p + f"tag/{key_segment(t)}/" + seq_key(n + 1), copy) for t in tags]
                mine_size = size_of + len(copy) * (1 + len(tags))
                new_op = o not in known
                if new_op:
                    mine += [E.put(p + f"opn/{key_segment(o)}", str(nops + 1)), E.put(p + "ord/" + seq_key(nops + 1), o)]
                if ops and (len(ops) + len(mine) + 2 + len(compare) > MAX_TXN_OPS or size + mine_size > TXN_BYTES):
                    break
                size += mine_size
                if new_op:
                    compare.append(E.cmp_created(p + f"opn/{key_segment(o)}", 0))
                    known.add(o)
                    nops += 1
                ops += mine
                n += 1
                taken += 1
            ops += [E.put(p + "n", str(n)), E.put(p + "ops", str(nops))]
            head = todo[0]

            def applied() -> bool:
                kv = self.etcd.range(p + "line/" + seq_key(first)).get(p + "line/" + seq_key(first))
                return kv is not None and kv.text == head

            res = self.txn(compare, ops, [E.get(self.p + "lock")] if guard else [], applied)
            if res.succeeded:
                todo = todo[taken:]
                continue
            if guard and not lock_still_ours(res, guard):
                raise LockLost("the lock's lease expired or was revoked (`inv unlock --force`)")
            # another writer moved the journal between the read and the write: read again

    def put_revision(self, doc: dict, number: int | None, snapshot: dict | None, guard: list[dict]) -> int:
        p = self.p
        if number is None:
            keys = self.etcd.range(p + "rev/", prefix=True, keys_only=True).kvs
            number = max((int(kv.key.rsplit("/", 1)[1]) for kv in keys), default=0) + 1
            fresh = True
        else:
            fresh = False
        doc = dict(doc, number=int(number))
        ops = [E.put(p + "rev/" + rev_key(number), json.dumps(doc, indent=2, sort_keys=True))]
        if snapshot is not None:
            data = json.dumps(snapshot, sort_keys=True).encode("utf-8")
            parts = [data[i:i + PART_BYTES] for i in range(0, len(data), PART_BYTES)] or [b""]
            names = [hashlib.sha256(x).hexdigest() for x in parts]
            have = self.etcd.read(*(E.get(p + "blob/" + h, keys_only=True) for h in names))
            for i, (h, part) in enumerate(zip(names, parts)):
                if not have.range(i).kvs:  # content-addressed: a part already there is shared
                    self.guarded(guard, [E.put(p + "blob/" + h, part)])  # idempotent
            ops.append(E.put(p + "snap/" + rev_key(number), json.dumps(
                {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "parts": names})))
        compare = [*guard] + ([E.cmp_created(p + "rev/" + rev_key(number), 0)] if fresh else [])
        key = p + "rev/" + rev_key(number)

        def applied() -> bool:
            kv = self.etcd.range(key).get(key)
            return kv is not None and json.loads(kv.value) == doc

        res = self.txn(compare, ops, [E.get(p + "lock")], applied)
        if not res.succeeded:
            if guard and not lock_still_ours(res, guard):
                raise LockLost("the lock's lease expired or was revoked (`inv unlock --force`)")
            return self.put_revision(doc, None, snapshot, guard)  # the number was taken meanwhile
        return int(number)

    def guarded(self, guard: list[dict], ops: list[dict]) -> None:
        res = self.txn(list(guard), ops, [E.get(self.p + "lock")], lambda: False)
        if not res.succeeded:
            raise LockLost("the lock's lease expired or was revoked (`inv unlock --force`)")

    def set_current(self, number: int, guard: list[dict]) -> None:
        p = self.p
        res = self.txn([*guard, {"key": E.b64(p + "rev/" + rev_key(number)), "target": "CREATE",
                                 "result": "GREATER", "create_revision": "0"}],
                       [E.put(p + "current", str(int(number)))], [E.get(p + "lock"), E.get(p + "rev/" + rev_key(number))],
                       lambda: False)  # sent again if unsure: putting the same number twice is harmless
        if not res.succeeded:
            if not lock_still_ours(res, guard):
                raise LockLost("the lock's lease expired or was revoked: `current` was not moved")
            raise Unverified(f"{self.location}: no revision {number} to make current")

    def set_aside(self, guard: list[dict]) -> dict:
        """Delete the record's keys but the lock's and the format (a migration back into a prefix
        whose copy is older than, and contained in, the record being copied in: checked by the caller)."""
        p = self.p
        names = ["current", "rev/", "snap/", "blob/", "journal/", "moved"]
        ops = [E.delete(p + n, prefix=n.endswith("/")) for n in names]
        fmt = json.loads(self.etcd.range(p + "format").get(p + "format").value)
        ops.append(E.put(p + "format", json.dumps(dict(fmt, format=FORMAT))))  # no longer moved
        self.guarded(guard, ops)
        return {"ok": True, "aside": None, "moved": names}

    # -- the lock
    def hold(self, holder: dict, lease_s: float, *, even_if_moved: bool = False) -> "EtcdSession":
        return EtcdSession(self, holder, lease_s, even_if_moved=even_if_moved)

    def unlock(self, by: dict, reason: str, op_id: str) -> dict:
        """Revoke the holder's lease (its next write fails; nothing is killed), clear the holder
        record, journal who did it and why."""
        p = self.p
        res = self.etcd.read(E.get(p + "format"), E.get(p + "lock"), E.get(p + "holder"), E.get(p + "moved"))
        bad = self._check_format(res.range(0).get(p + "format"), res.range(3).get(p + "moved"))
        if bad:
            return bad
        lock, holder = res.range(1).get(p + "lock"), res.range(2).get(p + "holder")
        before = self._lock_doc(lock, holder)
        ended = None
        if lock is not None and lock.lease:
            if self.etcd.revoke(lock.lease):
                ended = {"lease": lock.lease}
        # only what was read: a next holder that took the lock since keeps it
        cleared = self.etcd.txn([E.cmp_created(p + "lock", 0), E.cmp_modified(p + "holder", holder.mod_revision if holder
                                                                                else 0)],
                                [E.delete(p + "holder")], [E.get(p + "lock"), E.get(p + "holder")])
        if not cleared.succeeded and cleared.range(0).kvs:
            return {"ok": False, "error": "locked", "holder": self._lock_doc(cleared.range(0).kvs[0],
                                                                             (cleared.range(1).kvs or [None])[0])}
        self.append_journal([json.dumps({"ts": now_iso(), "op_id": op_id, "step": "lock.unlock-forced",
                                         "status": "note", "evidence": {"reason": reason, "by": by,
                                                                        "previous_holder": before,
                                                                        "revoked_lease": ended}},
                                        sort_keys=True)], [])
        return {"ok": True, "was": before, "ended": ended}

    def close(self) -> None:
        self.etcd.close()


__all__ = ["EtcdStore", "EtcdSession", "LockLost", "FORMAT", "PART_BYTES"]
