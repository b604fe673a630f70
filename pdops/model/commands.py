"""What each process of the cluster is started with: an engine rank's SGLang argument list and
environment (the same list runs real SGLang on GPU hosts and `pdops.sim` in the lab; real SGLang on
CPU in the lab with its CPU stand-ins), the gateway's (smg) argument list, and where a unit's
runtime files are. Python computes every value; pdops.model.render writes them into files."""

from __future__ import annotations

import json
from pathlib import Path

from pdops.errors import InvalidInput
from pdops.model.inventory import GatewayNode, Inventory
from pdops.model.placement import Instance, Placement, Rank
from pdops.model.versions import MOONCAKE_VERSION, SGLANG_VERSION


def runtime_dir(unit: str) -> str:
    """The unit's RuntimeDirectory= (under /run), where its launch script notes its PID and config id."""
    return "pdops/" + unit.removesuffix(".service")


RUN_DIR = "/run"


def engine_tmpdir(unit: str) -> str:
    """An engine's TMPDIR: a directory of its unit's RuntimeDirectory= (engine.service.j2), made by
    systemd at each start and removed at each stop."""
    return f"{RUN_DIR}/{runtime_dir(unit)}/tmp"


# ---------------------------------------------------------------- engine

def engine_module(inv: Inventory) -> str:
    return "pdops.sim" if inv.engine == "sim" else "sglang.launch_server"


def ib_device_map(inv: Inventory, rank: Rank) -> dict[str, str]:
    """Per-GPU NIC map for --disaggregation-ib-device, keyed by the GPU index SGLang sees
    (local, after CUDA_VISIBLE_DEVICES)."""
    host = inv.host(rank.host)
    return {str(local): host.nic_for_gpu(phys).device for local, phys in enumerate(rank.gpus)}


# The lab's CPU profile (docs/lab.md): the stand-ins for GPU-only packages SGLang imports, put on
# the engine's PYTHONPATH (pdops/lab/cpu_engine/standins; a path, not an import: nothing of the lab
# loads here). A cpu profile is refused outside the lab (pdops.model.inventory.validate).
CPU_STANDINS = Path(__file__).resolve().parents[1] / "lab" / "cpu_engine" / "standins"
# Ports a CPU-profile engine binds on every address: gloo's store (`--nccl-port`), the engine-info
# bootstrap server, and Mooncake's RPC and data ports in [MC_MIN_RPC_PORT, MC_MAX_RPC_PORT] (below
# 32768, or it falls back to 15000-17000). Lab hosts share one network namespace, and so do two labs
# run side by side (`make test`'s workers): each engine gets its own, from the last two octets of its
# host's address and its slot (128 blocks), away from the lab's other ports (8998+, 20000+, 29000+).
MC_PORT_FLOOR = 15000
MC_PORTS_PER_ENGINE = 100
NCCL_PORT_FLOOR = 28000
ENGINE_INFO_PORT_FLOOR = 28200


def cpu_engine_ports(inv: Inventory, inst: Instance, rank: Rank) -> dict[str, int]:
    """The ports a CPU-profile engine binds beyond http and bootstrap. On GPU hosts SGLang picks them
    itself; in the lab pdops gives each engine its own (see above)."""
    parts = rank.data_addr.split(".")
    o3, o4 = (int(parts[2]), int(parts[3])) if len(parts) == 4 and all(x.isdigit() for x in parts) else (0, 0)
    block = ((o3 % 4) * 4 + o4 % 4) * 8 + inst.slot % 8
    mc_min = MC_PORT_FLOOR + MC_PORTS_PER_ENGINE * block
    return {"nccl": NCCL_PORT_FLOOR + block, "engine_info": ENGINE_INFO_PORT_FLOOR + block,
            "mc_min": mc_min, "mc_max": mc_min + MC_PORTS_PER_ENGINE - 1}


