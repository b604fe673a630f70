"""The checks, each data: a name, what it checks, the sections (command + parser) it reads, its
rule (a pure function of the facts giving each result with its fix), whether it needs hardware,
and when it applies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pdops.model import versions as pins
from pdops.errors import InvalidInput
from pdops.facts import Skipped, nvidia, rdma
from pdops.model.inventory import MOONCAKE_RPC_PORTS, Host, Inventory
from pdops.model.placement import Placement
from pdops.facts.host import Disk, GpuDirect, TimeSync, nccl_version
from pdops.steps.preflight.expected import describe_holders, expected_ports, expected_units, gpus_in_use, held_by_owner, instances_on, port_holders
from pdops.reads.check_result import CheckResult, fail_result, ok_result, skip_result
from pdops.steps.preflight.results import DEFAULT_MIN_LOG_GIB, GATEWAY_UNIT, MIN_FREE_RPC_PORTS

# ================================================================ checks (pure)

Facts = dict[str, Any]
Evaluate = Callable[[Inventory, Host, "Placement | None", Facts], list[CheckResult]]


@dataclass(frozen=True)
class Check:
    name: str
    title: str
    sections: Callable[[Inventory, Host], tuple[str, ...]]
    evaluate: Evaluate
    hardware: bool = False
    applies: Callable[[Inventory, Host, "Placement | None"], str | None] = lambda i, h, p: None  # reason if not


def _uses_gpus(inv: Inventory, host: Host, pl: Placement | None) -> str | None:
    if pl is not None and not pl.on_host(host.name):
        return f"no instance of {pl.topology} on this host"
    return None


def eval_gpu(inv, host, pl, facts) -> list[CheckResult]:
    gpus = facts["gpus"]
    if isinstance(gpus, Skipped):
        return [fail_result(host.name, "gpu", f"cannot read GPUs: {gpus.reason}",
                      "install the NVIDIA driver (nvidia-smi) or fix the inventory's pdops_gpus")]
    problems = []
    if len(gpus) != host.gpu_count:
        problems.append(f"{len(gpus)} GPUs found, the inventory declares {host.gpu_count}")
    wrong = [g for g in gpus if not nvidia.model_matches(g.name, host.gpu_model)]
    if wrong:
        names = sorted({g.name for g in wrong})
        problems.append(f"GPU(s) {[g.index for g in wrong]} are {' / '.join(repr(n) for n in names)}, "
                        f"the inventory declares {host.gpu_model!r}")
    if host.gpu_memory_gib:
        low = [g for g in gpus if g.memory_total_mib is not None
               and abs(g.memory_total_mib / 1024 - host.gpu_memory_gib) > 0.05 * host.gpu_memory_gib]
        unknown = [g.index for g in gpus if g.memory_total_mib is None]
        if low:
            problems.append(f"GPU(s) {[g.index for g in low]} have "
                            f"{sorted({round(g.memory_total_mib / 1024, 1) for g in low})} GiB, declared {host.gpu_memory_gib:g}")
        if unknown:
            problems.append(f"GPU(s) {unknown} report no memory size ([N/A])")
    ev = "\n".join(f"{g.index}: {g.name}, {g.memory_total_mib} MiB" for g in gpus)
    if problems:
        return [fail_result(host.name, "gpu", "; ".join(problems),
                      "fix pdops_gpus (count, model as nvidia-smi prints it, memory_gib) or the host's hardware", ev)]
    mem = round(gpus[0].memory_total_mib / 1024, 1) if gpus and gpus[0].memory_total_mib else "?"
    return [ok_result(host.name, "gpu", f"{len(gpus)} x {gpus[0].name if gpus else '-'} ({mem} GiB)", ev)]


def eval_gpu_driver(inv, host, pl, facts) -> list[CheckResult]:
    gpus = facts["gpus"]
    if isinstance(gpus, Skipped):
        return [fail_result(host.name, "gpu-driver", f"cannot read the driver: {gpus.reason}", "install the NVIDIA driver")]
    drivers = sorted({g.driver_version or "?" for g in gpus})
    if len(drivers) != 1 or drivers[0] == "?":
        return [fail_result(host.name, "gpu-driver", f"driver versions on this host: {drivers}",
                      "reboot after the driver upgrade so every GPU runs one driver")]
    # uniform across hosts is decided by :func:`evaluate_cluster`
    return [ok_result(host.name, "gpu-driver", f"driver {drivers[0]}")]


def eval_gpu_free(inv, host, pl, facts) -> list[CheckResult]:
    gpus, apps, pid_units = facts["gpus"], facts["apps"], facts["pids"]
    if isinstance(gpus, Skipped) or isinstance(apps, Skipped):
        reason = (gpus if isinstance(gpus, Skipped) else apps).reason
        return [fail_result(host.name, "gpu-free", f"cannot read GPU processes: {reason}", "install the NVIDIA driver")]
    index = {g.uuid: g.index for g in gpus}
    use = set(gpus_in_use(inv, host, pl))
    owner: dict[int, str] = {}
    for inst in instances_on(pl, host.name):
        for r in inst.ranks:
            if r.host == host.name:
                for g in r.gpus:
                    owner[g] = inst.unit(r.node_rank)
    foreign = []
    for app in apps:
        g = index.get(app.gpu_uuid)
        if g is None or g not in use:
            continue
        unit = pid_units.get(app.pid)
        if unit is not None and unit == owner.get(g):
            continue  # the running instance that belongs on this GPU
        foreign.append(f"GPU {g}: pid {app.pid} ({app.process_name}, {app.used_memory_mib or '?'} MiB"
                       f"{', unit ' + unit if unit else ''})")
    if foreign:
        return [fail_result(host.name, "gpu-free", "foreign compute process on GPUs about to be used: " + "; ".join(foreign),
                      "stop that process (or drain the instance that owns it); pdops never kills processes it did "
                      "not start")]
    return [ok_result(host.name, "gpu-free", f"no foreign compute process on GPU(s) {sorted(use)}")]


def _port_of(ports: list, device: str):
    mine = [p for p in ports if p.hca_id == device]
    return next((p for p in mine if p.port == 1), mine[0] if mine else None)


def eval_rdma(inv, host, pl, facts) -> list[CheckResult]:
    ports = facts["devinfo"]
    if isinstance(ports, Skipped):
        return [fail_result(host.name, "rdma", f"cannot list RDMA devices: {ports.reason}",
                      "install rdma-core (ibv_devinfo) and the NIC driver")]
    problems, good = [], []
    for nic in host.nics:
        p = _port_of(ports, nic.device)
        want = "Ethernet" if nic.link_layer == "RoCE" else "InfiniBand"
        if p is None:
            problems.append(f"{nic.device} not found (ibv_devinfo lists {sorted({x.hca_id for x in ports}) or 'none'})")
        elif not p.active:
            problems.append(f"{nic.device} port {p.port} is {p.state}, not PORT_ACTIVE")
        elif p.link_layer != want:
            problems.append(f"{nic.device} link layer is {p.link_layer}, the inventory declares {nic.link_layer}")
        else:
            good.append(f"{nic.device} active {p.link_layer} mtu {p.active_mtu}")
    ev = "\n".join(f"{p.hca_id}/{p.port}: {p.state} {p.link_layer} mtu {p.active_mtu}" for p in ports)
    if problems:
        return [fail_result(host.name, "rdma", "; ".join(problems),
                      "bring the port up (cable, switch port, `ip link set <netdev> up`) or fix pdops_nics "
                      "(device, link_layer)", ev)]
    return [ok_result(host.name, "rdma", "; ".join(good), ev)]


def _roce_nics(host: Host):
    return [n for n in host.nics if n.link_layer == "RoCE"]


def eval_roce_gid(inv, host, pl, facts) -> list[CheckResult]:
    nics = _roce_nics(host)
    if not nics:
        return [skip_result(host.name, "roce-gid", "no RoCE NIC declared (InfiniBand needs no RoCE GID)")]
    problems, fixes, good, ev = [], [], [], []
    for nic in nics:
        gids = facts[f"gids:{nic.device}"]
        if isinstance(gids, Skipped):
            problems.append(f"{nic.device}: no GID table ({gids.reason})")
            fixes.append(f"check that {nic.device} exists (ibv_devinfo) and fix pdops_nics")
            continue
        ev += [f"{nic.device} {g.index} {g.gid} {g.type}" for g in gids]
        best = rdma.roce_v2_index(gids, ipv4=host.data_addr)
        if best is None:
            best = rdma.roce_v2_index(gids)
        entry = next((g for g in gids if g.index == nic.gid_index), None)
        if entry is not None and entry.type == "RoCE v2" and not entry.link_local:
            good.append(f"{nic.device} gid {nic.gid_index} RoCE v2 {entry.ipv4 or entry.gid}")
            continue
        if entry is None:
            problems.append(f"{nic.device}: GID index {nic.gid_index} is empty")
        elif entry.type != "RoCE v2":
            problems.append(f"{nic.device}: GID index {nic.gid_index} is {entry.type or 'untyped'}, not RoCE v2")
        else:
            problems.append(f"{nic.device}: GID index {nic.gid_index} is link-local ({entry.gid}), not routable")
        if best is not None:
            b = next(g for g in gids if g.index == best)
            fixes.append(f"set gid_index to the RoCE v2 entry {best} ({b.ipv4 or b.gid}) for {nic.device} in pdops_nics")
        else:
            problems[-1] += "; the table has only link-local entries (Mooncake: 'GID is NULL', then 'session not alive')"
            fixes.append(f"set gid_index to the RoCE v2 entry of an IPv4 address: configure the data-network IPv4 "
                         f"address on {nic.netdev} first (its table has no routable RoCE v2 entry), then read "
                         f"/sys/class/infiniband/{nic.device}/ports/1/gid_attrs/types/")
    if problems:
        return [fail_result(host.name, "roce-gid", "; ".join(problems), "; ".join(fixes), "\n".join(ev))]
    return [ok_result(host.name, "roce-gid", "; ".join(good), "\n".join(ev))]


def eval_nic_affinity(inv, host, pl, facts) -> list[CheckResult]:
    topo = facts["topo"]
    if isinstance(topo, Skipped):
        return [fail_result(host.name, "nic-affinity", f"cannot read the PCIe topology: {topo.reason}",
                      "install the NVIDIA driver (nvidia-smi topo -m)")]
    known = set(topo.nic_names.values())
    problems, moves = [], []
    for g in gpus_in_use(inv, host, pl):
        dev = f"GPU{g}"
        if dev not in topo.devices:
            problems.append(f"GPU {g} is not in nvidia-smi topo -m")
            continue
        declared = host.nic_for_gpu(g).device
        ranked = topo.nics_by_closeness(dev)
        if declared not in known:
            problems.append(f"GPU {g} is mapped to {declared}, which topo -m does not list ({sorted(known)})")
            continue
        best_rel = nvidia.RELATION_RANK.get(ranked[0][1], 9)
        rel = dict(ranked)[declared]
        if nvidia.RELATION_RANK.get(rel, 9) > best_rel:
            closest = [n for n, r in ranked if nvidia.RELATION_RANK.get(r, 9) == best_rel]
            problems.append(f"GPU {g} is mapped to {declared} ({rel}) but {'/'.join(closest)} is closer ({ranked[0][1]})")
            moves.append(f"move GPU {g} to the gpus list of {closest[0]}")
    ev = "\n".join(f"GPU{g}: " + ", ".join(f"{n} {r}" for n, r in topo.nics_by_closeness(f"GPU{g}"))
                   for g in gpus_in_use(inv, host, pl) if f"GPU{g}" in topo.devices)
    if problems:
        return [fail_result(host.name, "nic-affinity", "; ".join(problems),
                      ("in pdops_nics: " + "; ".join(moves)) if moves else "fix pdops_nics to match `nvidia-smi topo -m`",
                      ev)]
    return [ok_result(host.name, "nic-affinity", "every GPU uses its closest NIC", ev)]


def eval_gpudirect(inv, host, pl, facts) -> list[CheckResult]:
    gd: GpuDirect = facts["gpudirect"]
    ev = f"modules: {'nvidia_peermem' if gd.peermem else 'no peermem'}; open kernel module: {gd.open_kernel_module}; " \
         f"kernel: {gd.kernel}"
    if gd.peermem:
        mod = "nvidia_peermem" if "nvidia_peermem" in gd.modules else "nv_peer_mem"
        return [ok_result(host.name, "gpudirect", f"{mod} loaded", ev)]
    if gd.dmabuf:
        return [ok_result(host.name, "gpudirect", "DMA-BUF (open NVIDIA kernel module, kernel "
                    f"{gd.kernel[0]}.{gd.kernel[1]})", ev)]
    why = "no NVIDIA driver loaded" if gd.open_kernel_module is None else (
        "the proprietary NVIDIA module has no DMA-BUF export" if not gd.open_kernel_module
        else f"kernel {gd.kernel} is older than 5.12")
    return [fail_result(host.name, "gpudirect", f"GPUDirect RDMA unavailable: nvidia_peermem is not loaded and no DMA-BUF ({why})",
                  "modprobe nvidia_peermem and list it in /etc/modules-load.d/ (or use the open NVIDIA kernel module "
                  "on Linux >= 5.12 for DMA-BUF)", ev)]


def eval_memlock(inv, host, pl, facts) -> list[CheckResult]:
    units, probe = facts["units"], facts["memlock"]
    engine_units = [u for u in expected_units(inv, host, pl) if u != GATEWAY_UNIT]
    bad, seen = [], []
    for u in engine_units:
        st = units.get(u)
        if st is None or not st.exists:
            continue
        seen.append(u)
        if not st.memlock_unlimited:
            bad.append(f"{u} has LimitMEMLOCK={st.raw.get('LimitMEMLOCK')}")
    if bad:
        return [fail_result(host.name, "memlock", "; ".join(bad) + " (the rendered unit says infinity: a drop-in overrides it)",
                      "remove the override (`systemctl cat <unit>` shows it), daemon-reload, then deploy")]
    if not probe.unlimited and inv.virtual_hardware:
        # Measured, not assumed: the lab's sandbox lacks CAP_SYS_RESOURCE, so no service can get
        # more than the machine's hard limit; the sim engine registers no RDMA memory.
        return [skip_result(host.name, "memlock", f"virtual hardware: {probe.detail} (this machine's systemd cannot raise "
                      "the hard limit without CAP_SYS_RESOURCE; the sim engine registers no RDMA memory)")]
    if not probe.unlimited:
        return [fail_result(host.name, "memlock", f"systemd does not grant LimitMEMLOCK=infinity: {probe.detail}",
                      "run services with an unlimited memlock: check the manager's limits (`systemctl show -p "
                      "DefaultLimitMEMLOCK`) and that systemd runs with CAP_SYS_RESOURCE", probe.detail)]
    what = f"units {', '.join(seen)} have LimitMEMLOCK=infinity; " if seen else ""
    return [ok_result(host.name, "memlock", what + probe.detail)]


def eval_ports(inv, host, pl, facts) -> list[CheckResult]:
    listeners, pid_units = facts["listen"], facts["pids"]
    taken, held = [], []
    for use in expected_ports(inv, host, pl):
        holders = port_holders(listeners, pid_units, host.data_addr, use.port)
        if not holders:
            continue
        if held_by_owner(holders, use):
            held.append(f"{use.port} ({use.purpose}) held by its own {'/'.join(sorted({u for _, ps in holders for _, u in ps if u}))}")
            continue
        taken.append(f"port {use.port} ({use.purpose}) on {host.data_addr} is taken: {describe_holders(holders)}")
    in_rpc = {lst.port for lst in listeners if lst.port in MOONCAKE_RPC_PORTS and lst.covers(host.data_addr)}
    free_rpc = len(MOONCAKE_RPC_PORTS) - len(in_rpc)
    if free_rpc < MIN_FREE_RPC_PORTS:
        taken.append(f"only {free_rpc} ports of Mooncake's RPC range 15000-17000 are free on {host.data_addr}")
    n = len(expected_ports(inv, host, pl))
    if taken:
        return [fail_result(host.name, "ports", "; ".join(taken),
                      "stop what holds the port (it is not the instance that belongs there), or move pdops_ports / "
                      "pdops_gateway ports in the inventory")]
    extra = f"; {'; '.join(held)}" if held else ""
    return [ok_result(host.name, "ports", f"{n} port(s) free on {host.data_addr}, {free_rpc} Mooncake RPC ports free{extra}")]


def eval_time(inv, host, pl, facts) -> list[CheckResult]:
    t: TimeSync = facts["time"]
    if t.synchronized:
        return [ok_result(host.name, "time", t.detail)]
    if inv.virtual_hardware:
        return [skip_result(host.name, "time", f"{t.detail}: lab hosts share the machine's clock (virtual hardware), "
                                         "so there is no per-host NTP to check")]
    if t.synchronized is None:
        return [fail_result(host.name, "time", f"cannot tell whether the clock is synchronized: {t.detail}",
                      "install/enable systemd-timesyncd or chrony and check `timedatectl`")]
    return [fail_result(host.name, "time", "clock not synchronized (NTPSynchronized=no)",
                  "start the time service (systemd-timesyncd or chrony) and wait for `timedatectl` to say synchronized")]


def eval_disk(inv, host, pl, facts) -> list[CheckResult]:
    d: Disk = facts["disk"]
    need = float((inv.vars.get("pdops_preflight") or {}).get("min_free_log_gib", DEFAULT_MIN_LOG_GIB))
    msg = f"{d.available_gib:.1f} GiB free for logs on {d.mount} ({d.capacity} used)"
    if d.available_gib < need:
        return [fail_result(host.name, "disk", f"{msg}, below {need:g} GiB",
                      "free space under /var/log (journal: `journalctl --vacuum-size=...`) or grow the disk")]
    return [ok_result(host.name, "disk", msg)]


# versions: per host against the pins here; across hosts in evaluate_cluster.
VERSION_CHECKS = {
    "ver-sglang": ("sglang", lambda v: v.get("sglang"), lambda: pins.SGLANG_VERSION),
    "ver-mooncake": ("mooncake-transfer-engine", lambda v: v.get("mooncake-transfer-engine"), lambda: pins.MOONCAKE_VERSION),
    "ver-nccl": ("NCCL", nccl_version, lambda: getattr(pins, "NCCL_VERSION", None)),
    "ver-gateway": ("smg", lambda v: v.get("smg"), lambda: pins.SMG_VERSION),
}
# the facts section each version check reads (default: the engine python's "versions")
VERSION_SECTIONS = {"ver-gateway": "gateway-versions"}


def _eval_version(check: str):
    label, read, pin_of = VERSION_CHECKS[check]

    def evaluate(inv, host, pl, facts) -> list[CheckResult]:
        section = VERSION_SECTIONS.get(check, "versions")
        v = facts[section]
        python = inv.gateway.python if section == "gateway-versions" else inv.engine_python
        pin = pin_of()
        if isinstance(v, Skipped):
            if inv.virtual_hardware:
                return [skip_result(host.name, check, f"{v.reason} (lab)")]
            return [fail_result(host.name, check, v.reason, "run the host preparation playbook (it installs the engine venv)")]
        have = read(v)
        if have is None:
            if check == "ver-mooncake" and inv.profile.transfer_backend != "mooncake":
                return [skip_result(host.name, check, f"profile uses the {inv.profile.transfer_backend} backend")]
            if inv.virtual_hardware and check in ("ver-mooncake", "ver-nccl"):
                return [skip_result(host.name, check, f"{label} is not installed in the engine python "
                                                "(lab: the sim engine does not use it, virtual hardware)")]
            return [fail_result(host.name, check, f"{label} is not installed in {python}",
                          f"install {label}{' ' + pin if pin else ''} in the engine venv (host preparation playbook)")]
        if pin and have != pin:
            return [fail_result(host.name, check, f"{label} {have}, pdops pins {pin} (pdops/model/versions.py)",
                          f"install {label}=={pin} in {python}, or move the pin (and re-check docs/design/sglang.md)")]
        return [ok_result(host.name, check, f"{label} {have}" + ("" if pin else " (no pin in pdops/model/versions.py: "
                                                                     "compared across hosts only)"))]

    return evaluate


CHECKS: dict[str, Check] = {c.name: c for c in (
    Check("gpu", "GPU count, model and memory as declared", lambda i, h: ("gpus",), eval_gpu, True, _uses_gpus),
    Check("gpu-driver", "driver version uniform", lambda i, h: ("gpus",), eval_gpu_driver, True, _uses_gpus),
    Check("gpu-free", "no foreign compute process on the GPUs to be used",
          lambda i, h: ("gpus", "apps", "pids"), eval_gpu_free, True, _uses_gpus),
    Check("rdma", "RDMA devices present, port active, link layer as declared",
          lambda i, h: ("devinfo",), eval_rdma, True, _uses_gpus),
    Check("roce-gid", "declared GID index is RoCE v2 and routable",
          lambda i, h: tuple(f"gids:{n.device}" for n in _roce_nics(h)), eval_roce_gid, True, _uses_gpus),
    Check("nic-affinity", "NIC-to-GPU mapping matches nvidia-smi topo -m",
          lambda i, h: ("topo",), eval_nic_affinity, True, _uses_gpus),
    Check("gpudirect", "GPUDirect RDMA (nvidia_peermem or DMA-BUF)",
          lambda i, h: ("gpudirect",), eval_gpudirect, True, _uses_gpus),
    Check("memlock", "memlock unlimited for the units as systemd runs them",
          lambda i, h: ("units", "memlock"), eval_memlock, False, _uses_gpus),
    Check("ports", "ports free on the data address", lambda i, h: ("listen", "pids"), eval_ports),
    Check("time", "clock synchronized", lambda i, h: ("time",), eval_time),
    Check("disk", "free disk for logs", lambda i, h: ("disk",), eval_disk),
    Check("ver-sglang", "SGLang version = pin, same on every host", lambda i, h: ("versions",),
          _eval_version("ver-sglang"), False, _uses_gpus),
    Check("ver-mooncake", "Mooncake version = pin, same on every host", lambda i, h: ("versions",),
          _eval_version("ver-mooncake"), False, _uses_gpus),
    Check("ver-nccl", "NCCL version same on every host", lambda i, h: ("versions",),
          _eval_version("ver-nccl"), False, _uses_gpus),
    Check("ver-gateway", "smg version = pin, in the gateway's own environment (gateway host)",
          lambda i, h: ("gateway-versions",), _eval_version("ver-gateway"), False,
          lambda i, h, p: None if h.name in i.gateway.hosts else "not a gateway host"),
)}
PAIRING = "pairing"
CHECK_NAMES = tuple(CHECKS) + (PAIRING,)


def validate_skip(skip: set[str] | list[str] | None) -> set[str]:
    skip = set(skip or ())
    unknown = sorted(skip - set(CHECK_NAMES))
    if unknown:
        raise InvalidInput("--skip-check", f"unknown check(s) {unknown}", fix=f"use one of: {', '.join(CHECK_NAMES)}")
    return skip


