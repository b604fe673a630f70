"""`inv preflight`: host, GPU, RDMA, version and P x D pairing checks before any change.

Read, then decide (STYLE.md 1 and 5):

- READ: every host gets ONE batched command (one SSH round trip): each *section* is a
  command whose output is cut out of the batch and given to a pure parser
  (:data:`SECTIONS`). A host that cannot be reached fails its ``ssh`` check; the others
  are still reported.
- DECIDE: each check (:data:`CHECKS`) is a pure function
  ``(inventory, host, placement-or-None, facts) -> [CheckResult]``; a few compare hosts
  with each other afterwards (driver and versions uniform).
- PAIRING: from every decode host, a real TCP connection to every prefill host's data
  address at each bootstrap port and at one port of Mooncake's RPC range. A port no
  instance holds yet gets a temporary listener (a transient systemd unit, stopped by its
  unit name afterwards); a port held by the running instance that belongs there is
  tested as it is.

On a virtual-hardware inventory (the lab) the GPU/RDMA checks say ``skipped`` with the
reason: they never pass without hardware.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from pdops import versions as pins
from pdops.errors import InvalidInput, PdopsError, Refused, Unverified
from pdops.facts import Skipped, nvidia, q, rdma, skipped_in
from pdops.facts import cgroup as cgroup_facts
from pdops.facts import ports as port_facts
from pdops.facts import systemd as systemd_facts
from pdops.inventory import MOONCAKE_RPC_PORTS, Host, Inventory
from pdops.placement import Instance, Placement, place
from pdops.runner import run_parallel
from pdops.topology import Topology

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
VIRTUAL_REASON = "lab host has no nvidia-smi/RDMA (virtual hardware)"
GATEWAY_UNIT = "pdops-gateway.service"  # same name as pdops.render.GATEWAY_UNIT (kept import-light)
LISTEN_UNIT_PREFIX = "pdops-preflight-listen-"
DEFAULT_MIN_LOG_GIB = 5.0
MIN_FREE_RPC_PORTS = 16
PROBE_TIMEOUT_S = 3.0

Say = Callable[[str], None]


# ================================================================ results

@dataclass(frozen=True)
class CheckResult:
    host: str
    check: str
    status: str  # pass | fail | skipped
    reason: str = ""
    fix: str = ""
    evidence: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL


def _ok(host: str, check: str, reason: str, evidence: str = "") -> CheckResult:
    return CheckResult(host, check, PASS, reason, "", evidence)


def _fail(host: str, check: str, reason: str, fix: str, evidence: str = "") -> CheckResult:
    return CheckResult(host, check, FAIL, reason, fix, evidence)


def _skip(host: str, check: str, reason: str) -> CheckResult:
    return CheckResult(host, check, SKIPPED, reason)


# ================================================================ sections: command + pure parser

@dataclass(frozen=True)
class ReadError:
    """A section whose output could not be parsed (the checks reading it fail with this)."""

    section: str
    message: str
    raw: str


@dataclass(frozen=True)
class GpuDirect:
    modules: frozenset[str]
    open_kernel_module: bool | None  # None: no NVIDIA driver loaded
    kernel: tuple[int, int] | None

    @property
    def peermem(self) -> bool:
        return rdma.has_peermem(set(self.modules))

    @property
    def dmabuf(self) -> bool:
        """DMA-BUF GPUDirect: the open NVIDIA kernel module on Linux >= 5.12."""
        return bool(self.open_kernel_module) and self.kernel is not None and self.kernel >= (5, 12)


_SPLIT = "@@PDOPS-PART@@"


def gpudirect_command() -> str:
    return (f"lsmod; echo {_SPLIT}; cat /proc/driver/nvidia/version 2>/dev/null; "
            f"echo {_SPLIT}; uname -r")


def parse_gpudirect(output: str) -> GpuDirect:
    """``lsmod``, ``/proc/driver/nvidia/version`` and ``uname -r``, split by markers."""
    parts = output.split(_SPLIT)
    if len(parts) != 3:
        raise Unverified("gpudirect reader printed an unexpected layout", evidence=output[-800:])
    mods = frozenset(rdma.parse_lsmod(parts[0].strip("\n")))
    ver = parts[1].strip()
    open_mod = None if not ver else ("Open Kernel Module" in ver)
    m = re.match(r"(\d+)\.(\d+)", parts[2].strip())
    return GpuDirect(mods, open_mod, (int(m.group(1)), int(m.group(2))) if m else None)


def time_command() -> str:
    return "timedatectl show -p NTPSynchronized --value 2>&1; echo \"rc=$?\""


@dataclass(frozen=True)
class TimeSync:
    synchronized: bool | None  # None: could not tell
    detail: str


def parse_time(output: str) -> TimeSync:
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    rc = next((ln[3:] for ln in reversed(lines) if ln.startswith("rc=")), "?")
    body = [ln for ln in lines if not ln.startswith("rc=")]
    if rc == "0" and body and body[0] in ("yes", "no"):
        return TimeSync(body[0] == "yes", f"NTPSynchronized={body[0]}")
    return TimeSync(None, f"timedatectl exited {rc}: {' '.join(body)[:200]}")


def disk_command() -> str:
    return "df -P /var/log"


@dataclass(frozen=True)
class Disk:
    mount: str
    available_gib: float
    capacity: str


def parse_df(output: str) -> Disk:
    """``df -P``: POSIX format, 1024-byte blocks (header, then one line per file system)."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    if len(lines) < 2 or not lines[0].startswith("Filesystem"):
        raise Unverified("df -P printed no table", evidence=output[-500:])
    f = lines[-1].split()
    if len(f) < 6 or not f[3].isdigit():
        raise Unverified(f"unexpected df -P line: {lines[-1]!r}")
    return Disk(f[5], int(f[3]) / 1024 / 1024, f[4])


def memlock_command() -> str:
    """What systemd grants a service asking for LimitMEMLOCK=infinity, as the rendered units do.

    A transient service (unique name, collected, at most 30 s) is started with that limit and
    its MainPID's /proc limits are read, then it is stopped by its unit name: this is the
    limit as systemd sets it, which a login shell's `ulimit` or limits.conf would not show
    (PAM limits never apply to services). No D-Bus needed (`--wait --pipe` would need it)."""
    return ('u="pdops-preflight-memlock-$$.service"; '
            'timeout 20 systemd-run --quiet --unit="$u" --collect -p LimitMEMLOCK=infinity -p RuntimeMaxSec=30 '
            '/bin/sleep 30 </dev/null 2>&1; rc=$?; '
            'if [ "$rc" = 0 ]; then pid=$(systemctl show -p MainPID --value "$u"); '
            'grep "Max locked memory" "/proc/$pid/limits"; systemctl stop "$u"; fi; echo "rc=$rc"')


@dataclass(frozen=True)
class MemlockProbe:
    unlimited: bool
    detail: str


