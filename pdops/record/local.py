"""A cluster's record: numbered revisions, the ``current`` pointer, the journal, the lock.

This module holds the formats (:class:`Revision`, journal lines), what every record answers
(:class:`RecordReads`) and :class:`StateDir`, a record in a local directory. The cluster's
record itself lives on its state host (:mod:`pdops.record`, docs/state.md); a StateDir is what
an operator machine held before that (moved by ``inv state.push``) and what unit tests use.
The same layout is kept on the state host::

    revisions/0001/revision.json   one immutable record per deployed topology
    current                        the number of the revision in force (moved only by set_current)
    journal.jsonl                  one JSON line per step of every operation (fsynced)
    lock                           the cluster lock: who holds it, for which operation
    lock.flock                     guards check-and-take of ``lock`` between local processes

A revision is written completely (temp file, fsync, rename) before ``current`` can point
at it, so a crash between the two leaves ``current`` at the previous revision.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import getpass
import json
import os
import socket
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdops.errors import InvalidInput, Refused, Unverified
from pdops.facts import procs
from pdops.record.journal import Journal, now_iso

DEFAULT_ROOT = "/var/lib/pdops-operator"
ENV_STATE_DIR = "PDOPS_STATE_DIR"


def local_dir(inv) -> Path:
    """This operator machine's own dir for the cluster `inv` (builds, bench runs, the record's
    cache): `$PDOPS_STATE_DIR`, else `pdops_state_dir`, else <lab dir>/state for a lab, else
    the default."""
    if os.environ.get(ENV_STATE_DIR):
        return Path(os.environ[ENV_STATE_DIR])
    if inv.vars.get("pdops_state_dir"):
        return Path(inv.vars["pdops_state_dir"])
    if inv.vars.get("pdops_lab_dir"):
        return Path(inv.vars["pdops_lab_dir"]) / "state"
    return Path(DEFAULT_ROOT) / inv.cluster


ENV_OPERATOR = "PDOPS_OPERATOR"


def default_operator() -> str:
    """Who runs pdops: ``$PDOPS_OPERATOR`` (e.g. an on-call engineer's name), else the login name."""
    if os.environ.get(ENV_OPERATOR):
        return os.environ[ENV_OPERATOR]
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def default_machine() -> str:
    """The operator machine pdops runs on (recorded beside the operator)."""
    return socket.gethostname()


def new_op_id(kind: str = "op") -> str:
    """A sortable, unique operation id, e.g. ``drain-20250101T120000Z-1a2b3c``."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{kind}-{stamp}-{uuid.uuid4().hex[:6]}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: str) -> None:
    """Write ``data`` to ``path`` via temp file + fsync + rename (+ fsync of the directory)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


@dataclass
class Revision:
    """One recorded deployment. ``instances``: {instance id: {hosts, units, worker_ids, ...}}."""

    number: int
    topology: str
    inventory_hash: str
    placement: dict
    manifest: dict  # {rendered path: sha256}
    instances: dict
    operator: str
    created: str
    outcome: str = "pending"  # pending | deployed | failed | rolled-back ...
    op_id: str | None = None
    extra: dict = field(default_factory=dict)
    machine: str = ""  # the operator machine it was made from ("" in records older than the shared record)

    @classmethod
    def from_dict(cls, d: dict) -> "Revision":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


class RecordReads:
    """What every record answers from its primitives (``current``, ``revision_numbers``,
    ``read_revision``): the current revision, the history, the rollback target."""

    def current(self) -> int | None:  # pragma: no cover - each record implements it
        raise NotImplementedError

    def revision_numbers(self) -> list[int]:  # pragma: no cover
        raise NotImplementedError

    def read_revision(self, n: int) -> Revision:  # pragma: no cover
        raise NotImplementedError

    def current_revision(self) -> Revision | None:
        n = self.current()
        return None if n is None else self.read_revision(n)

    def history(self) -> list[Revision]:
        """Every complete revision, oldest first."""
        return [self.read_revision(n) for n in self.revision_numbers()]

    def previous(self) -> Revision | None:
        """The newest revision before ``current`` whose outcome was deployed (rollback target)."""
        cur = self.current()
        for n in reversed(self.revision_numbers()):
            if cur is not None and n >= cur:
                continue
            rev = self.read_revision(n)
            if rev.outcome == "deployed":
                return rev
        return None

    def check_basis(self, planned: int | None) -> None:
        """Under the lock: refuse when ``current`` moved since the plan was made from ``planned``."""
        now = self.current()
        if now != planned:
            raise Refused(f"`current` moved from revision {planned} to {now} since this plan was made "
                          "(another operation ran in between)", fix="plan the change again; nothing was changed")

    @staticmethod
    def new_revision(n: int, *, topology: str, inventory_hash: str, placement: dict, manifest: dict,
                     instances: dict, operator: str | None, outcome: str, op_id: str | None,
                     extra: dict | None) -> Revision:
        return Revision(n, topology, inventory_hash, placement, manifest, instances, operator or default_operator(),
                        now_iso(), outcome, op_id, extra or {}, default_machine())


class StateDir(RecordReads):
    """A record in a local directory: the operator machine's own (before the shared record, and
    what `inv state.push` moves), and unit tests. Nothing is created until something is written."""

    def __init__(self, cluster: str, root: str | os.PathLike | None = None):
        if not cluster or "/" in cluster or cluster in (".", ".."):
            raise InvalidInput("cluster", f"{cluster!r} is not a usable cluster name",
                               fix="use a plain name such as 'lab' or 'prod-a'")
        self.cluster = cluster
        if root is not None:
            self.path = Path(root)
        elif os.environ.get(ENV_STATE_DIR):
            self.path = Path(os.environ[ENV_STATE_DIR])
        else:
            self.path = Path(DEFAULT_ROOT) / cluster

    # -- paths
    @property
    def revisions_dir(self) -> Path:
        return self.path / "revisions"

    @property
    def current_file(self) -> Path:
        return self.path / "current"

    def revision_file(self, n: int) -> Path:
        return self.revisions_dir / f"{int(n):04d}" / "revision.json"

    def ensure(self) -> None:
        self.revisions_dir.mkdir(parents=True, exist_ok=True)

    # -- revisions
    def revision_numbers(self) -> list[int]:
        """Numbers of complete revisions (a directory without revision.json is a crash leftover)."""
        if not self.revisions_dir.is_dir():
            return []
        nums = []
        for d in self.revisions_dir.iterdir():
            if d.name.isdigit() and (d / "revision.json").is_file():
                nums.append(int(d.name))
        return sorted(nums)

    def write_revision(
        self, *, topology: str, inventory_hash: str, placement: dict, manifest: dict,
        instances: dict, operator: str | None = None, outcome: str = "pending",
        op_id: str | None = None, extra: dict | None = None, snapshot: dict | None = None,
    ) -> Revision:
        """Record a new revision under the next free number. Does NOT move ``current``.
        `snapshot`: what a rollback needs to return to it (pdops.snapshot), kept beside it (0600)."""
        self.ensure()
        taken = {int(d.name) for d in self.revisions_dir.iterdir() if d.name.isdigit()}
        n = max(taken, default=0) + 1
        while True:  # mkdir is the atomic claim of a number
            try:
                (self.revisions_dir / f"{n:04d}").mkdir()
                break
            except FileExistsError:
                n += 1
        rev = self.new_revision(n, topology=topology, inventory_hash=inventory_hash, placement=placement,
                                manifest=manifest, instances=instances, operator=operator, outcome=outcome,
                                op_id=op_id, extra=extra)
        if snapshot is not None:
            path = self.revisions_dir / f"{n:04d}" / "snapshot.json"
            atomic_write(path, json.dumps(snapshot, sort_keys=True) + "\n")
            os.chmod(path, 0o600)
        atomic_write(self.revision_file(n), json.dumps(asdict(rev), indent=2, sort_keys=True) + "\n")
        return rev

    def revision_snapshot(self, n: int) -> dict | None:
        try:
            return json.loads((self.revisions_dir / f"{int(n):04d}" / "snapshot.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None

    def read_revision(self, n: int) -> Revision:
        path = self.revision_file(n)
        try:
            return Revision.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise InvalidInput("revision", f"no revision {n} in {self.revisions_dir}",
                               fix="see `inv history` for recorded revisions") from None
        except json.JSONDecodeError as e:
            raise Unverified(f"revision file {path} is not valid JSON: {e}") from e

    def set_outcome(self, n: int, outcome: str) -> Revision:
        """Record how the operation that wrote revision ``n`` ended."""
        rev = self.read_revision(n)
        rev.outcome = outcome
        atomic_write(self.revision_file(n), json.dumps(asdict(rev), indent=2, sort_keys=True) + "\n")
        return rev

    def current(self) -> int | None:
        """The revision in force, or None before the first deploy."""
        try:
            text = self.current_file.read_text().strip()
        except FileNotFoundError:
            return None
        if not text.isdigit():
            raise Unverified(f"{self.current_file} holds {text!r}, not a revision number")
        return int(text)

    def set_current(self, n: int) -> None:
        """Point ``current`` at revision ``n`` (must exist), atomically."""
        if not self.revision_file(n).is_file():
            raise InvalidInput("revision", f"no revision {n} to make current")
        atomic_write(self.current_file, f"{int(n)}\n")

    # -- journal and lock
    def journal(self) -> "Journal":
        return Journal(self.path / "journal.jsonl")

    def lock(self, operation: str, *, op_id: str | None = None, operator: str | None = None,
             say=None) -> "ClusterLock":
        """The local lock (one machine's processes only: the shared record's lock is pdops.record's)."""
        return ClusterLock(self, operation, op_id=op_id, operator=operator)


@dataclass(frozen=True)
class LockHolder:
    pid: int
    start_ticks: int | None
    boot_id: str
    host: str
    operator: str
    operation: str
    op_id: str | None
    since: str
    token: str

    def describe(self) -> str:
        return (f"{self.operator} (pid {self.pid} on {self.host}) running "
                f"'{self.operation}' since {self.since}")


class ClusterLock:
    """One operation at a time per cluster.

    The lock file is created with O_EXCL and holds the holder's pid, that pid's start
    time, host, operator, operation and since. A second holder gets :class:`Refused`
    naming the holder. A lock whose holder is on this host and whose pid is gone or now
    another process (start time differs) is stale: it is taken over, with a journal note.
    A ``flock`` on ``lock.flock`` serialises check-and-take between local processes.
    """

    def __init__(self, record: StateDir, operation: str, *, op_id: str | None = None,
                 operator: str | None = None, journal: Journal | None = None):
        self.record = record
        self.operation = operation
        self.op_id = op_id or new_op_id(operation)
        self.operator = operator or default_operator()
        self.journal = journal or record.journal()
        self.path = record.path / "lock"
        self._flock_path = record.path / "lock.flock"
        self._token = uuid.uuid4().hex
        self.held = False
        self.took_over: LockHolder | None = None

    # -- reading
    def holder(self) -> LockHolder | None:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            d = json.loads(text)
            return LockHolder(**{k: d.get(k) for k in LockHolder.__dataclass_fields__})
        except (json.JSONDecodeError, TypeError) as e:
            raise Unverified(f"lock file {self.path} is unreadable", evidence=text[-500:]) from e

    @staticmethod
    def is_stale(holder: LockHolder) -> bool:
        """True only if the holder is on this host and its process is provably gone or replaced."""
        if holder.host != socket.gethostname():
            return False  # cannot check another host's processes from here
        me_boot = procs.read_local(os.getpid())
        if me_boot and holder.boot_id and me_boot.boot_id and holder.boot_id != me_boot.boot_id:
            return True  # the machine rebooted since
        cur = procs.read_local(holder.pid)
        if cur is None:
            return True
        return holder.start_ticks is not None and cur.start_ticks != holder.start_ticks

    # -- taking
    def acquire(self) -> "ClusterLock":
        self.record.path.mkdir(parents=True, exist_ok=True)
        with open(self._flock_path, "a") as guard:
            fcntl.flock(guard.fileno(), fcntl.LOCK_EX)
            try:
                self._acquire_locked()
            finally:
                fcntl.flock(guard.fileno(), fcntl.LOCK_UN)
        return self

    def _acquire_locked(self) -> None:
        try:
            holder = self.holder()
        except Unverified:
            # under our flock nobody is writing it: a crash left it half-written
            holder = None
            self._takeover_note({"reason": "unreadable lock file",
                                 "content": self.path.read_text(errors="replace")[-500:]})
            self.path.unlink()
        if holder is not None:
            if not self.is_stale(holder):
                raise Refused(
                    f"cluster '{self.record.cluster}' is locked by {holder.describe()}",
                    fix=("wait for it to finish; if that operation is dead on another host, "
                         f"check it there and remove {self.path} by hand"),
                    evidence=json.dumps(asdict(holder), indent=2),
                )
            self._takeover_note({"reason": "stale lock: holder process gone or replaced",
                                 "stale_holder": asdict(holder)})
            self.took_over = holder
            self.path.unlink()
        me = procs.read_local(os.getpid())
        rec = LockHolder(
            pid=os.getpid(), start_ticks=me.start_ticks if me else None,
            boot_id=me.boot_id if me else "", host=socket.gethostname(),
            operator=self.operator, operation=self.operation, op_id=self.op_id,
            since=now_iso(), token=self._token,
        )
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            # only a process not honouring lock.flock can get here
            raise Refused(f"cluster '{self.record.cluster}' lock appeared while taking it") from None
        try:
            os.write(fd, (json.dumps(asdict(rec), indent=2) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self.held = True

    def _takeover_note(self, evidence: dict) -> None:
        self.journal.step(self.op_id, "lock.takeover", "note", evidence)

    def release(self) -> None:
        """Remove the lock file if it is still ours."""
        if not self.held:
            return
        with open(self._flock_path, "a") as guard:
            fcntl.flock(guard.fileno(), fcntl.LOCK_EX)
            try:
                try:
                    holder = self.holder()
                except Unverified:
                    holder = None
                if holder is not None and holder.token == self._token:
                    self.path.unlink()
            finally:
                fcntl.flock(guard.fileno(), fcntl.LOCK_UN)
        self.held = False

    def __enter__(self) -> "ClusterLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


__all__ = [
    "StateDir", "Revision", "ClusterLock", "LockHolder", "atomic_write",
    "new_op_id", "default_operator",
]
