"""What `inv deploy --topology T` will do (pure apart from reading the record): a fresh deploy, a
repair of the live revision decided from what the hosts and the gateway report (plan_reconcile),
or any other difference as a change (pdops.ops.scale.plan_apply)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdops.steps.builders import end_orphans_step
from pdops.model.inventory import Inventory
from pdops.steps.builders import member_start_steps, targets_step
from pdops.model.placement import Placement, place
from pdops.model.render import RenderedFile, gateway_paths, manifest, render_files
from pdops.plans import Plan, Step
from pdops.facts.systemd import UnitState
from pdops.record.local import Revision
from pdops.model.topology import Topology

from pdops.reads.observation import Observation, Seen
from pdops.reads.observe import unit_files

from pdops.steps.builders import (admission_steps, gateway_restart_steps, canary_step, healthy_steps, close_breakers_step, connect_step, delivery_steps, front_door_step,
                                  gateway_steps, preflight_step,
                                register_steps, start_steps,
                                undo_register_step, verify_running_step)
from pdops.steps.preflight.checks import validate_skip
from pdops.ops import scale as sc
from pdops.model.admission import FULL_WEIGHT


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
    record: object = field(default=None, repr=False, compare=False)
    basis: int | None = None
    # on a live cluster whose topology or rendered files differ, or whose processes run other
    # files: the deploy is this rolling change (pdops.ops.scale.ScalePlan), walked by execute_scale
    change: object = None

    @property
    def title(self) -> str:
        if self.live is not None and not self.findings:
            return (f"plan: deploy {self.placement.topology} on {self.inv.cluster}: revision {self.live.number} has "
                    "these rendered files; what to do is decided from what the hosts and the gateway report")
        if self.live is not None:
            what = ("what runs differs from it" if any(not f.startswith("the inventory on disk") for f in self.findings)
                    else "nothing that runs differs from it, only the inventory")
            return (f"plan: repair revision {self.live.number} ({self.placement.topology}) on {self.inv.cluster}: "
                    f"its rendered files are in place; {what}, as observed now:\n"
                    + "\n".join(f"  - {f}" for f in self.findings) + "\nunder the cluster lock")
        return (f"plan: deploy {self.placement.topology} on {self.inv.cluster} ({len(self.hosts)} hosts, engine "
                f"{self.inv.engine}, profile {self.inv.profile.name}), under the cluster lock")

    @property
    def plan(self) -> Plan:
        if self.change is not None:
            return self.change.plan
        rescue = [undo_register_step(fresh=self.previous is None and self.live is None,
                                     instances=len(self.placement.instances))]
        if self.live is not None:
            return Plan("deploy", self.title, self.steps, head={"topology": str(self.placement.topology),
                                                                "repair_of": self.live.number,
                                                                "findings": self.findings},
                        footer=["verified at the end: what each repair step proved"], rescue=rescue,
                        always=[targets_step()], failure_line="deploy-failed")
        return Plan("deploy", self.title, self.steps, head={"topology": str(self.placement.topology)},
                    footer=["verified at the end: what each step above proved; anything it could not check is "
                            "listed as not verified"], rescue=rescue, always=[targets_step()],
                    failure_line="deploy-failed")

    def render(self) -> str:
        if self.change is not None:
            return self.change.render()
        if self.noop:
            return self.title + f"\nno change: {self.noop}"
        return self.plan.render()


def plan_deploy(inv: Inventory, topo: Topology, record, skip_checks: set[str] | None = None, *,
                max_unavailable: int = 1, force: bool = False, allow_capacity_dip: bool = False, seen=None,
                unfenced: bool = False):
    """Pure apart from reading the record: what a deploy of `topo` will do, or why not; always a
    DeployPlan. On a live cluster: the live revision's placement and files (its repairs decided
    from observation, plan_reconcile), or any other difference as a rolling change
    (`change`: pdops.ops.scale.plan_apply: keep, replace, add, remove)."""

    skip_checks = validate_skip(skip_checks)
    current = record.current_revision()
    previous = Placement.from_dict(current.placement) if current else None
    if current is not None:

        # one placement and one rendering: the change planner's, from the record
        change = sc.plan_apply(inv, topo, record, skip_checks=skip_checks, max_unavailable=max_unavailable,
                               force=force, allow_capacity_dip=allow_capacity_dip, seen=seen, unfenced=unfenced)
        if change.noop and seen is None and change.target == previous and manifest(change.files) == current.manifest:
            # same placement, same files (every one: the change planner's no-op does not count shared
            # files new in the target, e.g. an admission layer just added): whether anything is to be
            # done is read from the hosts and the gateway (plan_reconcile), not assumed from the record
            pl, files = change.target, change.files
            return DeployPlan(inv, pl, files, [], hosts=sorted({f.host for f in files}), skip_checks=skip_checks,
                              previous=previous, live=current, record=record, basis=current.number)
        return DeployPlan(inv, change.target, change.files, [], noop=change.noop, skip_checks=skip_checks,
                          previous=previous, record=record, basis=current.number, change=change)
    pl = place(inv, topo, previous)
    files = render_files(inv, pl)
    hosts = sorted({f.host for f in files})
    fresh = current is None
    steps = [connect_step(hosts), preflight_step(skip_checks, pl, previous)]
    steps += delivery_steps(inv, pl, files)
    steps += gateway_steps(inv, restart=fresh, what=" with no workers", wait="")
    steps += admission_steps(inv, restart=fresh)
    steps += start_steps(inv, pl.instances, restart=fresh, group="start")
    pairs = [(p.id, d.id) for p in pl.role("prefill") for d in pl.role("decode")]
    steps.append(canary_step("canary", pairs, retry_once=False,
                             why="sent straight to each pair before anything is registered"))
    steps += register_steps(inv, pl.instances, group="register")
    steps += front_door_step(inv)
    steps.append(verify_running_step(pl, inv, files))
    steps.append(Step("record", None, "write the revision, move `current` to it", kind="record-deploy",
                      params={"placement": pl, "files": files}))
    return DeployPlan(inv, pl, files, steps, hosts=hosts, skip_checks=skip_checks, previous=previous, record=record,
                      basis=current.number if current else None)


def plan_reconcile(plan: DeployPlan, obs: Observation) -> DeployPlan:
    """For a deploy of the live revision, from what runs (`obs`: pdops.reads.observe.observe, read by
    the caller) plan the repairs:
    start what is down, canary every pair through a started or restarted instance, register what
    the gateway lacks or does not route to, then record the MainPIDs seen. An inventory that renders
    the same files but is not the one recorded (a host that runs nothing added or taken out) is
    recorded too, so the operations that require the running revision's inventory accept it.
    Nothing to repair or record: a no-op whose message names what was observed."""
    inv, rev, pl = plan.inv, plan.live, plan.placement
    findings = obs.findings()
    if not inv.matches(rev.inventory_hash):
        findings.append(f"the inventory on disk (digest {inv.digest[:12]}) is not revision {rev.number}'s "
                        f"({rev.inventory_hash[:12]}) but renders the same files: recorded with it")
    if not findings:
        return replace(plan, noop=f"revision {rev.number} ({pl.topology}) is live with identical rendered files; "
                                  f"{obs.summary()}")
    # files edited on the host that its process runs, or will at its next start (a crash loop of a
    # hand-made change): the fault this deploy repairs
    runs_edited = {o.id: "its files were changed on the host: " + "; ".join(o.edited)
                   for o in obs.instances if o.runs_edited}
    stale = {**runs_edited, **{o.id: "its process runs other files: " + "; ".join(o.stale)
                               for o in obs.instances if o.stale}}
    if stale and not any(o.down for o in obs.instances if o.id not in stale) and not obs.gateway_down:
        # replaced, rolling, as any change, which delivers the revision's files before each starts again;
        # as in any change planned from what serves now, an instance that does not serve (down, or not
        # routed) counts for no floor and is started again first. An instance edited beside its recorded
        # process goes with them: its wave puts its files back.

        stale.update({o.id: "its files were changed on the host (its recorded process runs the revision's): "
                      + "; ".join(o.edited) for o in obs.instances if o.edited and o.id not in stale})
        change = sc.plan_change(inv, rev, pl, skip_checks=plan.skip_checks, replace_ids=stale, seen=Seen.of(obs),
                                fault="; ".join(f"{k} {v}" for k, v in sorted(runs_edited.items())) or None)
        return replace(plan, change=change, noop=change.noop, findings=findings)
    steps = [connect_step(plan.hosts)]
    # with something else down: every instance's edited files put back before anything starts; one whose
    # recorded process runs (started from the revision's files) is not restarted, one that systemd started
    # again from the edited files is, in place
    edited = [o for o in obs.instances if o.edited]
    # a gateway that runs other files than the revision's (its files changed after it started, and no
    # restart followed): the revision's files put back, then restarted on them (below), one at a time
    stale_gws = [g.host for g in obs.gateways if g.stale]
    # and a gateway that is down (its unit read: its host answers) starts again from the revision's files, not
    # from whatever is on its disk (a hand edit that makes it crash loop): Ansible changes only what differs
    gw_files = stale_gws + [g.host for g in obs.gateways if g.down and isinstance(g.unit, UnitState)]
    if edited or gw_files:
        own = {(h, p) for o in edited for h, u in o.instance.units for p in unit_files(rev.manifest, h, u)}
        own |= {(h, p) for h in gw_files for p in gateway_paths()}
        files = [f for f in plan.files if (f.host, f.path) in own]
        insts = tuple(o.instance for o in edited)
        whose = [o.id for o in edited] + [f"gateway {h}" for h in gw_files]
        steps += delivery_steps(inv, Placement(Topology(sum(i.role == "prefill" for i in insts),
                                                        sum(i.role == "decode" for i in insts)), insts),
                                files, {"restore": whose, "of": rev.number},
                                note=f" (only {', '.join(whose)}'s files, as revision {rev.number} rendered them, "
                                     "before anything starts" + ("; a recorded process, started from them, is not "
                                                                 "restarted" if edited else "") + ")")
    down_gws = [g for g in obs.gateways if g.down]
    if down_gws:
        restart = {g.host: isinstance(g.unit, UnitState) and g.unit.active_state == "active" for g in down_gws}
        steps += [s for s in gateway_steps(inv, restart=restart, what=" (after each start it queues its start-up "
                                           "list itself)", wait="") if s.params["gateway"] in restart]
    steps += admission_steps(inv, restart=False, hosts=sorted(obs.admission_down),
                             why=lambda h: f" (observed {obs.admission_down[h]})")
    down = [o.instance for o in obs.instances if o.down]
    restarted = [o.instance for o in obs.instances if o.restarted and not o.down]
    steps += start_steps(inv, down, restart=False, group="start")
    ran_edit = {o.id for o in obs.instances if o.restarted and not o.down and o.edited}
    steps += start_steps(inv, [i for i in restarted if i.id in ran_edit], restart=True, group="start")
    steps += healthy_steps(inv, [i for i in restarted if i.id not in ran_edit], group="healthy")
    touched = {i.id for i in down + restarted}
    pairs = [(p.id, d.id) for p in pl.role("prefill") for d in pl.role("decode") if {p.id, d.id} & touched]
    if pairs:
        steps.append(canary_step("canary", pairs, retry_once=True,
                                 why="through every pair of a started or restarted instance, before registration"))
    need = [o.instance for o in obs.instances if o.down or o.gateway_problem or not o.in_list or obs.gateway_down]
    steps += register_steps(inv, need, group="register")
    if stale_gws:
        steps += gateway_restart_steps(inv, [i.id for i in pl.instances], hosts=stale_gws)
    if obs.front_door and inv.admission is not None:  # a stopped change left a gateway drained or weighted

        standbys = sorted({h for h in inv.gateway.hosts for f in obs.front_door if f"the stand-in of gateway {h} " in f})
        steps.append(Step("front-door open", inv.admission.hosts[0] if len(inv.admission.hosts) == 1 else None,
                          f"observed: {'; '.join(obs.front_door)}; HAProxy on {', '.join(inv.admission.hosts)}: "
                          f"every gateway ready at weight {FULL_WEIGHT}"
                          + (f"; then the stand-in of {', '.join(standbys)} drained to 0 sessions, MAINT, its unit "
                             "stopped" if standbys else ""), 60 + (float(inv.drain_budget_s) + 60) * len(standbys),
                          kind="front-door-set",
                          params={"admission_hosts": list(inv.admission.hosts),
                                  "weights": {h: FULL_WEIGHT for h in inv.gateway.hosts},
                                  "ready": list(inv.gateway.hosts), "standbys": standbys}))
    if down_gws or stale_gws or need or obs.front_door or obs.admission_down:
        steps += front_door_step(inv)
    if obs.gateway_down or obs.gateway_restarted or any(i.role == "decode" for i in down + restarted):
        # a restarted decode or gateway leaves prefill halves no decode will take: ended, named
        steps.append(end_orphans_step([p.id for p in pl.role("prefill")]))
    if touched or need:
        steps.append(close_breakers_step(inv, pl, sorted(touched | {i.id for i in need}),
                                         "engines started again at their URLs, or workers the gateway did not route to"))
    # the record's store where pdops runs it: after the serving parts (a member that cannot start must not
    # keep the gateways and engines down), before the record is written
    steps += member_start_steps(inv, obs.store_down)
    steps.append(verify_running_step(pl, inv, plan.files))
    steps.append(Step("record", None, f"record the MainPIDs seen as a repair of revision {rev.number} (same files "
                      "and topology" + ("; the inventory on disk" if not inv.matches(rev.inventory_hash) else "")
                      + "); move `current` to it", kind="record-repair",
                      params={"live": rev, "placement": pl, "files": plan.files, "findings": findings}))
    return replace(plan, steps=steps, findings=findings)
