"""What a drain or a stop will do (pure apart from reading the record): its plan (of the drain
sub-plan every change embeds, pdops.steps.builders.drain_steps), and the plan that ends a stop's
survivors."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdops.errors import InvalidInput, Refused
from pdops.model.inventory import Inventory
from pdops.steps.builders import drain_steps, targets_step
from pdops.model.placement import Instance, Placement
from pdops.plans import Plan, Step
from pdops.record.local import Revision, StateDir
from pdops.steps.stopping import last_stop_record


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
                    always=[targets_step()], failure_line="drain-interrupted")

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
