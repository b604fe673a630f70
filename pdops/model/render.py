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
from pdops.model.inventory import GatewayNode, Inventory
from pdops.model.commands import engine_argv, engine_env, gateway_argv, gateway_grace_s, runtime_dir
from pdops.model.placement import Placement
from pdops.model import membership
from pdops.model.versions import SMG_VERSION

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
