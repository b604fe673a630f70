"""What a drain or a stop will do (pure apart from reading the record): its plan, the drain
sub-plan every change embeds (`drain_steps`), and the plan that ends a stop's survivors."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdops.errors import InvalidInput, Refused
from pdops.model.inventory import Inventory
from pdops.steps.builders import targets_step
from pdops.model.placement import Instance, Placement
from pdops.plans import Plan, Step
from pdops.record.local import Revision, StateDir

from pdops.ops.drain.stopping import last_stop_record


@dataclass
class DrainPlan:
    inv: Inventory
    rev: Revision
    placement: Placement
    instance: Instance
    steps: list[Step]
    wait_s: float
    interval_s: float
    force_after: bool = False
    skip_gateway: bool = False
    persist: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def plan(self) -> Plan:
        i = self.instance
        verb = "drain" if not self.skip_gateway else "stop"
        title = (f"plan: {verb} {i.id} ({i.role}, {', '.join(f'{h}:{u}' for h, u in i.units)}) from revision "
                 f"{self.rev.number} ({self.rev.topology}), under the cluster lock")
        return Plan(verb, title, self.steps, self.notes, head={"instance": i.id, "revision": self.rev.number},
                    always=[targets_step()])

    def render(self) -> str:
        return self.plan.render()


def plan_drain(inv: Inventory, record: StateDir, instance_id: str, *, force: bool = False,
               wait_s: float | None = None, interval_s: float | None = None, force_after: bool = False,
               skip_gateway: bool = False, seen=None) -> DrainPlan:
    """What a drain of `instance_id` will do, or why it is refused. Reads the state dir and, with
    `seen` (pdops.reads.observation.Seen), what serves now: the floor counts only instances that serve; one
    that does not serve may be drained even if it is the last of its role (nothing is lost that
    serves), and one whose units are not running is not waited for."""
    rev = record.current_revision()
    if rev is None:
        raise Refused(f"{inv.cluster} has no current revision: nothing to drain", fix="deploy first (inv deploy)")
    if not inv.matches(rev.inventory_hash):
        raise Refused(f"the inventory changed since revision {rev.number} was deployed "
                      f"(digest {rev.inventory_hash[:12]} -> {inv.digest[:12]})",
                      fix=f"use the inventory of the running revision, or apply this one first: `inv deploy --topology "
                          f"{rev.topology}` (it records an inventory that renders the same files, or plans the change)")
    pl = Placement.from_dict(rev.placement)
    inst = pl.get(instance_id)
    same_role = pl.role(inst.role)
    ns = seen.not_serving if seen is not None else {}
    others = [i.id for i in same_role if i.id != inst.id and i.id not in ns]
    if not force and not skip_gateway and inst.id not in ns and not others:
        idle = [i.id for i in same_role if i.id != inst.id]
        raise Refused(f"{inst.id} is the last {inst.role} instance of {inv.cluster} that serves: draining it leaves no "
                      f"{inst.role}" + (f" ({', '.join(idle)} observed not serving)" if idle else ""),
                      fix="scale up first (or repair the others), or pass --force if serving must stop")
    wait_s = float(wait_s if wait_s is not None else inv.drain_budget_s)
    interval_s = float(interval_s if interval_s is not None else inv.vars.get("pdops_empty_check_interval_s", 5))
    if wait_s <= 0 or interval_s < 0:
        raise InvalidInput("--wait/--interval", "must be positive seconds", fix="e.g. --wait 600 --interval 5")
    worker = (rev.instances.get(inst.id) or {}).get("worker_id")
    down = seen is not None and inst.id in seen.down
    steps = drain_steps(inv, inst, worker, wait_s=wait_s, interval_s=interval_s, force_after=force_after,
                        gateway=not skip_gateway, wait=not down, guard=not force)
    notes = [f"observed: {seen.basis}"] if seen is not None and seen.basis else []
    if inst.id in ns:
        notes.append(f"observed: {inst.id} does not serve ({ns[inst.id]})" + (
            "; nothing runs to wait for: " + ("the verified stop reads what is left of it" if skip_gateway else
                                              "leave the gateway, then the verified stop")
            + " (`inv repair` names the work its ended process lost)" if down else ""))
    if not skip_gateway:
        steps.append(Step("record", None, f"new revision without {inst.id} becomes current; rollback record kept",
                          kind="record-drain", params={"instance": inst.id, "revision": rev, "placement": pl}))
        if inst.role == "prefill":
            notes.append("a drained prefill's prefix cache is lost: cold inputs will be slower for a while")
    else:
        notes.append("stop only: the instance stays in the current revision (shown as stopped by `inv status`)")
    return DrainPlan(inv, rev, pl, inst, steps, wait_s, interval_s, force_after, skip_gateway,
                     persist=not skip_gateway, notes=notes)


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
        for st in row:
            st.group = f"{group} {n}" if len(row) > 1 else None
            out.append(st)
    return out


@dataclass
class KillPlan:
    inv: Inventory
    rev: Revision
    instance: Instance
    survivors: list[dict]
    from_op: str
    steps: list[Step]

    @property
    def plan(self) -> Plan:
        return Plan("stop", f"plan: end the processes that survived the stop of {self.instance.id} (recorded by "
                    f"{self.from_op}), under the cluster lock", self.steps,
                    ["only these PIDs, each only while its start time is the recorded one; nothing by name"],
                    head={"instance": self.instance.id, "kill_survivors": True, "from_op": self.from_op})

    def render(self) -> str:
        return self.plan.render()


def plan_kill_survivors(inv: Inventory, record: StateDir, instance_id: str) -> KillPlan:
    """What `inv stop --kill-survivors` will do: the survivors the last stop of the instance
    recorded, or Refused when none is recorded. Reads only the state dir."""
    rev = record.current_revision()
    if rev is None:
        raise Refused(f"{inv.cluster} has no current revision", fix="nothing was deployed by pdops here")
    inst = Placement.from_dict(rev.placement).get(instance_id)
    rec = last_stop_record(record.journal(), inst.id)
    survivors = (rec or {}).get("evidence", {}).get("survivors") or []
    if not survivors:
        raise Refused(f"no stop of {inst.id} with surviving processes is recorded: nothing to end",
                      fix=f"`inv stop --instance {inst.id}` stops and verifies; it lists any survivor")
    p = {"instance": inst.id}
    steps = [Step("check-units", inst.head.host, f"every unit of {inst.id} is inactive (refuse if it runs again)",
                  30, kind="check-units", params=p)]
    for host in sorted({r["host"] for r in survivors}):
        mine = [r for r in survivors if r["host"] == host]
        steps.append(Step(f"kill-survivors {host}", host, "; ".join(
            f"SIGKILL PID {r['pid']} only if its start time is still {r['start_ticks']}: {r['cmdline']} "
            f"(cgroup {r['cgroup']}, ports {r['ports'] or 'none'})" for r in mine), 30, kind="kill-survivors",
            params={**p, "records": mine}))
    steps.append(Step("verify-stop", inst.head.host, "every recorded PID gone or reused, the instance's ports closed, "
                      "no GPU compute process of it (skipped where nvidia-smi is absent)", 30, kind="verify-gone",
                      params={**p, "records": survivors}))
    return KillPlan(inv, rev, inst, survivors, rec["op_id"], steps)
