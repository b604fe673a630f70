"""The P x D pairing matrix: from every decode host, a real TCP connection to every prefill
host's data address at each bootstrap port and one Mooncake RPC port (a transient listener
where no instance holds the port yet). The host-side helpers are the files in scripts/."""

from __future__ import annotations

from pathlib import Path

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from pdops.errors import Unverified
from pdops.facts import q
from pdops.model.inventory import Inventory
from pdops.model.placement import Placement
from pdops.fanout import run_parallel
from pdops.steps.preflight.checks import Facts, PAIRING
from pdops.steps.preflight.expected import PortUse, describe_holders, free_rpc_port, held_by_owner, port_holders
from pdops.reads.check_result import CheckResult, fail_result, ok_result
from pdops.steps.preflight.results import LISTEN_UNIT_PREFIX, PROBE_TIMEOUT_S

def script(name: str) -> str:
    """A host-side helper script shipped with pdops (pdops/steps/preflight/scripts/), as text for `python3 -c`."""
    return (Path(__file__).parent / "scripts" / name).read_text()


# ================================================================ pairing matrix

@dataclass(frozen=True)
class Target:
    """One port a decode must reach on a prefill host."""

    prefill_host: str
    addr: str
    port: int
    label: str  # "p01 bootstrap" | "Mooncake RPC"
    mode: str  # "listener" (pdops starts one) | "instance" (the running instance) | "held" (foreign: untestable)
    note: str = ""


@dataclass(frozen=True)
class Probe:
    addr: str
    port: int
    ok: bool
    error: str


@dataclass
class Matrix:
    prefill_hosts: list[str]
    decode_hosts: list[str]
    cells: dict[tuple[str, str], list[tuple[Target, bool, str]]] = field(default_factory=dict)
    listener_errors: dict[str, str] = field(default_factory=dict)  # prefill host -> why no listener
    skipped: str = ""

    def cell_ok(self, p: str, d: str) -> bool:
        return all(ok for _, ok, _ in self.cells.get((p, d), []))

    def failures(self) -> list[tuple[str, str, Target, str]]:
        return [(p, d, t, err) for (p, d), items in self.cells.items() for t, ok, err in items if not ok]

    def to_dict(self) -> dict:
        return {
            "skipped": self.skipped or None,
            "prefill_hosts": self.prefill_hosts, "decode_hosts": self.decode_hosts,
            "cells": [{"prefill": p, "decode": d, "ok": self.cell_ok(p, d),
                       "targets": [{"addr": t.addr, "port": t.port, "label": t.label, "mode": t.mode,
                                    "ok": ok, "error": err} for t, ok, err in items]}
                      for (p, d), items in self.cells.items()],
            "listener_errors": self.listener_errors,
        }

    def format(self) -> str:
        if self.skipped:
            return f"pairing: skipped ({self.skipped})"
        w = max([len("prefill \\ decode")] + [len(h) for h in self.prefill_hosts])
        cw = [max(len(d), 4) for d in self.decode_hosts]
        lines = ["pairing: decode -> prefill, real TCP connections to the bootstrap port(s) and a Mooncake RPC port",
                 "  " + "prefill \\ decode".ljust(w) + "  " + "  ".join(d.ljust(c) for d, c in zip(self.decode_hosts, cw))]
        for p in self.prefill_hosts:
            cells = ["ok" if self.cell_ok(p, d) else "FAIL" for d in self.decode_hosts]
            lines.append("  " + p.ljust(w) + "  " + "  ".join(c.ljust(n) for c, n in zip(cells, cw)))
        for p, d, t, err in self.failures():
            lines.append(f"  {d} -> {p} {_where(t)}: {err}")
        return "\n".join(lines)


def _where(t: Target) -> str:
    return f"{t.addr}:{t.port} ({t.label})" if t.port else f"{t.addr} ({t.label})"


def pairing_hosts(pl: Placement) -> tuple[list[str], list[str]]:
    pre, dec = [], []
    for inst in pl.instances:
        for h in inst.hosts:
            lst = pre if inst.role == "prefill" else dec
            if h not in lst:
                lst.append(h)
    return pre, dec


