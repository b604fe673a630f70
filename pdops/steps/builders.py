"""The step builders deploy and a change share (pure): connect, preflight, render and deliver, start,
canary, register, verify what runs, the rescue that takes back what a failed deploy registered, the
start of etcd members observed down, the publishing of Prometheus targets every plan ends with, and
the drain sub-plan (leave the gateway, wait empty, two empty checks, the verified stop) that drain,
stop, every change and the undo of a halted one embed."""

from __future__ import annotations

from dataclasses import replace

from pdops.model import membership
from pdops.model.inventory import Inventory
from pdops.model.placement import Instance, Placement
from pdops.model.admission import UNIT as ADMISSION_UNIT
from pdops.model.commands import gateway_grace_s
from pdops.model.etcd_member import UNIT as ETCD_UNIT
from pdops.model.render import GATEWAY_UNIT, RenderedFile, admission_config
from pdops.plans import Step
from pdops.reads.orphans import GRACE_S


# ---------------------------------------------------------------- step builders (shared by deploy and scale)

def connect_step(hosts: list[str]) -> Step:
    return Step("connect", None, f"SSH to {len(hosts)} hosts in parallel: {', '.join(hosts)}", 30, kind="connect",
                params={"hosts": list(hosts)})


def preflight_step(skip_checks: set[str], pl: Placement, previous: Placement | None, note: str = "") -> Step:
    """`note`: what the caller says of the hosts it leaves out (a fenced rollout's slots freed later)."""
    return Step("preflight", None, "host, limits, ports, versions and P x D pairing checks; refuse a failing host"
                + (f" (skipping {', '.join(sorted(skip_checks))})" if skip_checks else "") + note, kind="preflight",
                params={"skip": sorted(skip_checks), "placement": pl, "previous": previous})


def delivery_steps(inv: Inventory, pl: Placement, files: list[RenderedFile], meta: dict | None = None, *,
                   note: str = "", now: tuple[list[RenderedFile], Placement] | None = None,
                   hold: list[str] | None = None) -> list[Step]:
    """Render every file of `files` into the build, then deliver them with Ansible; `now` (files,
    placement): only these go out at this step (a change's replaced instances, `hold`, get theirs in
    their waves); `note` ends the deliver step's text with what the caller delivers or holds back."""
    deliver_files, deliver_pl = now if now is not None else (files, pl)
    return [Step("render", None, f"{len(files)} files into the revision's build folder, with a manifest",
                 kind="render", params={"files": files, "meta": meta or {}}),
            Step("deliver", None, "ansible-playbook prepare.yml deploy.yml (directories, limits, engine environment; "
                 "units, launch scripts, 0600 env files, daemon-reload, enable)" + note, kind="deliver",
                 params={"placement": deliver_pl, "files": deliver_files, **({"hold": hold} if hold else {})})]


def start_steps(inv: Inventory, insts, *, restart: bool, group: str | None) -> list[Step]:
    start_s = float(inv.vars.get("pdops_start_timeout_s", 900))
    return [Step(f"start {i.id}", i.head.host, f"{i.id} ({i.role}): {'restart' if restart else 'start'} "
                 f"{', '.join(f'{h}:{u}' for h, u in i.units)}, wait {i.url}/health", start_s,
                 kind="start", params={"instance": i.id, "restart": restart}, group=group) for i in insts]


def healthy_steps(inv: Inventory, insts, *, group: str | None) -> list[Step]:
    """Instances running as processes the record does not know (systemd started them: a reboot, a
    crash restart): wait for each one's /health before anything is sent through it."""
    start_s = float(inv.vars.get("pdops_start_timeout_s", 900))
    return [Step(f"healthy {i.id}", i.head.host, f"{i.id} ({i.role}), started by systemd: wait {i.url}/health "
                 "(nothing is started)", start_s, kind="wait-healthy", params={"instance": i.id}, group=group)
            for i in insts]


def canary_step(name: str, pairs: list[tuple[str, str]], *, retry_once: bool, why: str, instance: str | None = None,
                kind: str = "canary") -> Step:
    return Step(name, None, f"{len(pairs)} generation request(s), one through each prefill x decode pair "
                f"({', '.join(f'{p} x {d}' for p, d in pairs)}), {why}", 120, kind=kind,
                params={"pairs": pairs, "retry_once": retry_once, **({"instance": instance} if instance else {})})


