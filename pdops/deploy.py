"""`inv deploy`: render, deliver with Ansible, start in order, health-gate, register, canary, record.

Plan (pure, printable with --dry-run) and do (walks the plan over Fabric, journals every
step with its evidence, stops at the first failure and says what it left running).
`current` moves only after every step succeeded.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pdops import ansible
from pdops.errors import PdopsError, Refused, Unreachable, Unverified
from pdops.facts import q
from pdops.gateway import GatewayClient, deadline_in
from pdops.hosts import HostPool, http_json
from pdops.inventory import Inventory
from pdops.placement import Instance, Placement, place
from pdops.admission import UNIT as ADMISSION_UNIT
from pdops.render import GATEWAY_UNIT, RenderedFile, admission_config, manifest, render_files, write_build
from pdops.runner import Step, failures, run_parallel
from pdops.state import StateDir, new_op_id
from pdops.topology import Topology
from pdops.versions import MOONCAKE_VERSION, SGLANG_ROUTER_VERSION, SGLANG_VERSION

Say = Callable[[str], None]


def state_for(inv: Inventory) -> StateDir:
    """The cluster's state dir: `pdops_state_dir`, else <lab dir>/state for a lab, else the default."""
    root = inv.vars.get("pdops_state_dir")
    if root is None and inv.vars.get("pdops_lab_dir"):
        root = Path(inv.vars["pdops_lab_dir"]) / "state"
    return StateDir(inv.cluster, root)


@dataclass
class DeployPlan:
    inv: Inventory
    placement: Placement
    files: list[RenderedFile]
    steps: list[Step]
    noop: str | None = None
    hosts: list[str] = field(default_factory=list)
    skip_checks: set[str] = field(default_factory=set)
    previous: Placement | None = None

    def render(self) -> str:
        lines = [f"plan: deploy {self.placement.topology} on {self.inv.cluster} "
                 f"({len(self.hosts)} hosts, engine {self.inv.engine}, profile {self.inv.profile.name})"]
        if self.noop:
            return lines[0] + f"\nno change: {self.noop}"
        lines += [f"  {n:2d}. {s}" for n, s in enumerate(self.steps, 1)]
        lines.append("verified at the end: every unit active with its MainPID, every instance healthy on its "
                     "/health, registered and healthy in the gateway, a canary through every P x D pair")
        return "\n".join(lines)


def plan_deploy(inv: Inventory, topo: Topology, state: StateDir, skip_checks: set[str] | None = None) -> DeployPlan:
    """Pure apart from reading the state dir: what a deploy of `topo` will do, or why not."""
    from pdops.preflight import validate_skip

    skip_checks = validate_skip(skip_checks)
    current = state.current_revision()
    previous = Placement.from_dict(current.placement) if current else None
    if current is not None:
        if current.topology != str(topo):
            raise Refused(f"{inv.cluster} is live at revision {current.number} ({current.topology}); "
                          f"deploy does not change a live topology",
                          fix=f"use `inv scale --topology {topo}` to plan the change from {current.topology}")
        if current.inventory_hash != inv.digest:
            raise Refused(f"the inventory changed since revision {current.number} was deployed "
                          f"(digest {current.inventory_hash[:12]} -> {inv.digest[:12]})",
                          fix="restore the inventory of the running revision, or plan the change with `inv scale`")
    pl = place(inv, topo, previous)
    files = render_files(inv, pl)
    hosts = sorted({f.host for f in files})
    if current is not None and current.manifest == manifest(files):
        return DeployPlan(inv, pl, files, [], noop=f"revision {current.number} ({topo}) is already live with "
                          "identical rendered files; `inv status` shows its health", hosts=hosts)
    start_s = inv.vars.get("pdops_start_timeout_s", 900)
    gw = inv.gateway
    steps = [
        Step("lock", None, f"take the {inv.cluster} cluster lock"),
        Step("connect", None, f"SSH to {len(hosts)} hosts in parallel: {', '.join(hosts)}", 30),
        Step("preflight", None, "host, limits, ports, versions and P x D pairing checks; refuse a failing host"
             + (f" (skipping {', '.join(sorted(skip_checks))})" if skip_checks else "")),
        Step("render", None, f"{len(files)} files into the revision's build folder, with a manifest"),
        Step("deliver", None, "ansible-playbook prepare.yml deploy.yml (directories, limits, engine environment; "
                              "units, launch scripts, 0600 env files, daemon-reload, enable)"),
        Step("gateway", gw.host, f"start {GATEWAY_UNIT} with no workers, wait for {gw.url}/health", 60),
    ]
    adm = admission_config(inv)
    if adm is not None:
        steps.append(Step("admission", adm.host, f"start {ADMISSION_UNIT} in front of the gateway, wait for "
                          f"{adm.url} to answer", 30))
    for inst in pl.instances:
        ranks = ", ".join(f"{h}:{u}" for h, u in inst.units)
        steps.append(Step("start", inst.head.host, f"{inst.id} ({inst.role}): start {ranks}, wait {inst.url}/health",
                          start_s))
    npairs = len(pl.role("prefill")) * len(pl.role("decode"))
    steps.append(Step("canary", None, f"{npairs} generation requests, one through every prefill x decode pair, "
                      "sent straight to the pair before anything is registered", 120))
    reg_s = float(inv.vars.get("pdops_register_timeout_s", 60))
    for inst in pl.instances:
        bp = f" bootstrap {inst.bootstrap_port}" if inst.bootstrap_port else ""
        steps.append(Step("register", gw.host, f"{inst.id}: POST /workers {inst.url} ({inst.role}{bp}), wait healthy",
                          reg_s))
    steps.append(Step("record", None, "write the revision, move `current` to it, release the lock"))
    return DeployPlan(inv, pl, files, steps, hosts=hosts, skip_checks=skip_checks, previous=previous)


