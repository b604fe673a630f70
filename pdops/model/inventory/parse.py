"""From Ansible's merged variables to pdops's model: cluster and host settings, the profile; the
inventory as one YAML document."""

from __future__ import annotations

import ipaddress
import re
import sys
from pathlib import Path
from typing import Any


from pdops.errors import InvalidInput

from pdops.model.inventory.schema import DEVICES, HOST_NAME_RE, Host, LINK_LAYERS, Nic, PROFILES_DIR, Profile, TRANSFER_BACKENDS
from pdops.model.inventory.read import inventory_files, read_with_ansible, read_yaml


def single_file_doc(path: str | Path) -> dict:
    """An inventory (any layout Ansible reads) as one single-file YAML document: the cluster's
    settings in all.vars, each GPU host with its own (HOST_KEYS). Ansible reads the document
    exactly as the original; tests and tools derive inventories from it."""
    hostvars = read_with_ansible(inventory_files(Path(path))).hostvars
    cluster = cluster_vars(hostvars) if hostvars else {}
    hosts = {h: {k: v[k] for k in HOST_KEYS if k in v} for h, v in hostvars.items()}
    return {"all": {"vars": cluster, "children": {"gpu_hosts": {"hosts": hosts}}}}


# Host-level settings: each host has its own (usually from a group's group_vars). Every other
# pdops_* setting is the cluster's and must be the same for every host.
HOST_KEYS = ("pdops_data_addr", "pdops_gpus", "pdops_nics", "ansible_host", "ansible_port")


def cluster_vars(hostvars: dict[str, dict]) -> dict:
    """The cluster-wide settings as every host sees them; a pdops_* setting that differs between
    hosts is refused (it would mean two clusters in one inventory)."""
    names = list(hostvars)
    first = hostvars[names[0]]
    for k in sorted({k for hv in hostvars.values() for k in hv if k.startswith("pdops_") and k not in HOST_KEYS}):
        for n in names[1:]:
            if hostvars[n].get(k) != first.get(k):
                raise InvalidInput(k, f"is {first.get(k)!r} for {names[0]} but {hostvars[n].get(k)!r} for {n}",
                                   fix="set cluster settings once, for all hosts (group_vars/all or all.vars)")
    return {k: v for k, v in first.items() if k not in HOST_KEYS}


def required(d: dict, key: str, where: str, kind: type | tuple, fix: str) -> Any:
    if key not in d or d[key] is None:
        raise InvalidInput(f"{where}.{key}", "missing", fix=fix)
    val = d[key]
    if kind is int and (isinstance(val, bool) or not isinstance(val, int)):
        raise InvalidInput(f"{where}.{key}", f"must be an integer, got {val!r}", fix=fix)
    if kind is not int and not isinstance(val, kind):
        raise InvalidInput(f"{where}.{key}", f"must be {getattr(kind, '__name__', kind)}, got {val!r}", fix=fix)
    return val


def address_of(val: Any, where: str) -> str:
    try:
        return str(ipaddress.ip_address(str(val)))
    except ValueError:
        raise InvalidInput(where, f"{val!r} is not an IP address", fix="use the host's IP address") from None


def port_number(val: Any, where: str) -> int:
    if isinstance(val, bool) or not isinstance(val, int) or not 1024 <= val <= 65535:
        raise InvalidInput(where, f"{val!r} is not a port in 1024-65535", fix="pick an unprivileged port number")
    return val


