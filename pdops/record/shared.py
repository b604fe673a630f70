"""The shared record, its journal and its lock, read and written through the holder process."""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import asdict
from pathlib import Path

from pdops import __version__
from pdops.errors import InvalidInput, PdopsError, Refused, Unreachable, Unverified
from pdops.runner import Say
from pdops.record.journal import Journal, journal_tags, last_operations, now_iso, parse_lines
from pdops.record.local import (RecordReads, Revision, StateDir, atomic_write, default_machine, default_operator, new_op_id)

from pdops.record.transport import LEASE_S, Session


def lock_line(h: dict | None) -> str:
    """The lock as `inv status`, `inv history` and `inv state.show` show it."""
    if not h:
        return "lock: free"
    if h.get("holder_alive") is False:
        return (f"lock: free; left by {describe_holder(h)}: the next change takes it and reports that "
                "operation as interrupted")
    return f"lock: held by {describe_holder(h)}"


def describe_holder(h: dict) -> str:
    alive = h.get("holder_alive")
    seen = h.get("last_seen_s")
    what = f"its lease {h['lease']} in etcd" if h.get("lease") else "its lock process on the state host"
    state = ("" if alive is None else f"; {what} is alive" if alive
             else (f"; {what} is gone" if h.get("lease") else f"; {what} is gone")
             + " (the operation did not finish)")
    return (f"{h.get('operator')} on {h.get('machine')} running '{h.get('operation')}' ({h.get('op_id')}) since "
            f"{h.get('since')}" + (f", last heard from {seen} s ago" if seen is not None else "") + state)


def revision_docs(revs: dict) -> dict[int, dict]:
    """Revision docs keyed by number, as this pdops reads them (for comparing two records)."""
    return {int(n): asdict(Revision.from_dict(d)) for n, d in revs.items()}