# ---------------------------------------------------------------- doing

class DeployFailed(PdopsError):
    exit_code = 7
    kind = "deploy failed"


def _ansible_files(build: Path, files: list[RenderedFile]) -> dict:
    """{host: [pdops_files entry]} from the written build (what was recorded is what is sent)."""
    out: dict[str, list] = {}
    for f in files:
        data = (build / f.host / f.path.lstrip("/")).read_bytes()
        out.setdefault(f.host, []).append(ansible.file_entry(f.path, data, f.mode))
    return out


def _units_by_host(pl: Placement, inv: Inventory) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {inv.gateway.host: [GATEWAY_UNIT]}
    adm = admission_config(inv)
    if adm is not None:
        out.setdefault(adm.host, []).append(ADMISSION_UNIT)
    for inst in pl.instances:
        for host, unit in inst.units:
            out.setdefault(host, []).append(unit)
    return out


def deliver(inv: Inventory, pl: Placement, files: list[RenderedFile], build: Path, remove: dict | None,
            say: Say) -> dict:
    """Ansible: prepare.yml then deploy.yml, in one ansible-playbook run. Returns evidence.

    prepare.yml's folder task is skipped: deploy.yml's one module run per host makes the same
    folders (playbooks/vars/pdops.yml) and checks the engine's python."""
    hosts = sorted({f.host for f in files} | set((remove or {}).keys()))
    extra = {"pdops_engine_python": inv.engine_python, "pdops_sglang_version": SGLANG_VERSION,
             "pdops_mooncake_version": MOONCAKE_VERSION, "pdops_router_version": SGLANG_ROUTER_VERSION,
             "pdops_files": _ansible_files(build, files), "pdops_remove": remove or {},
             "pdops_units": _units_by_host(pl, inv)}
    t0 = time.monotonic()
    res = ansible.run_playbook(inv, ["prepare.yml", "deploy.yml"], extra, hosts, skip_tags=("pdops-folders",))
    secs = round(time.monotonic() - t0, 1)
    say(f"  prepare.yml + deploy.yml: {len(res.recap)} hosts ok, {res.changed} changes ({secs}s)")
    return {"playbooks": res.playbook, "changed": res.changed, "seconds": secs,
            "hosts": {h: vars(r) for h, r in res.recap.items()}}


def start_gateway(inv: Inventory, pool: HostPool, say: Say, restart: bool) -> dict:
    gw = inv.gateway
    verb = "restart" if restart else "start"
    pool.run(gw.host, f"systemctl {verb} {q(GATEWAY_UNIT)}")
    client = GatewayClient(gw.url, api_key_file=gw.api_key_file)
    deadline = deadline_in(60)
    while True:
        try:
            client.health()
            break
        except (Unreachable, Unverified):
            st = pool.unit_states(gw.host, [GATEWAY_UNIT])[GATEWAY_UNIT]
            if st.active_state == "failed" or time.monotonic() > deadline:
                raise DeployFailed(f"gateway {GATEWAY_UNIT} on {gw.host} did not answer {gw.url}/health "
                                   f"(unit {st.active_state}/{st.sub_state})",
                                   evidence=pool.journal_tail(gw.host, GATEWAY_UNIT)) from None
            time.sleep(0.3)
    st = pool.unit_states(gw.host, [GATEWAY_UNIT])[GATEWAY_UNIT]
    say(f"  gateway up: {gw.url} (MainPID {st.main_pid})")
    return {"url": gw.url, "main_pid": st.main_pid, "unit": GATEWAY_UNIT}


