"""`inv admission.keys` without hosts: the map round trip, and what it refuses before any host."""

from pathlib import Path

import pytest
import yaml

from pdops.model import admission as adm
from pdops.ops import admission_keys as ops
from pdops.errors import InvalidInput, Refused
from pdops.model.inventory import load_inventory, single_file_doc

REPO = Path(__file__).resolve().parents[3]
KEYS = ("pdops-key-one-0123456789", "Zm9vYmFyYmF6cXV4Cg==", "a.b_c~d+e/f=g-h0123456")


def test_parse_map_reads_back_the_rendered_map():
    assert ops.parse_map(adm.keys_map(KEYS)) == KEYS
    assert ops.parse_map("") == ()


def _inv(tmp_path, admission: dict | None):
    doc = single_file_doc(REPO / "inventory" / "lab")
    doc["all"]["vars"]["pdops_state_dir"] = str(tmp_path / "state")
    if admission is not None:
        doc["all"]["vars"]["pdops_admission"] = admission
    (tmp_path / "inv").mkdir()
    (tmp_path / "inv" / "hosts.yml").write_text(yaml.safe_dump(doc))
    return load_inventory(tmp_path / "inv")


def test_refuses_an_inventory_without_admission(tmp_path):
    with pytest.raises(InvalidInput, match="no admission layer"):
        ops.rotate_keys(_inv(tmp_path, None), None, say=lambda s: None, pool=None)


def test_refuses_a_key_file_readable_by_others_before_touching_a_host(tmp_path):
    kf = tmp_path / "k"
    kf.write_text(KEYS[0] + "\n")
    kf.chmod(0o644)
    with pytest.raises(InvalidInput, match="mode 0644"):
        ops.rotate_keys(_inv(tmp_path, {"api_keys_file": str(kf)}), None, say=lambda s: None, pool=None)


def test_refuses_a_cluster_never_deployed(tmp_path, local_record):
    kf = tmp_path / "k"
    kf.write_text(KEYS[0] + "\n")
    kf.chmod(0o600)
    inv = _inv(tmp_path, {"api_keys_file": str(kf)})
    with pytest.raises(Refused, match="no deployed revision"):
        ops.rotate_keys(inv, local_record(inv), say=lambda s: None, pool=None)
