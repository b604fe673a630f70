"""Inventory: hosts, GPUs, NICs, gateway and port settings, model profile.

An inventory is an Ansible YAML inventory (`ansible-inventory -i inventory/<name> --list`
reads it) with pdops's variables. `load_inventory` reads it and validates everything
before any host is touched; every error names the field and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import ipaddress
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdops.admission import parse_admission

from pdops.errors import InvalidInput
from pdops.prometheus_setting import parse_prometheus

PROFILES_DIR = Path(__file__).parent / "profiles"
ENGINES = ("sglang", "sim")
LINK_LAYERS = ("RoCE", "IB")
TRANSFER_BACKENDS = ("mooncake", "nixl")
HOST_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# Mooncake's RPC port range (docs/design/sglang.md): instance ports must stay clear of it.
MOONCAKE_RPC_PORTS = range(15000, 17001)


@dataclass(frozen=True)
class Nic:
    device: str
    netdev: str
    link_layer: str
    gid_index: int
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class Host:
    name: str
    ssh_addr: str
    data_addr: str
    gpu_count: int
    gpu_model: str
    gpu_memory_gib: float
    nics: tuple[Nic, ...]
    # ansible_port, where set: Ansible and pdops's own SSH use the same one. None: as Ansible does,
    # the ssh_config's Port for the host, else 22
    ssh_port: int | None = None

    def nic_for_gpu(self, gpu: int) -> Nic:
        for nic in self.nics:
            if gpu in nic.gpus:
                return nic
        raise InvalidInput(f"hosts.{self.name}.pdops_nics", f"GPU {gpu} has no RDMA device mapped",
                           fix=f"add GPU {gpu} to the `gpus` list of the NIC that serves it")


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    model_path: str
    served_model_name: str
    tp: int
    ep: int
    pp: int
    transfer_backend: str
    decode_allocation_policy: str
    bundle: dict
    workload: dict
    model_shape: dict
    extra_args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    # service objectives the alert rules use (pdops.observability), e.g. {"ttft_p99_s": 5}
    slo: dict = field(default_factory=dict)
    # memory of one GPU of the instances' hosts (GiB); the sim's memory model runs against it
    gpu_memory_gib: float | None = None

    @property
    def gpus_per_instance(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class Gateway:
    host: str
    addr: str
    port: int
    prometheus_port: int
    api_key_file: str | None
    max_concurrent_requests: int
    queue_size: int
    health_check_interval_secs: int
    # The python of the gateway's own environment (smg installed, no torch); smg sits beside it
    python: str = "/opt/pdops/gateway-venv/bin/python"
    # Routing (smg --policy / --prefill-policy / --decode-policy); None: the gateway's default
    policy: str | None = None
    prefill_policy: str | None = None
    decode_policy: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}"


DEFAULT_STATE_DIR = "/var/lib/pdops/state"


@dataclass(frozen=True)
class StateLocation:
    """Where the cluster's record and lock live (`pdops_state`): a host of the inventory and a dir."""

    host: str
    dir: str = DEFAULT_STATE_DIR


@dataclass(frozen=True)
class Ports:
    http_base: int
    bootstrap_base: int
    dist_init_base: int
    # Each instance slot on a host gets base + stride * slot for each kind of port;
    # SGLang derives further internal ports from the dist-init port, so keep a gap.
    stride: int = 10


