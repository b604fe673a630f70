"""Rendering: placement -> per-host files (units, launch scripts, env files) + manifest.

Python computes every value (flags, ports, transport environment); the Jinja2 templates
in templates/ only substitute. The same argument list runs real SGLang in production
and `pdops.sim` in the lab.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import jinja2

from pdops.model import admission as adm_mod
from pdops.errors import InvalidInput
from pdops.model.inventory import GatewayNode, Inventory
from pdops.model.placement import Instance, Placement, Rank
from pdops.model import membership
from pdops.model.versions import MOONCAKE_VERSION, SGLANG_VERSION, SMG_VERSION

TEMPLATES = Path(__file__).resolve().parents[2] / "templates"

# Host layout (same on every host).
UNIT_DIR = "/etc/systemd/system"
ENV_DIR = "/etc/pdops"
BIN_DIR = "/opt/pdops/bin"
GATEWAY_UNIT = "pdops-gateway.service"
# the only gateway's stand-in while it restarts behind the admission layer: a transient unit, never enabled
STANDBY_UNIT = "pdops-gateway-standby.service"
SLICE_UNIT = "pdops.slice"



@dataclass(frozen=True)
class RenderedFile:
    host: str
    path: str  # absolute path on the host
    content: str
    mode: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content.encode()).hexdigest()


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, autoescape=False)


def _quote_env_value(v: str) -> str:
    """Quote a value for a systemd EnvironmentFile: bare when plainly safe, else double-quoted."""
    if re.fullmatch(r"[A-Za-z0-9_.,:/=+@%-]*", v):
        return v
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


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


# ---------------------------------------------------------------- files

def _launch_script(inv: Inventory, what: str, argv: list[str], secret_flag: str | None, key_file: str | None,
                   *, more_args: bool = False) -> str:
    # which files this process starts from, for pdops.reads.observe (the PID stays the same through exec);
    # an engine's unit has two runtime directories (its own, its TMPDIR), which systemd lists joined by
    # ':' in $RUNTIME_DIRECTORY: the note goes into the first
    pre: list[str] = [f'[ -z "${{RUNTIME_DIRECTORY:-}}" ] || printf \'%s %s\\n\' "$$" "${{{CONFIG_VAR}:-}}" '
                      '> "${RUNTIME_DIRECTORY%%:*}/config"']
    line = " ".join(shlex.quote(a) for a in argv)
    if secret_flag and key_file:
        # The key is read from its 0600 file at start; it is never in a rendered file or a log.
        pre.append(f'key=$(cat {shlex.quote(key_file)}) || {{ echo "cannot read {key_file}" >&2; exit 78; }}')
        line += f' {secret_flag} "$key"'
    if more_args:  # flags given to the script come last and win (a lone gateway's stand-in: its own ports)
        line += ' "$@"'
    return _env().get_template("launch.sh.j2").render(cluster=inv.cluster, what=what, pre=pre, argv=line)


def _env_file(inv: Inventory, what: str, env: dict[str, str]) -> str:
    items = [(k, _quote_env_value(v)) for k, v in env.items()]
    return _env().get_template("env.j2").render(cluster=inv.cluster, what=what, env=items)


def _unit_common(inv: Inventory) -> dict:
    return {"cluster": inv.cluster, "start_limit_interval": 600, "start_limit_burst": 3,
            "limit_nofile": 1048576, "restart_sec": 5}


# The gateway restarts fast (no model) and while it is down nothing is served: restart it after
# 1 s, and give up only after 10 failures within 60 s (engines: 3 within 600 s). Found by
# bench/gateway_restart.py: 4 SIGKILLs within minutes left it failed for good under the engines' limit.
GATEWAY_RESTART = {"restart_sec": 1, "start_limit_interval": 60, "start_limit_burst": 10}


def gateway_restart_sec(inv: Inventory) -> int:
    """How long systemd waits before it starts a crashed gateway again. Alone, 1 s: nothing is served
    while it is down. One of several behind the admission layer: longer than HAProxy takes to mark
    it DOWN (its check refused `fall` times, `inter` apart) plus a margin, so that HAProxy never sends
    a request to the new process before its start-up list registered every worker (smg answers
    requests at once, with 503 "no available workers"): it must pass its readiness check `rise`
    times first. Found by the lab test that SIGKILLs one of two gateways under load."""
    if len(inv.gateway.nodes) > 1 and inv.admission is not None:
        return adm_mod.CHECK_INTER_MS * adm_mod.CHECK_FALL // 1000 + 2
    return GATEWAY_RESTART["restart_sec"]


def render_files(inv: Inventory, pl: Placement) -> list[RenderedFile]:
    """Every file of a revision, per host. Pure: nothing is written."""
    tpl = _env()
    files: list[RenderedFile] = []
    hosts_used = sorted({r.host for i in pl.instances for r in i.ranks} | set(inv.gateway.hosts))
    slice_text = tpl.get_template("pdops.slice.j2").render(cluster=inv.cluster)
    for h in hosts_used:
        files.append(RenderedFile(h, f"{UNIT_DIR}/{SLICE_UNIT}", slice_text, 0o644))
    for inst in pl.instances:
        for rank in inst.ranks:
            unit = inst.unit(rank.node_rank)
            stem = unit.removesuffix(".service")
            script = f"{BIN_DIR}/{stem}.sh"
            env_file = f"{ENV_DIR}/{stem}.env"
            what = f"{inst.role} {inst.id} node {rank.node_rank}/{inst.nnodes}"
            unit_text = tpl.get_template("engine.service.j2").render(
                role=inst.role, instance=inst.id, nnodes=inst.nnodes, node_rank=rank.node_rank, engine=inv.engine,
                launch_script=script, env_file=env_file, timeout_stop_sec=inv.stop_timeout_s,
                runtime_dir=runtime_dir(unit), tmp_dir=runtime_dir(unit) + "/tmp", **_unit_common(inv))
            script_text = _launch_script(inv, what, engine_argv(inv, pl, inst, rank), None, None)
            env = engine_env(inv, inst, rank)
            env[CONFIG_VAR] = config_id(unit_text, script_text, _env_file(inv, what, env), slice_text)
            files.append(RenderedFile(rank.host, f"{UNIT_DIR}/{unit}", unit_text, 0o644))
            files.append(RenderedFile(rank.host, script, script_text, 0o755))
            files.append(RenderedFile(rank.host, env_file, _env_file(inv, what, env), 0o600))
    for node in inv.gateway.nodes:
        files += _gateway_files(inv, node, slice_text)
    adm = admission_config(inv)
    if adm is not None:
        for h in adm.hosts:
            if h not in hosts_used:
                files.append(RenderedFile(h, f"{UNIT_DIR}/{SLICE_UNIT}",
                                          tpl.get_template("pdops.slice.j2").render(cluster=inv.cluster), 0o644))
        files += render_admission_files(inv, adm)
    return files


def gateway_paths() -> tuple[str, str, str, str]:
    """Where one gateway's own files go on its host: its unit, start-up-list script, launch script and env file."""
    return (f"{UNIT_DIR}/{GATEWAY_UNIT}", membership.SCRIPT_PATH, f"{BIN_DIR}/pdops-gateway.sh", f"{ENV_DIR}/gateway.env")


