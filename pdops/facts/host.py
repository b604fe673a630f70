"""Host facts preflight reads: GPUDirect, clock sync, disk, memlock under systemd, PIDs with
their units, and the engine's package versions. A quoted command + a pure parser each."""

from __future__ import annotations

from pathlib import Path

import json
import re
from dataclasses import dataclass

from pdops.errors import Unverified
from pdops.facts import Skipped, q, rdma, skipped_in
from pdops.facts import cgroup as cgroup_facts

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
                    "torch", "smg")

_VERSIONS_SCRIPT = (Path(__file__).parent / "scripts" / "versions.py").read_text()

# Wheel metadata folders are named `<name>-<version>.dist-info`, the name with `-`/`.` as `_`
# (the binary distribution format spec); older wheels keep capitals, hence -i.
_DIST_RE = "^(sglang|sglang[-_.]router|smg|mooncake[-_.]transfer[-_.]engine|nvidia[-_.]nccl[-_.]cu1[23]|torch)-[^-]+[.]dist-info$"
DIST_MARK = "PDOPS-DIST-INFO"


def versions_command(engine_python: str, *, torch_nccl: bool, need: str = "sglang") -> str:
    """Package versions as the engine's python sees them (or the gateway's: ``need="smg"``).

    Fast path, no interpreter start: in a virtualenv that does not see the system's packages
    (pyvenv.cfg), the `.dist-info` folders of its one site-packages are what importlib.metadata
    would read. Anything else (a system python, a venv with system packages, sglang not found
    there, or NCCL to be read from torch itself) runs the engine python with importlib.metadata."""
    py = q(engine_python)
    args = " torch-nccl" if torch_nccl else ""
    has = "printf '%s\\n' \"$found\" | grep -qiE "
    enough = has + q(f"^{need}-[^-]+[.]dist-info$") + (" && " + has + q("^nvidia[-_.]nccl") if torch_nccl else "")
    who = "engine" if need == "sglang" else "gateway"
    return (f"if [ ! -x {py} ]; then echo {q(f'PDOPS-SKIPPED: no {who} python ' + engine_python)}; else "
            f"pre=$(dirname -- \"$(dirname -- {py})\"); found=''; sp=''; "
            "if grep -qsiE '^include-system-site-packages *= *false' \"$pre/pyvenv.cfg\"; then "
            "for d in \"$pre\"/lib/python3*/site-packages; do [ -d \"$d\" ] && [ -z \"$sp\" ] && sp=$d; done; "
            f"[ -n \"$sp\" ] && found=$(ls -- \"$sp\" | grep -iE {q(_DIST_RE)}); fi; "
            f"if {enough}; then echo \"{DIST_MARK} $sp\"; printf '%s\\n' \"$found\"; "
            f"else {py} -c {q(_VERSIONS_SCRIPT)} {q(json.dumps(list(VERSION_PACKAGES)))}{args}; fi; fi")


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