@dataclass(frozen=True)
class Inventory:
    cluster: str
    path: Path
    engine: str
    profile: Profile
    hosts: tuple[Host, ...]
    gateway: Gateway
    ports: Ports
    engine_python: str
    virtual_hardware: bool
    digest: str
    drain_budget_s: int = 1800
    stop_timeout_s: int = 1920
    # The YAML files read: tools are given these, never the directory, because Ansible
    # runs any executable file in an inventory directory as a dynamic inventory script.
    files: tuple[Path, ...] = ()
    vars: dict = field(default_factory=dict, compare=False, repr=False)
    # engine sim only: {instance id: PDOPS_SIM_FAULTS value} (docs/sim.md), for lab tests
    sim_faults: dict = field(default_factory=dict, compare=False)
    # {instance id: ((flag, value or None), ...)}: SGLang flags that replace or add to the profile's
    # for that instance only (`inv probe` renders a candidate bundle this way; never read from a file)
    engine_overrides: dict = field(default_factory=dict, compare=False)
    # the admission layer (pdops.admission.AdmissionConfig), validated once at load; None: none
    admission: Any = field(default=None, compare=False, repr=False)
    # where Prometheus reads the target file (pdops.prometheus_setting.PrometheusConfig); None: nowhere
    prometheus: Any = field(default=None, compare=False, repr=False)
    # where the shared record and lock live (`pdops_state`); None only for inventories built by hand
    state: StateLocation | None = field(default=None, compare=False)

    def reserved_port_ranges(self) -> dict[str, range]:
        """The port ranges instance slots take on every host (the port plan), by the setting that owns them."""
        ports = self.ports
        span = ports.stride * max(max_slots(self.hosts, self.profile) - 1, 0) + 1
        return {
            "pdops_ports.http_base": range(ports.http_base, ports.http_base + span),
            # each slot has two bootstrap ports: a replaced prefill takes the one its predecessor did not use
            "pdops_ports.bootstrap_base": range(ports.bootstrap_base, ports.bootstrap_base + span + 1),
            "pdops_ports.dist_init_base": range(ports.dist_init_base, ports.dist_init_base + span + ports.stride - 1),
            "Mooncake's RPC range": MOONCAKE_RPC_PORTS,
        }

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise InvalidInput("host", f"unknown host {name!r}", fix=f"use one of: {', '.join(h.name for h in self.hosts)}")

    @property
    def gateway_binary(self) -> str:
        return str(Path(self.gateway.python).parent / "smg")

    @property
    def total_gpus(self) -> int:
        return sum(h.gpu_count for h in self.hosts)


# ---------------------------------------------------------------- reading

def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidInput(str(path), f"cannot read: {exc.strerror}", fix="check the inventory path") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InvalidInput(str(path), f"YAML syntax error{where}: {problem}",
                           fix="fix the YAML (indentation, quoting, colons) and retry") from None


INVENTORY_SUFFIXES = (".yml", ".yaml", ".ini")
ANSIBLE_CFG = Path(__file__).resolve().parent.parent / "playbooks" / "ansible.cfg"


def _inventory_files(path: Path) -> list[Path]:
    """The inventory sources: the file, or a directory's *.yml/*.yaml/*.ini and `hosts` files
    (group_vars/ and host_vars/ beside them are read by Ansible's own vars plugin)."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and (p.suffix in INVENTORY_SUFFIXES or p.name == "hosts"))
        if files:
            return files
        raise InvalidInput(str(path), "no inventory file (.yml, .yaml, .ini or hosts) in this directory",
                           fix="point -i at an inventory directory holding hosts.yml")
    raise InvalidInput(str(path), "inventory not found", fix="pass -i inventory/<name> (see inventory/)")


def _plain(value: Any) -> Any:
    """Ansible's tagged values (str, int, dict, list subclasses carrying their origin) as plain ones."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for t in (bool, int, float, str):
        if isinstance(value, t):
            return t(value)
    return value


@dataclass
class AnsibleReading:
    """Each host's variables as Ansible merges them (every layout and precedence rule it has),
    plain, and the tagged originals to say which file a value came from."""

    hostvars: dict[str, dict]
    raw: dict[str, dict] | None  # None: read from the cache (no origins)

    def origin(self, field_path: str) -> str | None:
        """`file:line` of the value at an InvalidInput field (hosts.gpu01.pdops_gpus.count,
        pdops_gateway.port, ...), where Ansible recorded it."""
        from ansible._internal._datatag._tags import Origin

        parts = [p for p in re.split(r"\.|\[(\d+)\]", field_path) if p]
        if parts and parts[0] == "hosts" and len(parts) > 1 and parts[1] in self.raw:
            node, parts = self.raw[parts[1]], parts[2:]
        elif self.raw:
            node = next(iter(self.raw.values()))
            parts = parts[2:] if parts[:2] == ["all", "vars"] else parts
        else:
            return None
        best = None
        for p in parts:
            try:
                node = node[int(p)] if isinstance(node, list) else node[p]
            except (KeyError, IndexError, ValueError, TypeError):
                break
            best = Origin.get_tag(node) or best
        if best is None or not getattr(best, "path", None):
            return None
        return f"{best.path}:{best.line_num}" if getattr(best, "line_num", None) else str(best.path)


