"""The change planner (pure): `plan_change`, from a revision to a placement (keep, replace, add, remove;
surge; floors from what serves now; a change of generation handed to `fenced`), composed of the
decisions in `decide`, each of one concern. The operations that are one change (scale, apply,
rollback, `drain --host`, uncordon) are in `operations`."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from pdops.errors import Refused
from pdops.model.inventory import Inventory
from pdops.model.placement import Placement
from pdops.model.render import manifest, render_files
from pdops.record.local import Revision

from pdops.ops.scale.change import ScalePlan, cordoned_hosts, instance_files
from pdops.ops.scale.decide import (check_max_unavailable, floors, generation_change, order_steps,
                                   other_bootstrap_ports, refuse_moves_onto_held_slots, replacements,
                                   retired_gateways, shared_changes, surges, target_files, waves_why)
from pdops.ops.scale.fenced import plan_fenced
from pdops.ops.scale.steps import rescue_steps, runner_steps
from pdops.steps.preflight.checks import validate_skip

if TYPE_CHECKING:
    from pdops.reads.observation import Seen


def compile_steps(plan: ScalePlan) -> ScalePlan:
    """The plan with the runner's steps and rescue made from what it decided (a new value)."""
    return replace(plan, run=runner_steps(plan), rescue=rescue_steps(plan))

