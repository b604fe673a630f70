"""The cluster's record and lock, kept on a state host of the cluster (docs/state.md).

The revisions, ``current`` and the journal live in ``pdops_state.dir`` on ``pdops_state.host``
(default: the gateway host, ``/var/lib/pdops/state``), so every engineer of an on-call rotation
with the inventory and SSH access reads and changes the same record. A change holds the cluster
lock for its whole life: a process on the state host (``pdops/hostscripts/record.py hold``) holds
``flock`` on the state dir for as long as the operator's SSH session lives, pinged every
:data:`PING_S` seconds; a killed laptop process, a cut session or :data:`LEASE_S` seconds of silence
end it, and the kernel frees the lock. Every write of the operation (revision, ``current``,
journal line) goes through that process, so nothing is written by an operator who lost the lock.

The operator machine keeps a read-only copy of the last record it read (``<local dir>/cache``):
`inv status` and `inv history` show it, marked as such, when the state host cannot be reached;
nothing that changes the cluster runs from it.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import threading
import time
import weakref
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from pdops import __version__
from pdops.errors import InvalidInput, PdopsError, Refused, RemoteCommandFailed, Unreachable, Unverified
from pdops.facts import q
from pdops.runner import Say
from pdops.state import (
    Journal, RecordReads, Revision, StateDir, atomic_write, default_machine, default_operator, new_op_id, now_iso,
)

SCRIPT = (Path(__file__).parent / "hostscripts" / "record.py").read_text()
LEASE_S = 30.0  # the holder process on the state host gives up after this long without a word
PING_S = 5.0  # how often the operator's process says it is alive
REPLY_S = 60.0  # longest wait for one answer of the state host



# ---------------------------------------------------------------- reaching the state host

class _Lines:
    """Lines from a byte source read in chunks with a timeout (paramiko channel or pipe)."""

    def __init__(self, read_chunk: Callable[[float], bytes]):
        self._read = read_chunk
        self._buf = b""

    def readline(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer in {timeout:.0f} s")
            chunk = self._read(left)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode("utf-8")


class Session:
    """One `hold` process on the state host: JSON requests and answers, one per line, serialised
    between the operation's thread and the heartbeat."""

    def __init__(self, where: str, send: Callable[[bytes], None], read_chunk: Callable[[float], bytes],
                 close: Callable[[], None]):
        self.where = where
        self._send, self._lines, self._close = send, _Lines(read_chunk), close
        self._lock = threading.Lock()
        self.broken: str | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def first(self) -> dict:
        line = self._lines.readline(REPLY_S)
        if line is None:
            raise Unreachable(f"{self.where}: the state host ended the lock session before answering")
        return json.loads(line)

    def request(self, doc: dict) -> dict:
        with self._lock:
            if self.broken:
                raise Unreachable(f"lost the cluster lock: {self.broken}",
                                  fix="the operation stopped here; its journal says how far it got. Check "
                                      "`inv status` and `inv journal`, then run it again")
            try:
                self._send((json.dumps(doc) + "\n").encode("utf-8"))
                line = self._lines.readline(REPLY_S)
            except (OSError, EOFError, TimeoutError) as e:
                self.broken = f"{self.where}: the lock session failed: {e}"
                raise Unreachable(f"lost the cluster lock: {self.broken}") from None
            if line is None:
                self.broken = f"{self.where}: the state host ended the lock session"
                raise Unreachable(f"lost the cluster lock: {self.broken}",
                                  fix="someone may have run `inv unlock --force`; see `inv journal`")
        ans = json.loads(line)
        if not ans.get("ok"):
            raise Unverified(f"{self.where}: the state host refused {doc.get('op')!r}: {ans.get('message')}")
        return ans

    def start_heartbeat(self, every: float = PING_S) -> None:
        def beat():
            while not self._stop.wait(every):
                try:
                    self.request({"op": "ping"})
                except PdopsError:
                    return

        self._beat = threading.Thread(target=beat, name="pdops-lock-heartbeat", daemon=True)
        self._beat.start()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            try:
                self._close()
            except Exception:  # noqa: BLE001 - closing a dead session
                pass


