"""Command line of the sim: SGLang 0.5.23's launch_server flags, same parser behaviour.

The parser is built from the flag table extracted from SGLang (``pdops/model/sglang_flags.py``):
same names, argparse abbreviations, choices and int/float types, so a flag SGLang
rejects is rejected here with exit status 2. ``PDOPS_SIM_VALIDATE=sglang`` additionally
runs SGLang's own ``prepare_server_args`` in a throw-away subprocess first (about 5 s
and the torch import; needs the sglang package); the default ``own`` uses the table only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass

from pdops.model.generation import sglang_parser


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser accepting exactly SGLang's launch_server flags (pdops's own, which the
    generation digest parses with: one parse for both)."""
    return sglang_parser(
        prog="python -m pdops.sim",
        usage="python -m pdops.sim --model-path PATH [SGLang 0.5.23 launch_server flags]",
        description="Stand-in SGLang engine",
    )


@dataclass
class SimArgs:
    """The resolved flags; ``all`` holds every flag (for /server_info)."""

    all: dict
    host: str
    port: int
    model_path: str
    served_model_name: str
    mode: str  # null | prefill | decode
    bootstrap_port: int
    tp_size: int
    pp_size: int
    dp_size: int
    nnodes: int
    node_rank: int
    dist_init_addr: str | None
    max_running_requests: int | None
    context_length: int | None
    chunked_prefill_size: int | None
    api_key: str | None
    enable_metrics: bool

    @property
    def local_ranks(self) -> int:
        """Scheduler processes on this node: tp*pp / nnodes."""
        return max(1, self.tp_size * self.pp_size // max(self.nnodes, 1))

    @property
    def engine_type(self) -> str:
        return {"prefill": "prefill", "decode": "decode"}.get(self.mode, "unified")


def _int_or_none(v):
    """SGLang types some size flags with its own converters; the sim wants ints."""
    if v is None:
        return None
    try:
        return int(float(v))
    except (TypeError, ValueError):
        raise SystemExit(f"pdops.sim: expected a number, got {v!r}") from None


def _sglang_validate(argv: list[str]) -> None:
    code = "import sys\nfrom sglang.srt.server_args import prepare_server_args\nprepare_server_args(sys.argv[1:])\n"
    rc = subprocess.run([sys.executable, "-c", code, *argv]).returncode
    if rc != 0:
        raise SystemExit(rc)


def parse_args(argv: list[str], env=None) -> SimArgs:
    """Parse SGLang flags; SystemExit(2) on a flag SGLang would reject, 1 on launch checks."""
    env = os.environ if env is None else env
    mode = env.get("PDOPS_SIM_VALIDATE", "own")
    if mode not in ("own", "sglang"):
        raise SystemExit(f"pdops.sim: PDOPS_SIM_VALIDATE={mode!r}: expected own or sglang")
    ns = build_parser().parse_args(argv)
    if mode == "sglang":
        _sglang_validate(argv)
    a = vars(ns)
    tp, pp, nnodes = a["tp_size"] or 1, a["pp_size"] or 1, a["nnodes"] or 1
    dp = a.get("dp_size") or 1
    if (tp * pp) % nnodes != 0:
        raise SystemExit(f"pdops.sim: tp_size*pp_size ({tp * pp}) must be divisible by nnodes ({nnodes})")
    if dp > 1 and nnodes > 1:
        raise SystemExit("pdops.sim: dp_size > 1 with nnodes > 1 is not supported (SGLang refuses it)")
    if nnodes > 1 and not a.get("dist_init_addr"):
        raise SystemExit("pdops.sim: --nnodes > 1 needs --dist-init-addr")
    if a.get("disaggregation_mode") == "prefill" and a.get("disaggregation_transfer_backend") == "fake":
        raise SystemExit("pdops.sim: --disaggregation-transfer-backend fake is refused on a prefill")
    return SimArgs(
        all=a,
        host=a["host"] or "127.0.0.1",
        port=a["port"],
        model_path=a["model_path"],
        served_model_name=a.get("served_model_name") or a["model_path"],
        mode=a.get("disaggregation_mode") or "null",
        bootstrap_port=a.get("disaggregation_bootstrap_port") or 8998,
        tp_size=tp,
        pp_size=pp,
        dp_size=dp,
        nnodes=nnodes,
        node_rank=a.get("node_rank") or 0,
        dist_init_addr=a.get("dist_init_addr"),
        max_running_requests=a.get("max_running_requests"),
        context_length=_int_or_none(a.get("context_length")),
        chunked_prefill_size=a.get("chunked_prefill_size"),
        api_key=a.get("api_key"),
        enable_metrics=bool(a.get("enable_metrics")),
    )
