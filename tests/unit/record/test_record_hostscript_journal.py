"""The record host script's paged journal (`journal` subcommand and `journal-query` request), run as
the real program: the state host filters the journal so that the operator fetches only what it
shows, however long the journal has grown."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pdops.errors import Unverified
from pdops.record import SCRIPT, LocalTransport

BLOCK = 65536  # the script's JOURNAL_BLOCK: it reads the journal backwards this many bytes at a time


def hold_args(d: Path) -> list[str]:
    return ["hold", "--dir", str(d), "--cluster", "lab", "--holder",
            json.dumps({"operator": "alice", "op_id": "test-hold"}), "--lease", "30"]


@pytest.fixture
def state(tmp_path) -> Path:
    """A state dir made by the script's own `hold` (taken and released), its journal still empty."""
    d = tmp_path / "shared"
    sess = LocalTransport().open_session(hold_args(d))
    try:
        assert sess.first()["ok"]
        assert sess.request({"op": "release"})["released"]
    finally:
        sess.close()
    assert (d / "format.json").is_file() and not (d / "journal.jsonl").exists()
    return d


def line(op_id: str, step: str, status: str = "ok", ascii_only: bool = True, **evidence) -> str:
    rec = {"ts": "2026-01-01T00:00:00Z", "op_id": op_id, "step": step, "status": status, "evidence": evidence}
    return json.dumps(rec, sort_keys=True, default=str, ensure_ascii=ascii_only)


def write(d: Path, lines: list[str], tail: str = "") -> Path:
    path = d / "journal.jsonl"
    path.write_bytes(("".join(x + "\n" for x in lines) + tail).encode("utf-8"))
    path.chmod(0o600)
    return path


