"""`inv deploy`: render, deliver with Ansible, start in order, health-gate, register, canary, record.

Plan (pure, printable with --dry-run) and do (walks the plan over Fabric, journals every
step with its evidence, stops at the first failure and says what it left running).
`current` moves only after every step succeeded.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdops import ansible, membership, orphans
from pdops.errors import DeployFailed, PdopsError, Refused, Unreachable, Unverified
from pdops.facts import q
from pdops.gateway import GatewayClient, deadline_in
from pdops.hosts import HostPool, http_json
from pdops.inventory import Inventory
from pdops.observability import targets_step
from pdops.placement import Instance, Placement, last_bootstrap_ports, place
from pdops.admission import UNIT as ADMISSION_UNIT
from pdops.render import (GATEWAY_UNIT, RenderedFile, admission_config, manifest, render_files, snapshot_of,
                          write_build)
from pdops.runner import Outcome, Plan, RunContext, Say, Step, failures, register_executors, run_parallel, walk
from pdops.facts.systemd import UnitState
from pdops.state import Revision, local_dir, new_op_id
from pdops.topology import Topology
from pdops.versions import MOONCAKE_VERSION, SGLANG_VERSION, SMG_VERSION



def state_for(inv: Inventory, *, cached_ok: bool = False):
    """The cluster's record, on its state host (`pdops_state`; pdops.record). `cached_ok`: a
    read-only command may fall back to this machine's cached copy when the state host is down."""
    from pdops.inventory import StateLocation
    from pdops.record import SharedRecord, SSHTransport

    where = inv.state or StateLocation(inv.gateway.host)
    return SharedRecord(inv.cluster, local_dir(inv), where.host, where.dir, SSHTransport(inv, where.host),
                        cached_ok=cached_ok)


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
    # the live revision when its topology and rendered files are the ones asked for: what to do
    # is then decided from observation (plan_reconcile), never from the record alone
    live: Revision | None = None
    findings: list[str] = field(default_factory=list)
    # the record the plan was read from, and its `current` then (checked again under the lock)
    state: object = field(default=None, repr=False, compare=False)
    basis: int | None = None

    @property
    def title(self) -> str:
        if self.live is not None and not self.findings:
            return (f"plan: deploy {self.placement.topology} on {self.inv.cluster}: revision {self.live.number} has "
                    "these rendered files; what to do is decided from what the hosts and the gateway report")
        if self.live is not None:
            return (f"plan: repair revision {self.live.number} ({self.placement.topology}) on {self.inv.cluster}: "
                    "its rendered files are in place; what runs differs from it, as observed now:\n"
                    + "\n".join(f"  - {f}" for f in self.findings) + "\nunder the cluster lock")
        return (f"plan: deploy {self.placement.topology} on {self.inv.cluster} ({len(self.hosts)} hosts, engine "
                f"{self.inv.engine}, profile {self.inv.profile.name}), under the cluster lock")

    @property
    def plan(self) -> Plan:
        rescue = [undo_register_step(fresh=self.previous is None and self.live is None,
                                     instances=len(self.placement.instances))]
        if self.live is not None:
            return Plan("deploy", self.title, self.steps, head={"topology": str(self.placement.topology),
                                                                "repair_of": self.live.number,
                                                                "findings": self.findings},
                        footer=["verified at the end: what each repair step proved"], rescue=rescue,
                        always=[targets_step()])
        return Plan("deploy", self.title, self.steps, head={"topology": str(self.placement.topology)},
                    footer=["verified at the end: what each step above proved; anything it could not check is "
                            "listed as not verified"], rescue=rescue, always=[targets_step()])

    def render(self) -> str:
        if self.noop:
            return self.title + f"\nno change: {self.noop}"
        return self.plan.render()


