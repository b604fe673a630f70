"""The cluster lock held in etcd for one operation (docs/state.md, "The record on etcd"): a key under
a lease kept alive by a heartbeat, and every write of the operation a transaction guarded by that
key's create revision (a holder whose lease expired writes nothing)."""

from __future__ import annotations

import json
import threading

from pdops.errors import PdopsError, Unreachable, Unverified
from pdops.record.etcdkeys import FORMAT, MOVED_FORMAT
from pdops.record.journal import now_iso
from pdops.record.transport import PING_S, lock_lost
from pdops.remote import etcd as E


def lock_still_ours(res: E.TxnResult, guard: list[dict]) -> bool:
    """After a failed transaction whose failure branch read P/lock first: is the lock still ours?"""
    lock = res.range(0).kvs
    want = next((int(g["create_revision"]) for g in guard if g.get("target") == "CREATE"), None)
    return bool(lock) and want is not None and lock[0].create_revision == want


class LockLost(Unreachable):
    pass


class EtcdSession:
    """The lock held in etcd for one operation: a lease kept alive every PING_S seconds, and the
    same requests as the state host's lock session (pdops.record.transport.Session), served here by
    `store` (the pdops.record.etcdstore.EtcdStore that made it)."""

    def __init__(self, store, holder: dict, lease_s: float, *, even_if_moved: bool = False):
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
            st.guarded(self.guard, [E.put(st.p + "moved", json.dumps(doc["doc"], sort_keys=True)),
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


__all__ = ["EtcdSession", "LockLost", "lock_still_ours"]
