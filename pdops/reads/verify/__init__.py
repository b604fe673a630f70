"""`inv verify`: the deployed state of the current revision, its host checks read in one SSH
command per host (pdops.reads.verify.host_state), then what runs now against the revision (pdops.reads.observe,
a few more reads per host: units, MainPIDs, the files each process runs, the gateway's workers
and start-up list)."""

from __future__ import annotations

from collections import Counter

from pdops.errors import PdopsError, Refused, Unverified
from pdops.model.inventory import Inventory
from pdops.reads.check_result import PASS, SKIPPED, CheckResult, fail_result
from pdops.reads.verify.host_state import host_command, host_plans, judge, read_facts
from pdops.remote.hosts import connections
from pdops.reads.observe import observe
from pdops.fanout import run_parallel


def run_verify(inv: Inventory, record) -> str:
    """Every check on every host of the current revision, and the observation; Unverified naming
    each failure if any fails, else one line of what passed and what was skipped, and why."""

    rev = record.current_revision()
    if rev is None:
        raise Refused(f"{inv.cluster} has no current revision to verify", fix="deploy first (inv deploy)")
    plans = {p.host: p for p in host_plans(rev)}
    with connections(inv) as conns:
        pool = conns["pool"]
        outputs = run_parallel(list(plans), lambda h: pool.run(h, host_command(plans[h]), timeout=60).stdout)
        findings = observe(inv, rev, pool, conns["gateways"]).findings()
    checks: list[CheckResult] = []
    for host, out in outputs.items():
        if isinstance(out, Exception):
            msg = out.message if isinstance(out, PdopsError) else f"{type(out).__name__}: {out}"
            checks.append(fail_result(host, "read", msg, ""))
        else:
            checks += judge(plans[host], read_facts(out), virtual=inv.virtual_hardware)
    failed = [c for c in checks if c.failed]
    if failed or findings:
        evidence = "\n".join(f"  - {c.line()}" for c in failed)
        if findings:
            evidence += "\nobserved, against the revision:\n" + "\n".join(f"  - {f}" for f in findings)
        raise Unverified(f"verify of revision {rev.number} failed ({len(failed)} check(s) failed on the hosts, "
                         f"{len(findings)} observed difference(s))", evidence=evidence.strip("\n"),
                         fix="`inv deploy --topology <the live one>` repairs what is down, restarted or missing "
                             "in the gateway" if findings else None)
    return summary(checks, rev.number)


def summary(checks: list[CheckResult], rev_n: int) -> str:
    counts = Counter(c.status for c in checks)
    hosts = len({c.host for c in checks})
    skipped = sorted({f"{c.check}: {c.reason}" for c in checks if c.status == SKIPPED})
    return (f"{counts[PASS]} check(s) passed on {hosts} host(s), {counts[SKIPPED]} skipped"
            + (" (" + "; ".join(skipped) + ")" if skipped else "")
            + f"; gateway: every worker of revision {rev_n} healthy and ready, none unknown")