def plan_deploy(inv: Inventory, topo: Topology, state, skip_checks: set[str] | None = None, *,
                max_unavailable: int = 1, force: bool = False, allow_capacity_dip: bool = False, seen=None):
    """Pure apart from reading the record: what a deploy of `topo` will do, or why not. On a live
    cluster: the live revision's placement and files (a DeployPlan whose repairs are decided from
    observation, plan_reconcile), or any other difference as a rolling change (pdops.scale.plan_apply:
    keep, replace, add, remove)."""
    from pdops.placement import place_change
    from pdops.preflight import validate_skip

    skip_checks = validate_skip(skip_checks)
    current = state.current_revision()
    previous = Placement.from_dict(current.placement) if current else None
    if current is not None:
        from pdops import scale as sc

        pl = place_change(inv, topo, previous, avoid=frozenset(sc.cordoned_hosts(current)))
        files = render_files(inv, pl)
        if pl == previous and current.manifest == manifest(files):
            # same placement, same files: whether anything is to be done is read from the hosts and
            # the gateway (plan_reconcile), not assumed from the record
            return DeployPlan(inv, pl, files, [], hosts=sorted({f.host for f in files}), skip_checks=skip_checks,
                              previous=previous, live=current, state=state, basis=current.number)
        plan = sc.plan_apply(inv, topo, state, skip_checks=skip_checks, max_unavailable=max_unavailable,
                             force=force, allow_capacity_dip=allow_capacity_dip, seen=seen)
        plan.state = state
        return plan
    pl = place(inv, topo, previous)
    files = render_files(inv, pl)
    hosts = sorted({f.host for f in files})
    fresh = current is None
    steps = [connect_step(hosts), preflight_step(skip_checks, pl, previous)]
    steps += delivery_steps(inv, pl, files)
    steps.append(Step("gateway", inv.gateway.host, f"{'restart' if fresh else 'start'} {GATEWAY_UNIT} with no "
                      f"workers, wait for {inv.gateway.url}/health", 60, kind="gateway", params={"restart": fresh},
                      verifies="the gateway answers /health"))
    adm = admission_config(inv)
    if adm is not None:
        steps.append(Step("admission", adm.host, f"{'restart' if fresh else 'start'} {ADMISSION_UNIT} in front of "
                          f"the gateway, wait for {adm.url} to answer", 30, kind="admission", params={"restart": fresh}))
    steps += start_steps(inv, pl.instances, restart=fresh, group="start")
    pairs = [(p.id, d.id) for p in pl.role("prefill") for d in pl.role("decode")]
    steps.append(canary_step("canary", pairs, retry_once=False,
                             why="sent straight to each pair before anything is registered"))
    steps += register_steps(inv, pl.instances, group="register")
    steps.append(verify_running_step(pl, inv))
    steps.append(Step("record", None, "write the revision, move `current` to it", kind="record-deploy"))
    return DeployPlan(inv, pl, files, steps, hosts=hosts, skip_checks=skip_checks, previous=previous, state=state,
                      basis=current.number if current else None)


def plan_reconcile(plan: DeployPlan, *, pool: HostPool, gateway: GatewayClient) -> DeployPlan:
    """For a deploy of the live revision: observe what runs (pdops.observe) and plan the repairs:
    start what is down, canary every pair through a started or restarted instance, register what
    the gateway lacks or does not route to, then record the MainPIDs seen. Nothing to repair: a
    no-op whose message names what was observed."""
    from pdops.observe import observe

    inv, rev, pl = plan.inv, plan.live, plan.placement
    obs = observe(inv, rev, pool, gateway)
    findings = obs.findings()
    if not findings:
        return replace(plan, noop=f"revision {rev.number} ({pl.topology}) is live with identical rendered files; "
                                  f"{obs.summary()}")
    stale = {o.id: "its process runs other files: " + "; ".join(o.stale) for o in obs.instances if o.stale}
    if stale and not any(o.down for o in obs.instances) and not obs.gateway_down:
        # processes started from other files than the revision's: replaced, rolling, as any change
        from pdops import scale as sc

        change = sc.plan_change(inv, rev, pl, skip_checks=plan.skip_checks, replace_ids=stale)
        change.state = plan.state
        return change
    steps = [connect_step(plan.hosts)]
    if obs.gateway_down:
        restart = isinstance(obs.gateway_unit, UnitState) and obs.gateway_unit.active_state == "active"
        steps.append(Step("gateway", inv.gateway.host, f"{'restart' if restart else 'start'} {GATEWAY_UNIT} (after "
                          "each start it queues its start-up list itself), wait for "
                          f"{inv.gateway.url}/health", 60, kind="gateway", params={"restart": restart}))
    down = [o.instance for o in obs.instances if o.down]
    restarted = [o.instance for o in obs.instances if o.restarted and not o.down]
    steps += start_steps(inv, down, restart=False, group="start")
    touched = {i.id for i in down + restarted}
    pairs = [(p.id, d.id) for p in pl.role("prefill") for d in pl.role("decode") if {p.id, d.id} & touched]
    if pairs:
        steps.append(canary_step("canary", pairs, retry_once=True,
                                 why="through every pair of a started or restarted instance, before registration"))
    need = [o.instance for o in obs.instances if o.down or o.gateway_problem or not o.in_list or obs.gateway_down]
    steps += register_steps(inv, need, group="register")
    if obs.gateway_down or obs.gateway_restarted or any(i.role == "decode" for i in down + restarted):
        # a restarted decode or gateway leaves prefill halves no decode will take: ended, named
        steps.append(orphans.end_step([p.id for p in pl.role("prefill")]))
    steps.append(verify_running_step(pl, inv))
    steps.append(Step("record", None, f"record the MainPIDs seen as a repair of revision {rev.number} (same files "
                      "and topology); move `current` to it", kind="record-repair"))
    return replace(plan, steps=steps, findings=findings)


