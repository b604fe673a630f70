import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def fleet():
    from pdops.inventory import load_inventory

    return load_inventory(REPO / "inventory" / "rtx6000d")


@pytest.fixture
def lab_inv():
    from pdops.inventory import load_inventory

    return load_inventory(REPO / "inventory" / "lab")


@pytest.fixture
def local_record(tmp_path, monkeypatch):
    """`pdops.deploy.state_for` answering with a shared record whose state host is this machine
    (the real host script, run locally), its state dir and operator dir under tmp_path."""
    from pdops import deploy as dep
    from pdops.record import LocalTransport, SharedRecord

    def state_for(inv, **kw):
        return SharedRecord(inv.cluster, tmp_path / "operator", "localhost", str(tmp_path / "shared"),
                            LocalTransport(), **kw)

    monkeypatch.setattr(dep, "state_for", state_for)
    return state_for
