"""A check's result on one host, and the constants every part of preflight shares."""

from __future__ import annotations

from dataclasses import dataclass


PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
VIRTUAL_REASON = "lab host has no nvidia-smi/RDMA (virtual hardware)"
GATEWAY_UNIT = "pdops-gateway.service"  # same name as pdops.model.render.GATEWAY_UNIT (kept import-light)
LISTEN_UNIT_PREFIX = "pdops-preflight-listen-"
DEFAULT_MIN_LOG_GIB = 5.0
MIN_FREE_RPC_PORTS = 16
PROBE_TIMEOUT_S = 3.0




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


def ok_result(host: str, check: str, reason: str, evidence: str = "") -> CheckResult:
    return CheckResult(host, check, PASS, reason, "", evidence)


def fail_result(host: str, check: str, reason: str, fix: str, evidence: str = "") -> CheckResult:
    return CheckResult(host, check, FAIL, reason, fix, evidence)


def skip_result(host: str, check: str, reason: str) -> CheckResult:
    return CheckResult(host, check, SKIPPED, reason)


