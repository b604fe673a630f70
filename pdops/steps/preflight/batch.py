"""The shell batch protocol: every host gets ONE command (one SSH round trip); each section's
output is cut out of it, framed by markers with its exit code, and given to its parser."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pdops.errors import PdopsError
from pdops.facts import nvidia, rdma, split_sections
from pdops.facts import ports as port_facts
from pdops.facts import systemd as systemd_facts
from pdops.model.inventory import Host, Inventory
from pdops.model.placement import Placement
from pdops.facts.host import ReadError, disk_command, gpudirect_command, memlock_command, parse_df, parse_gpudirect, parse_memlock, parse_pids, parse_time, parse_versions, pids_command, time_command, versions_command
from pdops.steps.preflight.expected import expected_units

@dataclass(frozen=True)
class Section:
    name: str
    command: Callable[[Inventory, Host, Placement | None], str]
    parse: Callable[[str], Any]


def _units_command(inv: Inventory, host: Host, pl: Placement | None) -> str:
    units = expected_units(inv, host, pl)
    return systemd_facts.command(*units) if units else "true"


SECTIONS: dict[str, Section] = {s.name: s for s in (
    Section("gpus", lambda i, h, p: nvidia.gpus_command(), nvidia.parse_gpus),
    Section("apps", lambda i, h, p: nvidia.apps_command(), nvidia.parse_apps),
    Section("topo", lambda i, h, p: nvidia.topo_command(), nvidia.parse_topo),
    Section("devinfo", lambda i, h, p: rdma.devinfo_command(), rdma.parse_devinfo),
    Section("gpudirect", lambda i, h, p: gpudirect_command(), parse_gpudirect),
    Section("listen", lambda i, h, p: port_facts.command(), port_facts.parse),
    Section("pids", lambda i, h, p: pids_command(), parse_pids),
    Section("units", _units_command, systemd_facts.parse_by_id),
    Section("memlock", lambda i, h, p: memlock_command(), parse_memlock),
    Section("time", lambda i, h, p: time_command(), parse_time),
    Section("disk", lambda i, h, p: disk_command(), parse_df),
    Section("versions", lambda i, h, p: versions_command(i.engine_python, torch_nccl=not i.virtual_hardware),
            parse_versions),
    # the gateway's own environment (smg, no SGLang), read on the gateway host only
    Section("gateway-versions", lambda i, h, p: versions_command(i.gateway.python, torch_nccl=False, need="smg"),
            parse_versions),
)}


def gid_section(nic_device: str) -> Section:
    """One GID table per RoCE device (port 1, as Mooncake's MC_IB_PORT default)."""
    return Section(f"gids:{nic_device}", lambda i, h, p: rdma.gids_command(nic_device, 1), rdma.parse_gids)


def parse_sections(output: str, sections: dict[str, Section]) -> dict[str, Any]:
    """Parse each section of a batch output; a section that failed or did not parse is a ReadError."""
    raw = split_sections(output)
    facts: dict[str, Any] = {}
    for name, sec in sections.items():
        if name not in raw:
            facts[name] = ReadError(name, "no output (the batch stopped before it)", output[-500:])
            continue
        rc, text = raw[name]
        if rc != 0:
            facts[name] = ReadError(name, f"exited {rc}", text[-800:])
            continue
        try:
            facts[name] = sec.parse(text)
        except (PdopsError, ValueError, KeyError, IndexError) as exc:
            msg = exc.message if isinstance(exc, PdopsError) else f"{type(exc).__name__}: {exc}"
            facts[name] = ReadError(name, msg, text[-800:])
    return facts


