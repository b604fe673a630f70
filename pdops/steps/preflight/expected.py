"""What each host runs (or will run) by the placement: instances, GPUs, units, ports and who holds them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdops.facts import ports as port_facts
from pdops.model.inventory import MOONCAKE_RPC_PORTS, Host, Inventory
from pdops.model.placement import Instance, Placement
from pdops.steps.preflight.results import GATEWAY_UNIT

# ================================================================ what each host runs

def instances_on(pl: Placement | None, host: str) -> tuple[Instance, ...]:
    return pl.on_host(host) if pl is not None else ()


def gpus_in_use(inv: Inventory, host: Host, pl: Placement | None) -> list[int]:
    """GPU indices the placement uses on this host (every declared GPU without a topology)."""
    if pl is None:
        return list(range(host.gpu_count))
    return sorted({g for inst in pl.on_host(host.name) for r in inst.ranks if r.host == host.name for g in r.gpus})


def expected_units(inv: Inventory, host: Host, pl: Placement | None) -> list[str]:
    units = [u for inst in instances_on(pl, host.name) for h, u in inst.units if h == host.name]
    if host.name in inv.gateway.hosts:
        units.append(GATEWAY_UNIT)
    return units


@dataclass(frozen=True)
class PortUse:
    port: int
    purpose: str
    owners: tuple[str, ...]  # units allowed to hold it (the running instance of this revision)
    any_instance: bool = False  # without a topology: any pdops instance unit may hold it


def expected_ports(inv: Inventory, host: Host, pl: Placement | None) -> list[PortUse]:
    """Ports pdops will bind on this host's data address, and who may already hold each."""
    out: list[PortUse] = []
    if pl is not None:
        for inst in pl.on_host(host.name):
            for rank in inst.ranks:
                if rank.host != host.name or rank.node_rank != 0:
                    continue
                unit = inst.unit(0)
                out.append(PortUse(inst.http_port, f"{inst.id} http", (unit,)))
                if inst.bootstrap_port:
                    out.append(PortUse(inst.bootstrap_port, f"{inst.id} bootstrap", (unit,)))
                if inst.dist_init_port:
                    out.append(PortUse(inst.dist_init_port, f"{inst.id} dist-init", (unit,)))
    else:
        g = inv.profile.gpus_per_instance
        p = inv.ports
        for s in range(max(host.gpu_count // g, 1)):
            out.append(PortUse(p.http_base + p.stride * s, f"slot {s} http", (), True))
            out.append(PortUse(p.bootstrap_base + p.stride * s, f"slot {s} bootstrap", (), True))
    if host.name in inv.gateway.hosts:
        out.append(PortUse(inv.gateway.port, "gateway", (GATEWAY_UNIT,)))
        out.append(PortUse(inv.gateway.prometheus_port, "gateway metrics", (GATEWAY_UNIT,)))
    return out


_INSTANCE_UNIT = re.compile(r"^pdops-[pd]\d+(-r\d+)?\.service$")


def port_holders(listeners: list, pid_units: dict[int, str | None], addr: str, port: int) -> list[tuple]:
    """[(listener, [(pid, unit)])] for sockets a connection to addr:port would reach."""
    out = []
    for lst in port_facts.listening_on_port(listeners, port):
        if lst.covers(addr):
            out.append((lst, [(pid, pid_units.get(pid)) for pid in lst.pids]))
    return out


def held_by_owner(holders: list[tuple], use: PortUse) -> bool:
    """True when every process on the port is in the unit that belongs there."""
    if not holders:
        return False
    for lst, procs in holders:
        if not procs:
            return False
        for _, unit in procs:
            if unit is None:
                return False
            if unit not in use.owners and not (use.any_instance and _INSTANCE_UNIT.match(unit)):
                return False
    return True


def describe_holders(holders: list[tuple]) -> str:
    parts = []
    for lst, procs in holders:
        where = f"{'[' + lst.addr + ']' if lst.is_ipv6 else lst.addr}:{lst.port}"
        if not procs:
            parts.append(f"{where} by a process this host cannot see (another user, or in the lab another lab host)")
            continue
        names = dict(zip(lst.pids, lst.names))
        parts.append(where + " by " + ", ".join(
            f"pid {pid} ({names.get(pid, '?')}{', unit ' + unit if unit else ''})" for pid, unit in procs))
    return "; ".join(parts)


def free_rpc_port(listeners: list, addr: str) -> int | None:
    """The lowest port of Mooncake's RPC range nothing holds on ``addr``."""
    for p in MOONCAKE_RPC_PORTS:
        if not port_facts.is_listening(listeners, addr, p):
            return p
    return None