def do_record_repair(ctx: RunContext, step: Step) -> Outcome:
    """A new revision: the live one's files and topology, with the MainPIDs and worker ids seen now."""
    plan: DeployPlan = ctx.data["deploy_plan"]
    live = plan.live
    instances = {k: dict(v) for k, v in live.instances.items()}
    seen = {}
    for inst in plan.placement.instances:
        pids = {}
        for host, unit in inst.units:
            st = ctx.pool.unit_states(host, [unit])[unit]
            if st.active_state != "active" or not st.main_pid:
                raise Unverified(f"{inst.id}: {host}:{unit} is {st.active_state}/{st.sub_state} after the repair")
            pids[f"{host}:{unit}"] = st.main_pid
        instances[inst.id]["main_pids"] = seen[inst.id] = pids
        if inst.id in ctx.data.get("workers", {}):
            instances[inst.id]["worker_id"] = ctx.data["workers"][inst.id]
    rev = ctx.state.write_revision(topology=live.topology, inventory_hash=live.inventory_hash,
                                   placement=live.placement, manifest=live.manifest, instances=instances,
                                   outcome="deployed", op_id=ctx.op,
                                   extra={**live.extra, "repair_of": live.number, "repaired": plan.findings,
                                          **({"configs": configs_of(ctx.data["running"]),
                                              **gateway_pid_of(ctx.data["running"], ctx.inv)} if "running" in ctx.data
                                             else {})},
                                   snapshot=ctx.state.revision_snapshot(live.number))
    ctx.state.set_current(rev.number)
    ctx.data["verdict"] = {"revision": rev.number}
    return Outcome(evidence={"revision": rev.number, "main_pids": seen},
                   verified=[f"revision {rev.number} records the repair of revision {live.number}: every unit "
                             "active, MainPIDs as read from systemd now"])


# ---------------------------------------------------------------- step builders (shared by deploy and scale)

def connect_step(hosts: list[str]) -> Step:
    return Step("connect", None, f"SSH to {len(hosts)} hosts in parallel: {', '.join(hosts)}", 30, kind="connect",
                params={"hosts": list(hosts)})


def preflight_step(skip_checks: set[str], pl: Placement, previous: Placement | None) -> Step:
    return Step("preflight", None, "host, limits, ports, versions and P x D pairing checks; refuse a failing host"
                + (f" (skipping {', '.join(sorted(skip_checks))})" if skip_checks else ""), kind="preflight",
                params={"skip": sorted(skip_checks), "placement": pl, "previous": previous})


def delivery_steps(inv: Inventory, pl: Placement, files: list[RenderedFile], meta: dict | None = None) -> list[Step]:
    return [Step("render", None, f"{len(files)} files into the revision's build folder, with a manifest",
                 kind="render", params={"files": files, "meta": meta or {}}),
            Step("deliver", None, "ansible-playbook prepare.yml deploy.yml (directories, limits, engine environment; "
                 "units, launch scripts, 0600 env files, daemon-reload, enable)", kind="deliver",
                 params={"placement": pl})]


def start_steps(inv: Inventory, insts, *, restart: bool, group: str | None) -> list[Step]:
    start_s = float(inv.vars.get("pdops_start_timeout_s", 900))
    return [Step(f"start {i.id}", i.head.host, f"{i.id} ({i.role}): {'restart' if restart else 'start'} "
                 f"{', '.join(f'{h}:{u}' for h, u in i.units)}, wait {i.url}/health", start_s,
                 kind="start", params={"instance": i.id, "restart": restart}, group=group) for i in insts]


def canary_step(name: str, pairs: list[tuple[str, str]], *, retry_once: bool, why: str, instance: str | None = None,
                kind: str = "canary") -> Step:
    return Step(name, None, f"{len(pairs)} generation request(s), one through each prefill x decode pair "
                f"({', '.join(f'{p} x {d}' for p, d in pairs)}), {why}", 120, kind=kind,
                params={"pairs": pairs, "retry_once": retry_once, **({"instance": instance} if instance else {})})


def register_steps(inv: Inventory, insts, *, group: str | None) -> list[Step]:
    reg_s = float(inv.vars.get("pdops_register_timeout_s", 60))
    out = []
    for i in insts:
        bp = f" bootstrap {i.bootstrap_port}" if i.bootstrap_port else ""
        out.append(Step(f"register {i.id}", inv.gateway.host, f"{i.id}: POST /workers {i.url} ({i.role}{bp}), "
                        "wait until /workers lists it healthy and ready",
                        reg_s, kind="register", params={"instance": i.id},
                        group=group))
    if insts:
        ids = [i.id for i in insts]
        out.append(Step("gateway-list" + (f" {ids[0]}" if len(ids) == 1 else ""), inv.gateway.host,
                        f"add {', '.join(ids)} to the gateway's start-up list ({membership.PATH}): from now on a "
                        "gateway restart registers them by itself", 30, kind="gateway-list", params={"instances": ids}))
    return out