def plan_change(inv: Inventory, cur: Revision, target_pl: Placement, *, allow_capacity_dip: bool = False,
                skip_checks: set[str] | None = None, rollback_of: int | None = None, max_unavailable: int = 1,
                force: bool = False, replace_ids: dict[str, str] | None = None,
                cordoned: list[str] | None = None, snapshot: dict | None = None, seen: Seen | None = None,
                restart_not_serving: bool = True, cur_snapshot: dict | None = None, unfenced: bool = False,
                shift_hold_s: float | None = None, fault: str | None = None, inventory_hash: str | None = None,
                moves: list[tuple[str, str]] | None = None, repair: dict | None = None,
                guard: bool | None = None) -> ScalePlan:
    """The ordered, capacity-annotated change from revision `cur` to `target_pl` (pure): each instance
    is kept (same placement, identical files), replaced (same id and slot; its files, its placement or,
    in `replace_ids`, what its processes were observed to run differ: drained, then started from the
    new files, a prefill on its slot's other bootstrap port), added or removed. Replacements roll in
    waves of at most `max_unavailable` per role; a role that would be left with no serving instance
    surges into a free slot (new id, started before the old one drains) or is refused unless `force`.

    `seen` (pdops.reads.observation.Seen): what serves now. An instance of the revision that does not serve is
    replaced (started again), first in its role, and counts for no floor; one whose units are not
    running is not waited for (nothing runs to drain); a role of which nothing serves is said in the
    plan, not refused; a gateway that does not answer is started as the first step.
    `restart_not_serving=False` (`inv repair`, one instance): what does not serve counts for no floor
    and no canary pair, but only `replace_ids` are started again.

    `cur_snapshot` (the current revision's recorded files): the generation of each instance before
    and after is compared (pdops.model.generation). A change of generation is not rolled in waves,
    where old and new instances would pair: it is planned as a fenced rollout (pdops.ops.scale.fenced),
    or refused when the cluster cannot fence; `unfenced` rolls it in waves all the same.

    `fault`: what a deploy observed and replaces (pdops.ops.deploy.plan_reconcile: processes that run,
    or will run at their next start, files edited on their host): the change ends the prefill halves a replaced decode left and moves
    `inv status`'s baseline past the fault, as a repair does.

    What a caller adds is an argument, part of the plan before its steps are compiled (their record step
    carries it): `inventory_hash`, the inventory digest a rollback records (its target revision's, not
    the inventory on disk); `moves`, the (old id, new id) pairs a host maintenance planned, recorded as
    its surge; `repair` (pdops.ops.repair: the one instance a repair restarts, its state, whether to end
    what it runs after its wait), with `guard`: whether each drain keeps its serving guard at
    leave-gateway (default: not `force`; a repair overrides the planner's floors itself and keeps the
    guard unless the operator forced)."""

    skip_checks = validate_skip(skip_checks)
    check_max_unavailable(max_unavailable)
    cur_pl = Placement.from_dict(cur.placement)
    cur_ids = {i.id for i in cur_pl.instances}
    not_serving = {k: v for k, v in (seen.not_serving if seen else {}).items() if k in cur_ids}
    replace_ids = dict(replace_ids or {})
    for iid, reason in not_serving.items() if restart_not_serving else ():
        replace_ids.setdefault(iid, f"observed not serving ({reason}): started again")
    files = target_files(inv, target_pl, snapshot)
    gen = generation_change(cur_snapshot, cur_pl, files, target_pl)
    if gen is not None and gen.changes and not unfenced:
        return plan_fenced(inv, cur, target_pl.topology, gen, skip_checks=skip_checks, seen=seen,
                           allow_capacity_dip=allow_capacity_dip, cordoned=cordoned, rollback_of=rollback_of,
                           snapshot=snapshot, hold_s=shift_hold_s)
    why = replacements(cur, cur_pl, target_pl, manifest(files), replace_ids)
    refuse_moves_onto_held_slots(cur_pl, target_pl, why, rollback_of)
    gateway_restart, adm_changes = shared_changes(inv, cur, cur_pl, target_pl, manifest(files))
    retired = retired_gateways(inv, cur, cur_pl, target_pl, why)
    planned = target_pl
    if snapshot is None:
        target_pl = other_bootstrap_ports(inv, cur_pl, target_pl, why)
    target_pl, surge, why = surges(inv, cur_pl, target_pl, why, not_serving, max_unavailable=max_unavailable,
                                   force=force, snapshot=snapshot)
    if target_pl is not planned:  # new ports or surge instances: their files
        files = render_files(inv, target_pl)
    new_mf = manifest(files)
    tgt_ids = {i.id for i in target_pl.instances}
    added = [i for i in target_pl.instances if i.id not in cur_ids]
    removed = [i for i in cur_pl.instances if i.id not in tgt_ids]
    replaced = sorted((i for i in target_pl.instances if i.id in why), key=lambda i: i.id not in not_serving)
    kept = [i for i in target_pl.instances if i.id in cur_ids and i.id not in why]
    n_kept_files = sum(len(instance_files(new_mf, i.id)) for i in kept)
    cordoned = sorted(cordoned_hosts(cur) if cordoned is None else cordoned)
    cordon_change = cordoned != sorted(cordoned_hosts(cur))
    gateway_down = bool(seen and seen.gateway)
    if not added and not removed and not replaced and not gateway_restart and not cordon_change and not adm_changes \
            and not gateway_down and not retired:
        return ScalePlan(inv, cur, cur_pl, target_pl, files, [], [], kept, [], kept_files=n_kept_files,
                         noop=f"revision {cur.number} is already {cur.topology} with this placement and these "
                              "rendered files: nothing to add, replace or drain", rollback_of=rollback_of,
                         skip_checks=skip_checks)
    order = order_steps(cur_pl, target_pl, added, removed, replaced, not_serving, surge, max_unavailable)
    dip, zero, broken = floors(cur_pl, target_pl, order.steps, not_serving)
    dip = order.dip + dip
    plan = ScalePlan(inv, cur, cur_pl, target_pl, files, added, removed, kept, order.steps, dip=dip,
                     rollback_of=rollback_of, skip_checks=skip_checks, kept_files=n_kept_files,
                     replaced=replaced, why=why, waves=[[i.id for i in w] for w in order.waves],
                     surge=surge + list(moves or []), rollback_inventory_hash=inventory_hash,
                     max_unavailable=max_unavailable, gateway_restart=gateway_restart, cordoned=cordoned,
                     retired_gateways=retired,
                     base_snapshot=snapshot, admission_reload=adm_changes, seen=seen, broken=broken,
                     generation=gen, how=waves_why(gen), force=force if guard is None else not guard, fault=fault,
                     repair=repair)
    plan = compile_steps(plan)
    if zero and not force:
        raise Refused(f"the change would leave no serving {' and no '.join(zero)} instance at some step",
                      fix="add hosts so replacements start beside the old instances, or --force to accept it",
                      evidence=plan.render())
    if dip and not allow_capacity_dip:
        raise Refused(f"{cur.topology} -> {target_pl.topology} cannot add before it drains: "
                      + "; ".join(dip),
                      fix="pass --allow-capacity-dip to accept the temporary capacity, or add hosts so the new "
                          "instances fit beside the old ones",
                      evidence=plan.render())
    return plan