class SharedRecord(RecordReads):
    """The cluster's record in its store: a state host (pdops.record.hoststore) or etcd
    (pdops.record.etcdstore), both answering the same reads and serving the same requests under
    the lock.

    ``path`` is this operator machine's own dir (builds, bench runs, the cache), never the record.
    Reads come from one snapshot per process (refreshed when the lock is taken); writes need the
    lock, and go through its session.
    """

    def __init__(self, cluster: str, local: str | os.PathLike, store, *, cached_ok: bool = False):
        self.cluster = cluster
        self.path = Path(local)
        self.store = store
        self.cached_ok = cached_ok
        self.cached: dict | None = None  # {fetched_at, reason} when reads come from the local cache
        self._snap: dict | None = None
        self._session: Session | None = None
        self._check_local_record = True
        self.cache_error: str | None = None
        self.allow_moved = False  # `inv state.migrate` and `state.show` read a record marked as moved
        weakref.finalize(self, store.close)  # the store's own connection goes with the record

    @property
    def location(self) -> str:
        return self.store.location

    @property
    def cache_file(self) -> Path:
        return self.path / "cache" / "record.json"

    @property
    def snapshot_cache(self) -> Path:
        return self.path / "cache" / "snapshot.json"

    def answer(self, doc: dict) -> dict:
        """An answer of the store, or the one clear error it stands for."""
        if doc.get("ok"):
            return doc
        code, msg = doc.get("error"), doc.get("message")
        field = "pdops_state.etcd.prefix" if self.store.kind == "etcd" else "pdops_state.dir"
        if code == "dir":
            raise InvalidInput("pdops_state.dir", f"on {self.store.host}: {msg}",
                               fix="use a directory only root can write (pdops creates it 0700)")
        if code == "newer":
            raise Refused(f"{self.location}: {msg}", fix="run the pdops version that wrote it; nothing was changed")
        if code == "cluster":
            raise InvalidInput(field, f"{self.location}: {msg}", fix="give each cluster its own record")
        if code == "moved":
            raise Refused(f"{self.location}: {msg}; no change runs on this copy",
                          fix="point pdops_state at where the record is now (docs/runbooks/record-to-etcd.md); "
                              "nothing was changed")
        if code == "locked":
            h = doc.get("holder") or {}
            raise Refused(f"cluster '{self.cluster}' is locked by {describe_holder(h)}",
                          fix="wait for it to finish (`inv journal` shows its steps). If its operator's machine is "
                              "dead and the lock is not freed within a minute: `inv unlock --force --reason ...`",
                          evidence=json.dumps(h, indent=2, sort_keys=True))
        raise Unverified(f"{self.location}: {msg or code}", evidence=json.dumps(doc)[-1000:])

    # -- reading
    def snapshot(self) -> dict:
        if self._snap is None:
            self._snap = self._fetch()
        return self._snap

    def refresh(self) -> dict:
        self._snap = None if self._session is None else self._session.request({"op": "snapshot"})
        return self.snapshot()

    def _fetch(self) -> dict:
        try:
            doc = self.answer(self.store.read())
        except Unreachable as e:
            if self.cached_ok:
                return self._from_cache(e.message)
            raise Unreachable(f"the cluster's record is on {self.location}, and {e.message.rstrip('.')}",
                              fix=f"{self.store.bring_back}; no change runs from this machine's "
                                  "cached copy. Nothing was changed") from None
        if doc.get("moved") and not self.allow_moved:
            m = doc["moved"]
            raise Refused(f"the record of cluster '{self.cluster}' moved from {self.location} to {m.get('to')} "
                          f"({m.get('at')}, by {m.get('by')}, {m.get('op_id')})",
                          fix=f"set pdops_state.backend: {m.get('backend')} in the inventory "
                              "(docs/runbooks/record-to-etcd.md); nothing was changed")
        self._write_cache(doc)
        if self._check_local_record:
            self._check_local(doc)
        return doc

    def cached_revisions(self) -> list[int]:
        """The revision numbers this machine's cache holds of this cluster (none: no cache, or another's)."""
        try:
            old = json.loads(self.cache_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return []
        if old.get("cluster", self.cluster) != self.cluster:
            return []
        return sorted(int(n) for n in ((old.get("snapshot") or {}).get("revisions") or {}))

    def _write_cache(self, doc: dict) -> None:
        """Best effort: a machine that cannot keep the copy still reads and changes the record. A
        cache is replaced only by a record that holds every revision it holds (revisions are never
        deleted): not by an empty one, nor by another record begun on a replaced state host. It is
        what `inv state.restore --from-cache` rebuilds the record from."""
        body = {k: v for k, v in doc.items() if k != "journal"}
        had = self.cached_revisions()
        if had and not set(had) <= {int(n) for n in body.get("revisions") or {}}:
            self.cache_error = (f"{self.cache_file} kept: it holds revisions {had[0]}..{had[-1]}, which {self.location} "
                                "does not (`inv state.restore --from-cache` if the record was lost)")
            return
        try:
            d = self.cache_file.parent
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o700)
            atomic_write(self.cache_file, json.dumps({"fetched_at": now_iso(), "location": self.location,
                                                      "cluster": self.cluster, "snapshot": body},
                                                     sort_keys=True) + "\n")
            os.chmod(self.cache_file, 0o600)
        except OSError as e:
            self.cache_error = f"{self.cache_file}: {e.strerror}"

    def _from_cache(self, reason: str) -> dict:
        try:
            doc = json.loads(self.cache_file.read_text(encoding="utf-8"))
        except (FileNotFoundError, json.JSONDecodeError):
            raise Unreachable(f"the cluster's record is on {self.location}, and {reason}; this machine has no "
                              "cached copy of it", fix=self.store.bring_back) from None
        self.cached = {"fetched_at": doc.get("fetched_at"), "reason": reason}
        return doc["snapshot"]

    def cache_banner(self) -> str | None:
        if self.cached is None:
            return None
        return (f"READ-ONLY CACHED COPY of the record (fetched {self.cached['fetched_at']}): "
                f"{self.store.name} cannot be reached ({self.cached['reason']}); no change can run until it can "
                f"-> {self.store.bring_back}")

    def current(self) -> int | None:
        cur = self.snapshot().get("current")
        if cur is not None and not isinstance(cur, int):
            raise Unverified(f"{self.location}/current holds {cur!r}, not a revision number")
        return cur

    def revision_numbers(self) -> list[int]:
        return sorted(int(n) for n in self.snapshot().get("revisions", {}))

    def read_revision(self, n: int) -> Revision:
        doc = self.snapshot().get("revisions", {}).get(str(int(n)))
        if doc is None:
            raise InvalidInput("revision", f"no revision {n} in the record on {self.location}",
                               fix="see `inv history` for recorded revisions")
        return Revision.from_dict(doc)

    def lock_holder(self) -> dict | None:
        return self.snapshot().get("lock")

    def revision_snapshot(self, n: int) -> dict | None:
        """The files and inventory recorded with revision `n` (None: recorded before snapshots)."""
        if self._session is not None:
            return self._session.request({"op": "snapshot-of", "number": int(n)}).get("snapshot")
        return self.answer(self.store.revision_snapshot(n)).get("snapshot")

    def cache_snapshot(self, n: int, snapshot: dict) -> None:
        """Keep the newest revision's rollback snapshot on this machine too (0600), so that
        `inv state.restore --from-cache` can rebuild that revision whole. Best effort."""
        try:
            self.snapshot_cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.snapshot_cache, json.dumps({"number": int(n), "snapshot": snapshot}, sort_keys=True))
            os.chmod(self.snapshot_cache, 0o600)
        except OSError as e:
            self.cache_error = f"{self.snapshot_cache}: {e.strerror}"

    # -- the operator machine's record from before the shared one
    def local_record(self) -> StateDir:
        return StateDir(self.cluster, self.path)

    def _check_local(self, doc: dict) -> None:
        local = self.local_record()
        mine = local.revision_numbers()
        if not mine:
            return
        theirs = doc.get("revisions") or {}
        desc_local = record_summary(f"this machine ({local.path})", {n: asdict(local.read_revision(n)) for n in mine},
                              local.current())
        desc_shared = record_summary(f"the state host ({self.location})", revision_docs(theirs), doc.get("current"))
        if not theirs:
            raise Refused(f"the record of cluster '{self.cluster}' is only on this machine, in {local.path}; the "
                          f"shared record on {self.location} is empty",
                          fix="run `inv state.push` to move it to the state host (under the cluster lock), then "
                              "run this again; nothing was changed", evidence=desc_local)
        same = revision_docs({str(n): asdict(local.read_revision(n)) for n in mine}) == revision_docs(theirs) \
            and local.current() == doc.get("current")
        if not same:
            raise Refused(f"two records of cluster '{self.cluster}' disagree: this machine's ({local.path}) and the "
                          f"shared one ({self.location}); pdops will not guess which is right",
                          fix="compare both with what runs (`inv status`); to keep the shared record, move "
                              f"{local.path}/revisions, current and journal.jsonl aside. Nothing was changed",
                          evidence=desc_local + "\n" + desc_shared)

    # -- writing (under the lock only)
    def _held(self, what: str) -> Session:
        if self._session is None:
            raise PdopsError(f"{what} outside the cluster lock (a pdops bug): nothing was written")
        return self._session

    def write_revision(self, *, topology: str, inventory_hash: str, placement: dict, manifest: dict,
                       instances: dict, operator: str | None = None, outcome: str = "pending",
                       op_id: str | None = None, extra: dict | None = None, snapshot: dict | None = None) -> Revision:
        """Record a new revision under the next free number. Does NOT move ``current``. `snapshot`:
        what a rollback needs to return to it (pdops.snapshot), kept beside it on the state host (0600)."""
        sess = self._held("writing a revision")
        rev = self.new_revision(0, topology=topology, inventory_hash=inventory_hash, placement=placement,
                                manifest=manifest, instances=instances, operator=operator, outcome=outcome,
                                op_id=op_id, extra=extra)
        req = {"op": "put-revision", "doc": asdict(rev), "number": None}
        if snapshot is not None:
            req["snapshot"] = snapshot
        rev.number = sess.request(req)["number"]
        self._snap["revisions"][str(rev.number)] = asdict(rev)
        if snapshot is not None:
            self.cache_snapshot(rev.number, snapshot)
        return rev

    def set_outcome(self, n: int, outcome: str) -> Revision:
        sess = self._held("recording an outcome")
        rev = self.read_revision(n)
        rev.outcome = outcome
        sess.request({"op": "put-revision", "doc": asdict(rev), "number": rev.number})
        self._snap["revisions"][str(rev.number)] = asdict(rev)
        return rev

    def set_current(self, n: int) -> None:
        self._held("moving current").request({"op": "set-current", "number": int(n)})
        self._snap["current"] = int(n)

    def journal(self) -> "SharedJournal":
        return SharedJournal(self)

    def lock(self, operation: str, *, op_id: str | None = None, operator: str | None = None,
             say: Say = print, migrating: bool = False, restoring: bool = False) -> "SharedLock":
        """The cluster lock. `migrating` (`inv state.migrate` only): taken on a record marked as
        moved, and `lock.held` is journalled by the caller, after its copy. `restoring` (`inv
        state.restore` only): taken on an empty record although this machine's cache holds revisions."""
        return SharedLock(self, operation, op_id=op_id, operator=operator, say=say, migrating=migrating,
                          restoring=restoring)

    def close(self) -> None:
        self.store.close()


