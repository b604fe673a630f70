"""GPU facts from nvidia-smi (NVIDIA System Management Interface, nvidia-smi(1)).

``--query-gpu=... --format=csv,noheader,nounits`` prints one comma-separated line per GPU;
unavailable values are ``[N/A]`` (or ``[Not Supported]``). ``--query-compute-apps``
prints one line per compute process, nothing (or, in older drivers, "No running
processes found") when there is none. ``topo -m`` prints a tab-separated matrix with
legend X/SYS/NODE/PHB/PXB/PIX/NV#, followed by a "NIC Legend" mapping NIC# to devices.
On a host without nvidia-smi every parser returns :class:`~pdops.facts.Skipped`.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass

from pdops.errors import Unverified
from pdops.facts import Skipped, require_binary, skipped_in

GPU_FIELDS = ("index", "name", "memory.total", "driver_version", "uuid", "pci.bus_id")
APP_FIELDS = ("pid", "process_name", "used_memory", "gpu_uuid")
_NA = {"[N/A]", "[Not Supported]", "N/A", "[Unknown Error]", "[Insufficient Permissions]", ""}

# closeness order of `nvidia-smi topo -m` relations (best first)
RELATION_RANK = {"X": 0, "PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5}


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_total_mib: int | None
    driver_version: str | None
    uuid: str
    pci_bus_id: str | None


@dataclass(frozen=True)
class ComputeApp:
    pid: int
    process_name: str
    used_memory_mib: int | None
    gpu_uuid: str


def gpus_command() -> str:
    return require_binary(
        "nvidia-smi", f"nvidia-smi --query-gpu={','.join(GPU_FIELDS)} --format=csv,noheader,nounits")


def apps_command() -> str:
    return require_binary(
        "nvidia-smi", f"nvidia-smi --query-compute-apps={','.join(APP_FIELDS)} --format=csv,noheader,nounits")


def topo_command() -> str:
    return require_binary("nvidia-smi", "nvidia-smi topo -m")


def _na(v: str) -> str | None:
    v = v.strip()
    return None if v in _NA else v


def _int_or_none(v: str) -> int | None:
    v = _na(v)
    return None if v is None else int(float(v))


def _rows(output: str, n: int) -> list[list[str]]:
    if "NVIDIA-SMI has failed" in output or "couldn't communicate" in output:
        raise Unverified("nvidia-smi cannot talk to the driver", evidence=output[-1000:])
    rows = []
    for row in csv.reader(io.StringIO(output), skipinitialspace=True):
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        if len(row) != n:
            raise Unverified(f"nvidia-smi line has {len(row)} fields, expected {n}: {row!r}")
        rows.append([c.strip() for c in row])
    return rows


def parse_gpus(output: str) -> list[Gpu] | Skipped:
    """Parse ``--query-gpu`` CSV. Names are kept whole ("NVIDIA RTX PRO 6000D Blackwell")."""
    if (s := skipped_in(output)) is not None:
        return s
    return [
        Gpu(int(r[0]), r[1], _int_or_none(r[2]), _na(r[3]), r[4], _na(r[5]))
        for r in _rows(output, len(GPU_FIELDS))
    ]


def parse_apps(output: str) -> list[ComputeApp] | Skipped:
    """Parse ``--query-compute-apps`` CSV; no process is an empty list."""
    if (s := skipped_in(output)) is not None:
        return s
    text = "\n".join(ln for ln in output.splitlines() if "No running processes found" not in ln)
    return [
        ComputeApp(int(r[0]), r[1], _int_or_none(r[2]), r[3])
        for r in _rows(text, len(APP_FIELDS))
    ]


def model_matches(gpu_name: str, expected: str) -> bool:
    """Exact model match, ignoring case and spacing: "RTX 6000D" is not "RTX PRO 6000D Blackwell"."""
    norm = lambda s: " ".join(s.replace("NVIDIA ", "").split()).lower()  # noqa: E731
    return norm(gpu_name) == norm(expected)


@dataclass(frozen=True)
class Topology:
    devices: tuple[str, ...]  # GPU0.., NIC0..
    matrix: dict  # {(row, col): relation}
    cpu_affinity: dict  # {GPUn: "0-47"}
    numa_affinity: dict  # {GPUn: "0"}
    nic_names: dict  # {NIC0: "mlx5_0"}

    def relation(self, a: str, b: str) -> str:
        return self.matrix[(a, b)]

    def nics_by_closeness(self, gpu: str) -> list[tuple[str, str]]:
        """[(device name e.g. mlx5_0, relation)] for ``gpu`` (e.g. "GPU3"), closest first."""
        nics = [d for d in self.devices if d.startswith("NIC")]
        pairs = [(self.nic_names.get(n, n), self.matrix[(gpu, n)]) for n in nics]
        return sorted(pairs, key=lambda p: RELATION_RANK.get(p[1], 9))


def parse_topo(output: str) -> Topology | Skipped:
    """Parse ``nvidia-smi topo -m``."""
    if (s := skipped_in(output)) is not None:
        return s
    lines = [ln.rstrip() for ln in output.splitlines()]
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in lines]  # colour codes on a tty
    try:
        hi = next(i for i, ln in enumerate(lines) if re.match(r"^\s+GPU0\b", ln))
    except StopIteration:
        raise Unverified("nvidia-smi topo -m: no header row", evidence=output[-1500:]) from None
    header = [c.strip() for c in lines[hi].split("\t") if c.strip()]
    devices = tuple(c for c in header if re.fullmatch(r"(GPU|NIC)\d+", c))
    matrix, cpu, numa = {}, {}, {}
    for ln in lines[hi + 1:]:
        if not ln.strip() or ln.strip().startswith("Legend"):
            break
        cells = [c.strip() for c in ln.split("\t")]
        row, values = cells[0], [c for c in cells[1:] if c != ""]
        if row not in devices:
            continue
        for col, val in zip(devices, values):
            matrix[(row, col)] = val
        rest = values[len(devices):]
        if row.startswith("GPU") and rest:
            cpu[row] = rest[0]
            if len(rest) > 1:
                numa[row] = rest[1]
    nic_names = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)", output, re.M))
    missing = [(a, b) for a in devices for b in devices if (a, b) not in matrix]
    if missing:
        raise Unverified(f"nvidia-smi topo -m: incomplete matrix, missing {missing[:3]}")
    return Topology(devices, matrix, cpu, numa, nic_names)