# ---------------------------------------------------------------- doing



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
             "pdops_mooncake_version": MOONCAKE_VERSION, "pdops_smg_version": SMG_VERSION,
             "pdops_gateway_python": inv.gateway.python, "pdops_gateway_host": inv.gateway.host,
             "pdops_files": _ansible_files(build, files), "pdops_remove": remove or {},
             "pdops_units": _units_by_host(pl, inv)}
    t0 = time.monotonic()
    res = ansible.run_playbook(inv, ["prepare.yml", "deploy.yml"], extra, hosts, skip_tags=("pdops-folders",))
    secs = round(time.monotonic() - t0, 1)
    say(f"  prepare.yml + deploy.yml: {len(res.recap)} hosts ok, {res.changed} changes ({secs}s)")
    return {"playbooks": res.playbook, "changed": res.changed, "seconds": secs,
            "hosts": {h: vars(r) for h, r in res.recap.items()}}


def start_gateway(inv: Inventory, pool: HostPool, client: GatewayClient, say: Say, restart: bool,
                  deadline_s: float = 60, clear_list: bool | None = None) -> dict:
    """Start (or restart) the gateway unit and wait for its /health, bounded by `deadline_s`.
    `clear_list` (default: on a restart) empties its start-up list first."""
    gw = inv.gateway
    verb = "restart" if restart else "start"
    if restart if clear_list is None else clear_list:
        # a fresh cluster: a list left by an earlier life of it must not register anything
        membership.update(pool, inv, clear=True)
    # a unit that hit its start limit refuses `start` until reset: this start is the operator's
    pool.run(gw.host, f"systemctl reset-failed {q(GATEWAY_UNIT)} || true; systemctl {verb} {q(GATEWAY_UNIT)}")
    deadline = deadline_in(deadline_s)
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


def start_admission(inv: Inventory, pool: HostPool, say: Say, restart: bool, deadline_s: float = 30) -> dict | None:
    """Start the admission layer (HAProxy) after the gateway; wait until it answers HTTP."""
    adm = admission_config(inv)
    if adm is None:
        return None
    pool.run(adm.host, f"systemctl {'restart' if restart else 'start'} {q(ADMISSION_UNIT)}")
    deadline = deadline_in(deadline_s)
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
        # reset a start limit hit by a crash loop: this start is the operator's, and watched below
        pool.run(host, f"systemctl reset-failed {q(unit)} || true; systemctl {verb} {q(unit)}")
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
    """POST the instance to the gateway and wait until /workers lists it healthy. A worker still
    draining at this URL (the previous process at this address, drained moments ago: smg keeps it
    about 5 s) is waited out first: a POST now would answer 409 with that worker, which then goes."""
    from pdops.facts.gateway import DRAINING

    deadline = deadline_in(timeout_s)
    try:
        stale = [w for w in client.list_workers() if w.url.rstrip("/") == inst.url.rstrip("/")
                 and w.status == DRAINING]
    except PdopsError:
        stale = []  # the POST below says what is wrong with the gateway
    for w in stale:
        say(f"  {inst.id}: the gateway still drains worker {w.id} at {inst.url}; waiting until it is gone")
        client.wait_worker_gone(w.id, deadline)
    for w in other_identity(client.list_workers(), inst):
        # the same URL under another bootstrap port: an earlier process of it (a registration the
        # gateway retried in the background); requests routed there would fail at the bootstrap
        say(f"  {inst.id}: the gateway lists worker {w.id} at {inst.url} with bootstrap port {w.bootstrap_port}, "
            f"not {inst.bootstrap_port}: removing it first")
        client.remove_worker(w.id)
        client.wait_worker_gone(w.id, deadline)
    worker_id = client.add_worker(inst.url, inst.role, inst.bootstrap_port)
    w = client.wait_worker_healthy(inst.url, deadline)
    wrong = other_identity([w], inst)
    if wrong:
        raise Unverified(f"{inst.id}: the gateway lists worker {w.id} at {inst.url} with bootstrap port "
                         f"{w.bootstrap_port}, not {inst.bootstrap_port}: requests routed to it would fail at the "
                         "bootstrap", fix="run the operation again: it removes the stale worker first")
    say(f"  {inst.id} registered: worker {w.id} healthy")
    return w.id or worker_id