def record_summary(where: str, docs: dict[int, dict], current) -> str:
    lines = [f"{where}: current {current if current is not None else 'none'}"]
    for n in sorted(docs):
        d = docs[n]
        lines.append(f"  {n:4d}  {d.get('topology')}  {d.get('outcome')}  {d.get('created')}  {d.get('operator')}")
    return "\n".join(lines)


class SharedJournal(Journal):
    """The journal in the record: appended through the lock's session; read in pages where the
    record is (one operation, the last N operations, the lines of a tag), or whole."""

    def __init__(self, record: SharedRecord):
        super().__init__(Path(record.path) / "journal.jsonl")  # not used: every line goes to the store
        self.record = record

    def _append(self, line: str, tags: list[str] = ()) -> None:
        self.record._held("writing the journal").request({"op": "journal", "line": line})

    def _query(self, **what) -> list[str]:
        rec = self.record
        if rec._session is not None:
            return rec._session.request(rec.store.journal_request(**what)).get("lines", [])
        return rec.answer(rec.store.journal(**what)).get("lines", [])

    def _lines(self) -> list[str]:
        """Every line (`inv state.migrate`, `state.push`): read outside the lock's session."""
        return self.record.answer(self.record.store.journal(everything=True)).get("lines", [])

    def read(self, op_id: str) -> list[dict]:
        return [r for r in parse_lines(self._query(op_id=op_id)) if r.get("op_id") == op_id]

    def last_operations(self, n: int) -> list[dict]:
        return last_operations(parse_lines(self._query(last_ops=int(n))), int(n))

    def tagged(self, tag: str) -> list[dict]:
        return [r for r in parse_lines(self._query(tag=tag)) if tag in journal_tags(r)]


