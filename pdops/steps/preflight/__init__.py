"""`inv preflight`: host, GPU, RDMA, version and P x D pairing checks before any change.

Read, then decide (docs/design/style.md 1 and 5):

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

Layout: `pdops.facts.host` (facts: command + parser), `batch` (one SSH round trip per host),
`expected` (what each host runs), `checks` (each check as data), `pairing` (the P x D matrix;
host-side helpers in `scripts/`), `report`; plan, decide and do here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pdops.errors import PdopsError, Refused
from pdops.model.inventory import Inventory
from pdops.model.placement import Placement, place
from pdops.runner import Say
from pdops.fanout import run_parallel
from pdops.model.topology import Topology
from pdops.facts.host import ReadError
from pdops.facts import batch_command
from pdops.steps.preflight.batch import SECTIONS, Section, gid_section, parse_sections
from pdops.steps.preflight.checks import CHECKS, CHECK_NAMES, Facts, PAIRING, VERSION_CHECKS, VERSION_SECTIONS, validate_skip
from pdops.steps.preflight.pairing import Matrix, pairing_hosts, pairing_results, run_pairing
from pdops.steps.preflight.report import PreflightReport
from pdops.reads.check_result import CheckResult, FAIL, PASS, SKIPPED, fail_result, skip_result
from pdops.steps.preflight.results import VIRTUAL_REASON
from pdops.record.local import default_operator

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
    used.update(inv.gateway.hosts)
    plans = []
    for host in inv.hosts:
        if host.name not in used:
            continue
        run, skipped = [], []
        for name, chk in CHECKS.items():
            if name in skip:
                skipped.append(skip_result(host.name, name, f"skipped by the operator (--skip-check {name})"))
            elif (why := chk.applies(inv, host, pl)) is not None:
                skipped.append(skip_result(host.name, name, why))
            elif chk.hardware and inv.virtual_hardware:
                skipped.append(skip_result(host.name, name, VIRTUAL_REASON))
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
            out.append(fail_result(host.name, name, what, "run the command by hand on the host to see why",
                             e.raw if isinstance(e, ReadError) else ""))
            continue
        try:
            out.extend(chk.evaluate(inv, host, pl, facts))
        except PdopsError as exc:  # e.g. a GPU with no NIC mapped
            out.append(fail_result(host.name, name, exc.message, exc.fix or ""))
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
            replace(h, check, fail_result(h, check, reason, fix))

    drivers = {}
    for h, f in facts_by_host.items():
        gpus = f.get("gpus")
        if isinstance(gpus, list) and gpus and (h, "gpu-driver") in status and status[(h, "gpu-driver")].status == PASS:
            drivers[h] = gpus[0].driver_version or "?"
    compare("gpu-driver", drivers, "driver", "install the same NVIDIA driver on every host (and reboot)")
    for check, (label, read, pin_of) in VERSION_CHECKS.items():
        vals = {}
        for h, f in facts_by_host.items():
            v = f.get(VERSION_SECTIONS.get(check, "versions"))
            r = status.get((h, check))
            if isinstance(v, dict) and r is not None and r.status != SKIPPED and read(v):
                vals[h] = read(v)
        pin = pin_of()
        compare(check, vals, label, f"install {label}=={pin} on every host (pdops/model/versions.py)" if pin
                else f"install one {label} version on every host", pin)
    return out


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
            results.append(fail_result(name, "ssh", f"cannot read the host: {msg}",
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
        results.extend(skip_result(h, PAIRING, matrix.skipped) for h in sorted(set(sum(pairing_hosts(pl), []))))
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
