"""The record on an SSH state host: a directory written by pdops's host script
(pdops/hostscripts/record.py), the lock an ``flock`` held by that script for the operator's SSH
session. Answers are the script's own JSON documents (``{"ok": ...}``); the record turns an
error answer into the one clear error it stands for (:meth:`SharedRecord.answer`)."""

from __future__ import annotations

import json

from pdops.record.journal import tag_needles
from pdops.record.transport import Session


class HostStore:
    """One cluster's record in `dir` on `host`, reached through `transport` (SSH, or locally)."""

    kind = "state host"

    def __init__(self, cluster: str, host: str, dir: str, transport):
        self.cluster, self.host, self.dir = cluster, host, dir
        self.transport = transport

    @property
    def location(self) -> str:
        return f"{self.host}:{self.dir}"

    @property
    def name(self) -> str:
        """What a message names when the store cannot be reached."""
        return f"the state host {self.host}"

    @property
    def bring_back(self) -> str:
        """What a fix line tells the operator to do when the store cannot be reached."""
        return f"bring {self.name} back"

    def args(self, cmd: str, *more: str) -> list[str]:
        return [cmd, "--dir", self.dir, "--cluster", self.cluster, *more]

    def read(self) -> dict:
        """Revisions, `current` and the lock (no journal, no rollback snapshots)."""
        return self.transport.call(self.args("snapshot"))

    def revision_snapshot(self, n: int) -> dict:
        return self.transport.call(self.args("revision-snapshot", "--number", str(int(n))))

    def journal(self, *, op_id: str | None = None, last_ops: int | None = None, tag: str | None = None,
                everything: bool = False) -> dict:
        """Journal lines, paged and filtered on the state host (`lines`): one operation's, the last
        `last_ops` operations', the lines that may carry `tag` (checked exactly by the caller), or
        with `everything`, all of them."""
        more = []
        if op_id is not None:
            more += ["--op", op_id]
        if last_ops is not None:
            more += ["--last-ops", str(int(last_ops))]
        for needle in tag_needles(tag) if tag else ():
            more += ["--contains", needle]
        if not more and not everything:
            raise ValueError("a journal read names what it reads (op_id, last_ops, tag) or says everything")
        return self.transport.call(self.args("journal", *more))

    def hold(self, holder: dict, lease_s: float, *, even_if_moved: bool = False) -> Session:
        """Take the lock: a session whose first answer is the holder and the record, or who holds it.
        A record marked as moved (`inv state.migrate`) gives no lock unless `even_if_moved`."""
        return self.transport.open_session(self.args("hold", "--holder", json.dumps(holder), "--lease", str(lease_s),
                                                     *(["--even-if-moved"] if even_if_moved else [])))

    @staticmethod
    def journal_request(*, op_id=None, last_ops=None, tag=None) -> dict:
        """The same read as :meth:`journal`, as a request inside the lock's session."""
        return {"op": "journal-query", "op_id": op_id, "last_ops": last_ops,
                "contains": tag_needles(tag) if tag else []}

    def unlock(self, by: dict, reason: str, op_id: str) -> dict:
        """End a live holder's process (by recorded PID and start time), clear the lock, journal it."""
        return self.transport.call(self.args("unlock", "--by", json.dumps(by), "--reason", reason, "--op-id", op_id))

    def close(self) -> None:
        self.transport.close()