def _ansible():
    """ansible-core's pieces, imported once, with pdops's ansible.cfg as their configuration (set
    for the import only: Ansible reads its configuration then, and no child process inherits it)."""
    prev = os.environ.get("ANSIBLE_CONFIG")
    os.environ["ANSIBLE_CONFIG"] = str(ANSIBLE_CFG)
    try:
        from ansible import constants as C
        from ansible.errors import AnsibleError
        from ansible.inventory.manager import InventoryManager
        from ansible.parsing.dataloader import DataLoader
        from ansible.vars.manager import VariableManager
    finally:
        if prev is None:
            os.environ.pop("ANSIBLE_CONFIG", None)
        else:
            os.environ["ANSIBLE_CONFIG"] = prev
    return C, AnsibleError, InventoryManager, DataLoader, VariableManager


def read_with_ansible(files: list[Path]) -> AnsibleReading:
    """ansible-core's InventoryManager and VariableManager over `files`, with pdops's
    playbooks/ansible.cfg (as ansible-playbook runs): {host: variables} exactly as
    `ansible-inventory --host` prints them (internal variables removed)."""
    C, AnsibleError, InventoryManager, DataLoader, VariableManager = _ansible()

    loader = DataLoader()
    said = io.StringIO()  # Ansible's own warnings: evidence of a failure, noise otherwise
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            inventory = InventoryManager(loader=loader, sources=[str(f) for f in files])
            vm = VariableManager(loader=loader, inventory=inventory)
            raw = {}
            for h in inventory.get_hosts():
                v = vm.get_vars(host=h, include_hostvars=False, stage="all")
                raw[str(h.name)] = {str(k): val for k, val in v.items() if k not in C.INTERNAL_STATIC_VARS}
    except AnsibleError as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        why = re.findall(r"Failed to parse inventory with '(\w+)' plugin: (.*)", said.getvalue())
        if why:  # the reason is in Ansible's warning (its error only says "Completely failed"):
            # the one from the plugin the file is written for
            want = "yaml" if any(f.suffix in (".yml", ".yaml") for f in files) else "ini"
            plugin, reason = next((w for w in why if w[0] == want), why[-1])
            first = f"{reason.strip()} ({plugin} plugin)"
        exc2 = InvalidInput(", ".join(str(f) for f in files), f"Ansible cannot read the inventory: {first}",
                            fix="fix the file Ansible names (YAML or INI inventory syntax)")
        exc2.evidence = said.getvalue().strip() or None
        raise exc2 from None
    return AnsibleReading({h: _plain(v) for h, v in raw.items()}, raw)


def single_file_doc(path: str | Path) -> dict:
    """An inventory (any layout Ansible reads) as one single-file YAML document: the cluster's
    settings in all.vars, each GPU host with its own (HOST_KEYS). Ansible reads the document
    exactly as the original; tests and tools derive inventories from it."""
    hostvars = read_with_ansible(_inventory_files(Path(path))).hostvars
    cluster = _cluster_vars(hostvars) if hostvars else {}
    hosts = {h: {k: v[k] for k in HOST_KEYS if k in v} for h, v in hostvars.items()}
    return {"all": {"vars": cluster, "children": {"gpu_hosts": {"hosts": hosts}}}}


# Host-level settings: each host has its own (usually from a group's group_vars). Every other
# pdops_* setting is the cluster's and must be the same for every host.
HOST_KEYS = ("pdops_data_addr", "pdops_gpus", "pdops_nics", "ansible_host", "ansible_port")


def _cluster_vars(hostvars: dict[str, dict]) -> dict:
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


# ---------------------------------------------------------------- validation helpers

