"""An inventory placed and rendered, for the commands that show it (`inv plan`, `inv render`) and the
tables they print: load and place, write the build folder, format a placement or any rows."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pdops.model.inventory import Inventory, load_inventory
from pdops.model.placement import Placement, place, placement_table
from pdops.model.topology import parse_topology
from pdops.model.render import render_files, write_build

if TYPE_CHECKING:  # rendering (jinja2) is imported only by the commands that render
    from pdops.model.render import RenderedFile

REPO = Path(__file__).resolve().parents[2]


def load_and_place(inventory: str | Path, topology: str, previous: Placement | None = None) -> tuple[Inventory, Placement]:
    """Validate topology and inventory, then place; raises InvalidInput before any host is contacted."""
    topo = parse_topology(topology)
    inv = load_inventory(inventory)
    return inv, place(inv, topo, previous)


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "(none)"
    cols = list(rows[0])
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.upper().ljust(width[c]) for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def format_placement(inv: Inventory, pl: Placement) -> str:
    gw = inv.gateway
    head = (f"topology {pl.topology}: {len(pl.role('prefill'))} prefill + {len(pl.role('decode'))} decode instances, "
            f"TP{inv.profile.tp} x PP{inv.profile.pp} each, {inv.profile.gpus_per_instance * len(pl.instances)} "
            f"of {inv.total_gpus} GPUs; gateway " + ", ".join(f"{n.host} {n.url}" for n in gw.nodes))
    if inv.profile.device == "cpu":
        head += (f"\nengine: real SGLang on this machine's CPU (profile {inv.profile.name}, lab only): the units, "
                 "launch scripts and env files of a GPU host, with only these differences: --device cpu; each engine's "
                 "own --nccl-port, --engine-info-bootstrap-port and Mooncake port range (MC_MIN/MAX_RPC_PORT); "
                 "a decode's retraction backup cpu_tensor; SGLANG_USE_CPU_ENGINE=1; the stand-ins for torchvision and "
                 "sgl_kernel on PYTHONPATH (pdops/lab/cpu_engine/standins)")
    return head + "\n" + format_table(placement_table(pl))


def render_build(inv: Inventory, pl: Placement, out: Path | None) -> tuple[Path, list[RenderedFile]]:
    files = render_files(inv, pl)
    out = out or REPO / "build" / inv.cluster / str(pl.topology)
    meta = {"cluster": inv.cluster, "topology": str(pl.topology), "inventory_digest": inv.digest,
            "engine": inv.engine, "profile": inv.profile.name}
    return write_build(files, out, meta), files