def gateway_steps(inv: Inventory, *, restart: bool | dict, what: str, wait: str, deadline_s: float = 60,
                  **params) -> list[Step]:
    """One step per gateway (each an independent smg): start or restart its unit, wait for its /health.
    `restart`: one answer for all, or {host: bool}."""
    out = []
    for node in inv.gateway.nodes:
        again = restart.get(node.host, False) if isinstance(restart, dict) else restart
        name = "gateway" if len(inv.gateway.nodes) == 1 else f"gateway {node.host}"
        out.append(Step(name, node.host, f"{'restart' if again else 'start'} {GATEWAY_UNIT}{what}, wait for "
                        f"{node.url}/health{wait}", deadline_s, kind="gateway",
                        params={"restart": again, "gateway": node.host, **params},
                        verifies="the gateway answers /health"))
    return out


def admission_steps(inv: Inventory, *, restart: bool, hosts: list[str] | None = None,
                    why=lambda h: "") -> list[Step]:
    """Start (or restart) HAProxy on each admission host (`hosts`: these only), after the gateways,
    and wait for it to answer."""
    adm = admission_config(inv)
    if adm is None:
        return []
    return [Step("admission" + (f" {h}" if len(adm.hosts) > 1 else ""), h,
                 f"{'restart' if restart else 'start'} {ADMISSION_UNIT} in front of the gateways{why(h)}, wait for "
                 f"{adm.url_of(h)} to answer", 30, kind="admission", params={"restart": restart, "host": h})
            for h in (adm.hosts if hosts is None else hosts)]


def front_door_step(inv: Inventory) -> list[Step]:
    """Behind the admission layer: until HAProxy sees every gateway UP (its readiness check passed
    `rise` times, which needs workers registered), so the operation ends with the front door open."""
    adm = inv.admission
    if adm is None:
        return []
    return [Step("front-door", adm.host if len(adm.hosts) == 1 else None, f"until the admission layer on "
                 f"{', '.join(adm.hosts)} sees every gateway "
                 f"({', '.join(inv.gateway.hosts)}) UP: smg's /readiness answered 200 twice in a row", 30,
                 kind="front-door-ready", verifies="requests through the admission layer reach a gateway")]


def register_steps(inv: Inventory, insts, *, group: str | None, gateways: list[str] | None = None,
                   prefix: str = "", when: tuple | None = None) -> list[Step]:
    """Register each instance with every gateway (or only `gateways`), then one update of the
    start-up lists; `prefix` names the steps when a plan registers the same instances twice; `when`:
    each step's condition (pdops.plans.Step.when), for a rescue."""
    reg_s = float(inv.vars.get("pdops_register_timeout_s", 60))
    out = []
    where = inv.gateway.on_each() if gateways is None else f" on gateway {', '.join(gateways)} only"
    only = {} if gateways is None else {"gateways": list(gateways)}
    host = inv.gateway.step_host if gateways is None else (gateways[0] if len(gateways) == 1 else None)
    for i in insts:
        bp = f" bootstrap {i.bootstrap_port}" if i.bootstrap_port else ""
        out.append(Step(f"{prefix}register {i.id}", host, f"{i.id}: POST /workers {i.url} ({i.role}{bp}){where}, "
                        "wait until /workers lists it healthy and ready" + (" on each" if where else ""),
                        reg_s, kind="register", params={"instance": i.id, **only},
                        group=group, when=when))
    if insts:
        ids = [i.id for i in insts]
        out.append(Step(f"{prefix}gateway-list" + (f" {ids[0]}" if len(ids) == 1 else ""), host,
                        f"add {', '.join(ids)} to the gateway's start-up list ({membership.PATH}){where}: from now "
                        "on a gateway restart registers them by itself", 30, kind="gateway-list",
                        params={"instances": ids, **only}, when=when))
    return out


def close_breakers_step(inv: Inventory, pl: Placement, restarted: list[str], why: str) -> Step:
    """After engines restarted at unchanged URLs: every gateway routes to each of them and to each of
    their PD peers (the other role: a request that failed at a decode opened its prefill's breaker too)
    whose engine is healthy, with its circuit breaker closed (pdops.steps.serve.do_close_breakers)."""
    roles = {pl.get(i).role for i in restarted}
    ids = [i.id for i in pl.instances if i.id in restarted or ({"prefill", "decode"} - {i.role}) & roles]
    return Step("close-breakers", inv.gateway.step_host, f"{why}: on {inv.gateway.on_each().strip() or 'the gateway'}, "
                f"read the circuit breaker of {', '.join(ids)} (the restarted and their PD peers; smg_worker_cb_state "
                "on the gateway's /metrics); a healthy worker whose breaker is open or half-open is removed and added "
                "again (smg's only way to close one; it carried no request while open); verify each routable with its "
                "breaker closed (0)", 30 + 15 * len(ids), kind="close-breakers", params={"instances": ids},
                verifies="the gateways route to the restarted instances and their peers: healthy, ready, circuit closed")