def _req(d: dict, key: str, where: str, kind: type | tuple, fix: str) -> Any:
    if key not in d or d[key] is None:
        raise InvalidInput(f"{where}.{key}", "missing", fix=fix)
    val = d[key]
    if kind is int and (isinstance(val, bool) or not isinstance(val, int)):
        raise InvalidInput(f"{where}.{key}", f"must be an integer, got {val!r}", fix=fix)
    if kind is not int and not isinstance(val, kind):
        raise InvalidInput(f"{where}.{key}", f"must be {getattr(kind, '__name__', kind)}, got {val!r}", fix=fix)
    return val


def _addr(val: Any, where: str) -> str:
    try:
        return str(ipaddress.ip_address(str(val)))
    except ValueError:
        raise InvalidInput(where, f"{val!r} is not an IP address", fix="use the host's IP address") from None


def _port(val: Any, where: str) -> int:
    if isinstance(val, bool) or not isinstance(val, int) or not 1024 <= val <= 65535:
        raise InvalidInput(where, f"{val!r} is not a port in 1024-65535", fix="pick an unprivileged port number")
    return val


def _parse_host(name: str, hv: dict) -> Host:
    where = f"hosts.{name}"
    if not HOST_NAME_RE.match(name):
        raise InvalidInput(where, f"host name {name!r} has characters pdops does not accept",
                           fix="use letters, digits, '-', '_' and '.'")
    ssh = _addr(_req(hv, "ansible_host", where, (str,), "set ansible_host to the SSH address"), f"{where}.ansible_host")
    data = _addr(_req(hv, "pdops_data_addr", where, (str,), "set pdops_data_addr to the data-network address SGLang binds"),
                 f"{where}.pdops_data_addr")
    if data in ("0.0.0.0", "::"):
        raise InvalidInput(f"{where}.pdops_data_addr", "a wildcard address cannot be advertised to peers",
                           fix="use the host's data-network address")
    gpus = _req(hv, "pdops_gpus", where, (dict,), "set pdops_gpus: {count: 8, model: ..., memory_gib: 84}")
    count = _req(gpus, "count", f"{where}.pdops_gpus", int, "set the number of GPUs")
    if count < 1:
        raise InvalidInput(f"{where}.pdops_gpus.count", f"must be at least 1, got {count}", fix="set the number of GPUs")
    model = str(_req(gpus, "model", f"{where}.pdops_gpus", (str,), "set the GPU model name as nvidia-smi prints it"))
    mem = gpus.get("memory_gib", 0)
    if isinstance(mem, bool) or not isinstance(mem, (int, float)) or mem < 0:
        raise InvalidInput(f"{where}.pdops_gpus.memory_gib", f"{mem!r} is not a size in GiB",
                           fix="set each GPU's memory in GiB as nvidia-smi shows it (e.g. 84), or leave it out")
    nics_raw = _req(hv, "pdops_nics", where, (list,), "list the RDMA NICs with the GPUs each serves")
    nics = []
    seen: dict[int, str] = {}
    for i, n in enumerate(nics_raw):
        nw = f"{where}.pdops_nics[{i}]"
        if not isinstance(n, dict):
            raise InvalidInput(nw, "must be a mapping", fix="device, netdev, link_layer, gid_index, gpus")
        dev = _req(n, "device", nw, (str,), "set the RDMA device name (e.g. mlx5_0)")
        netdev = _req(n, "netdev", nw, (str,), "set the netdev name (e.g. ens1f0np0)")
        ll = _req(n, "link_layer", nw, (str,), "set link_layer: RoCE or IB")
        if ll not in LINK_LAYERS:
            raise InvalidInput(f"{nw}.link_layer", f"{ll!r} is not one of {LINK_LAYERS}", fix="use RoCE or IB")
        gid = _req(n, "gid_index", nw, int, "set the GID index (RoCE v2 entry of `show_gids`)")
        ngpus = _req(n, "gpus", nw, (list,), "list the GPU indices this NIC serves")
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
    d = _read_yaml(path)
    where = f"profile {name}"
    par = _req(d, "parallel", where, (dict,), "set parallel: {tp: 8, ep: 8, pp: 1}")
    tp = _req(par, "tp", f"{where}.parallel", int, "set tp")
    pp = _req(par, "pp", f"{where}.parallel", int, "set pp")
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
                           fix="use mooncake (default) or nixl")
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
        model_path=_req(d, "model_path", where, (str,), "set model_path"),
        served_model_name=d.get("served_model_name", name),
        tp=tp, ep=ep, pp=pp, transfer_backend=backend, decode_allocation_policy=policy,
        bundle=dict(d.get("bundle") or {}), workload=dict(d.get("workload") or {}),
        model_shape=dict(d.get("model_shape") or {}),
        extra_args=tuple(str(a) for a in d.get("extra_args") or ()),
        env={str(k): str(v) for k, v in (d.get("env") or {}).items()},
        slo=dict(slo), gpu_memory_gib=float(gmem) if gmem is not None else None,
    )


