"""How the tests themselves are written: each test folder mirrors a layer of pdops, helpers live in
helper modules (never imported from another test module), and one loop polls (pdops.sim.testing:
`poll`, and `wait_until` that fails naming what it waited for), so that every wait ends when what it
waits for is seen and says what it was."""

from __future__ import annotations

import ast
from collections import OrderedDict
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
TESTS = REPO / "tests"


def _modules():
    for p in sorted(TESTS.rglob("*.py")):
        yield p, p.read_text()


def test_no_test_polls_with_a_loop_of_its_own():
    """A `while` loop that reads the clock, sleeps or keeps a deadline is a polling loop written again:
    pdops.sim.testing.poll and wait_until are the one loop (with the deadline, the interval and the
    message)."""
    found = []
    for p, text in _modules():
        for n in ast.walk(ast.parse(text)):
            if isinstance(n, ast.While):
                src = ast.get_source_segment(text, n) or ""
                if any(s in src for s in ("monotonic()", "time.time()", "sleep(", "deadline")):
                    found.append(f"{p.relative_to(REPO)}:{n.lineno}")
    assert not found, found


def test_no_test_module_imports_from_another_test_module():
    found = []
    for p, text in _modules():
        for n in ast.walk(ast.parse(text)):
            mods = ([n.module or ""] if isinstance(n, ast.ImportFrom) else
                    [a.name for a in n.names] if isinstance(n, ast.Import) else [])
            found += [f"{p.relative_to(REPO)}:{n.lineno} {m}" for m in mods
                      if m.startswith("tests.") and m.rsplit(".", 1)[-1].startswith("test_")]
    assert not found, found


def test_the_unit_test_folders_are_the_layers_of_pdops():
    """tests/unit/<folder> is a layer (a folder of pdops) or `core` (runner, plans, kinds, errors,
    the layering): a test sits beside the tests of the code it exercises."""
    layers = {p.name for p in (REPO / "pdops").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    folders = {p.name for p in (TESTS / "unit").iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert folders - layers <= {"core"}, sorted(folders - layers - {"core"})


class _Node:
    """What xdist's scheduler uses of a worker: its id, the indexes it is sent, its shutdown."""

    def __init__(self, wid: str):
        self.gateway = type("Gateway", (), {"id": wid})()
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indexes):
        self.sent += indexes

    def shutdown(self):
        self.shutting_down = True


def _scheduling(lab_workers: int, nodes: list[_Node], collection: list[str]):
    from tests.conftest import LabWorkersFirst

    sched = object.__new__(LabWorkersFirst)  # its state set by hand: no pytest config to parse
    sched.lab_workers, sched.numnodes, sched.collection = lab_workers, len(nodes), None
    sched.workqueue, sched.assigned_work, sched.registered_collections = OrderedDict(), {}, {}
    sched.log = lambda *a: None
    sched.config = type("Config", (), {"option": type("Option", (), {"loadscopereorder": False})()})()
    for n in nodes:
        sched.add_node(n)
        sched.add_node_collection(n, collection)
    sched.schedule()
    return sched


def test_make_tests_light_worker_gets_no_lab_file_and_the_lab_workers_start_with_the_lab():
    """`make test`: gw0..gw(K-1) take the files in order (the lab's first); a worker numbered K or above
    takes only files of other areas, and stops when none is left rather than boot a lab."""
    collection = [f"tests/lab/test_{m}.py::t{i}" for m in "abc" for i in range(3)] + \
                 [f"tests/unit/test_{m}.py::t{i}" for m in "xy" for i in range(3)]
    gw0, gw1, gw2 = _Node("gw0"), _Node("gw1"), _Node("gw2")
    sched = _scheduling(2, [gw0, gw1, gw2], collection)
    files = {n.gateway.id: sorted({collection[i].split("::")[0].rsplit("/", 2)[-2] for i in n.sent}) for n in (gw0, gw1, gw2)}
    assert files == {"gw0": ["lab"], "gw1": ["lab"], "gw2": ["unit"]}, files
    # the light worker drains the other areas, then stops with lab files still waiting
    for _ in range(3):
        sched._reschedule(gw2)
        for scope in list(sched.assigned_work[gw2]):
            sched.assigned_work[gw2][scope] = {k: True for k in sched.assigned_work[gw2][scope]}
    assert all("/unit/" not in s for s in sched.workqueue) and gw2.shutting_down
    assert not any("/unit/" in collection[i] for n in (gw0, gw1) for i in n.sent)
    assert all(("/lab/" in collection[i]) for i in gw0.sent + gw1.sent)