def verify_running_step(pl: Placement, inv: Inventory, files: list[RenderedFile]) -> Step:
    n = sum(len(i.units) for i in pl.instances) + len(inv.gateway.nodes)
    gws = "the gateway's too" if len(inv.gateway.nodes) == 1 else f"the {len(inv.gateway.nodes)} gateways' too"
    return Step("verify-running", None, f"every unit of the revision ({n}, {gws}) active, and its "
                "MainPID started from this revision's files (the PID and config id its launch script noted in "
                "/run/pdops/<unit>/config before exec)", 60,
                kind="verify-running", verifies="the running processes use the revision's files",
                params={"placement": pl, "files": files})


def undo_register_step(*, fresh: bool, instances: int) -> Step:
    """A deploy's rescue: what it registered but cannot record leaves the gateway. Its budget: each
    removal waits up to 30 s for the gateway to stop listing the worker, one at a time."""
    return Step("undo-register", None, "remove from every gateway (and its start-up list) every instance this deploy "
                "registered that was not verified healthy" + (", and on this fresh cluster every one it registered "
                "(no revision will describe them)" if fresh else "") + "; the units it started are left running "
                "for inspection", 60 + 35 * instances, kind="undo-register", params={"fresh": fresh})


def gateway_restart_steps(inv: Inventory, instances: list[str], hosts: list[str] | None = None) -> list[Step]:
    """One gateway at a time (`hosts`: only these): restart it on its new files, wait until it lists
    every instance. Behind the admission layer, with other gateways: HAProxy sends it nothing new
    meanwhile (its server drained, ready again after); alone: a stand-in smg takes its place first
    (make before break)."""
    adm = inv.admission
    several = len(inv.gateway.nodes) > 1
    out = []
    for node in [n for n in inv.gateway.nodes if hosts is None or n.host in hosts]:
        held = ""
        where = ", ".join(adm.hosts) if adm else ""
        if adm and several:
            held = (f"; first its server in the admission layer on {where} is set to drain (refused unless "
                    "another gateway is UP there): no new request goes to it, those on it finish; set ready "
                    "again once it lists every worker, whatever the outcome")
        elif adm:
            sb = inv.gateway.standby(node.host)
            held = (f"; make before break, as the only gateway behind the admission layer on {where}: first a "
                    f"stand-in smg from the new files on {sb.url} (transient unit pdops-gateway-standby.service; "
                    "HAProxy reloaded first, gracefully, when its running config has no server for it), every "
                    "instance registered with it and routable, its /readiness 200, its server in HAProxy set "
                    "ready and seen UP; then the gateway's server drained to 0 sessions, the restart, the gateway "
                    "ready and UP again; then the stand-in drained to 0 sessions, set MAINT and stopped. No health "
                    "check is paused. A failed restart leaves the stand-in serving (said) unless the gateway is UP")
        out.append(Step("gateway-restart" + (f" {node.host}" if several else ""), node.host,
                        f"systemctl restart {GATEWAY_UNIT}: smg finishes what is in flight (up to "
                        f"{gateway_grace_s(inv)}s), the new process starts from the new files and registers every "
                        f"worker of its start-up list; wait until /workers lists each healthy and ready" + held,
                        gateway_grace_s(inv) + 120 + (2 * (float(inv.drain_budget_s) + 30) + 60 if adm else 0),
                        kind="gateway-restart",
                        params={"gateway": node.host, "instances": list(instances),
                                "admission_hosts": list(adm.hosts) if adm else []}))
    return out


# ---------------------------------------------------------------- the record of a repair

def lost_work_step(inst: Instance, rep: dict) -> Step:
    host, unit = inst.units[0]
    return Step(f"lost-work {inst.id}", host, f"read {unit}'s request log in the journal since the revision, per "
                "process (invocation): request IDs an ended process received and never finished are lost; they are "
                "named here, marked failed, never sent again", 60, kind="lost-work",
                params={"instance": inst.id, "old": True, "since": rep.get("since", 0)})