def _resolve_engine_python(val: str) -> str:
    if val == "auto":
        # The project's own environment: in the lab every host sees this path.
        return str(Path(sys.executable).absolute())
    if not val.startswith("/"):
        raise InvalidInput("pdops_engine_python", f"{val!r} is not an absolute path",
                           fix="set the absolute path of the engine's python (or `auto` in the lab)")
    return val


def _resolve_gateway_python(val: str) -> str:
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


# Ansible's reading of an inventory, cached on this operator machine by the digest of everything it
# depends on: importing ansible-core is most of what `inv plan` costs (bench/plan_speed.py).
CACHE_FORMAT = 1


def cache_dir() -> Path:
    return Path(os.environ.get("PDOPS_CACHE_DIR") or Path.home() / ".cache" / "pdops") / "inventory"


def sources_digest(files: list[Path]) -> str:
    """sha256 over what Ansible's reading depends on: the inventory files, group_vars/ and
    host_vars/ beside them, pdops's ansible.cfg, ansible-core's release file (its version) and
    Python's (any change: a new key)."""
    import importlib.util

    h = hashlib.sha256(f"{CACHE_FORMAT}\0{sys.version_info[:2]}\0".encode())
    spec = importlib.util.find_spec("ansible")  # its release file names the version; nothing imported
    release = Path(spec.origin).parent / "release.py" if spec and spec.origin else None
    h.update(release.read_bytes() if release and release.is_file() else b"no ansible release file")
    sources = list(files)
    for d in sorted({f.parent for f in files}):
        for sub in ("group_vars", "host_vars"):
            if (d / sub).is_dir():
                sources += sorted(x for x in (d / sub).rglob("*") if x.is_file())
    for src in sources + [ANSIBLE_CFG]:
        h.update(str(src.resolve()).encode() + b"\0" + src.read_bytes() + b"\0")
    return h.hexdigest()


def _cached_reading(digest: str) -> AnsibleReading | None:
    try:
        doc = json.loads((cache_dir() / f"{digest}.json").read_text())
    except (OSError, ValueError):
        return None
    return AnsibleReading(doc["hostvars"], None) if isinstance(doc, dict) and "hostvars" in doc else None


def _cache_reading(digest: str, reading: AnsibleReading) -> None:
    """0600 in a 0700 dir; a value JSON cannot hold, or a dir that cannot be written: not cached."""
    try:
        text = json.dumps({"hostvars": reading.hostvars})
        if json.loads(text)["hostvars"] != reading.hostvars:  # tuples, dates...: not cached
            return
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = d / f".{digest}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, d / f"{digest}.json")
    except (OSError, TypeError, ValueError):
        return


def load_inventory(path: str | Path, *, profile: str | None = None) -> Inventory:
    """Read and validate an inventory; nothing is contacted. Ansible's reading of the same files
    is taken from this machine's cache (cache_dir()); pdops's own rules always run."""
    path = Path(path)
    files = _inventory_files(path)
    digest = sources_digest(files)
    cached = _cached_reading(digest)
    try:
        reading = cached or read_with_ansible(files)
    except InvalidInput:
        for f in files:  # a YAML syntax error: say where, with its line and column
            if f.suffix in (".yml", ".yaml"):
                doc = _read_yaml(f)
                if doc is not None and not isinstance(doc, dict):
                    raise InvalidInput(str(f), f"is a YAML {type(doc).__name__}, not an inventory mapping",
                                       fix="start the file with `all:` (see inventory/lab/hosts.yml)") from None
        raise
    if cached is None:
        _cache_reading(digest, reading)
    hostvars = reading.hostvars
    if not hostvars:
        raise InvalidInput(str(path), "the inventory lists no hosts", fix="add hosts under all.children.gpu_hosts.hosts")
    try:
        return _validate(path, files, hostvars, profile)
    except InvalidInput as exc:
        if reading.raw is None:  # where a value came from is in Ansible's own reading
            reading = read_with_ansible(files)
        where = reading.origin(exc.field)
        if where:
            exc.message += f" (from {where})"
        raise