def start_admission(inv: Inventory, pool: HostPool, say: Say, restart: bool) -> dict | None:
    """Start the admission layer (HAProxy) after the gateway; wait until it answers HTTP."""
    adm = admission_config(inv)
    if adm is None:
        return None
    pool.run(adm.host, f"systemctl {'restart' if restart else 'start'} {q(ADMISSION_UNIT)}")
    deadline = deadline_in(30)
    while True:
        try:
            status, _ = http_json("GET", f"{adm.url}/health", timeout=3)
            break  # any HTTP answer (401 without a key) means it serves
        except Unreachable:
            if time.monotonic() > deadline:
                raise DeployFailed(f"admission layer {ADMISSION_UNIT} on {adm.host} did not answer {adm.url}",
                                   evidence=pool.journal_tail(adm.host, ADMISSION_UNIT)) from None
            time.sleep(0.3)
    say(f"  admission layer up: {adm.url} (cap {adm.cap}, queue {adm.queue}; unauthenticated probe got {status})")
    return {"url": adm.url, "cap": adm.cap, "probe_status": status}


def start_instance(inv: Inventory, pool: HostPool, inst: Instance, deadline_s: float, say: Say,
                   restart: bool) -> dict:
    """Start every rank's unit (rank 0 first), then wait for rank 0's /health with a deadline.
    A unit that fails stops the wait with the tail of its journal."""
    verb = "restart" if restart else "start"
    for host, unit in inst.units:
        pool.run(host, f"systemctl {verb} {q(unit)}")
    deadline = time.monotonic() + deadline_s
    t0 = time.monotonic()
    last_check = t0  # the unit's state is read from 2 s on: most instances are healthy before
    while True:
        try:
            status, _ = http_json("GET", f"{inst.url}/health", timeout=5)
        except Unreachable:
            status = None
        if status == 200:
            break
        if time.monotonic() - last_check > 2:
            last_check = time.monotonic()
            for host, unit in inst.units:
                st = pool.unit_states(host, [unit])[unit]
                if st.active_state in ("failed", "inactive") or st.n_restarts > 0:
                    raise DeployFailed(f"{inst.id}: {unit} on {host} is {st.active_state}/{st.sub_state} "
                                       f"(result {st.result}, restarts {st.n_restarts}) before becoming healthy",
                                       fix="read the journal below; fix the cause and deploy again",
                                       evidence=pool.journal_tail(host, unit))
        if time.monotonic() > deadline:
            raise DeployFailed(f"{inst.id} did not answer {inst.url}/health within {deadline_s:.0f}s (last: {status})",
                               evidence=pool.journal_tail(inst.head.host, inst.unit(0)))
        time.sleep(0.25)
    pids = {}
    for host, unit in inst.units:
        st = pool.unit_states(host, [unit])[unit]
        pids[f"{host}:{unit}"] = st.main_pid
    say(f"  {inst.id} healthy in {time.monotonic() - t0:.1f}s at {inst.url} (MainPID {', '.join(map(str, pids.values()))})")
    return {"url": inst.url, "main_pids": pids, "ready_s": round(time.monotonic() - t0, 2)}


def register(client: GatewayClient, inst: Instance, say: Say, timeout_s: float = 60) -> str:
    """POST the instance to the gateway and wait until /workers lists it healthy."""
    worker_id = client.add_worker(inst.url, inst.role, inst.bootstrap_port)
    w = client.wait_worker_healthy(inst.url, deadline_in(timeout_s))
    say(f"  {inst.id} registered: worker {w.id} healthy")
    return w.id or worker_id


def _undo_registrations(client: GatewayClient, pl: Placement, workers: dict, bad: dict, fresh: bool,
                        say: Say) -> dict:
    """After a failed registration: remove from the gateway what this deploy could not verify (any
    worker listed for a failed instance) and, on a fresh cluster, what it registered (no revision
    will describe it). Returns what was removed and what is left."""
    removed, left = [], []
    try:
        listed = client.list_workers()
    except PdopsError as exc:
        return {"removed": [], "left": [f"gateway unreadable: {exc.message}"]}
    targets = {i.url: i.id for i in bad}
    if fresh:
        targets.update({i.url: i.id for i in pl.instances if i.id in workers})
    for w in listed:
        if w.url in targets:
            try:
                client.remove_worker(w.id)
                client.wait_worker_gone(w.id, deadline_in(30))
                removed.append(f"{targets[w.url]} ({w.id})")
            except PdopsError as exc:
                left.append(f"{targets[w.url]} ({w.id}): {exc.message}")
    if removed:
        say(f"  removed from the gateway: {', '.join(removed)}")
    return {"removed": removed, "left": left}