def _gateway_files(inv: Inventory, node: GatewayNode, slice_text: str) -> list[RenderedFile]:
    """One gateway's unit, launch script, env file and start-up-list script, on its host."""
    tpl = _env()
    gw = inv.gateway
    gw_unit = tpl.get_template("gateway.service.j2").render(
        smg_version=SMG_VERSION, launch_script=f"{BIN_DIR}/pdops-gateway.sh",
        env_file=f"{ENV_DIR}/gateway.env", exec_start_post=membership.exec_start_post(inv, node),
        workers_file=membership.PATH, runtime_dir=runtime_dir(GATEWAY_UNIT),
        timeout_stop_sec=gateway_grace_s(inv) + 30,
        **{**_unit_common(inv), **GATEWAY_RESTART, "restart_sec": gateway_restart_sec(inv)})
    gw_script = _launch_script(inv, "model gateway", gateway_argv(inv, node), "--api-key", gw.api_key_file,
                               more_args=True)
    gw_env = {"RUST_LOG": "info", "PDOPS_CLUSTER": inv.cluster, "PDOPS_SMG_VERSION": SMG_VERSION}
    gw_env[CONFIG_VAR] = config_id(gw_unit, gw_script, _env_file(inv, "model gateway", gw_env), slice_text,
                                   membership.SCRIPT)
    unit_path, list_script_path, script_path, env_path = gateway_paths()
    return [RenderedFile(node.host, unit_path, gw_unit, 0o644),
            RenderedFile(node.host, list_script_path, membership.SCRIPT, 0o755),
            RenderedFile(node.host, script_path, gw_script, 0o755),
            RenderedFile(node.host, env_path, _env_file(inv, "model gateway", gw_env), 0o600)]


# Every unit's env file names the files it was rendered with: a digest of its unit, launch script,
# env file (without this line) and slice. Its launch script notes "<PID> <id>" in the unit's
# RuntimeDirectory before it execs, so which files a process was started from is read from what
# the process left at its start (checked against MainPID), not assumed from the files on disk
# (pdops.reads.observe). Not /proc/<pid>/environ: smg sets its process title over that area.
CONFIG_VAR = "PDOPS_CONFIG"


