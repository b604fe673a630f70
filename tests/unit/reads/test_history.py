"""`inv history` and `inv diff`: pure functions over a state dir."""

from __future__ import annotations

import socket

import pytest

from pdops.reads import history as hist
from pdops.errors import InvalidInput
from pdops.model.placement import place
from pdops.record.local import StateDir
from pdops.model.topology import parse_topology
from tests.unit.recorded import deployed


def record(inv, state, pl, **extra):
    return deployed(inv, state, pl=pl, instances={}, operator="bob@ops",
                    op_id=f"op-{len(state.revision_numbers()) + 1}", extra=extra)


@pytest.fixture
def revs(lab_inv, tmp_path):
    state = StateDir("lab", tmp_path / "s")
    p1 = place(lab_inv, parse_topology("2p1d"))
    record(lab_inv, state, p1)
    p2 = place(lab_inv, parse_topology("3p1d"), p1)
    record(lab_inv, state, p2, scale={"from_revision": 1, "added": ["p03"], "removed": []})
    record(lab_inv, state, p1, scale={"from_revision": 2, "added": [], "removed": ["p03"]}, rollback_of=1)
    return state


def test_history_lists_every_revision_with_the_current_marked(revs):
    rows = hist.history_rows(revs)
    here = socket.gethostname()  # each revision records the machine it was made from
    assert [(r["revision"], r["topology"], r["outcome"], r["operator"], r["machine"]) for r in rows] == [
        (1, "2p1d", "deployed", "bob@ops", here), (2, "3p1d", "deployed", "bob@ops", here),
        (3, "2p1d", "deployed", "bob@ops", here)]
    assert [r["current"] for r in rows] == ["", "", "*"]
    assert [r["change"] for r in rows] == ["deploy", "scale from 1 +p03", "rollback to 1 (from 2)"]
    assert rows[1]["op_id"] == "op-2" and rows[0]["created"]
    text = hist.format_history(revs)
    assert "REVISION" in text and "OPERATOR" in text and "MACHINE" in text and "(* = current" in text


def test_history_of_an_empty_state_dir(tmp_path):
    assert "no revision recorded yet" in hist.format_history(StateDir("lab", tmp_path / "none"))


def test_diff_names_added_instance_and_its_files(revs):
    d = hist.diff_revisions(revs, 1, 2)
    assert [r["instance"] for r in d["instances"]["added"]] == ["p03"]
    assert d["instances"]["removed"] == [] and d["instances"]["moved"] == []
    assert d["instances"]["unchanged"] == ["p01", "p02", "d01"]
    assert set(d["files"]) == {"lab04"}
    assert "/etc/systemd/system/pdops-p03.service" in d["files"]["lab04"]["added"]
    assert not d["inventory_changed"]
    text = hist.format_diff(d)
    assert "+ p03 (prefill) on lab04 slot 0" in text and "files on lab04:" in text


def test_diff_reverse_and_identical(revs):
    d = hist.diff_revisions(revs, 2, 3)
    assert [r["instance"] for r in d["instances"]["removed"]] == ["p03"]
    assert "/etc/pdops/pdops-p03.env" in d["files"]["lab04"]["removed"]
    same = hist.diff_revisions(revs, 1, 3)
    assert same["files"] == {} and "files: identical" in hist.format_diff(same)


def test_diff_shows_moved_instances_and_changed_files(lab_inv, revs):
    r1 = revs.read_revision(1)
    pl = r1.placement
    pl["instances"][0]["http_port"] = 31001
    mf = {h: dict(f) for h, f in r1.manifest.items()}
    path = next(iter(mf["lab01"]))
    mf["lab01"][path] = {"sha256": "0" * 64, "mode": "0o644"}
    r4 = revs.write_revision(topology="2p1d", inventory_hash="x", placement=pl, manifest=mf, instances={})
    d = hist.diff_revisions(revs, 1, r4.number)
    assert d["instances"]["moved"][0]["instance"] == "p01" and "port 31001" in d["instances"]["moved"][0]["to"]
    assert d["files"]["lab01"]["changed"] == [path] and d["inventory_changed"]
    assert "~ p01 moved" in hist.format_diff(d)


def test_diff_of_unknown_revision_is_invalid_input(revs):
    with pytest.raises(InvalidInput, match="no revision 7"):
        hist.diff_revisions(revs, 1, 7)
    with pytest.raises(InvalidInput, match="not a revision number"):
        hist.diff_revisions(revs, "one", 2)


def test_a_revision_from_before_the_shared_record_shows_its_operator_and_machine_apart():
    from pdops.record.local import Revision

    old = Revision.from_dict({"number": 1, "topology": "1p1d", "inventory_hash": "h", "placement": {},
                              "manifest": {}, "instances": {}, "operator": "alice@laptop-a", "created": "t"})
    assert hist._who(old) == ("alice", "laptop-a")


def test_history_names_a_halted_change_as_it_is_recorded_now_and_as_older_records_wrote_it(lab_inv, tmp_path):
    """A halted change's `partial` revision says it halted (`halted`); a record written before that says
    so with the error's text (`scale_failed`): `inv history` names both the same way."""
    state = StateDir("lab", tmp_path / "s")
    p1 = place(lab_inv, parse_topology("2p1d"))
    record(lab_inv, state, p1)
    record(lab_inv, state, p1, halted=True, from_revision=1, target="3p1d", drained=["p02"])
    record(lab_inv, state, p1, scale_failed="p03: not healthy", from_revision=2, target="3p1d", drained=["p02"])
    assert [r["change"] for r in hist.history_rows(state)][1:] == [
        "stopped midway from 1 towards 3p1d", "stopped midway from 2 towards 3p1d"]