class SSHTransport:
    """The host script over the state host's own SSH connection (not the operation's pool)."""

    def __init__(self, inv, host: str):
        from pdops.hosts import HostPool

        self.host = host
        self._pool = HostPool(inv)

    def _command(self, args: list[str]) -> str:
        return f"python3 -c {q(SCRIPT)} " + " ".join(q(a) for a in args)

    def call(self, args: list[str], timeout: float = REPLY_S) -> dict:
        try:
            res = self._pool.run(self.host, self._command(args), timeout=timeout)
        except Unreachable as e:  # say why, without the script the command carried
            why = e.message.rsplit("`: ", 1)[-1] if " running `" in e.message else e.message
            raise Unreachable(f"{self.host} cannot be reached over SSH: {why}") from None
        except RemoteCommandFailed as e:
            raise Unverified(f"{self.host}: the record script exited {e.returncode}", evidence=e.output[-1500:]) from None
        return _last_json(res.stdout, self.host)

    def open_session(self, args: list[str]) -> Session:
        try:
            conn = self._pool[self.host]
            conn.open()
            chan = conn.client.get_transport().open_session()
            chan.exec_command(self._command(args))
        except Exception as e:  # noqa: BLE001 - paramiko / socket errors: the host is not reachable
            raise Unreachable(f"{self.host}: cannot open the lock session: {type(e).__name__}: {e}") from None

        def read_chunk(timeout: float) -> bytes:
            chan.settimeout(timeout)
            try:
                return chan.recv(65536)
            except socket.timeout:
                raise TimeoutError(f"no answer in {timeout:.0f} s") from None

        return Session(self.host, chan.sendall, read_chunk, chan.close)

    def close(self) -> None:
        self._pool.close()