def plan_targets(inv: Inventory, pl: Placement, facts_by_host: dict[str, Facts]) -> list[Target]:
    """Ports each prefill host must accept from every decode host, and how each is tested (pure)."""
    out = []
    pre, _ = pairing_hosts(pl)
    for name in pre:
        host = inv.host(name)
        f = facts_by_host.get(name, {})
        listeners = f.get("listen")
        pid_units = f.get("pids") if isinstance(f.get("pids"), dict) else {}
        if not isinstance(listeners, list):
            listeners = []
        uses = [PortUse(i.bootstrap_port, f"{i.id} bootstrap", (i.unit(0),))
                for i in pl.on_host(name) if i.role == "prefill" and i.head.host == name and i.bootstrap_port]
        rpc = free_rpc_port(listeners, host.data_addr)
        if rpc is not None:
            uses.append(PortUse(rpc, "Mooncake RPC", ()))
        for use in uses:
            holders = port_holders(listeners, pid_units, host.data_addr, use.port)
            if not holders:
                out.append(Target(name, host.data_addr, use.port, use.purpose, "listener"))
            elif held_by_owner(holders, use):
                out.append(Target(name, host.data_addr, use.port, use.purpose, "instance",
                                  "tested against the running instance"))
            else:
                out.append(Target(name, host.data_addr, use.port, use.purpose, "held",
                                  f"held by a foreign process: {describe_holders(holders)}"))
    return out


_LISTENER = script("listener.py")

_WAITER = script("waiter.py")

_PROBE = script("probe.py")


def host_python(inv: Inventory) -> str:
    return str(inv.vars.get("ansible_python_interpreter", "/usr/bin/python3"))


def listener_unit(token: str) -> str:
    return f"{LISTEN_UNIT_PREFIX}{token}.service"


def listener_start_command(python: str, unit: str, addr: str, ports: list[int], max_s: int = 60) -> str:
    """Start a transient listener unit on addr:ports, then wait until each port accepts (JSON {port: ok|error})."""
    args = " ".join(str(int(p)) for p in ports)
    return (f"systemd-run --quiet --unit={q(unit)} --collect -p RuntimeMaxSec={int(max_s)} "
            f"{q(python)} -c {q(_LISTENER)} {q(addr)} {args} && "
            f"{q(python)} -c {q(_WAITER)} {q('unit=' + unit)} {q(addr)} {args}; "
            f"journalctl -u {q(unit)} -o cat -n 3 --no-pager 2>/dev/null | sed 's/^/journal: /'; true")


def parse_listener_start(output: str) -> tuple[dict[int, str], str]:
    """({port: 'ok' | error}, journal lines) from :func:`listener_start_command`."""
    res: dict[int, str] = {}
    journal = []
    for line in output.splitlines():
        if line.startswith("{"):
            res = {int(k): v for k, v in json.loads(line).items()}
        elif line.startswith("journal: "):
            journal.append(line[len("journal: "):])
        elif line.strip():
            journal.append(line.strip())
    return res, "\n".join(journal)


def listener_stop_command(unit: str) -> str:
    """Stop our own listener by its exact unit name (never by pattern); gone already is fine."""
    return f"systemctl stop {q(unit)} 2>/dev/null; systemctl reset-failed {q(unit)} 2>/dev/null; true"


def probe_command(python: str, targets: list[tuple[str, int]], source_addr: str, timeout: float = PROBE_TIMEOUT_S) -> str:
    return f"{q(python)} -c {q(_PROBE)} {q(json.dumps([list(t) for t in targets]))} {q(source_addr)} {float(timeout):g}"


def parse_probe(output: str) -> list[Probe]:
    out = []
    for line in output.splitlines():
        if line.startswith("["):
            a, p, ok, err = json.loads(line)
            out.append(Probe(a, int(p), bool(ok), err))
    return out


def evaluate_pairing(pre: list[str], dec: list[str], targets: list[Target],
                     probes: dict[str, list[Probe] | Exception],
                     listener_ready: dict[str, dict[int, str] | Exception]) -> Matrix:
    """The P x D matrix from what each decode host saw (pure)."""
    m = Matrix(list(pre), list(dec))
    for p in pre:
        ready = listener_ready.get(p)
        if isinstance(ready, Exception):
            m.listener_errors[p] = str(ready)
    for d in dec:
        seen = probes.get(d)
        by = {} if isinstance(seen, Exception) or seen is None else {(x.addr, x.port): x for x in seen}
        for t in targets:
            key = (t.prefill_host, d)
            if t.mode == "held":
                err, ok = f"not tested: {t.note}", False
            elif isinstance(seen, Exception):
                err, ok = f"cannot run the probe on {d}: {seen}", False
            else:
                pr = by.get((t.addr, t.port))
                ok = bool(pr and pr.ok)
                err = "" if ok else (pr.error if pr else "no probe result")
                if not ok and t.mode == "listener":
                    lr = listener_ready.get(t.prefill_host)
                    why = m.listener_errors.get(t.prefill_host) or (
                        lr.get(t.port) if isinstance(lr, dict) and lr.get(t.port) != "ok" else None)
                    if why:
                        err += f" (the test listener on {t.prefill_host} could not listen: {why})"
            m.cells.setdefault(key, []).append((t, ok, err))
    return m


