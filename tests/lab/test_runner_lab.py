"""`--dry-run` prints exactly what the runner walks: for a deploy, a scale, a drain and a
rollback on the lab, the ordered step ids in the real run's journal equal the dry-run's list
(parallel groups compared as sets)."""

from __future__ import annotations

import re

import pytest

from tests.lab.clusters import deployed, inv_cmd, record

pytestmark = pytest.mark.lab

_LINE = re.compile(r"^ {1,5}\d+\. (.+?) — ")  # a plan's own steps (a walked or may-run step is indented deeper)
_ALWAYS = re.compile(r"^\s+A\d+\. (.+?) — ")  # what runs last whatever the outcome
PARALLEL = "(in parallel with the rest of its group)"


def dry_run_ids(out: str) -> list:
    """The printed plan as [id | {ids of one parallel group}]."""
    seq: list = []
    for ln in out.splitlines():
        m = _LINE.match(ln)
        if not m:
            continue
        if PARALLEL in ln and seq and isinstance(seq[-1], set) and getattr(seq[-1], "open", True):
            seq[-1].add(m.group(1))
        elif PARALLEL in ln:
            seq.append({m.group(1)})
        else:
            seq.append(m.group(1))
    return seq


def journal_ids(state, kind: str) -> tuple[list[str], list[str]]:
    """(steps of the newest operation of `kind` as journalled, minus the lock's, plan and verdict; the plan
    record's ids, its `always` steps last)."""
    j = state.journal()
    op = [o for o in j.operations() if o.startswith(kind + "-")][-1]
    recs = [r for r in j.read(op) if not r["step"].startswith("lock.")]
    ev = recs[0]["evidence"]
    return [r["step"] for r in recs if r["step"] not in ("plan", "verdict")], ev["steps"] + ev.get("always", [])


def matches(printed: list, journalled: list[str]) -> bool:
    i = 0
    for item in printed:
        if isinstance(item, set):
            if set(journalled[i:i + len(item)]) != item:
                return False
            i += len(item)
        else:
            if i >= len(journalled) or journalled[i] != item:
                return False
            i += 1
    return i == len(journalled)


@pytest.fixture(scope="module")
def inv(lab, tmp_path_factory):
    # nothing deployed here: the first case is the deploy whose journal is checked
    profile = {"env": {"PDOPS_SIM_SHUTDOWN_POLL_S": "1"}}
    with deployed(lab, tmp_path_factory.mktemp("runner"), None, profile=profile) as c:
        yield c.inv_dir


@pytest.mark.parametrize("kind,args", [
    ("deploy", ["deploy", "--topology", "1p1d"]),
    ("scale", ["scale", "--topology", "2p1d"]),
    ("drain", ["drain", "--instance", "p02", "--interval", "1"]),
    ("rollback", ["rollback"]),
])
def test_the_journal_of_a_real_run_walks_exactly_the_dry_run(inv, kind, args):
    dry = inv_cmd(*args, "-i", str(inv), "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    printed = dry_run_ids(dry.stdout)
    assert printed, dry.stdout
    last = [m.group(1) for m in map(_ALWAYS.match, dry.stdout.splitlines()) if m]
    assert last == ["publish-targets"], dry.stdout  # every operation that moves `current` publishes its targets
    printed += last
    real = inv_cmd(*args, "-i", str(inv))
    assert real.returncode == 0, real.stdout + real.stderr
    walked, planned = journal_ids(record(inv), kind)
    assert matches(printed, walked), (printed, walked)
    assert planned == walked  # the plan record names the same steps, in the same order