class SharedLock:
    """The cluster lock, held by a process on the state host for this operation's life."""

    def __init__(self, record: SharedRecord, operation: str, *, op_id: str | None = None,
                 operator: str | None = None, say: Say = print, migrating: bool = False, restoring: bool = False):
        self.record = record
        self.migrating, self.restoring = migrating, restoring
        self.operation = operation
        self.op_id = op_id or new_op_id(operation)
        self.operator = operator or default_operator()
        self.say = say
        self.held = False
        self.holder: dict | None = None
        self.interrupted: dict | None = None

    def acquire(self) -> "SharedLock":
        rec = self.record
        if rec.cached is not None:
            raise Unreachable(f"{rec.store.name} cannot be reached ({rec.cached['reason']}): no change runs "
                              "from the cached copy of the record", fix=f"{rec.store.bring_back}; nothing was changed")
        me = {"operator": self.operator, "machine": default_machine(), "operation": self.operation,
              "op_id": self.op_id, "client_pid": os.getpid(), "since": now_iso(), "pdops": __version__}
        sess = rec.store.hold(me, LEASE_S, even_if_moved=self.migrating)
        try:
            first = rec.answer(sess.first())
        except BaseException:
            sess.close()
            raise
        rec._session, rec._snap = sess, first["snapshot"]
        had = rec.cached_revisions()
        if had and not rec._snap.get("revisions") and not (self.migrating or self.restoring):
            self.release()
            raise Refused(f"the record of cluster '{rec.cluster}' in {rec.location} holds no revision, but this machine's "
                          f"cache holds revisions {had[0]}..{had[-1]} of it ({rec.cache_file})",
                          fix="if the record was lost: `inv state.restore --from-cache` (docs/runbooks/state-host-lost.md); "
                              "if the cluster was rebuilt from nothing, move that file aside. Nothing was changed")
        rec._write_cache(rec._snap)
        if rec._check_local_record:
            try:
                rec._check_local(first["snapshot"])
            except PdopsError:
                self.release()
                raise
        sess.start_heartbeat()
        self.held, self.holder = True, first["holder"]
        if self.migrating:
            self.interrupted = first.get("interrupted")
            return self
        j = rec.journal()
        j.step(self.op_id, "lock.held", "ok", {k: self.holder.get(k) for k in (
            "operator", "machine", "operation", "client_pid", "ssh_client", "state_pid", "since")})
        prev = first.get("interrupted")
        if prev:
            self.interrupted = prev
            steps = parse_lines(sess.request(rec.store.journal_request(op_id=prev.get("op_id")))["lines"])
            # its own last step: the store's note that its lease ran out is not one
            own = [x for x in steps if x.get("step") != "lock.lease-expired"]
            last = own[-1] if own else {}
            j.step(self.op_id, "lock.interrupted", "note",
                   {"previous_holder": prev, "last_step": last.get("step"), "last_status": last.get("status"),
                    "last_ts": last.get("ts"), "steps": len(steps)})
            finished = last.get("step") == "verdict"
            self.say(f"note: the previous operation {prev.get('op_id')} ('{prev.get('operation')}' by "
                     f"{prev.get('operator')} on {prev.get('machine')}, since {prev.get('since')}) "
                     + ("ended without releasing the lock" if finished else
                        f"did not finish: its last journalled step is '{last.get('step')}' ({last.get('status')})")
                     + f"; see `inv journal --op {prev.get('op_id')}`")
        return self

    def release(self) -> None:
        rec = self.record
        sess = rec._session
        if sess is None:
            return
        try:
            sess.request({"op": "release"})
            if rec._snap is not None:
                rec._snap["lock"] = None  # ours, now released
        except PdopsError:
            pass  # the session is gone: the flock went with it; the lock file says the operation was cut
        sess.close()
        rec._session = None
        self.held = False
        if rec._snap is not None:
            rec._write_cache(rec._snap)  # what this operation wrote, for reading while the host is down

    def __enter__(self) -> "SharedLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
