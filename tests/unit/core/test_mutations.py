"""`make mutate` stays applicable: a guard that runs in every `make test`, with no lab.

`make mutate` is slow (it boots the lab), so nothing ran it and its list went stale when the
code moved. Here, for each mutation: its function is defined exactly once under pdops/, the
mutation applies and still compiles, and every test it names exists. A failure names the
mutation and the fix (update MUTATIONS in scripts/mutate.py).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("pdops_mutate", REPO / "scripts" / "mutate.py")
mutate = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = mutate  # dataclasses look their module up there
_spec.loader.exec_module(mutate)

IDS = [m.verifier.split(":")[0] for m in mutate.MUTATIONS]


@pytest.mark.parametrize("m", mutate.MUTATIONS, ids=IDS)
def test_each_mutation_applies_once_and_still_compiles(m):
    try:
        path, original, text = mutate.mutated_text(m)
    except mutate.NotApplicable as exc:
        pytest.fail(str(exc))
    assert text != original
    assert path.read_text() == original  # checking applies nothing to the file


@pytest.mark.parametrize("m", mutate.MUTATIONS, ids=IDS)
def test_each_test_a_mutation_names_exists(m):
    assert m.tests, f"{m.verifier}: names no test that catches it; update MUTATIONS in scripts/mutate.py"
    for test in m.tests:
        file, _, name = test.partition("::")
        path = REPO / file
        assert path.is_file(), f"{m.verifier}: {file} does not exist; update MUTATIONS in scripts/mutate.py"
        if name:
            defined = {n.name for n in ast.parse(path.read_text()).body
                       if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            assert name in defined, f"{m.verifier}: {file} defines no {name}; update MUTATIONS in scripts/mutate.py"


def test_a_renamed_or_duplicated_function_is_named_with_the_fix(tmp_path):
    pkg = tmp_path / "pdops"
    pkg.mkdir()
    (pkg / "a.py").write_text("class StopEvidence:\n    def verified(self):\n        return False\n")
    (pkg / "b.py").write_text("class StopEvidence:\n    def verified(self):\n        return False\n")
    m = mutate.Mutation("stop", "StopEvidence.verified", ("x",), body="return True")
    with pytest.raises(mutate.NotApplicable, match="defined 2 times.*update MUTATIONS"):
        mutate.mutated_text(m, tmp_path)
    (pkg / "b.py").unlink()
    path, _, text = mutate.mutated_text(m, tmp_path)
    assert "return True" in text and "return False" not in text
    gone = mutate.Mutation("walk", "walk", ("x",), old="verified +=", new="x")
    with pytest.raises(mutate.NotApplicable, match="defined 0 times"):
        mutate.mutated_text(gone, tmp_path)
