"""`inv state.etcd-up` whole (pdops.ops.record_store.operate_etcd_up), without hosts: under the cluster
lock when the record can take one; journalled on this machine, and said, when the record lives in the
very etcd being brought up; any other unreachable record is an error, nothing run."""

from __future__ import annotations

import pytest

from pdops.errors import Unreachable
from pdops.ops import record_store as rs


class Lock:
    def __init__(self, fails: bool, log: list):
        self.fails, self.log = fails, log

    def acquire(self):
        if self.fails:
            raise Unreachable("etcd: no member answers")
        self.log.append("acquired")
        return self

    def release(self):
        self.log.append("released")


class Record:
    def __init__(self, kind: str, fails: bool):
        self.store = type("Store", (), {"kind": kind})()
        self.log: list = []
        self._lock = Lock(fails, self.log)

    def lock(self, kind):
        self.log.append(f"lock {kind}")
        return self._lock


@pytest.fixture
def walked(monkeypatch):
    got = []
    monkeypatch.setattr(rs, "etcd_up", lambda inv, say, *, pool, journal_record: got.append(journal_record)
                        or {"op": "state-etcd-up-1", "verdict": {}})
    return got


def test_under_the_lock_the_walk_is_journalled_in_the_record(lab_inv, walked):
    record = Record("host", fails=False)
    rs.operate_etcd_up(lab_inv, record, say=lambda s: None, pool=None)
    assert walked == [record] and record.log == ["lock state-etcd-up", "acquired", "released"]


def test_the_record_in_the_etcd_being_brought_up_is_journalled_on_this_machine_and_said(lab_inv, walked, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setenv("PDOPS_STATE_DIR", str(tmp_path))
    said = []
    rs.operate_etcd_up(lab_inv, Record("etcd", fails=True), say=said.append, pool=None)
    assert len(walked) == 1 and str(walked[0].path).startswith(str(tmp_path / "etcd-up"))
    assert said and "no member answers" in said[0] and "journalled on this machine" in said[0]


def test_another_record_that_cannot_be_locked_is_an_error_and_nothing_runs(lab_inv, walked):
    with pytest.raises(Unreachable):
        rs.operate_etcd_up(lab_inv, Record("host", fails=True), say=lambda s: None, pool=None)
    assert walked == []