def parse_memlock(output: str) -> MemlockProbe:
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    rc = next((ln[3:] for ln in reversed(lines) if ln.startswith("rc=")), "?")
    body = [ln for ln in lines if not ln.startswith("rc=")]
    if rc == "0" and body:
        last = body[-1]
        if last.startswith("Max locked memory"):
            soft = last.split()[3] if len(last.split()) > 3 else "?"
            shown = f"{soft} bytes ({int(soft) / 2**20:g} MiB)" if soft.isdigit() else soft
            return MemlockProbe(soft == "unlimited", f"Max locked memory of a service under systemd: {shown}")
        return MemlockProbe(last == "unlimited", f"ulimit -l under systemd: {last}")
    return MemlockProbe(False, f"systemd-run exited {rc}: {' '.join(body)[:300]}")


def pids_command() -> str:
    """The cgroup of every process that listens on TCP or computes on a GPU."""
    return (
        "for p in $( { ss -Hltnp 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2; "
        "if command -v nvidia-smi >/dev/null 2>&1; then "
        "nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null; fi; } | sort -un); "
        "do echo \"pid $p\"; cat /proc/$p/cgroup 2>/dev/null; done; true"
    )


def unit_of_cgroup(path: str | None) -> str | None:
    """The systemd unit a cgroup path belongs to: its deepest ``.service``/``.scope`` component."""
    if not path:
        return None
    units = [c for c in path.split("/") if c.endswith((".service", ".scope"))]
    return units[-1] if units else None


def parse_pids(output: str) -> dict[int, str | None]:
    """{pid: unit} from :func:`pids_command` (a vanished process has no unit)."""
    out: dict[int, str | None] = {}
    pid, block = None, []

    def flush():
        if pid is not None:
            out[pid] = unit_of_cgroup(cgroup_facts.parse_proc_cgroup("\n".join(block)).path) if block else None

    for line in output.splitlines():
        if line.startswith("pid ") and line[4:].strip().isdigit():
            flush()
            pid, block = int(line[4:].strip()), []
        elif line.strip():
            block.append(line)
    flush()
    return out


VERSION_PACKAGES = ("sglang", "mooncake-transfer-engine", "nvidia-nccl-cu12", "nvidia-nccl-cu13", "sglang-router",
                    "torch")

_VERSIONS_SCRIPT = (
    "import importlib.metadata as m, json, sys\n"
    f"names = {VERSION_PACKAGES!r}\n"
    "out = {}\n"
    "for n in names:\n"
    "    try:\n"
    "        out[n] = m.version(n)\n"
    "    except Exception:\n"
    "        out[n] = None\n"
    "if 'torch-nccl' in sys.argv[1:] and not (out['nvidia-nccl-cu12'] or out['nvidia-nccl-cu13']):\n"
    "    try:\n"
    "        import torch\n"
    "        v = torch.cuda.nccl.version()\n"
    "        out['torch.cuda.nccl'] = '.'.join(map(str, v)) if isinstance(v, tuple) else str(v)\n"
    "    except Exception as e:\n"
    "        out['torch.cuda.nccl'] = None\n"
    "        out['torch.cuda.nccl.error'] = str(e)[:200]\n"
    "print(json.dumps(out))\n"
)

# Wheel metadata folders are named `<name>-<version>.dist-info`, the name with `-`/`.` as `_`
# (the binary distribution format spec); older wheels keep capitals, hence -i.
_DIST_RE = "^(sglang|sglang[-_.]router|mooncake[-_.]transfer[-_.]engine|nvidia[-_.]nccl[-_.]cu1[23]|torch)-[^-]+[.]dist-info$"
DIST_MARK = "PDOPS-DIST-INFO"


def versions_command(engine_python: str, *, torch_nccl: bool) -> str:
    """Package versions as the engine's python sees them.

    Fast path, no interpreter start: in a virtualenv that does not see the system's packages
    (pyvenv.cfg), the `.dist-info` folders of its one site-packages are what importlib.metadata
    would read. Anything else (a system python, a venv with system packages, sglang not found
    there, or NCCL to be read from torch itself) runs the engine python with importlib.metadata."""
    py = q(engine_python)
    args = " torch-nccl" if torch_nccl else ""
    has = "printf '%s\\n' \"$found\" | grep -qiE "
    enough = has + q("^sglang-[^-]+[.]dist-info$") + (" && " + has + q("^nvidia[-_.]nccl") if torch_nccl else "")
    return (f"if [ ! -x {py} ]; then echo {q('PDOPS-SKIPPED: no engine python ' + engine_python)}; else "
            f"pre=$(dirname -- \"$(dirname -- {py})\"); found=''; sp=''; "
            "if grep -qsiE '^include-system-site-packages *= *false' \"$pre/pyvenv.cfg\"; then "
            "for d in \"$pre\"/lib/python3*/site-packages; do [ -d \"$d\" ] && [ -z \"$sp\" ] && sp=$d; done; "
            f"[ -n \"$sp\" ] && found=$(ls -- \"$sp\" | grep -iE {q(_DIST_RE)}); fi; "
            f"if {enough}; then echo \"{DIST_MARK} $sp\"; printf '%s\\n' \"$found\"; "
            f"else {py} -c {q(_VERSIONS_SCRIPT)}{args}; fi; fi")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_dist_infos(lines: list[str]) -> dict[str, str | None]:
    """{package: version} from `.dist-info` folder names; two versions of one package are both named."""
    seen: dict[str, list[str]] = {}
    for line in lines:
        line = line.strip()
        if not line.lower().endswith(".dist-info") or "-" not in line:
            continue
        name, version = line[: -len(".dist-info")].split("-", 1)
        seen.setdefault(_canonical(name), []).append(version)
    return {n: (" and ".join(sorted(set(seen[n]))) if n in seen else None) for n in VERSION_PACKAGES}


def parse_versions(output: str) -> dict[str, str | None] | Skipped:
    if (s := skipped_in(output)) is not None:
        return s
    lines = output.strip().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(DIST_MARK):
            return parse_dist_infos(lines[i + 1:])
    for line in reversed(lines):
        if line.startswith("{"):
            return json.loads(line)
    raise Unverified("the engine python printed no versions", evidence=output[-800:])


def nccl_version(v: dict) -> str | None:
    return v.get("nvidia-nccl-cu12") or v.get("nvidia-nccl-cu13") or v.get("torch.cuda.nccl")


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
)}


def gid_section(nic_device: str) -> Section:
    """One GID table per RoCE device (port 1, as Mooncake's MC_IB_PORT default)."""
    return Section(f"gids:{nic_device}", lambda i, h, p: rdma.gids_command(nic_device, 1), rdma.parse_gids)


_BEGIN, _END = "@@PDOPS-SECTION-BEGIN", "@@PDOPS-SECTION-END"


def batch_command(commands: dict[str, str]) -> str:
    """One shell command running every section in a subshell, each framed by markers with its exit code."""
    parts = []
    for name, cmd in commands.items():
        parts.append(f"echo {q(_BEGIN + ' ' + name)}; ( {cmd} ) 2>&1; echo \"{_END} {name} $?\"")
    return "; ".join(parts)


