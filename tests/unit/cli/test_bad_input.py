"""Operator mistakes, one data file each (tests/data/bad_input/*.yml): every one gets one
clear message naming the field, a non-zero exit, no traceback, and nothing written."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
CASES = sorted((REPO / "tests" / "data" / "bad_input").glob("*.yml"))
# the reference fleet in the single-file form (every setting in hosts.yml), an Ansible layout too
INV = REPO / "tests" / "data" / "inventory" / "rtx6000d-single" / "hosts.yml"
PROFILE = REPO / "pdops" / "profiles" / "deepseek-flash-160k.yml"


def _set(doc: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        doc = doc[k]
    doc[keys[-1]] = value


def _deep_update(d: dict, u: dict) -> None:
    for k, v in u.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            _deep_update(d[k], v)
        else:
            d[k] = v


def make_inventory(case: dict, where: Path) -> Path:
    where.mkdir(parents=True)
    text = INV.read_text()
    if "raw_replace" in case:
        old, new = case["raw_replace"]
        assert old in text
        text = text.replace(old, new)
    else:
        doc = yaml.safe_load(text)
        for k, v in (case.get("set") or {}).items():
            _set(doc, k, copy.deepcopy(v))
        if "profile_set" in case:
            prof = yaml.safe_load(PROFILE.read_text())
            _deep_update(prof, case["profile_set"])
            (where / "custom-profile.yml.d").mkdir()
            (where / "custom-profile.yml.d" / "p.yml").write_text(yaml.safe_dump(prof))
            doc["all"]["vars"]["pdops_profile"] = "custom-profile.yml.d/p.yml"
        if "raw_append" in case:
            doc["all"].setdefault("children", {}).update(yaml.safe_load(case["raw_append"]))
        text = yaml.safe_dump(doc, sort_keys=False)
    (where / "hosts.yml").write_text(text)
    return where


@pytest.mark.parametrize("case_file", CASES, ids=[c.stem for c in CASES])
def test_bad_input_is_refused_before_anything_is_written(case_file, tmp_path):
    case = yaml.safe_load(case_file.read_text())
    inv = make_inventory(case, tmp_path / "inv")
    out = tmp_path / "build"
    proc = subprocess.run([sys.executable, "-m", "invoke", "render", "--topology", str(case["topology"]),
                           "-i", str(inv), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert case["expect"] in proc.stderr, proc.stderr
    assert proc.stderr.startswith("invalid input: ")
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "fix:" in proc.stderr
    assert not out.exists()


def test_the_reference_inventory_itself_renders(tmp_path):
    """Guards the cases above: they fail because of their one change, not the base."""
    inv = make_inventory({}, tmp_path / "inv")
    proc = subprocess.run([sys.executable, "-m", "invoke", "render", "--topology", "8p4d", "-i", str(inv),
                           "--out", str(tmp_path / "build")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "build" / "manifest.json").is_file()