def _validate(path: Path, files: list[Path], hostvars: dict[str, dict], profile: str | None) -> "Inventory":
    """Every rule of pdops, on the variables Ansible merged for each host."""
    all_vars = _cluster_vars(hostvars)
    cluster = str(all_vars.get("pdops_cluster") or path.stem)
    if not re.match(r"^[A-Za-z0-9_.-]+$", cluster):
        raise InvalidInput("pdops_cluster", f"{cluster!r} is not a valid cluster name", fix="letters, digits, '-', '_', '.'")
    engine = all_vars.get("pdops_engine", "sglang")
    if engine not in ENGINES:
        raise InvalidInput("pdops_engine", f"{engine!r} is not one of {ENGINES}", fix="use sglang (production) or sim (lab)")
    prof = load_profile(profile or _req(all_vars, "pdops_profile", "all.vars", (str,), "name a profile from pdops/profiles/"),
                        path if path.is_dir() else path.parent)

    hosts = tuple(_parse_host(n, hv) for n, hv in hostvars.items())
    _check_unique(hosts)

    pv = _req(all_vars, "pdops_ports", "all.vars", (dict,), "set pdops_ports: {http_base, bootstrap_base, dist_init_base}")
    ports = Ports(
        http_base=_port(pv.get("http_base"), "pdops_ports.http_base"),
        bootstrap_base=_port(pv.get("bootstrap_base"), "pdops_ports.bootstrap_base"),
        dist_init_base=_port(pv.get("dist_init_base"), "pdops_ports.dist_init_base"),
        stride=_stride(pv.get("stride", 10)),
    )
    gv = _req(all_vars, "pdops_gateway", "all.vars", (dict,), "set pdops_gateway: {host, port, prometheus_port, ...}")
    gw_host = _req(gv, "host", "pdops_gateway", (str,), "name the inventory host that runs the gateway")
    names = {h.name: h for h in hosts}
    if gw_host not in names:
        raise InvalidInput("pdops_gateway.host", f"{gw_host!r} is not a host of this inventory",
                           fix=f"use one of: {', '.join(names)}")
    mcr = gv.get("max_concurrent_requests", -1)
    qs = gv.get("queue_size", 0)
    if not isinstance(mcr, int) or (mcr < 1 and mcr != -1):
        raise InvalidInput("pdops_gateway.max_concurrent_requests", f"{mcr!r} must be -1 (off) or at least 1",
                           fix="the real cap belongs to the admission layer; leave -1")
    if not isinstance(qs, int) or qs < 0:
        raise InvalidInput("pdops_gateway.queue_size", f"{qs!r} must be 0 or more", fix="set a non-negative queue size")
    key_file = gv.get("api_key_file")
    if key_file is not None and not str(key_file).startswith("/"):
        raise InvalidInput("pdops_gateway.api_key_file", f"{key_file!r} is not an absolute path", fix="use an absolute path")
    policies = {k: _routing_policy(gv, k) for k in ("policy", "prefill_policy", "decode_policy")}
    gateway = Gateway(
        host=gw_host, addr=names[gw_host].data_addr,
        port=_port(gv.get("port"), "pdops_gateway.port"),
        prometheus_port=_port(gv.get("prometheus_port"), "pdops_gateway.prometheus_port"),
        api_key_file=key_file, max_concurrent_requests=mcr, queue_size=qs,
        health_check_interval_secs=int(gv.get("health_check_interval_secs", 5)),
        python=_resolve_gateway_python(str(gv.get("python", "/opt/pdops/gateway-venv/bin/python"))), **policies,
    )
    _check_port_plan(hosts, ports, gateway, prof)
    state = _state_location(all_vars.get("pdops_state"), names, gw_host)

    drain = all_vars.get("pdops_drain") or {}
    budget = drain.get("budget_s", 1800)
    margin = drain.get("stop_margin_s", 120)
    for k, v in (("budget_s", budget), ("stop_margin_s", margin)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidInput(f"pdops_drain.{k}", f"{v!r} must be a positive number of seconds", fix="set whole seconds")
    for k in ("pdops_start_timeout_s", "pdops_register_timeout_s"):
        v = all_vars.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise InvalidInput(k, f"{v!r} must be a positive number of seconds", fix=f"e.g. {k}: 60")
    sim_faults = _sim_faults(all_vars.get("pdops_sim_faults"), engine)
    canonical = json.dumps({"vars": all_vars, "hosts": hostvars}, sort_keys=True, default=str)
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    inv = Inventory(
        cluster=cluster, path=path, engine=engine, profile=prof, hosts=hosts, gateway=gateway, ports=ports,
        engine_python=_resolve_engine_python(str(all_vars.get("pdops_engine_python", "/opt/pdops/venv/bin/python"))),
        virtual_hardware=bool(all_vars.get("pdops_virtual_hardware", False)), digest=digest,
        drain_budget_s=budget, stop_timeout_s=budget + margin, files=tuple(f.resolve() for f in files),
        vars=all_vars, sim_faults=sim_faults, state=state,
    )
    return dataclasses.replace(inv, admission=parse_admission(all_vars, inv),
                               prometheus=parse_prometheus(all_vars, [h.name for h in hosts]))


def _state_location(val: Any, names: dict, gw_host: str) -> StateLocation:
    """`pdops_state: {host, dir}`: default the gateway host and /var/lib/pdops/state."""
    fix = f"e.g. pdops_state: {{host: {gw_host}, dir: {DEFAULT_STATE_DIR}}}"
    if val is None:
        return StateLocation(gw_host)
    if not isinstance(val, dict):
        raise InvalidInput("pdops_state", f"{val!r} is not a mapping", fix=fix)
    unknown = sorted(set(val) - {"host", "dir"})
    if unknown:
        raise InvalidInput("pdops_state", f"unknown key(s) {', '.join(map(str, unknown))}", fix=fix)
    host = val.get("host", gw_host)
    if not isinstance(host, str) or host not in names:
        raise InvalidInput("pdops_state.host", f"{host!r} is not a host of this inventory",
                           fix=f"use one of: {', '.join(names)} (the record lives on a host of the cluster)")
    d = val.get("dir", DEFAULT_STATE_DIR)
    if not isinstance(d, str) or not d.startswith("/"):
        raise InvalidInput("pdops_state.dir", f"{d!r} is not an absolute path", fix=fix)
    if os.path.normpath(d) != d.rstrip("/") or d.rstrip("/") in ("", "/") or any(c in d for c in "\n\0"):
        raise InvalidInput("pdops_state.dir", f"{d!r} is not a plain absolute directory path",
                           fix=f"a path such as {DEFAULT_STATE_DIR}, without '..' or '//'")
    return StateLocation(host, d.rstrip("/"))


def _sim_faults(val: Any, engine: str) -> dict[str, str]:
    """`pdops_sim_faults: {p02: fail_transfer}`: faults the sim engine starts with, per instance."""
    if val is None:
        return {}
    if engine != "sim":
        raise InvalidInput("pdops_sim_faults", f"set with engine {engine!r}; faults exist only in the sim engine",
                           fix="remove pdops_sim_faults (it is for lab tests with pdops_engine: sim)")
    if not isinstance(val, dict):
        raise InvalidInput("pdops_sim_faults", f"{val!r} is not a mapping", fix="e.g. {p02: fail_transfer}")
    from pdops.sim.faults import parse_faults

    out = {}
    for k, v in val.items():
        if not re.match(r"^[pd][0-9]{2,}$", str(k)):
            raise InvalidInput(f"pdops_sim_faults.{k}", "is not an instance id", fix="use ids such as p01 or d02")
        try:
            parse_faults(str(v))
        except ValueError as e:
            raise InvalidInput(f"pdops_sim_faults.{k}", str(e), fix="see docs/sim.md, Faults") from None
        out[str(k)] = str(v)
    return out


# The choices of `smg launch` (smg 1.13's parser) for each routing flag pdops supports. `manual`
# routes by a client-sent routing key, which pdops's canary, drain and bench do not send.
ROUTING_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")
PREFILL_POLICIES = ROUTING_POLICIES + ("bucket",)


def _routing_policy(gv: dict, key: str) -> str | None:
    val = gv.get(key)
    if val is None:
        return None
    allowed = PREFILL_POLICIES if key == "prefill_policy" else ROUTING_POLICIES
    if val not in allowed:
        raise InvalidInput(f"pdops_gateway.{key}", f"{val!r} is not a routing policy pdops supports",
                           fix=f"use one of: {', '.join(allowed)} (or leave it out for the gateway's default, "
                           "cache_aware)")
    return val


def _check_unique(hosts: tuple[Host, ...]) -> None:
    for attr, label in (("ssh_addr", "ansible_host"), ("data_addr", "pdops_data_addr")):
        seen: dict[str, str] = {}
        for h in hosts:
            val = getattr(h, attr)
            if val in seen:
                raise InvalidInput(f"hosts.{h.name}.{label}", f"{val} is also the {label} of {seen[val]}",
                                   fix="every host needs its own address")
            seen[val] = h.name


def max_slots(hosts: tuple[Host, ...], profile: Profile) -> int:
    g = profile.gpus_per_instance
    return max((h.gpu_count // g if g <= h.gpu_count else 1) for h in hosts)


def _stride(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 2:
        raise InvalidInput("pdops_ports.stride", f"{v!r} is not a whole number of at least 2",
                           fix="each slot takes base + stride * slot, and a prefill slot two bootstrap ports: "
                               "use the default 10")
    return v


def _check_port_plan(hosts: tuple[Host, ...], ports: Ports, gateway: Gateway, profile: Profile) -> None:
    """Port ranges of instance slots must not overlap each other, the gateway or Mooncake's RPC range."""
    slots = max_slots(hosts, profile)
    span = ports.stride * max(slots - 1, 0) + 1
    ranges = {
        "pdops_ports.http_base": range(ports.http_base, ports.http_base + span),
        "pdops_ports.bootstrap_base": range(ports.bootstrap_base, ports.bootstrap_base + span + 1),
        # SGLang takes a few ports above the dist-init port for its own sockets.
        "pdops_ports.dist_init_base": range(ports.dist_init_base, ports.dist_init_base + span + ports.stride - 1),
    }
    singles = {"pdops_gateway.port": gateway.port, "pdops_gateway.prometheus_port": gateway.prometheus_port}
    if gateway.port == gateway.prometheus_port:
        raise InvalidInput("pdops_gateway.prometheus_port", f"port {gateway.port} is also pdops_gateway.port",
                           fix="give Prometheus its own port")
    names = list(ranges)
    for i, a in enumerate(names):
        ra = ranges[a]
        if ra[-1] > 65535:
            raise InvalidInput(a, f"ports up to {ra[-1]} exceed 65535", fix="lower the base port")
        for b in names[i + 1:]:
            rb = ranges[b]
            if ra.start < rb.stop and rb.start < ra.stop:
                raise InvalidInput(b, f"ports {rb.start}-{rb.stop - 1} collide with {a} ({ra.start}-{ra.stop - 1})",
                                   fix="move one base so the ranges do not overlap")
        if ra.start < MOONCAKE_RPC_PORTS.stop and MOONCAKE_RPC_PORTS.start < ra.stop:
            raise InvalidInput(a, f"ports {ra.start}-{ra.stop - 1} collide with Mooncake's RPC range 15000-17000",
                               fix="move the base outside 15000-17000")
        for s, p in singles.items():
            if p in ra:
                raise InvalidInput(s, f"port {p} collides with {a} ({ra.start}-{ra.stop - 1})",
                                   fix="pick a gateway port outside the instance port ranges")