def engine_args(inv: Inventory, pl: Placement, inst: Instance, rank: Rank) -> list[str]:
    """SGLang flags for one rank of one instance: full flag names, the host's data address."""
    prof = inv.profile
    b = prof.bundle
    args = [
        "--model-path", prof.model_path,
        "--served-model-name", prof.served_model_name,
        "--host", rank.data_addr,
        "--port", str(inst.http_port),
        "--tp-size", str(prof.tp),
        "--pp-size", str(prof.pp),
        "--ep-size", str(prof.ep),
        "--disaggregation-mode", inst.role,
        "--disaggregation-transfer-backend", prof.transfer_backend,
        "--disaggregation-decode-allocation-policy", prof.decode_allocation_policy,
    ]
    if inst.role == "prefill":
        args += ["--disaggregation-bootstrap-port", str(inst.bootstrap_port)]
    if prof.transfer_backend == "mooncake":
        args += ["--disaggregation-ib-device", json.dumps(ib_device_map(inv, rank), separators=(",", ":"))]
    if prof.device == "cpu":
        ports = cpu_engine_ports(inv, inst, rank)
        args += ["--device", "cpu", "--nccl-port", str(ports["nccl"]),
                 "--engine-info-bootstrap-port", str(ports["engine_info"])]
        if inst.role == "decode":
            # the decode's default retraction backup (host_pool) calls torch.cuda.cudart()
            args += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    for key, flag in (("chunked_prefill_size", "--chunked-prefill-size"),
                      ("max_prefill_tokens", "--max-prefill-tokens"),
                      ("mem_fraction_static", "--mem-fraction-static"),
                      ("context_length", "--context-length"),
                      ("max_running_requests", "--max-running-requests"),
                      ("page_size", "--page-size")):
        if b.get(key) is not None:
            args += [flag, str(b[key])]
    if inst.nnodes > 1:
        args += ["--nnodes", str(inst.nnodes), "--node-rank", str(rank.node_rank),
                 "--dist-init-addr", f"{inst.head.data_addr}:{inst.dist_init_port}"]
    # Structured request log: the drain reads request.received / request.finished per rid.
    args += ["--enable-metrics", "--log-requests", "--log-requests-level", "0", "--log-requests-format", "json",
             "--trust-remote-code"]
    args += list(prof.extra_args)
    return override_args(args, inv.engine_overrides.get(inst.id, ()))


def override_args(args: list[str], overrides) -> list[str]:
    """`args` with each (flag, value) of `overrides` replacing that flag's value, or added; a value
    of None is a flag without a value (store_true); False removes the flag."""
    out = list(args)
    for flag, value in overrides:
        if flag in out:
            i = out.index(flag)
            has_value = i + 1 < len(out) and not out[i + 1].startswith("--")
            del out[i:i + (2 if has_value else 1)]
        if value is False:
            continue
        out += [flag] if value is None else [flag, str(value)]
    return out


def engine_env(inv: Inventory, inst: Instance, rank: Rank) -> dict[str, str]:
    """Transport environment computed from the inventory: NCCL/Gloo, Mooncake, SGLang host IP."""
    host = inv.host(rank.host)
    nics = []
    for g in rank.gpus:
        nic = host.nic_for_gpu(g)
        if nic not in nics:
            nics.append(nic)
    gid = {n.gid_index for n in nics}
    if len(gid) > 1:
        raise InvalidInput(f"hosts.{host.name}.pdops_nics", f"NICs used by {inst.id} have different GID indexes {sorted(gid)}",
                           fix="NCCL and Mooncake take one GID index per process; align the NICs' gid_index")
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, rank.gpus)),
        "SGLANG_HOST_IP": rank.data_addr,
        "NCCL_IB_HCA": ",".join(n.device for n in nics),
        "NCCL_SOCKET_IFNAME": ",".join(dict.fromkeys(n.netdev for n in nics)),
        "GLOO_SOCKET_IFNAME": nics[0].netdev,
        "NCCL_IB_GID_INDEX": str(nics[0].gid_index),
        "MC_GID_INDEX": str(nics[0].gid_index),
        "MOONCAKE_PROTOCOL": "rdma",
        "PDOPS_CLUSTER": inv.cluster,
        "PDOPS_INSTANCE": inst.id,
        "PDOPS_ROLE": inst.role,
        "PDOPS_NODE_RANK": str(rank.node_rank),
        # the pinned engine versions: an upgrade changes every engine's config id, so a change
        # replaces (rolls) every instance onto it
        "PDOPS_SGLANG_VERSION": SGLANG_VERSION,
        "PDOPS_MOONCAKE_VERSION": MOONCAKE_VERSION,
        # SGLang makes its IPC sockets (zmq ipc://), its metrics directory and other scratch files with
        # Python's tempfile and leaves some behind at every stop (observed in the lab): under the unit's
        # RuntimeDirectory, systemd removes them when the unit stops or restarts. Caches that must
        # outlive a restart (e.g. TORCHINDUCTOR_CACHE_DIR) go to a persistent path in the profile's env.
        "TMPDIR": engine_tmpdir(inst.unit(rank.node_rank)),
    }
    if inv.profile.transfer_backend == "nixl":
        env["UCX_NET_DEVICES"] = ",".join(f"{n.device}:1" for n in nics)
    if inv.profile.device == "cpu":
        ports = cpu_engine_ports(inv, inst, rank)
        env.update({
            "SGLANG_USE_CPU_ENGINE": "1",
            "PYTHONPATH": str(CPU_STANDINS),
            "MOONCAKE_PROTOCOL": "tcp",
            "MC_MIN_RPC_PORT": str(ports["mc_min"]), "MC_MAX_RPC_PORT": str(ports["mc_max"]),
            # flashinfer is imported even on CPU and writes a log under $HOME; a lab host's root
            # is read-only: its scratch directory, removed with it
            "HOME": engine_tmpdir(inst.unit(rank.node_rank)),
        })
    if inv.engine == "sim" and inv.profile.gpu_memory_gib:
        env["PDOPS_SIM_GPU_MEMORY_GIB"] = f"{inv.profile.gpu_memory_gib:g}"
    env.update(inv.profile.env)
    if inst.id in inv.sim_faults:
        env["PDOPS_SIM_FAULTS"] = inv.sim_faults[inst.id]
    return env


