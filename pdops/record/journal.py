"""The journal's format and its local file: one JSON line per step of every operation (written,
flushed and fsynced; a torn last line is skipped), what a line is found by besides its operation
(its tags), and reading the last operations. The shared record's journal (pdops.record.shared) pages
the same lines on the state host or in etcd."""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


TAGGED_STEPS = ("probe-result", "probe-note")  # the probe table's records


def journal_tags(rec: dict) -> list[str]:
    """What a journal record is found by besides its operation: `step:<name>` for the probe
    table's steps, `stop:<instance>` for a stop's verification (its survivors). A store keeps an
    index of each tag (etcd), or filters on them where the record is (the state host)."""
    tags = [f"step:{rec['step']}"] if rec.get("step") in TAGGED_STEPS else []
    ev = rec.get("evidence")
    if isinstance(ev, dict) and isinstance(ev.get("instance"), str) and isinstance(ev.get("survivors"), list):
        tags.append(f"stop:{ev['instance']}")
    return tags


def tag_needles(tag: str) -> list[str]:
    """Substrings every line with `tag` contains (lines are `json.dumps(sort_keys=True)`): what the
    state host filters on before the exact check here."""
    kind, _, val = tag.partition(":")
    if kind == "step":
        return [f'"step": {json.dumps(val)}']
    if kind == "stop":
        return [f'"instance": {json.dumps(val)}', '"survivors": [']
    raise ValueError(f"unknown journal tag {tag!r}")


def parse_lines(lines) -> list[dict]:
    """Journal records from lines; a torn line (crash mid-write) is skipped."""
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def last_operations(records: list[dict], n: int) -> list[dict]:
    """The records of the last `n` operations (by first appearance), in order."""
    ops: dict = {}
    for r in records:
        ops.setdefault(r.get("op_id"), None)
    keep = set(list(ops)[-n:]) if n > 0 else set()
    return [r for r in records if r.get("op_id") in keep]


class Journal:
    """Append-only JSONL of operation steps. Each line is written, flushed and fsynced.

    Reads: :meth:`read` (one operation), :meth:`last_operations`, :meth:`tagged` (see
    :func:`journal_tags`) read only what they return where the store allows it (the shared
    record's journal pages on the state host or in etcd); :meth:`records` reads everything."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def step(self, op_id: str, name: str, status: str, evidence: dict | None = None, **extra) -> dict:
        """Append one step record and return it."""
        rec = {"ts": now_iso(), "op_id": op_id, "step": name, "status": status,
               "evidence": evidence or {}}
        rec.update(extra)
        self._append(json.dumps(rec, sort_keys=True, default=str), journal_tags(rec))
        return rec

    def _append(self, line: str, tags: list[str] = ()) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: concurrent writers never interleave within one line (single write call)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (line + "\n").encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)

    def _lines(self) -> list[str]:
        if not self.path.exists():
            return []
        return self.path.read_text(encoding="utf-8").splitlines()

    def records(self) -> list[dict]:
        """Every record; a torn last line (crash mid-write) is skipped."""
        return parse_lines(self._lines())

    def read(self, op_id: str) -> list[dict]:
        """The steps of one operation, in order."""
        return [r for r in self.records() if r.get("op_id") == op_id]

    def last_operations(self, n: int) -> list[dict]:
        """The records of the last `n` operations, in order."""
        return last_operations(self.records(), n)

    def tagged(self, tag: str) -> list[dict]:
        """The records with `tag` (:func:`journal_tags`), in order."""
        return [r for r in self.records() if tag in journal_tags(r)]

    def operations(self) -> list[str]:
        """Operation ids in order of first appearance."""
        seen: dict[str, None] = {}
        for r in self.records():
            seen.setdefault(r.get("op_id"), None)
        return list(seen)