def runtime_dir(unit: str) -> str:
    """The unit's RuntimeDirectory= (under /run), where its launch script notes its PID and config id."""
    return "pdops/" + unit.removesuffix(".service")


RUN_DIR = "/run"


def engine_tmpdir(unit: str) -> str:
    """An engine's TMPDIR: a directory of its unit's RuntimeDirectory= (engine.service.j2), made by
    systemd at each start and removed at each stop."""
    return f"{RUN_DIR}/{runtime_dir(unit)}/tmp"


def config_id(*texts: str) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(hashlib.sha256(t.encode()).digest())
    return h.hexdigest()[:16]


def config_ids(files: list[RenderedFile]) -> dict[str, str]:
    """{"host:unit": config id} of every unit whose env file carries one (engines, gateway)."""
    out = {}
    for f in files:
        if f.path.startswith(ENV_DIR + "/") and f.path.endswith(".env"):
            for line in f.content.splitlines():
                if line.startswith(CONFIG_VAR + "="):
                    stem = f.path.rsplit("/", 1)[-1].removesuffix(".env")
                    unit = GATEWAY_UNIT if stem == "gateway" else f"{stem}.service"
                    out[f"{f.host}:{unit}"] = line.split("=", 1)[1].strip().strip("'\"")
    return dict(sorted(out.items()))


SNAPSHOT_FORMAT = 1


def snapshot_of(inv: Inventory, files: list[RenderedFile]) -> dict:
    """What a revision keeps to be returned to without re-rendering: every rendered file but the
    admission layer's (its key map holds keys; a change never rewrites it), the inventory files as
    they were on disk, and the model profile as loaded."""
    from dataclasses import asdict

    adm = admission_config(inv)
    skip = {(f.host, f.path) for f in render_admission_files(inv, adm)} if adm is not None else set()
    texts = {}
    for path in inv.files:
        try:
            texts[str(path)] = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            texts[str(path)] = f"(unreadable: {exc.strerror})"
    return {"format": SNAPSHOT_FORMAT, "inventory_files": texts, "profile": asdict(inv.profile),
            "files": [{"host": f.host, "path": f.path, "mode": f.mode, "content": f.content} for f in files
                      if (f.host, f.path) not in skip]}


def snapshot_subset(snapshot: dict | None, manifest: dict) -> dict | None:
    """`snapshot` with only the files `manifest` names (a drain's revision keeps the rest as they were)."""
    if snapshot is None:
        return None
    keep = {(h, p) for h, files in manifest.items() for p in files}
    return {**snapshot, "files": [f for f in snapshot["files"] if (f["host"], f["path"]) in keep]}


def files_of(snapshot: dict) -> list[RenderedFile]:
    return [RenderedFile(f["host"], f["path"], f["content"], int(f["mode"])) for f in snapshot["files"]]


def admission_config(inv: Inventory) -> adm_mod.AdmissionConfig | None:
    """The admission layer of this inventory (validated at load, keys read from the operator's 0600 file), or None."""
    return inv.admission


def haproxy_config(cfg: adm_mod.AdmissionConfig, *, keys_map_path: str = adm_mod.KEYS_MAP_PATH,
                   errorfile_path: str = adm_mod.ERRORFILE_PATH, user: str | None = "haproxy",
                   gateway_key_env: str | None = None, stats_socket: str | None = None,
                   host: str | None = None) -> str:
    """The HAProxy config text of one admission host (default: the first). Holds no key: keys come
    from `keys_map_path`. With a virtual address it binds that too (the host that does not hold
    it yet can, by the sysctl pdops renders beside: `net.ipv4.ip_nonlocal_bind`)."""
    def brk(a: str) -> str:
        return f"[{a}]" if ":" in a else a

    addr = cfg.addr_of(host or cfg.host)
    binds = [f"{brk(addr)}:{cfg.port}"] + ([f"{brk(cfg.vip)}:{cfg.port}"] if cfg.vip else [])
    servers = [(f"gw-{h}", f"{brk(a)}:{port}", False) for h, a, port in cfg.gateways]
    if cfg.standby:  # disabled (MAINT) until a restart of the lone gateway puts it in service
        h, a, port = cfg.standby
        servers.append((f"gw-{adm_mod.standby_server(h)}", f"{brk(a)}:{port}", True))
    return _env().get_template("haproxy.cfg.j2").render(
        cap=cfg.cap, queue=cfg.queue, queue_timeout_s=cfg.queue_timeout_s, overflow_status=cfg.overflow_status,
        binds=binds, servers=servers, keys_map=keys_map_path, admit_addr=adm_mod.admit_address(addr, cfg.port),
        admit_server=adm_mod.ADMIT_SERVER, gateways_backend=adm_mod.GATEWAYS_BACKEND, full_weight=adm_mod.FULL_WEIGHT,
        check_inter_ms=adm_mod.CHECK_INTER_MS, check_fall=adm_mod.CHECK_FALL, check_rise=adm_mod.CHECK_RISE,
        errorfile=errorfile_path, user=user, gateway_key_env=gateway_key_env, stats_socket=stats_socket,
        stream_timeout_s=adm_mod.STREAM_TIMEOUT_S, retries=adm_mod.CONN_RETRIES, maxconn=max(4 * (cfg.cap + cfg.queue), 1024),
        metrics_bind=(f"{brk(addr)}:{cfg.metrics_port}" if cfg.metrics_port else None),
    )


