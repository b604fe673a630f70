"""The constants every part of preflight shares (a check's result is pdops.reads.check_result.CheckResult)."""

from __future__ import annotations

VIRTUAL_REASON = "lab host has no nvidia-smi/RDMA (virtual hardware)"
GATEWAY_UNIT = "pdops-gateway.service"  # same name as pdops.model.render.GATEWAY_UNIT (kept import-light)
LISTEN_UNIT_PREFIX = "pdops-preflight-listen-"
DEFAULT_MIN_LOG_GIB = 5.0
MIN_FREE_RPC_PORTS = 16
PROBE_TIMEOUT_S = 3.0




# ================================================================ results


