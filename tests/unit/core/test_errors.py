"""One error hierarchy, one exit-status table: every status means one thing, and the README's
table says exactly what pdops/errors.py does."""

import importlib
import pkgutil
import re
from pathlib import Path

import pdops
from pdops.errors import PdopsError, exit_statuses

README = Path(__file__).resolve().parents[3] / "README.md"


def _import_all():
    for m in pkgutil.walk_packages(pdops.__path__, "pdops."):
        if m.name.endswith("__main__"):  # scripts, not libraries
            continue
        importlib.import_module(m.name)


def _classes(root):
    out, todo = [], [root]
    while todo:
        c = todo.pop()
        out.append(c)
        todo += c.__subclasses__()
    return out


def test_every_error_class_lives_in_errors_py_or_keeps_its_parents_status():
    _import_all()
    for cls in _classes(PdopsError):
        if "exit_code" in cls.__dict__:
            assert cls.__module__ == "pdops.errors", f"{cls.__qualname__} sets an exit status outside pdops/errors.py"


def test_readme_exit_table_equals_the_hierarchy():
    _import_all()
    rows = re.findall(r"^\| (\d+) \| ([^|]+?)(?: \(.*\))? \|$", README.read_text(), re.M)
    assert {int(k): v.strip() for k, v in rows} == exit_statuses()