def baseline_step(instance_id: str | None = None, when: tuple[str, bool] | None = None,
                  fault: str | None = None) -> Step:
    """The status baseline after a repair of `instance_id`, after a deploy that replaced what it observed
    broken (`fault`), or (neither) after `inv end-orphans`: real SGLang counts each ended half as a
    bootstrap failure of its prefill (observed in the lab, docs/sim.md)."""
    label = instance_id or ("deploy" if fault else "end-orphans")
    fault = fault or (f"the fault this repair of {instance_id} named" if instance_id
                      else "the orphaned halves this command ended")
    return Step("status-baseline", None, f"every instance routable again: the PD failure counters read now become "
                f"`inv status`'s last look; what rose since the previous look fell inside {fault}, and is named here "
                f"with it (`inv status` then reports only failures after it)",
                60, kind="status-baseline", params={"instance": label}, when=when)


# ---------------------------------------------------------------- the record's store and Prometheus

def member_start_steps(inv: Inventory, down: dict[str, str]) -> list[Step]:
    """For a deploy that observed members of the record's etcd not running (`down`: host -> why; read by
    pdops.reads.observe): start each one's unit (delivered and enabled by `inv state.etcd-up`; a member
    rejoins from its data dir), then wait until every member answers with one leader and a write is read
    back through each. None down: no step."""
    if not down:
        return []
    hosts = sorted(down)
    return [Step("etcd-members", None, f"systemctl reset-failed, start --no-block {ETCD_UNIT} on {', '.join(hosts)} (observed "
                 + "; ".join(f"{h}: {down[h]}" for h in hosts) + "); the record's writes go through the majority "
                 "meanwhile", 60, kind="etcd-member-start", params={"hosts": hosts}),
            Step("etcd-quorum", None, f"every member answers its status with one leader, and a write is read back "
                 f"through each of {', '.join(inv.state.etcd.endpoints)}", 120, kind="etcd-check-quorum",
                 params={"endpoints": list(inv.state.etcd.endpoints)},
                 verifies="the record's store runs on every member pdops runs")]


def targets_step() -> Step:
    """The `always` step of every plan that may move `current` (pdops.plans.Plan.always)."""
    return Step("publish-targets", None, "write the Prometheus target file of the revision current after the steps "
                "(the new one, a partial one, or the one before): this machine's copy, and the Prometheus host's "
                "where the inventory names one; one that cannot be written is said and undoes nothing", 30,
                kind="publish-targets")


def end_orphans_step(prefills: list[str], host: str | None = None) -> Step:
    return Step("end-orphans", host, f"read the open requests of {', '.join(prefills)} and of every decode; end each "
                f"prefill half that no decode holds (held {GRACE_S:g}s or more; one younger is read again once it is "
                f"{GRACE_S:g}s old) with /abort_request by its rid, named "
                "in the journal, never sent again; read again to prove each one ended", 90, kind="end-orphans",
                params={"prefills": list(prefills)})


def serving_wait_s(inv: Inventory) -> float:
    """How long a disruptive step waits for another instance of the role to be routable
    (`pdops_serving_wait_s`, default 30 s: smg re-admits a recovered worker within its health interval,
    and a breaker pdops closes by registering again takes about 6 s; longer means it is not coming)."""
    return float(inv.vars.get("pdops_serving_wait_s", 30))


# How long a drain's verify-stop waits for the gateway to drop the removed worker (smg: ~5 s).
GONE_WAIT_S = 30.0