class LocalTransport:
    """The host script on this machine (the state host is the operator machine; unit tests)."""

    host = "localhost"

    def call(self, args: list[str], timeout: float = REPLY_S) -> dict:
        res = subprocess.run(["python3", "-c", SCRIPT, *args], capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise Unverified(f"the record script exited {res.returncode}", evidence=res.stderr[-1500:])
        return _last_json(res.stdout, self.host)

    def open_session(self, args: list[str]) -> Session:
        proc = subprocess.Popen(["python3", "-c", SCRIPT, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

        def send(data: bytes) -> None:
            proc.stdin.write(data)
            proc.stdin.flush()

        def read_chunk(timeout: float) -> bytes:
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            if not ready:
                raise TimeoutError(f"no answer in {timeout:.0f} s")
            return os.read(proc.stdout.fileno(), 65536)

        def close() -> None:
            proc.stdin.close()
            proc.wait(10)
            proc.stdout.close()

        return Session(self.host, send, read_chunk, close)

    def close(self) -> None:
        pass


def _last_json(stdout: str, host: str) -> dict:
    try:
        return json.loads(stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise Unverified(f"{host}: the record script gave no answer", evidence=stdout[-1000:]) from None


# ---------------------------------------------------------------- the shared record

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
    state = ("" if alive is None else "; its lock process on the state host is alive" if alive
             else "; its lock process on the state host is gone (the operation did not finish)")
    return (f"{h.get('operator')} on {h.get('machine')} running '{h.get('operation')}' ({h.get('op_id')}) since "
            f"{h.get('since')}" + (f", last heard from {seen} s ago" if seen is not None else "") + state)


def _docs(revs: dict) -> dict[int, dict]:
    """Revision docs keyed by number, as this pdops reads them (for comparing two records)."""
    return {int(n): asdict(Revision.from_dict(d)) for n, d in revs.items()}


class SharedRecord(RecordReads):
    """The record on the state host, read and written through the host script.

    ``path`` is this operator machine's own dir (builds, bench runs, the cache), never the record.
    Reads come from one snapshot per process (refreshed when the lock is taken); writes need the
    lock, and go through its session.
    """

    def __init__(self, cluster: str, local: str | os.PathLike, host: str, dir: str, transport, *,
                 cached_ok: bool = False):
        self.cluster = cluster
        self.path = Path(local)
        self.host, self.dir = host, dir
        self.transport = transport
        self.cached_ok = cached_ok
        self.cached: dict | None = None  # {fetched_at, reason} when reads come from the local cache
        self._snap: dict | None = None
        self._session: Session | None = None
        self._check_local_record = True
        self.cache_error: str | None = None
        weakref.finalize(self, transport.close)  # the state host's own connection goes with the record

    @property
    def location(self) -> str:
        return f"{self.host}:{self.dir}"

    @property
    def cache_file(self) -> Path:
        return self.path / "cache" / "record.json"

    def args(self, cmd: str, *more: str) -> list[str]:
        return [cmd, "--dir", self.dir, "--cluster", self.cluster, *more]

    def answer(self, doc: dict) -> dict:
        """An answer of the host script, or the one clear error it stands for."""
        if doc.get("ok"):
            return doc
        code, msg = doc.get("error"), doc.get("message")
        if code == "dir":
            raise InvalidInput("pdops_state.dir", f"on {self.host}: {msg}",
                               fix="use a directory only root can write (pdops creates it 0700)")
        if code == "newer":
            raise Refused(f"{self.location}: {msg}", fix="run the pdops version that wrote it; nothing was changed")
        if code == "cluster":
            raise InvalidInput("pdops_state.dir", f"on {self.host}: {msg}",
                               fix="give each cluster its own state dir")
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
            doc = self.answer(self.transport.call(self.args("snapshot")))
        except Unreachable as e:
            if self.cached_ok:
                return self._from_cache(e.message)
            raise Unreachable(f"the cluster's record is on {self.location}, and {e.message.rstrip('.')}",
                              fix="bring the state host back (or fix SSH to it); no change runs from this machine's "
                                  "cached copy. Nothing was changed") from None
        self._write_cache(doc)
        if self._check_local_record:
            self._check_local(doc)
        return doc

    def _write_cache(self, doc: dict) -> None:
        """Best effort: a machine that cannot keep the copy still reads and changes the record."""
        body = {k: v for k, v in doc.items() if k != "journal"}
        try:
            d = self.cache_file.parent
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o700)
            atomic_write(self.cache_file, json.dumps({"fetched_at": now_iso(), "location": self.location,
                                                      "snapshot": body}, sort_keys=True) + "\n")
            os.chmod(self.cache_file, 0o600)
        except OSError as e:
            self.cache_error = f"{self.cache_file}: {e.strerror}"

    def _from_cache(self, reason: str) -> dict:
        try:
            doc = json.loads(self.cache_file.read_text(encoding="utf-8"))
        except (FileNotFoundError, json.JSONDecodeError):
            raise Unreachable(f"the cluster's record is on {self.location}, and {reason}; this machine has no "
                              "cached copy of it", fix="bring the state host back (or fix SSH to it)") from None
        self.cached = {"fetched_at": doc.get("fetched_at"), "reason": reason}
        return doc["snapshot"]

    def cache_banner(self) -> str | None:
        if self.cached is None:
            return None
        return (f"READ-ONLY CACHED COPY of the record, fetched {self.cached['fetched_at']}: the state host "
                f"{self.host} cannot be reached ({self.cached['reason']}); no change can run until it can")

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
        return self.answer(self.transport.call(self.args("revision-snapshot", "--number", str(int(n))))).get("snapshot")

    # -- the operator machine's record from before the shared one
    def local_record(self) -> StateDir:
        return StateDir(self.cluster, self.path)

    def _check_local(self, doc: dict) -> None:
        local = self.local_record()
        mine = local.revision_numbers()
        if not mine:
            return
        theirs = doc.get("revisions") or {}
        desc_local = _summary(f"this machine ({local.path})", {n: asdict(local.read_revision(n)) for n in mine},
                              local.current())
        desc_shared = _summary(f"the state host ({self.location})", _docs(theirs), doc.get("current"))
        if not theirs:
            raise Refused(f"the record of cluster '{self.cluster}' is only on this machine, in {local.path}; the "
                          f"shared record on {self.location} is empty",
                          fix="run `inv state.push` to move it to the state host (under the cluster lock), then "
                              "run this again; nothing was changed", evidence=desc_local)
        same = _docs({str(n): asdict(local.read_revision(n)) for n in mine}) == _docs(theirs) \
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
             say: Say = print) -> "SharedLock":
        return SharedLock(self, operation, op_id=op_id, operator=operator, say=say)

    def close(self) -> None:
        self.transport.close()


def _summary(where: str, docs: dict[int, dict], current) -> str:
    lines = [f"{where}: current {current if current is not None else 'none'}"]
    for n in sorted(docs):
        d = docs[n]
        lines.append(f"  {n:4d}  {d.get('topology')}  {d.get('outcome')}  {d.get('created')}  {d.get('operator')}")
    return "\n".join(lines)


class SharedJournal(Journal):
    """The journal in the record: appended through the lock's session, read with one call."""

    def __init__(self, record: SharedRecord):
        super().__init__(Path(record.dir) / "journal.jsonl")
        self.record = record

    def _append(self, line: str) -> None:
        self.record._held("writing the journal").request({"op": "journal", "line": line})

    def _lines(self) -> list[str]:
        rec = self.record
        return rec.answer(rec.transport.call(rec.args("snapshot", "--journal"))).get("journal", [])


class SharedLock:
    """The cluster lock, held by a process on the state host for this operation's life."""

    def __init__(self, record: SharedRecord, operation: str, *, op_id: str | None = None,
                 operator: str | None = None, say: Say = print):
        self.record = record
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
            raise Unreachable(f"the state host {rec.host} cannot be reached ({rec.cached['reason']}): no change runs "
                              "from the cached copy of the record", fix="bring the state host back; nothing was changed")
        me = {"operator": self.operator, "machine": default_machine(), "operation": self.operation,
              "op_id": self.op_id, "client_pid": os.getpid(), "since": now_iso(), "pdops": __version__}
        sess = rec.transport.open_session(rec.args("hold", "--holder", json.dumps(me), "--lease", str(LEASE_S)))
        try:
            first = rec.answer(sess.first())
        except BaseException:
            sess.close()
            raise
        rec._session, rec._snap = sess, first["snapshot"]
        rec._write_cache(rec._snap)
        if rec._check_local_record:
            try:
                rec._check_local(first["snapshot"])
            except PdopsError:
                self.release()
                raise
        sess.start_heartbeat()
        self.held, self.holder = True, first["holder"]
        j = rec.journal()
        j.step(self.op_id, "lock.held", "ok", {k: self.holder.get(k) for k in (
            "operator", "machine", "operation", "client_pid", "ssh_client", "state_pid", "since")})
        prev = first.get("interrupted")
        if prev:
            self.interrupted = prev
            steps = [json.loads(x) for x in sess.request({"op": "journal-of", "op_id": prev.get("op_id")})["lines"]]
            last = steps[-1] if steps else {}
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


# ---------------------------------------------------------------- operator commands

def _push_conflict(record: SharedRecord, local: StateDir, mine: dict, cur, theirs: dict) -> None:
    """Refuse when the shared record already holds something other than this machine's."""
    if theirs and (theirs != _docs({str(n): d for n, d in mine.items()}) or record.current() != cur):
        raise Refused(f"the shared record on {record.location} already holds revisions that differ from this "
                      f"machine's ({local.path}); pdops will not guess which is right",
                      fix="compare both with what runs (`inv status`); nothing was changed",
                      evidence=_summary(f"this machine ({local.path})", mine, cur) + "\n"
                      + _summary(f"the state host ({record.location})", theirs, record.current()))


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
        theirs = _docs(record.snapshot().get("revisions") or {})
        _push_conflict(record, local, mine, cur, theirs)
        lines = local.journal()._lines()
        return {"pushed": 0, "message": (
            f"would copy revisions {nums[0]}..{nums[-1]} (current {cur}) and {len(lines)} journal lines from "
            f"{local.path} to {record.location}" + (" (it holds the same revisions already)" if theirs else "")
            + f", under the cluster lock; then move {local.path}'s copy aside\n"
            + _summary(f"this machine ({local.path})", mine, cur))}
    with record.lock("state-push", say=say) as lk:
        sess = record._session
        theirs = _docs(record.snapshot().get("revisions") or {})
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
        if _docs(after.get("revisions") or {}) != _docs({str(n): d for n, d in mine.items()}) \
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
    ans = record.answer(record.transport.call(record.args("unlock", "--by", json.dumps(by), "--reason", reason,
                                                          "--op-id", op)))
    was, ended = ans.get("was"), ans.get("ended")
    if not was:
        msg = f"cluster '{record.cluster}' was not locked; the forced unlock is journalled ({op})"
    else:
        msg = (f"took the lock of cluster '{record.cluster}' over from {describe_holder(was)}"
               + (f", ending its lock process {ended['pid']} on {record.host}" if ended else "")
               + f", and released it; journalled as {op} with your reason")
    return {"locked": bool(was), "was": was, "ended": ended, "op_id": op, "message": msg}


def operations(journal: Journal) -> list[dict]:
    """One row per operation in the journal: when, what, who (operator and machine), how it ended."""
    rows: dict[str, dict] = {}
    for r in journal.records():
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