def preflight_unverified(report, skip_checks: set[str]) -> list[str]:
    """The preflight checks that did not run, by check: skipped by the operator or for a reason
    (no nvidia-smi in the lab). Never part of what an operation calls verified."""
    from pdops.preflight import SKIPPED

    out = [f"preflight {c}: skipped by the operator (--skip-check)" for c in sorted(skip_checks)]
    by_check: dict[str, dict[str, list[str]]] = {}
    for r in report.results:
        if r.status == SKIPPED and r.check not in skip_checks:
            by_check.setdefault(r.check, {}).setdefault(r.reason, []).append(r.host)
    for check, reasons in by_check.items():
        for reason, hosts in reasons.items():
            out.append(f"preflight {check}: skipped on {len(hosts)} host(s): {reason}")
    return out


def canary_pair(p: Instance, d: Instance, timeout: float = 60) -> dict:
    """One generation through exactly this prefill and this decode, sent as the gateway does:
    the same body (with a shared bootstrap room) to both, concurrently."""
    rid = f"pdops-canary-{p.id}-{d.id}-{uuid.uuid4().hex[:8]}"
    body = {"text": f"pdops canary {p.id} to {d.id}", "rid": rid, "stream": False,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "bootstrap_host": p.head.data_addr, "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": random.getrandbits(62)}
    res = run_parallel(["prefill", "decode"], lambda role: http_json(
        "POST", f"{(p if role == 'prefill' else d).url}/generate", body, timeout=timeout,
        headers={"x-request-id": rid}))
    out = {"rid": rid}
    for role, r in res.items():
        if isinstance(r, Exception):
            raise Unverified(f"canary {p.id} x {d.id}: {role} did not answer: {r}")
        status, doc = r
        out[role] = status
        if status != 200:
            raise Unverified(f"canary {p.id} x {d.id}: {role} answered HTTP {status}", evidence=str(doc)[-400:])
    meta = res["decode"][1].get("meta_info", {}) if isinstance(res["decode"][1], dict) else {}
    if not meta.get("completion_tokens"):
        raise Unverified(f"canary {p.id} x {d.id}: decode produced no tokens", evidence=str(res["decode"][1])[-400:])
    out["completion_tokens"] = meta.get("completion_tokens")
    return out


def canary_all(pl: Placement, say: Say) -> dict:
    pairs = [(p, d) for p in pl.role("prefill") for d in pl.role("decode")]
    res = run_parallel(pairs, lambda pd: canary_pair(*pd), max_workers=16)
    bad = failures(res)
    if bad:
        names = ", ".join(f"{p.id} x {d.id}" for p, d in bad)
        raise DeployFailed(f"canary failed for {names}", fix="the named pair cannot serve; check its transfer "
                           "settings (bootstrap port reachable, NIC/GID) with `inv preflight`",
                           evidence="\n".join(str(e) for e in bad.values()))
    say(f"  canary ok through all {len(pairs)} prefill x decode pairs")
    return {f"{p.id}x{d.id}": r for (p, d), r in res.items()}