def split_sections(output: str) -> dict[str, tuple[int, str]]:
    """{section: (exit code, text)} from :func:`batch_command` output."""
    out: dict[str, tuple[int, str]] = {}
    cur, buf = None, []
    for line in output.splitlines():
        if line.startswith(_BEGIN + " "):
            cur, buf = line[len(_BEGIN) + 1:].strip(), []
        elif line.startswith(_END + " ") and cur is not None:
            rc = line.rsplit(" ", 1)[-1]
            out[cur] = (int(rc) if rc.lstrip("-").isdigit() else -1, "\n".join(buf) + ("\n" if buf else ""))
            cur = None
        elif cur is not None:
            buf.append(line)
    return out


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
    if inv.gateway.host == host.name:
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
    if inv.gateway.host == host.name:
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


def _describe_holders(holders: list[tuple]) -> str:
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
        return [_fail(host.name, "gpu", f"cannot read GPUs: {gpus.reason}",
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
        return [_fail(host.name, "gpu", "; ".join(problems),
                      "fix pdops_gpus (count, model as nvidia-smi prints it, memory_gib) or the host's hardware", ev)]
    mem = round(gpus[0].memory_total_mib / 1024, 1) if gpus and gpus[0].memory_total_mib else "?"
    return [_ok(host.name, "gpu", f"{len(gpus)} x {gpus[0].name if gpus else '-'} ({mem} GiB)", ev)]


def eval_gpu_driver(inv, host, pl, facts) -> list[CheckResult]:
    gpus = facts["gpus"]
    if isinstance(gpus, Skipped):
        return [_fail(host.name, "gpu-driver", f"cannot read the driver: {gpus.reason}", "install the NVIDIA driver")]
    drivers = sorted({g.driver_version or "?" for g in gpus})
    if len(drivers) != 1 or drivers[0] == "?":
        return [_fail(host.name, "gpu-driver", f"driver versions on this host: {drivers}",
                      "reboot after the driver upgrade so every GPU runs one driver")]
    # uniform across hosts is decided by :func:`evaluate_cluster`
    return [_ok(host.name, "gpu-driver", f"driver {drivers[0]}")]


def eval_gpu_free(inv, host, pl, facts) -> list[CheckResult]:
    gpus, apps, pid_units = facts["gpus"], facts["apps"], facts["pids"]
    if isinstance(gpus, Skipped) or isinstance(apps, Skipped):
        reason = (gpus if isinstance(gpus, Skipped) else apps).reason
        return [_fail(host.name, "gpu-free", f"cannot read GPU processes: {reason}", "install the NVIDIA driver")]
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
        return [_fail(host.name, "gpu-free", "foreign compute process on GPUs about to be used: " + "; ".join(foreign),
                      "stop that process (or drain the instance that owns it); pdops never kills processes it did "
                      "not start")]
    return [_ok(host.name, "gpu-free", f"no foreign compute process on GPU(s) {sorted(use)}")]


def _port_of(ports: list, device: str):
    mine = [p for p in ports if p.hca_id == device]
    return next((p for p in mine if p.port == 1), mine[0] if mine else None)


def eval_rdma(inv, host, pl, facts) -> list[CheckResult]:
    ports = facts["devinfo"]
    if isinstance(ports, Skipped):
        return [_fail(host.name, "rdma", f"cannot list RDMA devices: {ports.reason}",
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
        return [_fail(host.name, "rdma", "; ".join(problems),
                      "bring the port up (cable, switch port, `ip link set <netdev> up`) or fix pdops_nics "
                      "(device, link_layer)", ev)]
    return [_ok(host.name, "rdma", "; ".join(good), ev)]


def _roce_nics(host: Host):
    return [n for n in host.nics if n.link_layer == "RoCE"]


def eval_roce_gid(inv, host, pl, facts) -> list[CheckResult]:
    nics = _roce_nics(host)
    if not nics:
        return [_skip(host.name, "roce-gid", "no RoCE NIC declared (InfiniBand needs no RoCE GID)")]
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
        return [_fail(host.name, "roce-gid", "; ".join(problems), "; ".join(fixes), "\n".join(ev))]
    return [_ok(host.name, "roce-gid", "; ".join(good), "\n".join(ev))]


def eval_nic_affinity(inv, host, pl, facts) -> list[CheckResult]:
    topo = facts["topo"]
    if isinstance(topo, Skipped):
        return [_fail(host.name, "nic-affinity", f"cannot read the PCIe topology: {topo.reason}",
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
        return [_fail(host.name, "nic-affinity", "; ".join(problems),
                      ("in pdops_nics: " + "; ".join(moves)) if moves else "fix pdops_nics to match `nvidia-smi topo -m`",
                      ev)]
    return [_ok(host.name, "nic-affinity", "every GPU uses its closest NIC", ev)]


def eval_gpudirect(inv, host, pl, facts) -> list[CheckResult]:
    gd: GpuDirect = facts["gpudirect"]
    ev = f"modules: {'nvidia_peermem' if gd.peermem else 'no peermem'}; open kernel module: {gd.open_kernel_module}; " \
         f"kernel: {gd.kernel}"
    if gd.peermem:
        mod = "nvidia_peermem" if "nvidia_peermem" in gd.modules else "nv_peer_mem"
        return [_ok(host.name, "gpudirect", f"{mod} loaded", ev)]
    if gd.dmabuf:
        return [_ok(host.name, "gpudirect", "DMA-BUF (open NVIDIA kernel module, kernel "
                    f"{gd.kernel[0]}.{gd.kernel[1]})", ev)]
    why = "no NVIDIA driver loaded" if gd.open_kernel_module is None else (
        "the proprietary NVIDIA module has no DMA-BUF export" if not gd.open_kernel_module
        else f"kernel {gd.kernel} is older than 5.12")
    return [_fail(host.name, "gpudirect", f"GPUDirect RDMA unavailable: nvidia_peermem is not loaded and no DMA-BUF ({why})",
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
        return [_fail(host.name, "memlock", "; ".join(bad) + " (the rendered unit says infinity: a drop-in overrides it)",
                      "remove the override (`systemctl cat <unit>` shows it), daemon-reload, then deploy")]
    if not probe.unlimited and inv.virtual_hardware:
        # Measured, not assumed: the lab's sandbox lacks CAP_SYS_RESOURCE, so no service can get
        # more than the machine's hard limit; the sim engine registers no RDMA memory.
        return [_skip(host.name, "memlock", f"virtual hardware: {probe.detail} (this machine's systemd cannot raise "
                      "the hard limit without CAP_SYS_RESOURCE; the sim engine registers no RDMA memory)")]
    if not probe.unlimited:
        return [_fail(host.name, "memlock", f"systemd does not grant LimitMEMLOCK=infinity: {probe.detail}",
                      "run services with an unlimited memlock: check the manager's limits (`systemctl show -p "
                      "DefaultLimitMEMLOCK`) and that systemd runs with CAP_SYS_RESOURCE", probe.detail)]
    what = f"units {', '.join(seen)} have LimitMEMLOCK=infinity; " if seen else ""
    return [_ok(host.name, "memlock", what + probe.detail)]


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
        taken.append(f"port {use.port} ({use.purpose}) on {host.data_addr} is taken: {_describe_holders(holders)}")
    in_rpc = {lst.port for lst in listeners if lst.port in MOONCAKE_RPC_PORTS and lst.covers(host.data_addr)}
    free_rpc = len(MOONCAKE_RPC_PORTS) - len(in_rpc)
    if free_rpc < MIN_FREE_RPC_PORTS:
        taken.append(f"only {free_rpc} ports of Mooncake's RPC range 15000-17000 are free on {host.data_addr}")
    n = len(expected_ports(inv, host, pl))
    if taken:
        return [_fail(host.name, "ports", "; ".join(taken),
                      "stop what holds the port (it is not the instance that belongs there), or move pdops_ports / "
                      "pdops_gateway ports in the inventory")]
    extra = f"; {'; '.join(held)}" if held else ""
    return [_ok(host.name, "ports", f"{n} port(s) free on {host.data_addr}, {free_rpc} Mooncake RPC ports free{extra}")]


def eval_time(inv, host, pl, facts) -> list[CheckResult]:
    t: TimeSync = facts["time"]
    if t.synchronized:
        return [_ok(host.name, "time", t.detail)]
    if inv.virtual_hardware:
        return [_skip(host.name, "time", f"{t.detail}: lab hosts share the machine's clock (virtual hardware), "
                                         "so there is no per-host NTP to check")]
    if t.synchronized is None:
        return [_fail(host.name, "time", f"cannot tell whether the clock is synchronized: {t.detail}",
                      "install/enable systemd-timesyncd or chrony and check `timedatectl`")]
    return [_fail(host.name, "time", "clock not synchronized (NTPSynchronized=no)",
                  "start the time service (systemd-timesyncd or chrony) and wait for `timedatectl` to say synchronized")]


def eval_disk(inv, host, pl, facts) -> list[CheckResult]:
    d: Disk = facts["disk"]
    need = float((inv.vars.get("pdops_preflight") or {}).get("min_free_log_gib", DEFAULT_MIN_LOG_GIB))
    msg = f"{d.available_gib:.1f} GiB free for logs on {d.mount} ({d.capacity} used)"
    if d.available_gib < need:
        return [_fail(host.name, "disk", f"{msg}, below {need:g} GiB",
                      "free space under /var/log (journal: `journalctl --vacuum-size=...`) or grow the disk")]
    return [_ok(host.name, "disk", msg)]


# versions: per host against the pins here; across hosts in evaluate_cluster.
VERSION_CHECKS = {
    "ver-sglang": ("sglang", lambda v: v.get("sglang"), lambda: pins.SGLANG_VERSION),
    "ver-mooncake": ("mooncake-transfer-engine", lambda v: v.get("mooncake-transfer-engine"), lambda: pins.MOONCAKE_VERSION),
    "ver-nccl": ("NCCL", nccl_version, lambda: getattr(pins, "NCCL_VERSION", None)),
    "ver-router": ("sglang-router", lambda v: v.get("sglang-router"), lambda: pins.SGLANG_ROUTER_VERSION),
}


def _eval_version(check: str):
    label, read, pin_of = VERSION_CHECKS[check]

    def evaluate(inv, host, pl, facts) -> list[CheckResult]:
        v = facts["versions"]
        pin = pin_of()
        if isinstance(v, Skipped):
            if inv.virtual_hardware:
                return [_skip(host.name, check, f"{v.reason} (lab)")]
            return [_fail(host.name, check, v.reason, "run the host preparation playbook (it installs the engine venv)")]
        have = read(v)
        if have is None:
            if check == "ver-mooncake" and inv.profile.transfer_backend != "mooncake":
                return [_skip(host.name, check, f"profile uses the {inv.profile.transfer_backend} backend")]
            if inv.virtual_hardware and check in ("ver-mooncake", "ver-nccl"):
                return [_skip(host.name, check, f"{label} is not installed in the engine python "
                                                "(lab: the sim engine does not use it, virtual hardware)")]
            return [_fail(host.name, check, f"{label} is not installed in {inv.engine_python}",
                          f"install {label}{' ' + pin if pin else ''} in the engine venv (host preparation playbook)")]
        if pin and have != pin:
            return [_fail(host.name, check, f"{label} {have}, pdops pins {pin} (pdops/versions.py)",
                          f"install {label}=={pin} in {inv.engine_python}, or move the pin (and re-check SGLANG.md)")]
        return [_ok(host.name, check, f"{label} {have}" + ("" if pin else " (no pin in pdops/versions.py: "
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
    Check("ver-router", "sglang-router version = pin (gateway host)", lambda i, h: ("versions",),
          _eval_version("ver-router"), False,
          lambda i, h, p: None if h.name == i.gateway.host else "not the gateway host"),
)}
PAIRING = "pairing"
CHECK_NAMES = tuple(CHECKS) + (PAIRING,)


def validate_skip(skip: set[str] | list[str] | None) -> set[str]:
    skip = set(skip or ())
    unknown = sorted(skip - set(CHECK_NAMES))
    if unknown:
        raise InvalidInput("--skip-check", f"unknown check(s) {unknown}", fix=f"use one of: {', '.join(CHECK_NAMES)}")
    return skip


# ================================================================ plan

@dataclass(frozen=True)
class HostPlan:
    host: str
    run: tuple[str, ...]  # checks whose sections are read
    skipped: tuple[CheckResult, ...]  # decided without reading anything

    def sections(self, inv: Inventory) -> dict[str, Section]:
        h = inv.host(self.host)
        out: dict[str, Section] = {}
        for name in self.run:
            for s in CHECKS[name].sections(inv, h):
                out[s] = SECTIONS[s] if s in SECTIONS else gid_section(s.split(":", 1)[1])
        return out


def resolve_placement(inv: Inventory, topology: Topology | Placement | None,
                      previous: Placement | None = None) -> Placement | None:
    if topology is None or isinstance(topology, Placement):
        return topology
    return place(inv, topology, previous)


def plan_preflight(inv: Inventory, topology: Topology | Placement | None, skip: set[str] | None = None,
                   previous: Placement | None = None) -> list[HostPlan]:
    """Which checks run on which host (pure). With a topology, only the hosts it uses (and the gateway's)."""
    skip = validate_skip(skip)
    pl = resolve_placement(inv, topology, previous)
    used = {h for i in pl.instances for h in i.hosts} if pl is not None else {h.name for h in inv.hosts}
    used.add(inv.gateway.host)
    plans = []
    for host in inv.hosts:
        if host.name not in used:
            continue
        run, skipped = [], []
        for name, chk in CHECKS.items():
            if name in skip:
                skipped.append(_skip(host.name, name, f"skipped by the operator (--skip-check {name})"))
            elif (why := chk.applies(inv, host, pl)) is not None:
                skipped.append(_skip(host.name, name, why))
            elif chk.hardware and inv.virtual_hardware:
                skipped.append(_skip(host.name, name, VIRTUAL_REASON))
            else:
                run.append(name)
        plans.append(HostPlan(host.name, tuple(run), tuple(skipped)))
    return plans


def host_command(inv: Inventory, hp: HostPlan, pl: Placement | None) -> str:
    host = inv.host(hp.host)
    return batch_command({name: sec.command(inv, host, pl) for name, sec in hp.sections(inv).items()})


# ================================================================ decide (pure)

def evaluate_host(inv: Inventory, hp: HostPlan, pl: Placement | None, facts: Facts) -> list[CheckResult]:
    """Every planned check of one host on its parsed facts; unreadable facts fail the checks that need them."""
    host = inv.host(hp.host)
    out = list(hp.skipped)
    for name in hp.run:
        chk = CHECKS[name]
        errors = [facts.get(s) for s in chk.sections(inv, host) if isinstance(facts.get(s), ReadError)
                  or s not in facts]
        if errors:
            e = errors[0]
            what = f"cannot read {e.section}: {e.message}" if isinstance(e, ReadError) else "facts missing"
            out.append(_fail(host.name, name, what, "run the command by hand on the host to see why",
                             e.raw if isinstance(e, ReadError) else ""))
            continue
        try:
            out.extend(chk.evaluate(inv, host, pl, facts))
        except PdopsError as exc:  # e.g. a GPU with no NIC mapped
            out.append(_fail(host.name, name, exc.message, exc.fix or ""))
    return out


def evaluate_cluster(inv: Inventory, facts_by_host: dict[str, Facts],
                     results: list[CheckResult]) -> list[CheckResult]:
    """Cross-host rules: one driver version, and identical package versions, on every host."""
    status = {(r.host, r.check): r for r in results}
    out = list(results)

    def replace(host: str, check: str, new: CheckResult):
        nonlocal out
        out = [new if (r.host, r.check) == (host, check) else r for r in out]

    def compare(check: str, values: dict[str, str], label: str, fix: str, pin: str | None = None):
        groups: dict[str, list[str]] = {}
        for h, v in values.items():
            groups.setdefault(v, []).append(h)
        if len(groups) < 2:
            return
        for h, v in values.items():
            if pin is not None and v == pin:
                continue  # on the pin: the others are the ones to fix
            others = "; ".join(f"{ov} on {', '.join(hs)}" for ov, hs in groups.items() if ov != v)
            prev = status.get((h, check))
            if prev is not None and prev.status == FAIL and label in prev.reason and "differ" in prev.reason:
                continue
            reason = f"{label} {v} here differs from other hosts: {others}"
            if prev is not None and prev.status == FAIL:
                reason = prev.reason + "; " + reason
            replace(h, check, _fail(h, check, reason, fix))

    drivers = {}
    for h, f in facts_by_host.items():
        gpus = f.get("gpus")
        if isinstance(gpus, list) and gpus and (h, "gpu-driver") in status and status[(h, "gpu-driver")].status == PASS:
            drivers[h] = gpus[0].driver_version or "?"
    compare("gpu-driver", drivers, "driver", "install the same NVIDIA driver on every host (and reboot)")
    for check, (label, read, pin_of) in VERSION_CHECKS.items():
        vals = {}
        for h, f in facts_by_host.items():
            v = f.get("versions")
            r = status.get((h, check))
            if isinstance(v, dict) and r is not None and r.status != SKIPPED and read(v):
                vals[h] = read(v)
        pin = pin_of()
        compare(check, vals, label, f"install {label}=={pin} on every host (pdops/versions.py)" if pin
                else f"install one {label} version on every host", pin)
    return out


# ================================================================ pairing matrix

@dataclass(frozen=True)
class Target:
    """One port a decode must reach on a prefill host."""

    prefill_host: str
    addr: str
    port: int
    label: str  # "p01 bootstrap" | "Mooncake RPC"
    mode: str  # "listener" (pdops starts one) | "instance" (the running instance) | "held" (foreign: untestable)
    note: str = ""


@dataclass(frozen=True)
class Probe:
    addr: str
    port: int
    ok: bool
    error: str


@dataclass
class Matrix:
    prefill_hosts: list[str]
    decode_hosts: list[str]
    cells: dict[tuple[str, str], list[tuple[Target, bool, str]]] = field(default_factory=dict)
    listener_errors: dict[str, str] = field(default_factory=dict)  # prefill host -> why no listener
    skipped: str = ""

    def cell_ok(self, p: str, d: str) -> bool:
        return all(ok for _, ok, _ in self.cells.get((p, d), []))

    def failures(self) -> list[tuple[str, str, Target, str]]:
        return [(p, d, t, err) for (p, d), items in self.cells.items() for t, ok, err in items if not ok]

    def to_dict(self) -> dict:
        return {
            "skipped": self.skipped or None,
            "prefill_hosts": self.prefill_hosts, "decode_hosts": self.decode_hosts,
            "cells": [{"prefill": p, "decode": d, "ok": self.cell_ok(p, d),
                       "targets": [{"addr": t.addr, "port": t.port, "label": t.label, "mode": t.mode,
                                    "ok": ok, "error": err} for t, ok, err in items]}
                      for (p, d), items in self.cells.items()],
            "listener_errors": self.listener_errors,
        }

    def format(self) -> str:
        if self.skipped:
            return f"pairing: skipped ({self.skipped})"
        w = max([len("prefill \\ decode")] + [len(h) for h in self.prefill_hosts])
        cw = [max(len(d), 4) for d in self.decode_hosts]
        lines = ["pairing: decode -> prefill, real TCP connections to the bootstrap port(s) and a Mooncake RPC port",
                 "  " + "prefill \\ decode".ljust(w) + "  " + "  ".join(d.ljust(c) for d, c in zip(self.decode_hosts, cw))]
        for p in self.prefill_hosts:
            cells = ["ok" if self.cell_ok(p, d) else "FAIL" for d in self.decode_hosts]
            lines.append("  " + p.ljust(w) + "  " + "  ".join(c.ljust(n) for c, n in zip(cells, cw)))
        for p, d, t, err in self.failures():
            lines.append(f"  {d} -> {p} {_where(t)}: {err}")
        return "\n".join(lines)


def _where(t: Target) -> str:
    return f"{t.addr}:{t.port} ({t.label})" if t.port else f"{t.addr} ({t.label})"


def pairing_hosts(pl: Placement) -> tuple[list[str], list[str]]:
    pre, dec = [], []
    for inst in pl.instances:
        for h in inst.hosts:
            lst = pre if inst.role == "prefill" else dec
            if h not in lst:
                lst.append(h)
    return pre, dec


def plan_targets(inv: Inventory, pl: Placement, facts_by_host: dict[str, Facts]) -> list[Target]:
    """Ports each prefill host must accept from every decode host, and how each is tested (pure)."""
    out = []
    pre, _ = pairing_hosts(pl)
    for name in pre:
        host = inv.host(name)
        f = facts_by_host.get(name, {})
        listeners = f.get("listen")
        pid_units = f.get("pids") if isinstance(f.get("pids"), dict) else {}
        if not isinstance(listeners, list):
            listeners = []
        uses = [PortUse(i.bootstrap_port, f"{i.id} bootstrap", (i.unit(0),))
                for i in pl.on_host(name) if i.role == "prefill" and i.head.host == name and i.bootstrap_port]
        rpc = free_rpc_port(listeners, host.data_addr)
        if rpc is not None:
            uses.append(PortUse(rpc, "Mooncake RPC", ()))
        for use in uses:
            holders = port_holders(listeners, pid_units, host.data_addr, use.port)
            if not holders:
                out.append(Target(name, host.data_addr, use.port, use.purpose, "listener"))
            elif held_by_owner(holders, use):
                out.append(Target(name, host.data_addr, use.port, use.purpose, "instance",
                                  "tested against the running instance"))
            else:
                out.append(Target(name, host.data_addr, use.port, use.purpose, "held",
                                  f"held by a foreign process: {_describe_holders(holders)}"))
    return out


_LISTENER = (
    "import selectors, socket, sys\n"
    "addr = sys.argv[1]\n"
    "sel = selectors.DefaultSelector()\n"
    "for p in sys.argv[2:]:\n"
    "    s = socket.socket(socket.AF_INET6 if ':' in addr else socket.AF_INET)\n"
    "    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "    try:\n"
    "        s.bind((addr, int(p)))\n"
    "        s.listen(128)\n"
    "    except OSError as e:\n"
    "        sys.exit(f'cannot listen on {addr}:{p}: {e}')\n"
    "    sel.register(s, selectors.EVENT_READ)\n"
    "while True:\n"
    "    for key, _ in sel.select():\n"
    "        conn, _ = key.fileobj.accept()\n"
    "        conn.close()\n"
)

_WAITER = (
    # Waits until each port accepts. Given unit=NAME, it stops waiting as soon as that listener
    # unit is no longer running and says why: it binds the port itself, which fails with the
    # listener's own error (e.g. [Errno 99] Cannot assign requested address).
    "import json, socket, subprocess, sys, time\n"
    "unit = next((a[5:] for a in sys.argv[1:] if a.startswith('unit=')), None)\n"
    "args = [a for a in sys.argv[1:] if not a.startswith('unit=')]\n"
    "addr, ports, end, res = args[0], [int(p) for p in args[1:]], time.time() + 5, {}\n"
    "def alive():\n"
    "    if not unit:\n"
    "        return True\n"
    "    try:\n"
    "        r = subprocess.run(['systemctl', 'is-active', unit], capture_output=True, text=True, timeout=5)\n"
    "    except (OSError, subprocess.SubprocessError):\n"
    "        return True\n"
    "    return r.stdout.strip() in ('active', 'activating', 'reloading')\n"
    "def why(p):\n"
    "    s = socket.socket(socket.AF_INET6 if ':' in addr else socket.AF_INET)\n"
    "    try:\n"
    "        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "        s.bind((addr, p))\n"
    "        return 'the listener exited (the port itself can be bound: see its journal)'\n"
    "    except OSError as e:\n"
    "        return str(e)\n"
    "    finally:\n"
    "        s.close()\n"
    "for p in ports:\n"
    "    while True:\n"
    "        try:\n"
    "            socket.create_connection((addr, p), timeout=1).close()\n"
    "            res[p] = 'ok'\n"
    "            break\n"
    "        except OSError as e:\n"
    "            if not alive():\n"
    "                res[p] = why(p)\n"
    "                break\n"
    "            if time.time() > end:\n"
    "                res[p] = str(e) or type(e).__name__\n"
    "                break\n"
    "            time.sleep(0.05)\n"
    "print(json.dumps(res))\n"
)

_PROBE = (
    "import concurrent.futures as cf, json, socket, sys\n"
    "targets, src, timeout = json.loads(sys.argv[1]), sys.argv[2], float(sys.argv[3])\n"
    "def one(t):\n"
    "    try:\n"
    "        socket.create_connection((t[0], t[1]), timeout=timeout, source_address=(src, 0) if src else None).close()\n"
    "        return [t[0], t[1], True, '']\n"
    "    except OSError as e:\n"
    "        return [t[0], t[1], False, str(e) or type(e).__name__]\n"
    "with cf.ThreadPoolExecutor(32) as ex:\n"
    "    for r in ex.map(one, targets):\n"
    "        print(json.dumps(r))\n"
)


def host_python(inv: Inventory) -> str:
    return str(inv.vars.get("ansible_python_interpreter", "/usr/bin/python3"))


def listener_unit(token: str) -> str:
    return f"{LISTEN_UNIT_PREFIX}{token}.service"


def listener_start_command(python: str, unit: str, addr: str, ports: list[int], max_s: int = 60) -> str:
    """Start a transient listener unit on addr:ports, then wait until each port accepts (JSON {port: ok|error})."""
    args = " ".join(str(int(p)) for p in ports)
    return (f"systemd-run --quiet --unit={q(unit)} --collect -p RuntimeMaxSec={int(max_s)} "
            f"{q(python)} -c {q(_LISTENER)} {q(addr)} {args} && "
            f"{q(python)} -c {q(_WAITER)} {q('unit=' + unit)} {q(addr)} {args}; "
            f"journalctl -u {q(unit)} -o cat -n 3 --no-pager 2>/dev/null | sed 's/^/journal: /'; true")


def parse_listener_start(output: str) -> tuple[dict[int, str], str]:
    """({port: 'ok' | error}, journal lines) from :func:`listener_start_command`."""
    res: dict[int, str] = {}
    journal = []
    for line in output.splitlines():
        if line.startswith("{"):
            res = {int(k): v for k, v in json.loads(line).items()}
        elif line.startswith("journal: "):
            journal.append(line[len("journal: "):])
        elif line.strip():
            journal.append(line.strip())
    return res, "\n".join(journal)


def listener_stop_command(unit: str) -> str:
    """Stop our own listener by its exact unit name (never by pattern); gone already is fine."""
    return f"systemctl stop {q(unit)} 2>/dev/null; systemctl reset-failed {q(unit)} 2>/dev/null; true"


def probe_command(python: str, targets: list[tuple[str, int]], source_addr: str, timeout: float = PROBE_TIMEOUT_S) -> str:
    return f"{q(python)} -c {q(_PROBE)} {q(json.dumps([list(t) for t in targets]))} {q(source_addr)} {float(timeout):g}"


def parse_probe(output: str) -> list[Probe]:
    out = []
    for line in output.splitlines():
        if line.startswith("["):
            a, p, ok, err = json.loads(line)
            out.append(Probe(a, int(p), bool(ok), err))
    return out


def evaluate_pairing(pre: list[str], dec: list[str], targets: list[Target],
                     probes: dict[str, list[Probe] | Exception],
                     listener_ready: dict[str, dict[int, str] | Exception]) -> Matrix:
    """The P x D matrix from what each decode host saw (pure)."""
    m = Matrix(list(pre), list(dec))
    for p in pre:
        ready = listener_ready.get(p)
        if isinstance(ready, Exception):
            m.listener_errors[p] = str(ready)
    for d in dec:
        seen = probes.get(d)
        by = {} if isinstance(seen, Exception) or seen is None else {(x.addr, x.port): x for x in seen}
        for t in targets:
            key = (t.prefill_host, d)
            if t.mode == "held":
                err, ok = f"not tested: {t.note}", False
            elif isinstance(seen, Exception):
                err, ok = f"cannot run the probe on {d}: {seen}", False
            else:
                pr = by.get((t.addr, t.port))
                ok = bool(pr and pr.ok)
                err = "" if ok else (pr.error if pr else "no probe result")
                if not ok and t.mode == "listener":
                    lr = listener_ready.get(t.prefill_host)
                    why = m.listener_errors.get(t.prefill_host) or (
                        lr.get(t.port) if isinstance(lr, dict) and lr.get(t.port) != "ok" else None)
                    if why:
                        err += f" (the test listener on {t.prefill_host} could not listen: {why})"
            m.cells.setdefault(key, []).append((t, ok, err))
    return m


def pairing_results(inv: Inventory, m: Matrix) -> list[CheckResult]:
    if m.skipped:
        return []
    out = []
    fails = m.failures()
    for p in m.prefill_hosts:
        bad = [(d, t, e) for pp, d, t, e in fails if pp == p]
        if not bad:
            out.append(_ok(p, PAIRING, f"reachable from every decode host ({len(m.decode_hosts)})"))
            continue
        listen_fail = any("could not listen" in e for _, _, e in bad)
        down = any("unreachable over SSH" in e for _, _, e in bad)
        held = any(t.mode == "held" for _, t, _ in bad)
        reason = "unreachable from " + "; ".join(f"{d}: {_where(t)} {e}" for d, t, e in bad)
        fixes = []
        if down:
            fixes.append("bring the unreachable host back (SSH), then run preflight again")
        if held:
            fixes.append("free the port on the prefill host (see the ports check), then run preflight again")
        if listen_fail:
            fixes.append(f"pdops_data_addr {inv.host(p).data_addr} must be an address of {p} on the data network: "
                         "fix the inventory or configure the address on the host")
        if not fixes:
            fixes.append(f"open TCP {', '.join(sorted({str(t.port) for _, t, _ in bad}))} and 15000-17000 on {p} for "
                         "the decode hosts' data addresses (firewall, security group) and check routing between the "
                         "data addresses")
        out.append(_fail(p, PAIRING, reason, "; ".join(fixes)))
    for d in m.decode_hosts:
        bad = [(p, t, e) for p, dd, t, e in fails if dd == d]
        if d in m.prefill_hosts and any(r.host == d for r in out):
            # a host holding both roles: one row, both directions
            if bad:
                i = next(k for k, r in enumerate(out) if r.host == d)
                prev = out[i]
                reason = (prev.reason + "; " if prev.failed else "") + \
                    "cannot reach " + "; ".join(f"{p} {_where(t)}" for p, t, _ in bad)
                out[i] = _fail(d, PAIRING, reason, prev.fix or "see the prefill hosts named here")
            continue
        if bad:
            out.append(_fail(d, PAIRING, "cannot reach " + "; ".join(f"{p} {_where(t)}: {e}"
                                                                   for p, t, e in bad),
                             "see the pairing failure of the prefill host(s) named here"))
        else:
            out.append(_ok(d, PAIRING, f"reaches every prefill host ({len(m.prefill_hosts)})"))
    return out


def run_pairing(inv: Inventory, pl: Placement, pool, facts_by_host: dict[str, Facts],
                unreachable: set[str]) -> Matrix:
    """Fan out: start test listeners on the prefill hosts, probe from every decode host, stop the listeners."""
    pre, dec = pairing_hosts(pl)
    if not pre or not dec:
        return Matrix(pre, dec, skipped="the topology has no prefill or no decode")
    py = host_python(inv)
    targets = [t for t in plan_targets(inv, pl, facts_by_host) if t.prefill_host not in unreachable]
    unit = listener_unit(secrets.token_hex(4))
    need: dict[str, list[int]] = {}
    for t in targets:
        if t.mode == "listener" and t.prefill_host not in unreachable:
            need.setdefault(t.prefill_host, []).append(t.port)

    def start(h: str) -> dict[int, str]:
        out = pool.run(h, listener_start_command(py, unit, inv.host(h).data_addr, need[h]), timeout=30).stdout
        res, journal = parse_listener_start(out)
        if not res:
            last = (journal or out).strip().splitlines()[-1:] or ["no output"]
            raise Unverified(f"the test listener did not start on {h}: {last[0]}", evidence=journal or out[-500:])
        # the waiter names the listener's own error; a bare timeout gets the journal's last line
        return {p: (v if v == "ok" or not journal or "timed out" not in v else f"{v}; {journal.splitlines()[-1]}")
                for p, v in res.items()}

    started: dict[str, Any] = {}
    try:
        started = run_parallel(list(need), start)
        live = [d for d in dec if d not in unreachable]
        probes = run_parallel(live, lambda d: parse_probe(pool.run(
            d, probe_command(py, [(t.addr, t.port) for t in targets if t.mode != "held"], inv.host(d).data_addr),
            timeout=PROBE_TIMEOUT_S * 4 + 10).stdout))
    finally:
        run_parallel(list(need), lambda h: pool.run(h, listener_stop_command(unit), timeout=20))
    m = evaluate_pairing(pre, dec, targets, dict(probes), dict(started))
    for p in pre:
        for d in dec:
            down = [h for h in (p, d) if h in unreachable]
            if down:
                m.cells[(p, d)] = [(Target(p, inv.host(p).data_addr, 0, "all ports", "held"), False,
                                    f"not tested: {' and '.join(down)} unreachable over SSH")]
    return m


# ================================================================ the report

@dataclass
class PreflightReport:
    cluster: str
    topology: str | None
    hosts: list[str]
    results: list[CheckResult]
    matrix: Matrix | None = None
    not_checked: list[str] = field(default_factory=list)  # hosts the topology does not use
    elapsed_s: float | None = None

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == FAIL]

    @property
    def failed_hosts(self) -> list[str]:
        bad = {r.host for r in self.failures}
        return [h for h in self.hosts if h in bad]

    @property
    def ok(self) -> bool:
        return not self.failures

    def result(self, host: str, check: str) -> CheckResult | None:
        return next((r for r in self.results if r.host == host and r.check == check), None)

    def checks(self) -> list[str]:
        present = {r.check for r in self.results}
        order = ["ssh", *CHECK_NAMES]
        return [c for c in order if c in present]

    def verdict(self) -> str:
        n = len(self.hosts)
        counts = {st: sum(r.status == st for r in self.results) for st in (PASS, FAIL, SKIPPED)}
        tally = f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIPPED]} skipped"
        if self.matrix is not None and not self.matrix.skipped:
            bad = sum(not self.matrix.cell_ok(p, d) for p in self.matrix.prefill_hosts for d in self.matrix.decode_hosts)
            tally += (f"; pairing {len(self.matrix.prefill_hosts)} P x {len(self.matrix.decode_hosts)} D: "
                      + ("every cell ok" if not bad else f"{bad} cell(s) FAIL"))
        if self.ok:
            return f"preflight ok: {n} host(s), every check passed or was skipped with its reason ({tally})"
        parts = [f"{h} ({', '.join(r.check for r in self.failures if r.host == h)})" for h in self.failed_hosts]
        return f"preflight FAILED on {len(self.failed_hosts)} of {n} host(s): " + "; ".join(parts) + f" ({tally})"

    def format_table(self) -> str:
        checks = self.checks()
        mark = {PASS: "ok", FAIL: "FAIL", SKIPPED: "skip"}
        w = max([4] + [len(h) for h in self.hosts])
        cw = [max(len(c), 4) for c in checks]
        lines = [f"preflight {self.cluster}" + (f" for {self.topology}" if self.topology else " (no topology: "
                                                "every host, every instance slot)"),
                 "host".ljust(w) + "  " + "  ".join(c.ljust(n) for c, n in zip(checks, cw))]
        for h in self.hosts:
            row = []
            for c, n in zip(checks, cw):
                r = self.result(h, c)
                row.append((mark[r.status] if r else "-").ljust(n))
            lines.append(h.ljust(w) + "  " + "  ".join(row))
        if self.failures:
            lines.append("")
            lines.append("failed:")
            for r in self.failures:
                lines.append(f"  {r.host} {r.check}: {r.reason}")
                if r.fix:
                    lines.append(f"    fix: {r.fix}")
        skipped: dict[tuple[str, str], list[str]] = {}
        for r in self.results:
            if r.status == SKIPPED:
                skipped.setdefault((r.reason, r.check), []).append(r.host)
        if skipped:
            lines.append("")
            lines.append("skipped:")
            by_reason: dict[tuple[str, tuple[str, ...]], list[str]] = {}
            for (reason, check), hosts in skipped.items():
                by_reason.setdefault((reason, tuple(hosts)), []).append(check)
            for (reason, hosts), checks_ in by_reason.items():
                lines.append(f"  {', '.join(checks_)} on {_host_list(list(hosts), self.hosts)}: {reason}")
        if self.matrix is not None:
            lines.append("")
            lines.append(self.matrix.format())
        if self.not_checked:
            lines.append("")
            lines.append(f"not checked (no instance of {self.topology} and not the gateway): {', '.join(self.not_checked)}")
        lines.append("")
        lines.append(self.verdict() + (f" in {self.elapsed_s:.1f}s" if self.elapsed_s is not None else ""))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "cluster": self.cluster, "topology": self.topology, "ok": self.ok, "hosts": self.hosts,
            "failed_hosts": self.failed_hosts, "checks": self.checks(),
            "results": [asdict(r) for r in self.results],
            "pairing": self.matrix.to_dict() if self.matrix is not None else None,
            "not_checked": self.not_checked, "elapsed_s": self.elapsed_s, "verdict": self.verdict(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)


def _host_list(hosts: list[str], all_hosts: list[str]) -> str:
    if len(hosts) > 1 and hosts == all_hosts:
        return "both hosts" if len(hosts) == 2 else f"all {len(hosts)} hosts"
    return ", ".join(hosts)


# ================================================================ do

def run_preflight(inv: Inventory, topology: Topology | Placement | None, pool, skip: set[str] | None = None,
                  *, previous: Placement | None = None) -> PreflightReport:
    """Read every host in parallel (one batched command each), decide, then test P x D pairing."""
    import time

    t0 = time.monotonic()
    skip = validate_skip(skip)
    pl = resolve_placement(inv, topology, previous)
    plans = plan_preflight(inv, pl, skip)
    by_name = {hp.host: hp for hp in plans}

    def read(name: str) -> Facts:
        hp = by_name[name]
        if not hp.run:
            return {}
        out = pool.run(name, host_command(inv, hp, pl), timeout=120).stdout
        return parse_sections(out, hp.sections(inv))

    raw = run_parallel(list(by_name), read)
    results: list[CheckResult] = []
    facts_by_host: dict[str, Facts] = {}
    unreachable: set[str] = set()
    for name, got in raw.items():
        if isinstance(got, Exception):
            unreachable.add(name)
            msg = got.message if isinstance(got, PdopsError) else f"{type(got).__name__}: {got}"
            msg = msg.rsplit("`: ", 1)[-1]  # the batched command itself is noise here
            results.extend(by_name[name].skipped)
            results.append(_fail(name, "ssh", f"cannot read the host: {msg}",
                                 "check that the host is up and SSH answers; nothing was checked on it",
                                 getattr(got, "evidence", "") or ""))
            continue
        facts_by_host[name] = got
        results.extend(evaluate_host(inv, by_name[name], pl, got))
    results = evaluate_cluster(inv, facts_by_host, results)
    matrix = None
    if pl is not None and PAIRING not in skip:
        matrix = run_pairing(inv, pl, pool, facts_by_host, unreachable)
        results.extend(pairing_results(inv, matrix))
    elif pl is not None:
        matrix = Matrix(*pairing_hosts(pl), skipped=f"skipped by the operator (--skip-check {PAIRING})")
        results.extend(_skip(h, PAIRING, matrix.skipped) for h in sorted(set(sum(pairing_hosts(pl), []))))
    hosts = [hp.host for hp in plans]
    order = {c: i for i, c in enumerate(["ssh", *CHECK_NAMES])}
    results.sort(key=lambda r: (hosts.index(r.host), order.get(r.check, 99)))
    not_checked = [h.name for h in inv.hosts if h.name not in by_name]
    return PreflightReport(inv.cluster, str(pl.topology) if pl else None, hosts, results, matrix, not_checked,
                           round(time.monotonic() - t0, 2))


def preflight_gate(inv: Inventory, topology: Topology | Placement | None, pool, skip: set[str] | None,
                   say: Say = print, *, previous: Placement | None = None) -> tuple[PreflightReport, dict]:
    """Run preflight before a change: (report, journal evidence), or Refused naming each failed
    host, check and fix (its ``journal_evidence`` holds the same evidence for the journal).

    Checks the operator skipped (``--skip-check``) are in the evidence, with who skipped them.
    """
    skip = validate_skip(skip)
    label = topology.topology if isinstance(topology, Placement) else topology
    say(f"preflight: checking {inv.cluster}" + (f" for {label}" if label is not None else ""))
    report = run_preflight(inv, topology, pool, skip, previous=previous)
    evidence = {
        "verdict": report.verdict(), "failed_hosts": report.failed_hosts,
        "failed": [asdict(r) for r in report.failures],
        "skipped": [f"{r.host} {r.check}: {r.reason}" for r in report.results if r.status == SKIPPED],
        "pairing": report.matrix.to_dict() if report.matrix is not None else None,
    }
    if skip:
        from pdops.state import default_operator

        evidence["skipped_by_operator"] = {"checks": sorted(skip), "operator": default_operator(),
                                           "why": "the operator skipped these checks (--skip-check)"}
    if report.ok:
        say(f"  {report.verdict()}")
        return report, evidence
    say(report.format_table())
    lines = [f"{r.host} {r.check}: {r.reason}" + (f" (fix: {r.fix})" if r.fix else "") for r in report.failures]
    names = sorted({r.check for r in report.failures})
    exc = Refused(f"preflight failed on {', '.join(report.failed_hosts)}; no host was changed",
                  fix="fix each failure below, or pass --skip-check " + " --skip-check ".join(names)
                      + " if you know better (it is recorded in the journal)",
                  evidence="\n".join(lines))
    exc.journal_evidence = evidence
    raise exc
