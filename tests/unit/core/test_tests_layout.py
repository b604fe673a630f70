"""How the tests themselves are written: each test folder mirrors a layer of pdops, helpers live in
helper modules (never imported from another test module), and one loop polls (pdops.sim.testing:
`poll`, and `wait_until` that fails naming what it waited for), so that every wait ends when what it
waits for is seen and says what it was."""

from __future__ import annotations

import ast
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
