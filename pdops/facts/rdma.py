"""RDMA facts: ``ibv_devinfo`` ports, the sysfs GID table, nvidia_peermem in ``lsmod``.

Formats: ibv_devinfo(1) (rdma-core), the kernel's sysfs ABI for InfiniBand
(Documentation/ABI/stable/sysfs-class-infiniband: ports/<port>/gids/<index> and
ports/<port>/gid_attrs/types/<index>, the latter "IB/RoCE v1" or "RoCE v2"; unused
entries read as all zeros and their type file cannot be read).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from pdops.errors import Unverified
from pdops.facts import Skipped, q, require_binary, skipped_in

ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


@dataclass(frozen=True)
class RdmaPort:
    hca_id: str
    port: int
    state: str  # PORT_ACTIVE, PORT_DOWN, ...
    link_layer: str  # Ethernet | InfiniBand
    active_mtu: int | None

    @property
    def active(self) -> bool:
        return self.state == "PORT_ACTIVE"


def devinfo_command() -> str:
    return require_binary("ibv_devinfo", "ibv_devinfo")


def parse_devinfo(output: str) -> list[RdmaPort] | Skipped:
    if (s := skipped_in(output)) is not None:
        return s
    if "No IB devices found" in output:
        return []
    ports, hca, cur = [], None, None

    def flush():
        if cur is not None:
            ports.append(RdmaPort(hca, cur["port"], cur.get("state", ""), cur.get("link_layer", ""),
                                  cur.get("active_mtu")))

    for line in output.splitlines():
        key, _, value = line.strip().partition(":")
        value = value.strip()
        if key == "hca_id":
            flush()
            hca, cur = value, None
        elif key == "port" and value.isdigit():
            flush()
            cur = {"port": int(value)}
        elif cur is not None and key == "state":
            cur["state"] = value.split()[0]
        elif cur is not None and key == "link_layer":
            cur["link_layer"] = value
        elif cur is not None and key == "active_mtu":
            cur["active_mtu"] = int(value.split()[0])
    flush()
    if hca is None:
        raise Unverified("ibv_devinfo printed no hca_id", evidence=output[-1000:])
    return ports


@dataclass(frozen=True)
class Gid:
    index: int
    gid: str
    type: str  # "RoCE v2" | "IB/RoCE v1" | ""

    @property
    def address(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Address(self.gid)

    @property
    def link_local(self) -> bool:
        return self.address.is_link_local

    @property
    def ipv4(self) -> str | None:
        mapped = self.address.ipv4_mapped
        return str(mapped) if mapped else None


def gids_command(device: str, port: int = 1, sysfs_root: str = "/sys/class/infiniband") -> str:
    """Print ``<index> <gid> <type>`` for every GID table entry of ``device``/``port``."""
    base = f"{sysfs_root}/{device}/ports/{int(port)}"
    return (
        f"d={q(base)}; [ -d \"$d/gids\" ] || {{ echo {q('PDOPS-SKIPPED: no ' + base)}; exit 0; }}; "
        "for f in \"$d\"/gids/*; do i=${f##*/}; "
        "printf '%s %s %s\\n' \"$i\" \"$(cat \"$f\" 2>/dev/null)\" "
        "\"$(cat \"$d/gid_attrs/types/$i\" 2>/dev/null)\"; done"
    )


def parse_gids(output: str) -> list[Gid] | Skipped:
    """Non-empty GID entries, by index (all-zero entries are empty slots)."""
    if (s := skipped_in(output)) is not None:
        return s
    out = []
    for line in output.splitlines():
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].isdigit():
            continue
        if parts[1] == ZERO_GID:
            continue
        out.append(Gid(int(parts[0]), parts[1], parts[2].strip() if len(parts) > 2 else ""))
    return sorted(out, key=lambda g: g.index)


def roce_v2_index(gids: list[Gid], ipv4: str | None = None) -> int | None:
    """The GID index for Mooncake/NCCL on RoCE (MC_GID_INDEX): a RoCE v2, non-link-local
    entry, the IPv4-mapped one (matching ``ipv4`` if given) preferred. None if only link-local."""
    cands = [g for g in gids if g.type == "RoCE v2" and not g.link_local]
    if ipv4:
        cands = [g for g in cands if g.ipv4 == ipv4]
    cands.sort(key=lambda g: (g.ipv4 is None, g.index))
    return cands[0].index if cands else None


LSMOD_COMMAND = "lsmod"


def parse_lsmod(output: str) -> set[str]:
    mods = set()
    for line in output.splitlines()[1:] if output.startswith("Module") else output.splitlines():
        m = re.match(r"^(\S+)\s+\d+", line)
        if m:
            mods.add(m.group(1))
    return mods


def has_peermem(modules: set[str]) -> bool:
    """GPUDirect RDMA needs nvidia_peermem (or the older nv_peer_mem)."""
    return bool({"nvidia_peermem", "nv_peer_mem"} & modules)
