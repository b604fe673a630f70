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
