"""nvidia-smi facts (samples: tests/data/facts/nvidia.source)."""

import shutil
import subprocess
from pathlib import Path

import pytest

from pdops.errors import Unverified
from pdops.facts import Skipped, nvidia

DATA = Path(__file__).resolve().parents[2] / "data" / "facts"


def test_gpus_keep_full_names_and_na():
    gpus = nvidia.parse_gpus((DATA / "nvidia_gpus.csv").read_text())
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].name == "NVIDIA RTX PRO 6000D Blackwell" and gpus[0].memory_total_mib == 85474
    assert gpus[1].pci_bus_id == "00000000:3D:00.0" and gpus[0].driver_version == "580.82.07"
    mixed = nvidia.parse_gpus((DATA / "nvidia_gpus_mixed.csv").read_text())
    assert mixed[1].name == "NVIDIA RTX 6000D"
    assert mixed[1].memory_total_mib is None and mixed[1].pci_bus_id is None
    assert nvidia.model_matches(mixed[0].name, "RTX PRO 6000D Blackwell")
    assert not nvidia.model_matches(mixed[1].name, "RTX PRO 6000D Blackwell")
    assert not nvidia.model_matches(mixed[0].name, "NVIDIA RTX 6000D")


def test_compute_apps_and_none():
    apps = nvidia.parse_apps((DATA / "nvidia_apps.csv").read_text())
    assert apps[0].pid == 41311 and apps[0].used_memory_mib == 79012
    assert apps[1].used_memory_mib is None and apps[1].process_name == "sglang::scheduler_TP1"
    assert nvidia.parse_apps((DATA / "nvidia_apps_none.txt").read_text()) == []
    assert nvidia.parse_apps("") == []


def test_topology_matrix_and_nic_affinity():
    t = nvidia.parse_topo((DATA / "nvidia_topo.txt").read_text())
    assert t.devices == ("GPU0", "GPU1", "GPU2", "GPU3", "NIC0", "NIC1")
    assert t.relation("GPU0", "NIC0") == "PIX" and t.relation("GPU1", "GPU1") == "X"
    assert t.nic_names == {"NIC0": "mlx5_0", "NIC1": "mlx5_1"}
    assert t.nics_by_closeness("GPU1") == [("mlx5_0", "PXB"), ("mlx5_1", "SYS")]
    assert t.nics_by_closeness("GPU3")[0] == ("mlx5_1", "PHB")
    assert t.cpu_affinity["GPU2"] == "48-95,144-191" and t.numa_affinity["GPU2"] == "1"


def test_driver_failure_is_unverified():
    with pytest.raises(Unverified):
        nvidia.parse_gpus("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n")
    with pytest.raises(Unverified):
        nvidia.parse_gpus("0, only two\n")


@pytest.mark.parametrize("cmd,parse", [
    (nvidia.gpus_command(), nvidia.parse_gpus),
    (nvidia.apps_command(), nvidia.parse_apps),
    (nvidia.topo_command(), nvidia.parse_topo),
])
def test_absent_binary_is_skipped_not_success(cmd, parse, tmp_path):
    # run for real with a PATH where nvidia-smi cannot be found
    sh = shutil.which("sh")
    out = subprocess.run([sh, "-c", cmd], capture_output=True, text=True, check=True,
                         env={"PATH": str(tmp_path)}).stdout
    res = parse(out)
    assert isinstance(res, Skipped) and "nvidia-smi" in res.reason
    assert not res  # a skipped check never reads as a pass
