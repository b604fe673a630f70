"""RDMA facts (samples: tests/data/facts/rdma.source)."""

import shutil
import subprocess
from pathlib import Path

from pdops.facts import Skipped, rdma

DATA = Path(__file__).resolve().parents[2] / "data" / "facts"


def test_devinfo_ports():
    ports = rdma.parse_devinfo((DATA / "ibv_devinfo.txt").read_text())
    assert [(p.hca_id, p.port) for p in ports] == [("mlx5_0", 1), ("mlx5_1", 1)]
    assert ports[0].active and ports[0].link_layer == "Ethernet" and ports[0].active_mtu == 4096
    assert not ports[1].active and ports[1].state == "PORT_DOWN" and ports[1].link_layer == "InfiniBand"
    assert rdma.parse_devinfo("No IB devices found\n") == []


def test_gid_table_roce_v2_pick():
    gids = rdma.parse_gids((DATA / "rdma_gids_roce.txt").read_text())
    assert [g.index for g in gids] == [0, 1, 2, 3]  # all-zero slots dropped
    assert gids[3].type == "RoCE v2" and gids[3].ipv4 == "10.0.0.5"
    assert gids[0].link_local
    assert rdma.roce_v2_index(gids) == 3
    assert rdma.roce_v2_index(gids, ipv4="10.0.0.5") == 3
    assert rdma.roce_v2_index(gids, ipv4="10.0.0.6") is None


def test_link_local_only_has_no_usable_index():
    gids = rdma.parse_gids((DATA / "rdma_gids_linklocal_only.txt").read_text())
    assert len(gids) == 2 and all(g.link_local for g in gids)
    assert rdma.roce_v2_index(gids) is None


def _sh(cmd):
    return subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True).stdout


def test_gids_command_on_a_fake_sysfs_and_missing_device(tmp_path):
    port = tmp_path / "mlx5_0" / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "gid_attrs" / "types").mkdir(parents=True)
    for i, (gid, typ) in enumerate([("fe80:0000:0000:0000:ba3f:d2ff:fea1:b2c4", "IB/RoCE v1"),
                                    ("0000:0000:0000:0000:0000:ffff:0a00:0005", "RoCE v2"),
                                    (rdma.ZERO_GID, None)]):
        (port / "gids" / str(i)).write_text(gid + "\n")
        if typ:
            (port / "gid_attrs" / "types" / str(i)).write_text(typ + "\n")
    gids = rdma.parse_gids(_sh(rdma.gids_command("mlx5_0", 1, sysfs_root=str(tmp_path))))
    assert [(g.index, g.type) for g in gids] == [(0, "IB/RoCE v1"), (1, "RoCE v2")]
    assert rdma.roce_v2_index(gids) == 1
    assert isinstance(rdma.parse_gids(_sh(rdma.gids_command("mlx5_9", 1, str(tmp_path)))), Skipped)


def test_lsmod_peermem():
    mods = rdma.parse_lsmod((DATA / "lsmod.txt").read_text())
    assert "nvidia_peermem" in mods and "Module" not in mods
    assert rdma.has_peermem(mods)
    assert not rdma.has_peermem(mods - {"nvidia_peermem"})


def test_absent_ibv_devinfo_is_skipped(tmp_path):
    out = subprocess.run([shutil.which("sh"), "-c", rdma.devinfo_command()], capture_output=True,
                         text=True, check=True, env={"PATH": str(tmp_path)}).stdout
    assert isinstance(rdma.parse_devinfo(out), Skipped)
