"""The inventory as pdops holds it: hosts, GPUs, NICs, gateway, ports, the model profile (data)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from pdops.errors import InvalidInput, one_of


PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"


ENGINES = ("sglang", "sim")


LINK_LAYERS = ("RoCE", "IB")


TRANSFER_BACKENDS = ("mooncake", "nixl", "mooncake_tcp")
# Where a profile runs the engine: "cuda" (GPU hosts) or "cpu" (the lab only: real SGLang on the
# machine's CPU, docs/lab.md; refused unless pdops_virtual_hardware is set)
DEVICES = ("cuda", "cpu")


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
    # service objectives the alert rules use (pdops.ops.prometheus), e.g. {"ttft_p99_s": 5}
    slo: dict = field(default_factory=dict)
    # memory of one GPU of the instances' hosts (GiB); the sim's memory model runs against it
    gpu_memory_gib: float | None = None
    device: str = "cuda"

    @property
    def gpus_per_instance(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class GatewayNode:
    """One smg process of the cluster: the host it runs on and the address it listens on. Every
    node takes the same port and Prometheus port (on its own host's data address)."""

    host: str
    addr: str
    port: int
    prometheus_port: int

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.addr}:{self.prometheus_port}/metrics"


@dataclass(frozen=True)
class Gateway:
    """The cluster's model gateways (`pdops_gateway`): one smg per node, independent of each other,
    every one given every worker by pdops (docs/gateway.md "Two or more gateways"); the settings
    below are the same on each."""

    nodes: tuple[GatewayNode, ...]
    port: int
    prometheus_port: int
    api_key_file: str | None
    max_concurrent_requests: int
    queue_size: int
    health_check_interval_secs: int
    # smg's circuit breaker and health thresholds (docs/gateway.md "Circuit breakers": chosen from
    # measurement on smg 1.13.0, why each value)
    cb_failure_threshold: int = 10
    cb_success_threshold: int = 3
    cb_timeout_secs: int = 15
    health_failure_threshold: int = 3
    # Where a lone gateway's stand-in listens while the gateway restarts behind the admission layer
    # (make before break: docs/gateway.md "Restarting the only gateway"); 0: port - 1 and
    # prometheus_port - 1
    standby_port: int = 0
    standby_prometheus_port: int = 0
    # The python of the gateway's own environment (smg installed, no torch); smg sits beside it
    python: str = "/opt/pdops/gateway-venv/bin/python"
    # Routing (smg --policy / --prefill-policy / --decode-policy); None: the gateway's default
    policy: str | None = None
    prefill_policy: str | None = None
    decode_policy: str | None = None

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(n.host for n in self.nodes)

    @property
    def urls(self) -> dict[str, str]:
        """{host: URL} of every gateway, as a revision records them."""
        return {n.host: n.url for n in self.nodes}

    @property
    def first(self) -> GatewayNode:
        """The first gateway named: the record's default host, and where a client with no admission
        layer in front is pointed by the docs' examples (it should be given every node's URL)."""
        return self.nodes[0]

    @property
    def step_host(self) -> str | None:
        """The host a step on "the gateway" names: the one gateway's, or None when it acts on several."""
        return self.nodes[0].host if len(self.nodes) == 1 else None

    def on_each(self) -> str:
        """How a step says where: "" for one gateway, " on each of the N gateways (a, b)" for several."""
        n = len(self.nodes)
        return "" if n == 1 else f" on each of the {n} gateways ({', '.join(self.hosts)})"

    def standby(self, host: str) -> GatewayNode:
        """The stand-in smg of a lone gateway: same host and address, its own ports."""
        n = self.node(host)
        return GatewayNode(n.host, n.addr, self.standby_port or n.port - 1,
                           self.standby_prometheus_port or n.prometheus_port - 1)

    def node(self, host: str) -> GatewayNode:
        for n in self.nodes:
            if n.host == host:
                return n
        raise InvalidInput("gateway", f"{host!r} runs no gateway of this cluster",
                           fix=one_of(self.hosts, host, "gateway"))


DEFAULT_STATE_DIR = "/var/lib/pdops/state"


ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380


@dataclass(frozen=True)
class EtcdSetting:
    """An etcd cluster that holds the record (`pdops_state.etcd`): its client URLs, the key prefix
    of this cluster's record, TLS files on the operator machine (optional), and, when pdops runs
    the members itself (`members`), the inventory hosts they run on (`inv state.etcd-up`)."""

    endpoints: tuple[str, ...]
    prefix: str
    members: tuple[str, ...] = ()
    member_addrs: tuple[str, ...] = ()
    ca: str | None = None
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class StateLocation:
    """Where the cluster's record and lock live (`pdops_state`): `backend` "host" (a host of the
    inventory and a dir, reached over SSH; the default) or "etcd" (`etcd`). The host and dir are
    kept for `inv state.migrate`, which copies between the two."""

    host: str
    dir: str = DEFAULT_STATE_DIR
    backend: str = "host"
    etcd: EtcdSetting | None = None


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
    legacy_digest: str = ""  # the digest with pdops_state, as records made before it could move hold: `matches`
    # engine sim only: {instance id: PDOPS_SIM_FAULTS value} (docs/sim.md), for lab tests
    sim_faults: dict = field(default_factory=dict, compare=False)
    # {instance id: ((flag, value or None), ...)}: SGLang flags that replace or add to the profile's
    # for that instance only (`inv probe` renders a candidate bundle this way; never read from a file)
    engine_overrides: dict = field(default_factory=dict, compare=False)
    # the admission layer (pdops.model.admission.AdmissionConfig), validated once at load; None: none
    admission: Any = field(default=None, compare=False, repr=False)
    # where Prometheus reads the target file (pdops.model.prometheus_setting.PrometheusConfig); None: nowhere
    prometheus: Any = field(default=None, compare=False, repr=False)
    # where the shared record and lock live (`pdops_state`); None only for inventories built by hand
    state: StateLocation | None = field(default=None, compare=False)

    def matches(self, inventory_hash: str) -> bool:
        """This inventory is the one a revision recorded (`inventory_hash`): its digest, or, for a
        revision recorded before the record's location left the digest, the digest with it."""
        return inventory_hash in (self.digest, self.legacy_digest)

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
        raise InvalidInput("host", f"unknown host {name!r}", fix=one_of([h.name for h in self.hosts], name))

    @property
    def gateway_binary(self) -> str:
        return str(Path(self.gateway.python).parent / "smg")

    @property
    def total_gpus(self) -> int:
        return sum(h.gpu_count for h in self.hosts)


def max_slots(hosts: tuple[Host, ...], profile: Profile) -> int:
    g = profile.gpus_per_instance
    return max((h.gpu_count // g if g <= h.gpu_count else 1) for h in hosts)