def journal(d: Path, *args: str, cluster: str = "lab") -> dict:
    res = subprocess.run(["python3", "-c", SCRIPT, "journal", "--dir", str(d), "--cluster", cluster, *args],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert len(out) == 1, res.stdout[-2000:]
    return json.loads(out[0])


def op_id(n: int) -> str:
    return f"drain-20260101T0000{n:02d}Z-1a2b{n:02d}"


def five_ops() -> tuple[dict[str, list[str]], list[str]]:
    """Five operations; the fourth has many lines holding multibyte UTF-8, one longer than a block."""
    ops: dict[str, list[str]] = {op_id(i): [] for i in range(1, 6)}
    o1, o2, o3, o4, o5 = ops
    ops[o1] += [line(o1, "lock.held"), line(o1, "stop", node="d01"), line(o1, "verdict")]
    ops[o2] += [line(o2, "lock.held"), line(o2, "verdict", "failed", why="d02 did not drain")]
    ops[o3] += [line(o3, "lock.held")] + [line(o3, f"step-{i}") for i in range(3)] + [line(o3, "verdict")]
    ops[o4] += [line(o4, "lock.held")]
    ops[o4] += [line(o4, f"wait-{i}", "running", ascii_only=False, note="é😀€ü" * 40, i=i) for i in range(400)]
    ops[o4] += [line(o4, "big", ascii_only=False, blob="ß😀" * 30000)]  # 180 KB: one line over several blocks
    ops[o4] += [line(o4, "verdict", "failed", ascii_only=False, why="nœud d04 injoignable")]
    ops[o5] += [line(o5, "lock.held"), line(o5, "verdict")]
    order = ops[o1] + ops[o2] + ops[o3] + ops[o4] + ops[o5]
    return ops, order


def test_op_returns_exactly_that_operations_lines_in_order(state):
    ops, order = five_ops()
    o1, o2, o3, o4, o5 = ops
    # interleaved: a later line of o2 after o3's, and a line of another op naming o2 in its evidence
    order = order[:9] + [line(o2, "note", previous=o2), line(o3, "after", previous_op_id=o2)] + order[9:]
    write(state, order)
    got = journal(state, "--op", o2)
    assert got == {"ok": True, "lines": ops[o2] + [line(o2, "note", previous=o2)]}
    assert journal(state, "--op", o4)["lines"] == ops[o4]
    assert journal(state, "--op", "drain-nobody")["lines"] == []


def test_last_ops_returns_the_last_operations_complete_across_blocks_and_multibyte_characters(state):
    ops, order = five_ops()
    o1, o2, o3, o4, o5 = ops
    path = write(state, order)
    data = path.read_bytes()
    size = len(data)
    assert sum(len(x.encode()) + 1 for x in ops[o4]) > 3 * BLOCK
    # some block boundary (counted from the end) cuts a multibyte character of o4's lines in two
    cuts = [size - k * BLOCK for k in range(1, size // BLOCK + 1)]
    assert any(0x80 <= data[c] <= 0xBF for c in cuts), "no block boundary inside a UTF-8 character"
    got = journal(state, "--last-ops", "2")
    assert got["ok"] and got["lines"] == ops[o4] + ops[o5]
    assert journal(state, "--last-ops", "1")["lines"] == ops[o5]
    assert journal(state, "--last-ops", "3")["lines"] == ops[o3] + ops[o4] + ops[o5]
    assert journal(state, "--last-ops", "5")["lines"] == order
    assert journal(state, "--last-ops", "50")["lines"] == order
    assert journal(state, "--last-ops", "0")["lines"] == []


def test_a_torn_last_line_is_skipped(state):
    ops, order = five_ops()
    o1, o2, o3, o4, o5 = ops
    torn = line(op_id(6), "lock.held")[:40]  # a crash mid-write: no end, no newline
    write(state, order, tail=torn)
    assert journal(state, "--last-ops", "1")["lines"] == ops[o5]
    assert journal(state, "--last-ops", "2")["lines"] == ops[o4] + ops[o5]
    assert journal(state, "--op", op_id(6))["lines"] == []
    assert journal(state, "--op", o5)["lines"] == ops[o5]
    # no filter: every line, the torn one too, as `snapshot --journal` gives them
    assert journal(state)["lines"] == order + [torn]


def test_contains_filters_with_and_and_combines_with_op_and_last_ops(state):
    ops, order = five_ops()
    o1, o2, o3, o4, o5 = ops
    write(state, order)
    verdicts = [x for x in order if '"step": "verdict"' in x]
    assert len(verdicts) == 5
    assert journal(state, "--contains", '"step": "verdict"')["lines"] == verdicts
    failed = [ops[o2][-1], ops[o4][-1]]
    assert journal(state, "--contains", '"step": "verdict"', "--contains", '"status": "failed"')["lines"] == failed
    assert journal(state, "--contains", "injoignable")["lines"] == [ops[o4][-1]]  # multibyte needle and line
    assert journal(state, "--contains", "verdict", "--contains", "nowhere")["lines"] == []
    assert journal(state, "--op", o2, "--contains", '"status": "failed"')["lines"] == [ops[o2][-1]]
    assert journal(state, "--op", o2, "--contains", '"step": "lock.held"')["lines"] == [ops[o2][0]]
    assert journal(state, "--last-ops", "2", "--contains", '"step": "verdict"')["lines"] == [ops[o4][-1], ops[o5][-1]]
    assert journal(state, "--last-ops", "2", "--op", o4, "--contains", '"step": "wait-39"')["lines"] == [ops[o4][40]]
    assert journal(state, "--last-ops", "2", "--op", o1)["lines"] == []


def test_no_state_dir_no_journal_or_another_clusters_record(tmp_path, state):
    assert journal(tmp_path / "nowhere", "--last-ops", "3") == {"ok": True, "lines": [], "total_lines": None}
    assert not (tmp_path / "nowhere").exists()  # a read creates nothing
    assert journal(state, "--last-ops", "3") == {"ok": True, "lines": []}
    assert journal(state, "--op", "x", "--contains", "y") == {"ok": True, "lines": []}
    write(state, [line(op_id(1), "verdict")])
    got = journal(state, "--last-ops", "1", cluster="prod-a")
    assert not got["ok"] and got["error"] == "cluster" and "lines" not in got
    got = journal(state, "--last-ops", "-1")
    assert not got["ok"] and got["error"] == "request"


def test_journal_query_inside_a_hold_session(state):
    ops, order = five_ops()
    o1, o2, o3, o4, o5 = ops
    write(state, order)
    sess = LocalTransport().open_session(hold_args(state))
    try:
        assert sess.first()["ok"]
        assert sess.request({"op": "journal-query", "op_id": o2}) == {"ok": True, "lines": ops[o2]}
        assert sess.request({"op": "journal-query", "last_ops": 2})["lines"] == ops[o4] + ops[o5]
        assert sess.request({"op": "journal-query", "op_id": None, "last_ops": 3,
                             "contains": ['"step": "verdict"']})["lines"] == [ops[o3][-1], ops[o4][-1], ops[o5][-1]]
        assert sess.request({"op": "journal-query"})["lines"] == order
        with pytest.raises(Unverified, match="last_ops"):
            sess.request({"op": "journal-query", "last_ops": "two"})
        with pytest.raises(Unverified, match="contains"):
            sess.request({"op": "journal-query", "contains": "verdict"})
        # the session survived the refusals, and what it appends is found at once
        sess.request({"op": "journal", "line": line("test-hold", "lock.held")})
        assert sess.request({"op": "journal-query", "last_ops": 1})["lines"] == [line("test-hold", "lock.held")]
        assert sess.request({"op": "journal-of", "op_id": o5})["lines"] == ops[o5]
        assert sess.request({"op": "release"})["released"]
    finally:
        sess.close()


def test_last_ops_on_a_20_mb_journal(state):
    per_op, n_ops = 100, 600
    pad = "x" * 260
    path = state / "journal.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for o in range(n_ops):
            oid = op_id(o % 100) + f"-{o:04d}"
            for i in range(per_op):
                f.write(line(oid, f"step-{i}", pad=pad, i=i) + "\n")
    path.chmod(0o600)
    assert path.stat().st_size > 20_000_000
    text = path.read_text(encoding="utf-8").splitlines()
    assert len(text) == per_op * n_ops
    got = journal(state, "--last-ops", "3")
    assert got["ok"] and got["lines"] == text[-3 * per_op:]
    mid = op_id(0) + "-0300"
    assert journal(state, "--op", mid)["lines"] == text[300 * per_op:301 * per_op]