def pairing_results(inv: Inventory, m: Matrix) -> list[CheckResult]:
    if m.skipped:
        return []
    out = []
    fails = m.failures()
    for p in m.prefill_hosts:
        bad = [(d, t, e) for pp, d, t, e in fails if pp == p]
        if not bad:
            out.append(ok_result(p, PAIRING, f"reachable from every decode host ({len(m.decode_hosts)})"))
            continue
        listen_fail = any("could not listen" in e for _, _, e in bad)
        down = any("unreachable over SSH" in e for _, _, e in bad)
        held = any(t.mode == "held" for _, t, _ in bad)
        reason = "unreachable from " + "; ".join(f"{d}: {_where(t)} {e}" for d, t, e in bad)
        fixes = []
        if down:
            fixes.append("bring the unreachable host back (SSH), then run preflight again")
        if held:
            fixes.append("free the port on the prefill host (see the ports check), then run preflight again")
        if listen_fail:
            fixes.append(f"pdops_data_addr {inv.host(p).data_addr} must be an address of {p} on the data network: "
                         "fix the inventory or configure the address on the host")
        if not fixes:
            fixes.append(f"open TCP {', '.join(sorted({str(t.port) for _, t, _ in bad}))} and 15000-17000 on {p} for "
                         "the decode hosts' data addresses (firewall, security group) and check routing between the "
                         "data addresses")
        out.append(fail_result(p, PAIRING, reason, "; ".join(fixes)))
    for d in m.decode_hosts:
        bad = [(p, t, e) for p, dd, t, e in fails if dd == d]
        if d in m.prefill_hosts and any(r.host == d for r in out):
            # a host holding both roles: one row, both directions
            if bad:
                i = next(k for k, r in enumerate(out) if r.host == d)
                prev = out[i]
                reason = (prev.reason + "; " if prev.failed else "") + \
                    "cannot reach " + "; ".join(f"{p} {_where(t)}" for p, t, _ in bad)
                out[i] = fail_result(d, PAIRING, reason, prev.fix or "see the prefill hosts named here")
            continue
        if bad:
            out.append(fail_result(d, PAIRING, "cannot reach " + "; ".join(f"{p} {_where(t)}: {e}"
                                                                   for p, t, e in bad),
                             "see the pairing failure of the prefill host(s) named here"))
        else:
            out.append(ok_result(d, PAIRING, f"reaches every prefill host ({len(m.prefill_hosts)})"))
    return out


def run_pairing(inv: Inventory, pl: Placement, pool, facts_by_host: dict[str, Facts],
                unreachable: set[str]) -> Matrix:
    """Fan out: start test listeners on the prefill hosts, probe from every decode host, stop the listeners."""
    pre, dec = pairing_hosts(pl)
    if not pre or not dec:
        return Matrix(pre, dec, skipped="the topology has no prefill or no decode")
    py = host_python(inv)
    targets = [t for t in plan_targets(inv, pl, facts_by_host) if t.prefill_host not in unreachable]
    unit = listener_unit(secrets.token_hex(4))
    need: dict[str, list[int]] = {}
    for t in targets:
        if t.mode == "listener" and t.prefill_host not in unreachable:
            need.setdefault(t.prefill_host, []).append(t.port)

    def start(h: str) -> dict[int, str]:
        out = pool.run(h, listener_start_command(py, unit, inv.host(h).data_addr, need[h]), timeout=30).stdout
        res, journal = parse_listener_start(out)
        if not res:
            last = (journal or out).strip().splitlines()[-1:] or ["no output"]
            raise Unverified(f"the test listener did not start on {h}: {last[0]}", evidence=journal or out[-500:])
        # the waiter names the listener's own error; a bare timeout gets the journal's last line
        return {p: (v if v == "ok" or not journal or "timed out" not in v else f"{v}; {journal.splitlines()[-1]}")
                for p, v in res.items()}

    started: dict[str, Any] = {}
    try:
        started = run_parallel(list(need), start)
        live = [d for d in dec if d not in unreachable]
        probes = run_parallel(live, lambda d: parse_probe(pool.run(
            d, probe_command(py, [(t.addr, t.port) for t in targets if t.mode != "held"], inv.host(d).data_addr),
            timeout=PROBE_TIMEOUT_S * 4 + 10).stdout))
    finally:
        run_parallel(list(need), lambda h: pool.run(h, listener_stop_command(unit), timeout=20))
    m = evaluate_pairing(pre, dec, targets, dict(probes), dict(started))
    for p in pre:
        for d in dec:
            down = [h for h in (p, d) if h in unreachable]
            if down:
                m.cells[(p, d)] = [(Target(p, inv.host(p).data_addr, 0, "all ports", "held"), False,
                                    f"not tested: {' and '.join(down)} unreachable over SSH")]
    return m


