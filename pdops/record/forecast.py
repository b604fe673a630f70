"""A forecast of a record: what it will hold after plans not yet walked have recorded their revisions.

`inv sweep` prints every row's change before the first runs, and each row after the first starts
from the revision the row before it is to record. A :class:`Forecast` reads through to the real
record and holds, in memory, the revisions written to it: the row's planner reads it as it reads
a record (`current_revision`, `revision_snapshot`), and the row's own record function writes to it
what it will write to the real one. Nothing is ever written to the real record through it.

What a forecast revision cannot know is what only running gives: the gateway's worker ids, the
processes' MainPIDs, the build folder. They are left out (None), so a plan made from it names a
worker "by its URL" where the real one will name its id. Its revision numbers follow the record's
last complete one; the record may give another (a crash's leftover folder takes a number). A
forecast plan is printed, never walked: when its row starts, the row is planned again from the real
record and walked only if it is the printed one (pdops.ops.sweep.rows).
"""

from __future__ import annotations

from pdops.record.local import RecordReads, Revision


class Forecast(RecordReads):
    """The record `base` as it will be after the revisions written here (in memory, never to `base`)."""

    def __init__(self, base: RecordReads):
        self.base = base
        self._current = base.current()
        self._revisions: dict[int, Revision] = {}
        self._snapshots: dict[int, dict | None] = {}

    def is_forecast(self, n: int | None) -> bool:
        """Whether revision `n` exists only in this forecast."""
        return n in self._revisions

    def current(self) -> int | None:
        return self._current

    def revision_numbers(self) -> list[int]:
        return sorted(set(self.base.revision_numbers()) | set(self._revisions))

    def read_revision(self, n: int) -> Revision:
        return self._revisions[n] if n in self._revisions else self.base.read_revision(n)

    def revision_snapshot(self, n: int) -> dict | None:
        return self._snapshots[n] if n in self._revisions else self.base.revision_snapshot(n)

    def write_revision(self, *, topology: str, inventory_hash: str, placement: dict, manifest: dict,
                       instances: dict, operator: str | None = None, outcome: str = "pending",
                       op_id: str | None = None, extra: dict | None = None, snapshot: dict | None = None) -> Revision:
        n = max(self.revision_numbers() + [self._current or 0], default=0) + 1
        self._revisions[n] = self.new_revision(n, topology=topology, inventory_hash=inventory_hash,
                                               placement=placement, manifest=manifest, instances=instances,
                                               operator=operator, outcome=outcome, op_id=op_id, extra=extra)
        self._snapshots[n] = snapshot
        return self._revisions[n]

    def set_current(self, n: int) -> None:
        self.read_revision(n)  # InvalidInput when it exists neither here nor in the base
        self._current = n