def other_identity(workers, inst: Instance) -> list:
    """Workers at the instance's URL registered with another bootstrap port (a prefill's old identity)."""
    return [w for w in workers if w.url.rstrip("/") == inst.url.rstrip("/") and inst.bootstrap_port is not None
            and w.bootstrap_port is not None and w.bootstrap_port != inst.bootstrap_port]


def _undo_registrations(client: GatewayClient, pl: Placement, workers: dict, bad: list, fresh: bool,
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
    res = _both_sides(p, d, body, rid, timeout)
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


def _both_sides(p: Instance, d: Instance, body: dict, rid: str, timeout: float) -> dict:
    """POST the canary to the prefill and the decode at once. When the decode fails first (its
    bootstrap or transfer failed), the prefill would hold the room until its own timeout: it is told
    to drop it (POST /abort_request with the canary's rid), so a failed canary fails in seconds."""
    from concurrent.futures import ThreadPoolExecutor

    def post(inst: Instance):
        return http_json("POST", f"{inst.url}/generate", body, timeout=timeout, headers={"x-request-id": rid})

    with ThreadPoolExecutor(max_workers=2) as ex:
        fp, fd = ex.submit(post, p), ex.submit(post, d)
        res: dict = {}
        try:
            res["decode"] = fd.result()
        except Exception as e:  # noqa: BLE001 - reported with the pair below
            res["decode"] = e
        dec = res["decode"]
        if isinstance(dec, Exception) or dec[0] != 200:
            try:
                http_json("POST", f"{p.url}/abort_request", {"rid": rid}, timeout=5)
            except PdopsError:
                pass  # the prefill's own answer (or timeout) says the rest
        try:
            res["prefill"] = fp.result()
        except Exception as e:  # noqa: BLE001
            res["prefill"] = e
    return {"prefill": res["prefill"], "decode": res["decode"]}


def canary_pairs(pairs: list[tuple[Instance, Instance]], say: Say, *, retry_once: bool = False,
                 deadline_s: float | None = None) -> dict:
    """One canary through each pair, in parallel; DeployFailed naming every pair that failed.

    `retry_once`: a decode keeps the route to a prefill's bootstrap address and drops it only
    when a transfer through it fails, so an instance re-added at an address it had before
    (rollback, re-scale) fails its first canary with each decode that knew the old process.
    One retry per pair, before the instance is registered (no user request can reach it)."""
    timeout = min(60.0, deadline_s / (2 if retry_once else 1)) if deadline_s else 60.0
    res = run_parallel(pairs, lambda pd: canary_pair(*pd, timeout=timeout), max_workers=16)
    bad = failures(res)
    retried = {}
    if bad and retry_once:
        retried = {f"{p.id}x{d.id}": str(e) for (p, d), e in bad.items()}
        say(f"  first canary failed for {', '.join(retried)} (a decode may hold a stale route to this address); "
            "retrying each once")
        again = run_parallel(list(bad), lambda pd: canary_pair(*pd, timeout=timeout), max_workers=16)
        res.update(again)
        bad = failures(again)
    if bad:
        names = ", ".join(f"{p.id} x {d.id}" for p, d in bad)
        raise DeployFailed(f"canary failed for {names}", fix="the named pair cannot serve; check its transfer "
                           "settings (bootstrap port reachable, NIC/GID) with `inv preflight`",
                           evidence="\n".join(f"{e}" + (f": {e.evidence}" if getattr(e, "evidence", None) else "")
                                              for e in bad.values()))
    say(f"  canary ok through {len(pairs)} prefill x decode pair(s)")
    out = {f"{p.id}x{d.id}": r for (p, d), r in res.items()}
    if retried:
        out["first_attempt_failed"] = retried
    return out


def _placement_of(ctx: RunContext) -> Placement:
    return ctx.data["placement"]


def _inst(ctx: RunContext, step: Step) -> Instance:
    return _placement_of(ctx).get(step.instance)


def do_connect(ctx: RunContext, step: Step) -> Outcome:
    return Outcome(evidence=ctx.pool.connect_all(step.params["hosts"]))


def do_preflight(ctx: RunContext, step: Step) -> Outcome:
    from pdops.preflight import preflight_gate

    skip = set(step.params["skip"])
    report, ev = preflight_gate(ctx.inv, step.params["placement"], ctx.pool, skip, ctx.say,
                                previous=step.params["previous"])
    from pdops.preflight import PASS

    passed = sum(r.status == PASS for r in report.results)
    pairing = "" if report.matrix is None or report.matrix.skipped else "; P x D pairing matrix: every cell ok"
    return Outcome(evidence=ev, verified=[f"preflight: {passed} check(s) passed on {len(report.hosts)} host(s), "
                                          f"none failed{pairing}"],
                   unverified=preflight_unverified(report, skip))


def do_render(ctx: RunContext, step: Step) -> Outcome:
    build = ctx.state.path / "builds" / ctx.op
    write_build(step.params["files"], build, {"op": ctx.op, **step.params["meta"]})
    ctx.data["build"] = build
    ctx.data["files"] = step.params["files"]
    return Outcome(evidence={"build": str(build), "files": len(step.params["files"])})


def do_deliver(ctx: RunContext, step: Step) -> Outcome:
    ctx.say(f"  delivering {len(ctx.data['files'])} rendered files with Ansible")
    return Outcome(evidence=deliver(ctx.inv, step.params["placement"], ctx.data["files"], ctx.data["build"], None,
                                    ctx.say))


def do_gateway(ctx: RunContext, step: Step) -> Outcome:
    """Start the gateway; with `wait_for` ({instance: url}), until it lists each healthy and ready."""
    from pdops.gateway import deadline_in

    t0 = time.monotonic()
    if step.params.get("unlist"):
        membership.update(ctx.pool, ctx.inv, remove=step.params["unlist"])
    ev = start_gateway(ctx.inv, ctx.pool, ctx.gateway, ctx.say, restart=step.params["restart"],
                       deadline_s=step.deadline, clear_list=step.params.get("clear_list"))
    ctx.data.setdefault("started", []).append(f"{ctx.inv.gateway.host}:{GATEWAY_UNIT}")
    wait_for = step.params.get("wait_for") or {}
    deadline = deadline_in(max(step.deadline - (time.monotonic() - t0), 5))
    for url in wait_for.values():
        ctx.gateway.wait_worker_healthy(url, deadline)
    listed = ([f"the gateway lists {', '.join(wait_for)} healthy and ready (registered from its start-up list)"]
              if wait_for else [])
    return Outcome(evidence={**ev, "listed": sorted(wait_for)},
                   verified=[f"gateway {GATEWAY_UNIT} active and answering {ctx.inv.gateway.url}/health"] + listed)


def do_admission(ctx: RunContext, step: Step) -> Outcome:
    ev = start_admission(ctx.inv, ctx.pool, ctx.say, restart=step.params["restart"], deadline_s=step.deadline)
    return Outcome(evidence=ev, verified=[f"admission layer answering {ev['url']}"])


def do_start(ctx: RunContext, step: Step) -> Outcome:
    inst = _inst(ctx, step)
    ctx.data.setdefault("started_instances", {})[inst.id] = inst
    ctx.data.setdefault("started", []).extend(f"{h}:{u}" for h, u in inst.units)
    try:
        ev = start_instance(ctx.inv, ctx.pool, inst, step.deadline, ctx.say, step.params["restart"])
    except PdopsError as exc:
        raise DeployFailed(f"{inst.id} did not start: {exc.message}", evidence=exc.evidence,
                           fix="nothing was registered with the gateway; read the evidence, fix the cause and "
                               "deploy again") from None
    ctx.data.setdefault("healthy", set()).add(inst.id)
    ctx.data.setdefault("main_pids", {})[inst.id] = ev["main_pids"]
    return Outcome(evidence=ev, verified=[f"{inst.id} active and healthy on its own /health (MainPID "
                                          f"{', '.join(map(str, ev['main_pids'].values()))})"])


def serving(ctx: RunContext, iid: str) -> Instance:
    """The instance as it serves at this point of the operation: a replaced one that is not started
    yet still runs its old process (old ports; a prefill's old bootstrap port)."""
    if iid in ctx.data.get("replacing", ()) and iid not in ctx.data.get("started_instances", {}):
        return ctx.data["old_placement"].get(iid)
    return _placement_of(ctx).get(iid)


def do_canary(ctx: RunContext, step: Step) -> Outcome:
    pairs = [(serving(ctx, p), serving(ctx, d)) for p, d in step.params["pairs"]]
    ev = canary_pairs(pairs, ctx.say, retry_once=step.params["retry_once"], deadline_s=step.deadline)
    return Outcome(evidence=ev, verified=[f"a canary generation through each of {len(pairs)} prefill x decode "
                                          f"pair(s): {', '.join(f'{p.id} x {d.id}' for p, d in pairs)}"])


def do_register(ctx: RunContext, step: Step) -> Outcome:
    inst = _inst(ctx, step)
    ctx.data.setdefault("posted", set()).add(inst.id)
    try:
        wid = register(ctx.gateway, inst, ctx.say, step.deadline)
    except PdopsError as exc:
        raise DeployFailed(f"{inst.id} not registered healthy: {exc.message}", evidence=exc.evidence,
                           fix="read the instance's journal (`journalctl -u <unit>` on its host) and the "
                               "gateway's; fix the cause and deploy again") from None
    ctx.data.setdefault("workers", {})[inst.id] = wid
    return Outcome(evidence={"worker_id": wid},
                   verified=[f"{inst.id} registered (worker {wid}), listed healthy and ready by the gateway's /workers"])


def do_gateway_list(ctx: RunContext, step: Step) -> Outcome:
    """One update of the start-up list for a registration group (each registered and ready by now)."""
    pl = _placement_of(ctx)
    add = [pl.get(i) for i in step.params["instances"]]
    missing = [i.id for i in add if i.id not in ctx.data.get("workers", {})]
    if missing:
        raise Unverified(f"not registered, so not put in the gateway's start-up list: {', '.join(missing)}")
    listed = membership.listed_ids(membership.update(ctx.pool, ctx.inv, add=add))
    return Outcome(evidence={"gateway_list": listed},
                   verified=[f"{', '.join(i.id for i in add)} in the gateway's start-up list"])


def do_record_deploy(ctx: RunContext, step: Step) -> Outcome:
    plan: DeployPlan = ctx.data["deploy_plan"]
    pl, workers = plan.placement, ctx.data["workers"]
    instances = {i.id: {"role": i.role, "hosts": list(i.hosts), "units": [list(u) for u in i.units],
                        "worker_id": workers[i.id], "url": i.url,
                        "main_pids": ctx.data.get("main_pids", {}).get(i.id)} for i in pl.instances}
    rev = ctx.state.write_revision(topology=str(pl.topology), inventory_hash=ctx.inv.digest,
                                   placement=pl.to_dict(), manifest=manifest(plan.files), instances=instances,
                                   outcome="deployed", op_id=ctx.op,
                                   extra={"gateway": ctx.inv.gateway.url, "build": str(ctx.data["build"]),
                                          "configs": configs_of(ctx.data["running"]),
                                          **gateway_pid_of(ctx.data["running"], ctx.inv),
                                          "last_bootstrap": last_bootstrap_ports({}, pl)},
                                   snapshot=snapshot_of(ctx.inv, plan.files))
    ctx.state.set_current(rev.number)
    ctx.data["verdict"] = {"revision": rev.number}
    return Outcome(evidence={"revision": rev.number}, verified=[f"revision {rev.number} ({pl.topology}) recorded and current"])


def verify_running_step(pl: Placement, inv: Inventory) -> Step:
    n = sum(len(i.units) for i in pl.instances) + 1
    return Step("verify-running", None, f"every unit of the revision ({n}, the gateway's too) active, and its "
                "MainPID started from this revision's files (the PID and config id its launch script noted in "
                "/run/pdops/<unit>/config before exec)", 60,
                kind="verify-running", verifies="the running processes use the revision's files")


def running_evidence(pool: HostPool, inv: Inventory, pl: Placement, files: list[RenderedFile]) -> dict:
    """{"host:unit": {main_pid, config}} for every unit of `pl` and the gateway, each checked against
    the config id its rendered env file carries; Unverified naming every unit that differs."""
    from pdops.observe import with_configs
    from pdops.render import config_ids

    want = config_ids(files)
    by_host: dict[str, list[str]] = {inv.gateway.host: [GATEWAY_UNIT]}
    for inst in pl.instances:
        for h, u in inst.units:
            by_host.setdefault(h, []).append(u)
    res = run_parallel(list(by_host), lambda h: with_configs(pool, h, by_host[h]))
    out, bad = {}, []
    for h, units in by_host.items():
        r = res[h]
        if isinstance(r, Exception):
            bad.append(f"{h}: unreadable: {getattr(r, 'message', r)}")
            continue
        states, configs = r
        for u in units:
            k, st = f"{h}:{u}", states.get(u)
            if st is None or st.active_state != "active" or not st.main_pid:
                bad.append(f"{k} is {st.active_state + '/' + st.sub_state if st else 'not reported'}")
                continue
            out[k] = {"main_pid": st.main_pid, "config": configs.get(u)}
            if k in want and configs.get(u) != want[k]:
                bad.append(f"{k} (MainPID {st.main_pid}) runs files {configs.get(u) or 'without a config id'}, "
                           f"this revision's are {want[k]}")
    if bad:
        raise Unverified("not every process runs this revision's files: " + "; ".join(bad),
                         fix="nothing was recorded; `inv deploy` again plans a replace of what runs other files")
    return out


def do_verify_running(ctx: RunContext, step: Step) -> Outcome:
    files = ctx.data.get("files") or (ctx.data.get("scale_plan") or ctx.data["deploy_plan"]).files
    ev = running_evidence(ctx.pool, ctx.inv, ctx.data["target"], files)
    ctx.data["running"] = ev
    return Outcome(evidence={"units": ev}, verified=[f"{len(ev)} unit(s) active, each MainPID started from this "
                                                     "revision's files (config id noted by its launch script)"])


def configs_of(running: dict) -> dict[str, str]:
    return {k: v["config"] for k, v in sorted(running.items()) if v.get("config")}


def gateway_pid_of(running: dict, inv: Inventory) -> dict:
    """{"gateway_main_pid": N} from what verify-running read, for a revision's record: a gateway
    MainPID that differs later means systemd (or someone) restarted it (pdops.observe)."""
    pid = (running.get(f"{inv.gateway.host}:{GATEWAY_UNIT}") or {}).get("main_pid")
    return {"gateway_main_pid": pid} if pid else {}


def undo_register_step(*, fresh: bool, instances: int) -> Step:
    """A deploy's rescue: what it registered but cannot record leaves the gateway. Its budget: each
    removal waits up to 30 s for the gateway to stop listing the worker, one at a time."""
    return Step("undo-register", None, "remove from the gateway (and its start-up list) every instance this deploy "
                "registered that was not verified healthy" + (", and on this fresh cluster every one it registered "
                "(no revision will describe them)" if fresh else "") + "; the units it started are left running "
                "for inspection", 60 + 35 * instances, kind="undo-register", params={"fresh": fresh})


def do_undo_register(ctx: RunContext, step: Step) -> Outcome:
    workers = ctx.data.get("workers", {})
    posted = ctx.data.get("posted", set())
    if not posted:
        return Outcome.noop("this deploy registered nothing")
    fresh = step.params["fresh"]
    pl = _placement_of(ctx)
    bad = [pl.get(i) for i in posted if i not in workers]
    undone = _undo_registrations(ctx.gateway, pl, workers, bad, fresh, ctx.say)
    # what the gateway no longer serves leaves its start-up list too (a restart must not revive it)
    drop = [i.id for i in bad] + ([i for i in workers] if fresh else [])
    if drop:
        try:
            undone["gateway_list"] = membership.listed_ids(membership.update(ctx.pool, ctx.inv, remove=drop))
        except PdopsError as e:
            undone["left"].append(f"gateway start-up list not updated: {e.message}")
    if undone["left"]:
        exc = Unverified("the deploy's registrations were not all undone", evidence="\n".join(undone["left"]))
        exc.journal_evidence = undone
        raise exc
    return Outcome(evidence=undone)


# the executors of the step kinds made here (scale, rollback, repair and probe reuse the kinds)
register_executors({"connect": do_connect, "preflight": do_preflight, "render": do_render, "deliver": do_deliver,
          "gateway": do_gateway, "admission": do_admission, "start": do_start, "canary": do_canary,
          "register": do_register, "gateway-list": do_gateway_list, "record-deploy": do_record_deploy,
          "record-repair": do_record_repair, "verify-running": do_verify_running,
          "undo-register": do_undo_register})


def execute_deploy(plan: DeployPlan, say: Say = print, *, pool: HostPool, gateway: GatewayClient) -> dict:
    """Walk a deploy plan with the runner. Returns the verdict: the new revision, what was verified
    and what could not be (skipped checks never count as verified). Raises with a verdict on failure.
    `pool` and `gateway` are the operation's connections, opened by the caller (pdops.hosts.connections)."""
    inv, pl = plan.inv, plan.placement
    if plan.live is not None and not plan.steps:
        raise Refused(f"revision {plan.live.number} is live with these files: what to repair is decided from "
                      "observation", fix="plan it with plan_reconcile (as `inv deploy` does)")
    state = plan.state if plan.state is not None else state_for(inv)
    op = new_op_id("deploy")
    with state.lock("deploy", op_id=op):
        state.check_basis(plan.basis)
        ctx = RunContext(inv, state, op, say, pool, gateway, {"placement": pl, "deploy_plan": plan, "target": pl})
        try:
            verdict = walk(plan.plan, ctx)
        except PdopsError as exc:
            _deploy_failed(ctx, exc)
            raise
        state.journal().step(op, "verdict", "ok", verdict)
        return verdict


def _deploy_failed(ctx: RunContext, exc: PdopsError) -> None:
    """The failure verdict (after the plan's rescue ran): what runs, what is current."""
    started = ctx.data.get("started", [])
    current = ctx.state.current()
    ctx.journal.step(ctx.op, "verdict", "failed", {"error": exc.render(), "left_running": started,
                                                   "current": current, "completed": ctx.done})
    exc.message += (f"\n  current revision unchanged: {current if current is not None else 'none'}; "
                    f"units started by this deploy (left for inspection): {', '.join(started) or 'nothing'}")
