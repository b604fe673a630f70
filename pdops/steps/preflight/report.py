"""The preflight report: host x check table, verdict, failures with their fixes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from pdops.steps.preflight.checks import CHECK_NAMES
from pdops.steps.preflight.pairing import Matrix
from pdops.reads.check_result import CheckResult, FAIL, PASS, SKIPPED

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