def keepalived_config(inv: Inventory, cfg: adm_mod.AdmissionConfig, host: str) -> str:
    """keepalived's VRRP instance on one admission host: the virtual address held by one host at a
    time, the first named preferred (priority 150, the others 100 less 10 per place), moved when
    the holder's HAProxy unit is not active (checked every 2 s, 2 failures)."""
    place_ = cfg.hosts.index(host)
    return _env().get_template("keepalived.conf.j2").render(
        cluster=inv.cluster, host=host, iface=cfg.vrrp_interface, router_id=cfg.vrrp_router_id,
        priority=150 if place_ == 0 else max(100 - 10 * (place_ - 1), 1), vip=cfg.vip,
        prefix=128 if ":" in cfg.vip else 32, unit=adm_mod.UNIT,
        # VRRP speaks between the hosts' own data addresses (a listen address may be 0.0.0.0)
        peers=[inv.host(h).data_addr for h in cfg.hosts if h != host], own=inv.host(host).data_addr)


def render_admission_files(inv: Inventory, cfg: adm_mod.AdmissionConfig) -> list[RenderedFile]:
    """On each admission host: haproxy.cfg, the 0600 key map, the overflow errorfile and the unit;
    with a virtual address also keepalived's config and the sysctl that lets HAProxy bind it."""
    key_file = inv.gateway.api_key_file
    env = adm_mod.GATEWAY_KEY_ENV if key_file else None
    unit = _env().get_template("admission.service.j2").render(
        cluster=inv.cluster, haproxy=adm_mod.HAPROXY_BIN, config=adm_mod.CONFIG_PATH, slice=SLICE_UNIT,
        gateway_key_file=key_file, gateway_key_env=adm_mod.GATEWAY_KEY_ENV)
    out = []
    for h in cfg.hosts:
        text = haproxy_config(cfg, gateway_key_env=env, stats_socket=adm_mod.STATS_SOCKET, host=h)
        out += [
            RenderedFile(h, adm_mod.CONFIG_PATH, text, 0o644),
            RenderedFile(h, adm_mod.KEYS_MAP_PATH, adm_mod.keys_map(cfg.keys), 0o600),
            RenderedFile(h, adm_mod.ERRORFILE_PATH, adm_mod.overflow_response(cfg.overflow_status), 0o644),
            RenderedFile(h, f"{UNIT_DIR}/{adm_mod.UNIT}", unit, 0o644),
        ]
        if cfg.vip:
            out += [RenderedFile(h, adm_mod.KEEPALIVED_CONFIG, keepalived_config(inv, cfg, h), 0o644),
                    RenderedFile(h, adm_mod.NONLOCAL_BIND_SYSCTL,
                                 f"# Rendered by pdops ({inv.cluster}): HAProxy binds the admission VIP {cfg.vip} "
                                 "before keepalived moves it here\nnet.ipv4.ip_nonlocal_bind = 1\n"
                                 + ("net.ipv6.ip_nonlocal_bind = 1\n" if ":" in cfg.vip else ""), 0o644)]
    return out


def manifest(files: list[RenderedFile]) -> dict[str, dict[str, dict]]:
    """{host: {path: {sha256, mode}}} for every rendered file."""
    out: dict[str, dict[str, dict]] = {}
    for f in files:
        out.setdefault(f.host, {})[f.path] = {"sha256": f.sha256, "mode": oct(f.mode)}
    return {h: dict(sorted(v.items())) for h, v in sorted(out.items())}


def write_build(files: list[RenderedFile], out_dir: Path, meta: dict | None = None) -> Path:
    """Write a build folder: <out>/<host>/<path on host>, plus manifest.json. Replaces out_dir."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    for f in files:
        p = tmp / f.host / f.path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f.content)
        p.chmod(f.mode)
    doc = {"meta": meta or {}, "files": manifest(files)}
    (tmp / "manifest.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