def engine_argv(inv: Inventory, pl: Placement, inst: Instance, rank: Rank) -> list[str]:
    return [inv.engine_python, "-m", engine_module(inv)] + engine_args(inv, pl, inst, rank)


# ---------------------------------------------------------------- gateway

def gateway_args(inv: Inventory, node: GatewayNode) -> list[str]:
    """`smg launch` flags of one gateway: PD mode, no static workers (pdops registers them, and the
    unit's ExecStartPost registers them again after every start: pdops.model.membership), retries
    off. No mesh: each gateway is independent and pdops gives each every worker (docs/gateway.md)."""
    gw = inv.gateway
    return [
        "launch", "--pd-disaggregation",
        "--host", node.addr, "--port", str(node.port),
        "--prometheus-host", node.addr, "--prometheus-port", str(node.prometheus_port),
        # Rule 3: a failed generation request is never replayed.
        "--disable-retries",
        "--max-concurrent-requests", str(gw.max_concurrent_requests),
        "--queue-size", str(gw.queue_size),
        "--health-check-interval-secs", str(gw.health_check_interval_secs),
        "--health-failure-threshold", str(gw.health_failure_threshold),
        # A breaker opened by failures (a dead engine, or its PD peer's) half-opens after this long:
        # the health detection window (threshold x interval), so a worker that stays dead is out by
        # its health first and gets no trial request (docs/gateway.md "Circuit breakers", measured).
        "--cb-failure-threshold", str(gw.cb_failure_threshold),
        "--cb-success-threshold", str(gw.cb_success_threshold),
        "--cb-timeout-duration-secs", str(gw.cb_timeout_secs),
        # A worker queued before its engine answers (after a reboot) is probed again this often,
        # not every 30 s (smg's default), until --worker-startup-timeout-secs.
        "--worker-startup-check-interval", "2",
        # On SIGTERM (a restart) smg answers 503 on readiness, keeps accepting for up to 5 s, then
        # waits for every request in flight up to this long: a restart cuts no stream within it.
        "--shutdown-grace-period-secs", str(gateway_grace_s(inv)),
    ] + [a for flag, val in (("--policy", gw.policy), ("--prefill-policy", gw.prefill_policy),
                             ("--decode-policy", gw.decode_policy)) if val for a in (flag, val)]


def gateway_grace_s(inv: Inventory) -> int:
    """How long a stopping gateway waits for the requests in flight: the drain budget, as an instance."""
    return int(inv.drain_budget_s)


def gateway_argv(inv: Inventory, node: GatewayNode) -> list[str]:
    return [inv.gateway_binary] + gateway_args(inv, node)