def execute_deploy(plan: DeployPlan, say: Say = print) -> dict:
    """Carry out a deploy plan. Returns the verdict: the new revision, what was verified and
    what could not be (skipped checks never count as verified). Raises with a verdict on failure."""
    inv, pl = plan.inv, plan.placement
    state = state_for(inv)
    op = new_op_id("deploy")
    journal = state.journal()
    started: list[str] = []
    verified: list[str] = []
    unverified: list[str] = []
    with state.lock("deploy", op_id=op):
        journal.step(op, "plan", "ok", {"topology": str(pl.topology), "steps": [str(s) for s in plan.steps]})
        try:
            with HostPool(inv) as pool:
                say(f"[1/7] connecting to {len(plan.hosts)} hosts")
                journal.step(op, "connect", "ok", pool.connect_all(plan.hosts))
                say("[2/7] preflight checks")
                from pdops.preflight import preflight_gate

                report = preflight_gate(inv, pl, pool, plan.skip_checks, journal, op, say, previous=plan.previous)
                verified.append(f"preflight: {report.verdict()}")
                unverified += preflight_unverified(report, plan.skip_checks)

                build = state.path / "builds" / op
                write_build(plan.files, build, {"topology": str(pl.topology), "op": op})
                say(f"[3/7] delivering {len(plan.files)} rendered files with Ansible")
                ev = deliver(inv, pl, plan.files, build, None, say)
                journal.step(op, "deliver", "ok", ev)

                say("[4/7] starting the gateway, then every instance")
                fresh = state.current() is None
                journal.step(op, "gateway", "ok", start_gateway(inv, pool, say, restart=fresh))
                started.append(f"{inv.gateway.host}:{GATEWAY_UNIT}")
                verified.append(f"gateway {GATEWAY_UNIT} active and answering {inv.gateway.url}/health")
                adm_ev = start_admission(inv, pool, say, restart=fresh)
                if adm_ev:
                    journal.step(op, "admission", "ok", adm_ev)
                    verified.append(f"admission layer answering {adm_ev['url']}")
                deadline_s = float(inv.vars.get("pdops_start_timeout_s", 900))
                res = run_parallel(list(pl.instances), lambda i: start_instance(inv, pool, i, deadline_s, say, fresh))
                started += [f"{h}:{u}" for i in pl.instances for h, u in i.units]
                for inst, r in res.items():
                    journal.step(op, f"start {inst.id}", "failed" if isinstance(r, Exception) else "ok",
                                 {"error": str(r)} if isinstance(r, Exception) else r)
                bad = failures(res)
                if bad:
                    first = next(iter(bad.values()))
                    raise DeployFailed(f"{len(bad)} instance(s) did not start: {', '.join(i.id for i in bad)}",
                                       evidence=first.render() if isinstance(first, PdopsError) else str(first),
                                       fix="nothing was registered with the gateway; read the evidence, fix the "
                                           "cause and deploy again")
                verified.append(f"{len(pl.instances)} instance(s) active and healthy on their own /health "
                                "(MainPIDs recorded)")

                say("[5/7] canary through every prefill x decode pair, before anything is registered")
                try:
                    canary = canary_all(pl, say)
                except DeployFailed as exc:
                    journal.step(op, "canary", "failed", {"error": exc.render()})
                    raise
                journal.step(op, "canary", "ok", canary)
                verified.append(f"a canary generation through every one of the {len(canary)} prefill x decode pairs")

                say("[6/7] registering every instance with the gateway")
                client = GatewayClient(inv.gateway.url, api_key_file=inv.gateway.api_key_file)
                reg_s = float(inv.vars.get("pdops_register_timeout_s", 60))
                res = run_parallel(list(pl.instances), lambda i: register(client, i, say, reg_s), max_workers=16)
                workers = {i.id: r for i, r in res.items() if not isinstance(r, Exception)}
                bad = failures(res)
                journal.step(op, "register", "failed" if bad else "ok",
                             {**workers, **{i.id: f"error: {e}" for i, e in bad.items()}})
                if bad:
                    first = next(iter(bad.values()))
                    undone = _undo_registrations(client, pl, workers, bad, fresh, say)
                    journal.step(op, "undo-register", "ok" if undone["left"] == [] else "failed", undone)
                    raise DeployFailed(f"{len(bad)} instance(s) not registered healthy: {', '.join(i.id for i in bad)}",
                                       evidence=first.render() if isinstance(first, PdopsError) else str(first),
                                       fix="read the instance's journal (`journalctl -u <unit>` on its host) and "
                                           "the gateway's; fix the cause and deploy again")
                verified.append(f"{len(workers)} worker(s) registered and listed healthy by the gateway's /workers")

                say("[7/7] recording the revision")
                instances = {i.id: {"role": i.role, "hosts": list(i.hosts), "units": [list(u) for u in i.units],
                                    "worker_id": workers[i.id], "url": i.url} for i in pl.instances}
                rev = state.write_revision(topology=str(pl.topology), inventory_hash=inv.digest,
                                           placement=pl.to_dict(), manifest=manifest(plan.files),
                                           instances=instances, outcome="deployed", op_id=op,
                                           extra={"gateway": inv.gateway.url, "build": str(build)})
                state.set_current(rev.number)
                journal.step(op, "record", "ok", {"revision": rev.number})
                verified.append(f"revision {rev.number} ({pl.topology}) recorded and current")
                verdict = {"revision": rev.number, "verified": verified, "unverified": unverified}
                journal.step(op, "verdict", "ok", verdict)
                return verdict
        except PdopsError as exc:
            current = state.current()
            left = ", ".join(started) or "nothing"
            journal.step(op, "verdict", "failed", {"error": exc.render(), "left_running": started, "current": current})
            exc.message += (f"\n  current revision unchanged: {current if current is not None else 'none'}; "
                            f"units started by this deploy (left for inspection): {left}")
            raise