def parse_host(name: str, hv: dict) -> Host:
    where = f"hosts.{name}"
    if not HOST_NAME_RE.match(name):
        raise InvalidInput(where, f"host name {name!r} has characters pdops does not accept",
                           fix="use letters, digits, '-', '_' and '.'")
    ssh = address_of(required(hv, "ansible_host", where, (str,), "set ansible_host to the SSH address"), f"{where}.ansible_host")
    data = address_of(required(hv, "pdops_data_addr", where, (str,), "set pdops_data_addr to the data-network address SGLang binds"),
                 f"{where}.pdops_data_addr")
    if data in ("0.0.0.0", "::"):
        raise InvalidInput(f"{where}.pdops_data_addr", "a wildcard address cannot be advertised to peers",
                           fix="use the host's data-network address")
    gpus = required(hv, "pdops_gpus", where, (dict,), "set pdops_gpus: {count: 8, model: ..., memory_gib: 84}")
    count = required(gpus, "count", f"{where}.pdops_gpus", int, "set the number of GPUs")
    if count < 1:
        raise InvalidInput(f"{where}.pdops_gpus.count", f"must be at least 1, got {count}", fix="set the number of GPUs")
    model = str(required(gpus, "model", f"{where}.pdops_gpus", (str,), "set the GPU model name as nvidia-smi prints it"))
    mem = gpus.get("memory_gib", 0)
    if isinstance(mem, bool) or not isinstance(mem, (int, float)) or mem < 0:
        raise InvalidInput(f"{where}.pdops_gpus.memory_gib", f"{mem!r} is not a size in GiB",
                           fix="set each GPU's memory in GiB as nvidia-smi shows it (e.g. 84), or leave it out")
    nics_raw = required(hv, "pdops_nics", where, (list,), "list the RDMA NICs with the GPUs each serves")
    nics = []
    seen: dict[int, str] = {}
    for i, n in enumerate(nics_raw):
        nw = f"{where}.pdops_nics[{i}]"
        if not isinstance(n, dict):
            raise InvalidInput(nw, "must be a mapping", fix="device, netdev, link_layer, gid_index, gpus")
        dev = required(n, "device", nw, (str,), "set the RDMA device name (e.g. mlx5_0)")
        netdev = required(n, "netdev", nw, (str,), "set the netdev name (e.g. ens1f0np0)")
        ll = required(n, "link_layer", nw, (str,), "set link_layer: RoCE or IB")
        if ll not in LINK_LAYERS:
            raise InvalidInput(f"{nw}.link_layer", f"{ll!r} is not one of {LINK_LAYERS}", fix="use RoCE or IB")
        gid = required(n, "gid_index", nw, int, "set the GID index (RoCE v2 entry of `show_gids`)")
        ngpus = required(n, "gpus", nw, (list,), "list the GPU indices this NIC serves")
        for g in ngpus:
            if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < count:
                raise InvalidInput(f"{nw}.gpus", f"GPU index {g!r} is not in 0..{count - 1}", fix="use GPU indices of this host")
            if g in seen:
                raise InvalidInput(f"{nw}.gpus", f"GPU {g} is already served by {seen[g]}", fix="map each GPU to one NIC")
            seen[g] = dev
        for bad in (dev, netdev):
            if not re.match(r"^[A-Za-z0-9_.:-]+$", bad):
                raise InvalidInput(nw, f"{bad!r} is not a device name", fix="use the device name as the kernel shows it")
        nics.append(Nic(dev, netdev, ll, gid, tuple(ngpus)))
    missing = [g for g in range(count) if g not in seen]
    if missing:
        raise InvalidInput(f"{where}.pdops_nics", f"GPU(s) {missing} have no RDMA device mapped",
                           fix="add each GPU index to the `gpus` list of the NIC that serves it")
    port = hv.get("ansible_port")
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        raise InvalidInput(f"{where}.ansible_port", f"{port!r} is not a TCP port", fix="the host's SSH port, e.g. 22")
    return Host(name, ssh, data, count, model, float(mem), tuple(nics), port)


