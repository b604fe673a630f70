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
    P/journal/tag/<tag>/<seq>      the same line, under each of its tags (pdops.record.local.journal_tags)
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
import threading
import time
import urllib.parse

from pdops.errors import PdopsError, Unreachable, Unverified
from pdops.record.local import journal_tags, now_iso
from pdops.record.transport import PING_S, lock_lost
from pdops.remote import etcd as E

FORMAT = 1
MOVED_FORMAT = 2  # P/format of a record marked as moved: a pdops that does not know P/moved refuses it
PART_BYTES = 512 * 1024  # < etcd's 1.5 MiB request limit once base64'd, with room for the rest
MAX_TXN_OPS = 100  # etcd's default --max-txn-ops is 128
TXN_BYTES = 1024 * 1024  # values per transaction, under etcd's default --max-request-bytes of 1.5 MiB
REF = "ref:"  # an operation's or a tag's copy of a line too big to copy: the key of the line itself
RETRY_S = 20.0  # a write whose member died is sent again for this long (a new leader takes ~1-3 s)
PAGE = 1000


def _seg(name: str) -> str:
    """An op id or a tag as one key segment (a "/" in it would reach into another's keys)."""
    return urllib.parse.quote(str(name), safe=":")


def _seq(n: int) -> str:
    return f"{int(n):012d}"


def _rev(n: int) -> str:
    return f"{int(n):08d}"


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
        kv = self.etcd.range(self.p + "snap/" + _rev(n)).get(self.p + "snap/" + _rev(n))
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
            return {"ok": True, "lines": self._lines_under(p + f"op/{_seg(op_id)}/")}
        if tag is not None:
            return {"ok": True, "lines": self._lines_under(p + f"tag/{_seg(tag)}/")}
        if last_ops is not None:
            ops = self.etcd.range(p + "ops").get(p + "ops")
            total = int(ops.text) if ops else 0
            first = max(1, total - int(last_ops) + 1)
            ords = self.etcd.range(p + "ord/" + _seq(first), end=p + "ord/" + _seq(total + 1)).kvs if total else []
            ids = [kv.text for kv in ords]
            lines: list[str] = []
            for i in range(0, len(ids), MAX_TXN_OPS):
                res = self.etcd.read(*(E.get(p + f"op/{_seg(x)}/", prefix=True) for x in ids[i:i + MAX_TXN_OPS]))
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
            res = self.etcd.read(E.get(p + "n"), E.get(p + "ops"), *(E.get(p + f"opn/{_seg(o)}") for o in op_ids))
            n_kv, ops_kv = res.range(0).get(p + "n"), res.range(1).get(p + "ops")
            n, nops = (int(n_kv.text) if n_kv else 0), (int(ops_kv.text) if ops_kv else 0)
            first = n + 1
            known = {o for i, o in enumerate(op_ids) if res.range(2 + i).get(p + f"opn/{_seg(o)}") is not None}
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
                key = p + "line/" + _seq(n + 1)
                copy = line if size_of * (2 + len(tags)) <= TXN_BYTES // 2 else REF + key  # big: copies refer to it
                mine = [E.put(key, line), E.put(p + f"op/{_seg(o)}/" + _seq(n + 1), copy)]
                mine += [E.put(p + f"tag/{_seg(t)}/" + _seq(n + 1), copy) for t in tags]
                mine_size = size_of + len(copy) * (1 + len(tags))
                new_op = o not in known
                if new_op:
                    mine += [E.put(p + f"opn/{_seg(o)}", str(nops + 1)), E.put(p + "ord/" + _seq(nops + 1), o)]
                if ops and (len(ops) + len(mine) + 2 + len(compare) > MAX_TXN_OPS or size + mine_size > TXN_BYTES):
                    break
                size += mine_size
                if new_op:
                    compare.append(E.cmp_created(p + f"opn/{_seg(o)}", 0))
                    known.add(o)
                    nops += 1
                ops += mine
                n += 1
                taken += 1
            ops += [E.put(p + "n", str(n)), E.put(p + "ops", str(nops))]
            head = todo[0]

            def applied() -> bool:
                kv = self.etcd.range(p + "line/" + _seq(first)).get(p + "line/" + _seq(first))
                return kv is not None and kv.text == head

            res = self.txn(compare, ops, [E.get(self.p + "lock")] if guard else [], applied)
            if res.succeeded:
                todo = todo[taken:]
                continue
            if guard and not _guard_holds(res, guard):
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
        ops = [E.put(p + "rev/" + _rev(number), json.dumps(doc, indent=2, sort_keys=True))]
        if snapshot is not None:
            data = json.dumps(snapshot, sort_keys=True).encode("utf-8")
            parts = [data[i:i + PART_BYTES] for i in range(0, len(data), PART_BYTES)] or [b""]
            names = [hashlib.sha256(x).hexdigest() for x in parts]
            have = self.etcd.read(*(E.get(p + "blob/" + h, keys_only=True) for h in names))
            for i, (h, part) in enumerate(zip(names, parts)):
                if not have.range(i).kvs:  # content-addressed: a part already there is shared
                    self._guarded(guard, [E.put(p + "blob/" + h, part)])  # idempotent
            ops.append(E.put(p + "snap/" + _rev(number), json.dumps(
                {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "parts": names})))
        compare = [*guard] + ([E.cmp_created(p + "rev/" + _rev(number), 0)] if fresh else [])
        key = p + "rev/" + _rev(number)

        def applied() -> bool:
            kv = self.etcd.range(key).get(key)
            return kv is not None and json.loads(kv.value) == doc

        res = self.txn(compare, ops, [E.get(p + "lock")], applied)
        if not res.succeeded:
            if guard and not _guard_holds(res, guard):
                raise LockLost("the lock's lease expired or was revoked (`inv unlock --force`)")
            return self.put_revision(doc, None, snapshot, guard)  # the number was taken meanwhile
        return int(number)

    def _guarded(self, guard: list[dict], ops: list[dict]) -> None:
        res = self.txn(list(guard), ops, [E.get(self.p + "lock")], lambda: False)
        if not res.succeeded:
            raise LockLost("the lock's lease expired or was revoked (`inv unlock --force`)")

    def set_current(self, number: int, guard: list[dict]) -> None:
        p = self.p
        res = self.txn([*guard, {"key": E.b64(p + "rev/" + _rev(number)), "target": "CREATE",
                                 "result": "GREATER", "create_revision": "0"}],
                       [E.put(p + "current", str(int(number)))], [E.get(p + "lock"), E.get(p + "rev/" + _rev(number))],
                       lambda: False)  # sent again if unsure: putting the same number twice is harmless
        if not res.succeeded:
            if not _guard_holds(res, guard):
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
        self._guarded(guard, ops)
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