def drain_steps(inv: Inventory, inst: Instance, worker_id: str | None, *, wait_s: float, interval_s: float,
                force_after: bool = False, gateway: bool = True, prefix: str = "", in_change: bool = False,
                check_ports: bool | str = True, resume: bool = True, extra: dict | None = None,
                wait: bool = True, guard: bool = False) -> list[Step]:
    """Rule 4 for one instance as steps: the one drain sub-plan that drain, scale and rollback
    embed (`prefix` names the instance in the step ids when an operation has several drains).
    `gateway=False`: the verified stop alone (`inv stop`); `check_ports="held"` for an instance that
    may never have listened (its port may be someone else's): only the ports its own processes listen
    on when its identity is recorded must be closed after the stop; `resume=False` (undoing an add): always
    stop, never accept units found stopped as the work of an earlier drain. `wait=False` (repairing
    an instance observed down: nothing of it runs to wait for): leave the gateway, then the verified
    stop, without the wait and the empty checks. `guard` (not with --force): while the instance is
    routable, it leaves the gateway only once another instance of its role is routable on a gateway
    (serving as smg routes: healthy, ready, circuit closed), waiting up to `serving_wait_s(inv)`."""
    p = {"instance": inst.id, "in_change": in_change, "check_ports": check_ports, "resume": resume, **(extra or {})}
    steps = []
    if gateway:
        steps.append(
            Step(f"{prefix}leave-gateway", inv.gateway.step_host, (
                 f"while {inst.id} is routable, first wait (up to {serving_wait_s(inv):g}s, else refuse, nothing "
                 f"changed) until another {inst.role} is routable on a gateway (healthy, ready, circuit closed); "
                 if guard else "") + "out of the gateway's start-up worker list, then DELETE "
                 f"/workers/{worker_id or '<its id, found by its URL>'}{inv.gateway.on_each()}; verify "
                 + ("the gateway lists" if len(inv.gateway.nodes) == 1 else "each gateway lists")
                 + " it draining (no new request) or not at all; requests already routed to it keep running",
                 30 * len(inv.gateway.nodes) + (serving_wait_s(inv) if guard else 0), kind="leave-gateway",
                 params={**p, "worker_id": worker_id, "guard_s": serving_wait_s(inv) if guard else 0}))
    if gateway and wait:
        steps += [
            Step(f"{prefix}wait-empty", inst.head.host, "until no request ID is open in its request log and every "
                 "queue (running, waiting, prefill bootstrap and in-flight KV, decode prealloc and transfer) is 0 on "
                 "/v1/loads and /metrics; progress shown"
                 + ("; what a prefill still holds that no decode holds (orphaned halves, pdops.reads.orphans) is ended by "
                    "request ID and named" if inst.role == "prefill" else "")
                 + "; at the deadline stop WITHOUT stopping the instance"
                 + (" (--force-after: stop anyway, loss recorded)" if force_after else ""), wait_s,
                 kind="wait-empty", params={**p, "force_after": force_after}),
            Step(f"{prefix}empty-check-1", inst.head.host, "read every source again: request log, /v1/loads, /metrics",
                 60, kind="empty-check", params={**p, "n": 1, "pause": 0.0}),
            Step(f"{prefix}empty-check-2", inst.head.host, f"after {interval_s:g}s, read every source again",
                 interval_s + 60, kind="empty-check", params={**p, "n": 2, "pause": interval_s}),
        ]
    steps += [
        Step(f"{prefix}record-identity", inst.head.host, "MainPID, ControlGroup, the cgroup's processes and the "
             "process tree with start times, on every rank", 60, kind="record-identity", params=p),
        Step(f"{prefix}stop", inst.head.host, "systemctl stop, rank 0 first, then the other ranks; disable the units",
             inv.stop_timeout_s + 60, kind="stop", params=p),
        Step(f"{prefix}verify-stop", inst.head.host, "cgroup empty (or removed), every recorded PID gone or reused, "
             + ("the ports its own processes listened on (read at record-identity) closed" if check_ports == "held"
                else "ports closed" if check_ports else "its ports not checked (it never listened)")
             + ", no GPU compute process of it (skipped where nvidia-smi is absent)"
             + (f"; {'the gateway no longer lists' if len(inv.gateway.nodes) == 1 else 'no gateway lists'} "
                + (f"worker {worker_id}" if worker_id else "a worker at its URL")
                + f" (smg drops a removed worker seconds after it is empty; still listed after {GONE_WAIT_S:g}s: "
                "not verified)" if gateway else ""),
             60 + (GONE_WAIT_S if gateway else 0),
             kind="verify-stop", params={**p, "gateway_gone": gateway}),
    ]
    return steps


def side_by_side(drains: list[list[Step]], group: str) -> list[Step]:
    """Several instances' drains (each `drain_steps`'s, named `... {id}: leave-gateway` etc.) run side
    by side: each step of a drain in parallel with the same step of the others (group `{group} {n}`),
    so that what each waits for (its requests to end, the gateway to drop it) is waited once, not once
    per instance; a step that fails fails its batch after every drain of it has answered. Drains of
    different shapes line up by step: an instance observed down has no wait and no empty checks, and
    its leave, stop and verify-stop still run beside the others' (never cut to the shortest drain)."""
    def sub(s: Step) -> str:
        return s.name.rsplit(": ", 1)[-1]

    order = [sub(s) for s in max(drains, key=len, default=[])]
    by = [{sub(s): s for s in d} for d in drains]
    for d in by:
        if not set(d) <= set(order):
            raise ValueError(f"drains of different step sets cannot run side by side: {sorted(d)} vs {order}")
    out = []
    for n, name in enumerate(order):
        row = [d[name] for d in by if name in d]
        out += [replace(st, group=f"{group} {n}" if len(row) > 1 else None) for st in row]
    return out