def load_profile(name: str, base_dir: Path | None = None) -> Profile:
    """Load a model profile: a name from pdops/profiles/, or a .yml path (relative to the inventory)."""
    known = sorted(p.stem for p in PROFILES_DIR.glob("*.yml"))
    if str(name).endswith((".yml", ".yaml")):
        path = (base_dir or Path.cwd()) / name
        if not path.is_file():
            raise InvalidInput("pdops_profile", f"profile file {path} not found", fix=f"use a file that exists, or one of: {', '.join(known)}")
    else:
        path = PROFILES_DIR / f"{name}.yml"
        if not re.match(r"^[A-Za-z0-9_-]+$", str(name)) or not path.is_file():
            raise InvalidInput("pdops_profile", f"unknown profile {name!r}", fix=f"use one of: {', '.join(known)}")
    d = read_yaml(path)
    where = f"profile {name}"
    par = required(d, "parallel", where, (dict,), "set parallel: {tp: 8, ep: 8, pp: 1}")
    tp = required(par, "tp", f"{where}.parallel", int, "set tp")
    pp = required(par, "pp", f"{where}.parallel", int, "set pp")
    ep = par.get("ep", 1)
    if tp < 1 or pp < 1:
        raise InvalidInput(f"{where}.parallel", "tp and pp must be at least 1", fix="set positive tp and pp")
    if not isinstance(d, dict):
        raise InvalidInput(where, "must be a mapping", fix="see pdops/profiles/ for the shape")
    roles = d.get("roles") or {}
    if roles and not d.get("heterogeneous", False):
        for role, rd in roles.items():
            rp = (rd or {}).get("parallel")
            if rp and (rp.get("tp", tp), rp.get("pp", pp)) != (tp, pp):
                raise InvalidInput(f"{where}.roles.{role}.parallel",
                                   f"heterogeneous P/D: {role} has tp={rp.get('tp', tp)} pp={rp.get('pp', pp)}, "
                                   f"the profile has tp={tp} pp={pp}",
                                   fix="P and D must share TP/PP, model and SGLang version; remove the override "
                                       "(or set `heterogeneous: true` once that is supported)")
    if d.get("heterogeneous", False):
        raise InvalidInput(f"{where}.heterogeneous", "heterogeneous P/D is not supported by this pdops version",
                           fix="use the same TP/PP for prefill and decode")
    backend = d.get("transfer_backend", "mooncake")
    if backend not in TRANSFER_BACKENDS:
        raise InvalidInput(f"{where}.transfer_backend", f"{backend!r} is not one of {TRANSFER_BACKENDS}",
                           fix="use mooncake (default), nixl, or mooncake_tcp (the lab's CPU profile)")
    device = d.get("device", "cuda")
    if device not in DEVICES:
        raise InvalidInput(f"{where}.device", f"{device!r} is not one of {DEVICES}", fix="use cuda (GPU hosts) or cpu (the lab)")
    if device == "cpu" and (tp, pp, ep) != (1, 1, 1):
        raise InvalidInput(f"{where}.parallel", f"a cpu profile runs one process per instance, not tp={tp} pp={pp} ep={ep}",
                           fix="parallel: {tp: 1, ep: 1, pp: 1}")
    slo = d.get("slo") or {}
    if not isinstance(slo, dict) or set(slo) - {"ttft_p99_s"}:
        raise InvalidInput(f"{where}.slo", f"{slo!r} is not a mapping of known objectives", fix="slo: {ttft_p99_s: 5}")
    t = slo.get("ttft_p99_s")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
        raise InvalidInput(f"{where}.slo.ttft_p99_s", f"{t!r} is not a positive number of seconds",
                           fix="slo: {ttft_p99_s: 5}")
    gmem = d.get("gpu_memory_gib")
    if gmem is not None and (isinstance(gmem, bool) or not isinstance(gmem, (int, float)) or not gmem > 0):
        raise InvalidInput(f"{where}.gpu_memory_gib", f"{gmem!r} is not a positive number of GiB",
                           fix="gpu_memory_gib: 96 (one GPU's memory), or leave it out")
    policy = d.get("decode_allocation_policy", "early")
    if policy not in ("early", "prefill_complete"):
        raise InvalidInput(f"{where}.decode_allocation_policy", f"{policy!r} is not early or prefill_complete",
                           fix="use early or prefill_complete (same on both roles)")
    return Profile(
        name=d.get("name", name), description=d.get("description", ""),
        model_path=required(d, "model_path", where, (str,), "set model_path"),
        served_model_name=d.get("served_model_name", name),
        tp=tp, ep=ep, pp=pp, transfer_backend=backend, decode_allocation_policy=policy,
        bundle=dict(d.get("bundle") or {}), workload=dict(d.get("workload") or {}),
        model_shape=dict(d.get("model_shape") or {}),
        extra_args=tuple(str(a) for a in d.get("extra_args") or ()),
        env={str(k): str(v) for k, v in (d.get("env") or {}).items()},
        slo=dict(slo), gpu_memory_gib=float(gmem) if gmem is not None else None, device=device,
    )


def resolve_engine_python(val: str, engine: str = "sim") -> str:
    if val == "auto":
        # The lab: every host sees this machine's paths. The sim runs from the project's own
        # environment; real SGLang from the real engine's, beside it (make env-engine builds it).
        if engine == "sim":
            return str(Path(sys.executable).absolute())
        cand = Path(sys.prefix).absolute().parent / ".venv-engine" / "bin" / "python"
        if not cand.exists():
            raise InvalidInput("pdops_engine_python", f"`auto`: {cand} does not exist",
                               fix="run `make env-engine` (it builds real SGLang's environment, .venv-engine)")
        return str(cand)
    if not val.startswith("/"):
        raise InvalidInput("pdops_engine_python", f"{val!r} is not an absolute path",
                           fix="set the absolute path of the engine's python (or `auto` in the lab)")
    return val


def resolve_gateway_python(val: str) -> str:
    if val == "auto":
        # The lab: the project's own gateway environment, beside its .venv (the Makefile builds both).
        cand = Path(sys.prefix).absolute().parent / ".venv-gateway" / "bin" / "python"
        if not cand.exists():
            raise InvalidInput("pdops_gateway.python", f"`auto`: {cand} does not exist",
                               fix="run `make env` (it builds the gateway's environment, .venv-gateway)")
        return str(cand)
    if not val.startswith("/"):
        raise InvalidInput("pdops_gateway.python", f"{val!r} is not an absolute path",
                           fix="set the absolute path of the python of the gateway's environment (or `auto` in the lab)")
    return val