def _guard_holds(res: E.TxnResult, guard: list[dict]) -> bool:
    """After a failed transaction whose failure branch read P/lock first: is the lock still ours?"""
    lock = res.range(0).kvs
    want = next((int(g["create_revision"]) for g in guard if g.get("target") == "CREATE"), None)
    return bool(lock) and want is not None and lock[0].create_revision == want


class LockLost(Unreachable):
    pass


class EtcdSession:
    """The lock held in etcd for one operation: a lease kept alive every PING_S seconds, and the
    same requests as the state host's lock session (pdops.record.transport.Session), served here."""

    def __init__(self, store: EtcdStore, holder: dict, lease_s: float, *, even_if_moved: bool = False):
        self.store, self.holder, self.lease_s = store, dict(holder), float(lease_s)
        self.even_if_moved = even_if_moved
        self.where = store.name
        self.broken: str | None = None
        self.lease = 0
        self.guard: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def first(self) -> dict:
        """Take the lock: a transaction that creates P/lock only if it does not exist."""
        st, p = self.store, self.store.p
        for _ in range(3):
            res = st.etcd.read(E.get(p + "format"), E.get(p + "lock"), E.get(p + "holder"), E.get(p + "moved"))
            fmt = res.range(0).get(p + "format")
            moved = res.range(3).get(p + "moved")
            bad = st._check_format(fmt, moved)
            if bad:
                return bad
            if moved is not None and not self.even_if_moved:
                return {"ok": False, "error": "moved", "message": f"the record under {p} was moved: "
                        f"{json.loads(moved.value).get('to')}"}
            lock, prev = res.range(1).get(p + "lock"), res.range(2).get(p + "holder")
            if lock is not None:
                return {"ok": False, "error": "locked", "holder": st._lock_doc(lock, prev)}
            self.lease = st.etcd.grant(self.lease_s)
            me = dict(self.holder, lease=self.lease, lease_s=self.lease_s, etcd_endpoint=st.etcd.endpoint,
                      taken=now_iso())
            body = json.dumps(me, indent=2, sort_keys=True)
            ops = [E.put(p + "lock", body, lease=self.lease), E.put(p + "holder", body)]
            compare = [E.cmp_created(p + "lock", 0), E.cmp_modified(p + "holder", prev.mod_revision if prev else 0)]
            if not self.even_if_moved:  # a migration marking it moved meanwhile: no lock on the old copy
                compare.append(E.cmp_created(p + "moved", 0))
            if fmt is None:
                ops.append(E.put(p + "format", json.dumps({"format": FORMAT, "cluster": st.cluster,
                                                           "created": now_iso()})))
                compare.append(E.cmp_created(p + "format", 0))

            def applied() -> bool:
                kv = st.etcd.range(p + "lock").get(p + "lock")
                return kv is not None and kv.text == body

            res = st.txn(compare, ops, [], applied)
            if res.succeeded and res.revision == 0:  # taken, but the answer was lost: read when
                res.revision = st.etcd.range(p + "lock").get(p + "lock").create_revision
            if res.succeeded:
                self.guard = [E.cmp_created(p + "lock", res.revision)]
                self.holder = me
                if prev is not None:  # its holder's lease ran out (or was revoked) before it released
                    was = json.loads(prev.value)
                    st.append_journal([json.dumps({"ts": now_iso(), "op_id": was.get("op_id"), "step": "lock.lease-expired",
                                                   "status": "failed", "evidence": {"lease_s": was.get("lease_s"),
                                                                                    "holder": was,
                                                                                    "found_by": me.get("op_id")}},
                                                  sort_keys=True)], self.guard)
                snap = st.read()
                return {"ok": True, "interrupted": json.loads(prev.value) if prev else None, "holder": me,
                        "snapshot": snap}
            st.etcd.revoke(self.lease)  # someone else took it in between: look again
        res = st.etcd.read(E.get(p + "lock"), E.get(p + "holder"))
        lock, holder = res.range(0).get(p + "lock"), res.range(1).get(p + "holder")
        if lock is None:
            return {"ok": False, "error": "contended", "message": "the lock changed hands three times while this "
                    "operation tried to take it; nothing was changed: run it again"}
        return {"ok": False, "error": "locked", "holder": st._lock_doc(lock, holder)}

    def request(self, doc: dict) -> dict:
        with self._lock:
            if self.broken:
                raise lock_lost(self.broken)
            try:
                return self._serve(doc)
            except LockLost as e:
                self.broken = f"{self.where}: {e.message}"
                raise Unreachable(f"lost the cluster lock: {self.broken}",
                                  fix="someone may have run `inv unlock --force`; see `inv journal`") from None
            except E.EtcdUnavailable as e:
                if doc.get("op") in ("ping", "snapshot", "snapshot-of", "journal-of", "journal-query"):
                    raise
                self.broken = f"{self.where}: {e.message}"
                raise Unreachable(f"lost the cluster lock: {self.broken}") from None

    def _serve(self, doc: dict) -> dict:
        st, op = self.store, doc.get("op")
        if op == "ping":
            if st.etcd.keepalive(self.lease) <= 0:
                raise LockLost(f"the lease {self.lease} expired")
            return {"ok": True}
        if op == "journal":
            st.append_journal(list(doc.get("lines") or [doc["line"]]), self.guard)
            return {"ok": True}
        if op == "put-revision":
            return {"ok": True, "number": st.put_revision(doc["doc"], doc.get("number"), doc.get("snapshot"),
                                                          self.guard)}
        if op == "set-current":
            st.set_current(doc["number"], self.guard)
            return {"ok": True}
        if op == "snapshot":
            return st.read()
        if op == "snapshot-of":
            return st.revision_snapshot(doc["number"])
        if op == "journal-of":
            return st.journal(op_id=doc["op_id"])
        if op == "journal-query":
            return st.journal(op_id=doc.get("op_id"), last_ops=doc.get("last_ops"), tag=doc.get("tag"))
        if op == "mark-moved":
            fmt = json.loads(st.etcd.range(st.p + "format").get(st.p + "format").value)
            st._guarded(self.guard, [E.put(st.p + "moved", json.dumps(doc["doc"], sort_keys=True)),
                                     E.put(st.p + "format", json.dumps(dict(fmt, format=MOVED_FORMAT)))])
            return {"ok": True}
        if op == "set-aside":
            return st.set_aside(self.guard)
        if op == "release":
            p = st.p
            res = st.txn(list(self.guard), [E.delete(p + "lock"), E.delete(p + "holder")], [], lambda: False)
            st.etcd.revoke(self.lease)
            return {"ok": True, "released": res.succeeded}
        raise Unverified(f"unknown request {op!r}")

    def start_heartbeat(self, every: float = PING_S) -> None:
        """Keep the lease alive every `every` s and check the lock is still this operation's, on a
        client of its own (never waiting behind the operation's requests). What ends it is kept in
        `broken`: the operation's next request stops with it."""
        st = self.store
        mine = E.Etcd(list(st.setting.endpoints), ca=st.setting.ca, cert=st.setting.cert, key=st.setting.key)

        def beat():
            try:
                while not self._stop.wait(every):
                    try:
                        if mine.keepalive(self.lease) <= 0:
                            self.broken = f"{self.where}: the lease {self.lease} expired (nothing was heard for " \
                                          f"{self.lease_s:g} s)"
                            return
                        held = mine.txn(list(self.guard), [], [E.get(st.p + "lock")])
                        if not held.succeeded:
                            self.broken = (f"{self.where}: the lock is no longer this operation's (its lease was "
                                           "revoked: `inv unlock --force`?)")
                            return
                    except E.EtcdUnavailable:
                        continue  # no member answered this time; the lease has lease_s
                    except PdopsError as e:
                        self.broken = f"{self.where}: the lease keepalive failed: {e.message}"
                        return
            finally:
                mine.close()

        threading.Thread(target=beat, name="pdops-lease-keepalive", daemon=True).start()

    def close(self) -> None:
        self._stop.set()


__all__ = ["EtcdStore", "EtcdSession", "LockLost", "FORMAT", "PART_BYTES"]
