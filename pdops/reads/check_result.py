"""A check's result on one host, the one type preflight and verify both report: passed, failed
(what was seen, and the fix where there is one) or skipped (why; never counted as passed)."""

from __future__ import annotations

from dataclasses import dataclass

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
_WORD = {PASS: "passed", FAIL: "failed", SKIPPED: "skipped"}


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

    def line(self) -> str:
        """``<host> <check>: failed: <reason>``."""
        return f"{self.host} {self.check}: {_WORD[self.status]}" + (f": {self.reason}" if self.reason else "")


def ok_result(host: str, check: str, reason: str, evidence: str = "") -> CheckResult:
    return CheckResult(host, check, PASS, reason, "", evidence)


def fail_result(host: str, check: str, reason: str, fix: str, evidence: str = "") -> CheckResult:
    return CheckResult(host, check, FAIL, reason, fix, evidence)


def skip_result(host: str, check: str, reason: str) -> CheckResult:
    return CheckResult(host, check, SKIPPED, reason)
