"""A change of generation, fenced (blue/green): old and new instances never pair (pure: a plan).

When a change alters what crosses the wire between a prefill and its decodes (the generation,
pdops.model.generation), a rolling change would let the gateway pair an old prefill with a new
decode and their KV transfers fail. A fenced rollout keeps the generations apart by gateway:

1. the new generation comes up as a pool of its own, on free slots, with new instance ids;
2. one gateway (the last one named, `green`) leaves the front door (its HAProxy server drained,
   nothing left in flight on it) and drops the old pool's workers: it routes to nothing;
3. the new pool starts, is canaried pair by pair, and is registered with that gateway only;
4. the front door's traffic moves to it in steps (HAProxy weights 10%, 50%, 100%), each held for a
   window in which the new pool's and its gateway's failure counters must not rise, else the
   shift is undone and the change fails with the old generation serving every request;
5. `commit`: from here the old pool drains by request id (the other gateways take no new request)
   and is removed; a failure from here leaves the new generation serving;
6. the other gateways get the new pool too, and every gateway is back in the front door.

With too few free slots the old pool shrinks first (drained down to one instance per role, which
is a capacity dip: refused unless `--allow-capacity-dip`). The rescue is part of the plan: before
`commit`, the front door goes back to the old gateways, the new pool is drained and stopped, the
fenced gateway gets the old pool back; after `commit`, the other gateways get the new pool."""

from __future__ import annotations

from dataclasses import replace

from pdops.errors import Refused
from pdops.model.admission import FULL_WEIGHT
from pdops.model.inventory import Inventory
from pdops.model.placement import Instance, Placement, gpu_slots, make_instance
from pdops.model.render import manifest, render_files
from pdops.model.topology import Topology
from pdops.record.local import Revision
from pdops.plans import Step

from pdops.steps.builders import (canary_step, connect_step, delivery_steps, drain_steps, front_door_step,
                                  preflight_step, register_steps, side_by_side, start_steps, verify_running_step)
from pdops.ops.scale.steps import rescue_steps, restore_steps, undo_group
from pdops.ops.scale.change import (ROLES, cordoned_hosts, GenerationChange, ScalePlan, ScaleStep, change_facts, file_changes,
                                   shared_files, slot_key)

SHIFTS = (10, 50, 100)
# How long each shift holds with the new pool's failure counters flat before the next one
# (`pdops_fence_hold_s`; the lab sets a few seconds).
DEFAULT_HOLD_S = 60.0


def plan_fenced(inv: Inventory, cur: Revision, topology: Topology, gen: GenerationChange, *, skip_checks, seen,
                allow_capacity_dip: bool, cordoned, rollback_of, snapshot, hold_s: float | None) -> ScalePlan:
    """The fenced rollout of a change of generation from revision `cur` to `topology` (module doc)."""
    why = "; ".join(gen.diff) or "the generation digest differs"
    n_gw = len(inv.gateway.nodes)
    if inv.admission is None or n_gw < 2:
        lacks = " and ".join(x for x in (f"{n_gw} gateway" + ("s" if n_gw != 1 else "") if n_gw < 2 else "",
                                         "no admission layer" if inv.admission is None else "") if x)
        raise Refused(f"this change alters the generation ({why}): rolled in waves, old and new instances would "
                      f"pair and their KV transfers fail. A fenced rollout needs two or more gateways behind the "
                      f"admission layer; this inventory has {lacks}",
                      fix="name a second gateway (pdops_gateway.hosts) and the admission layer (pdops_admission), "
                          "or pass --unfenced to roll in waves and accept failed requests until the last wave "
                          "(docs/changes.md)")
    if rollback_of is not None or snapshot is not None:
        raise Refused(f"returning to revision {rollback_of} changes the generation ({why}): a rollback replaces in "
                      "place, which would pair the generations",
                      fix="deploy the old settings instead (`inv deploy --topology ...` with them: a fenced rollout), "
                          "or --unfenced")
    not_serving = dict(seen.not_serving) if seen else {}
    if not_serving or (seen and seen.gateways_down):
        raise Refused("a fenced rollout starts from a cluster that serves whole: "
                      + "; ".join([f"{i}: {w}" for i, w in not_serving.items()]
                                  + [f"gateway {h}: {w}" for h, w in (seen.gateways_down if seen else {}).items()]),
                      fix="`inv deploy --topology <the live one>` repairs it first")
    cur_pl = Placement.from_dict(cur.placement)
    avoid = set(cordoned_hosts(cur) if cordoned is None else cordoned)
    held = {slot_key(i) for i in cur_pl.instances}

    def key(sl):
        return (tuple(h.name for h in sl[0]), sl[1])

    busy = {(r.host, g) for i in cur_pl.instances for r in i.ranks for g in r.gpus}

    def gpus(sl):
        return {(h.name, g) for h in sl[0] for g in sl[2]}

    # free: no instance of the old pool on its GPUs (a slot of another shape may overlap one)
    free = [sl for sl in gpu_slots(inv) if key(sl) not in held and not (gpus(sl) & busy)
            and not ({h.name for h in sl[0]} & avoid)]
    need = topology.prefill + topology.decode
    shrink: list[Instance] = []
    dip: list[str] = []
    if len(free) < need:
        shrink = _shrink(cur_pl, need - len(free))
        if shrink is None:
            raise Refused(f"a fenced rollout to {topology} needs {need} free slots beside the old pool; there are "
                          f"{len(free)}, and the old pool at its floor (one instance per role) frees too few",
                          fix="add hosts, or --unfenced to roll in waves (requests pairing across generations fail)")
        dip = [f"the old pool shrinks by {', '.join(i.id for i in shrink)} first: {len(free)} free slot(s) for a "
               f"new pool of {need}"]
        by_key = {key(sl): sl for sl in gpu_slots(inv)}
        free += [by_key[slot_key(i)] for i in shrink]
    green: list[Instance] = []
    last = {slot_key(i): i for i in cur_pl.instances}
    for role in ROLES:
        n = 0
        for _ in range(topology.prefill if role == "prefill" else topology.decode):
            n += 1
            while n in {int(i.id[1:]) for i in cur_pl.role(role)} | {int(i.id[1:]) for i in green if i.role == role}:
                n += 1
            sl = free.pop(0)
            prev = last.get(key(sl))
            # a prefill on a slot an old prefill held takes the port it did not use (no cached route)
            alt = role == "prefill" and prev is not None and prev.role == "prefill" and \
                prev.bootstrap_port == inv.ports.bootstrap_base + inv.ports.stride * sl[1]
            green.append(make_instance(inv, role, n, sl, alt))
    green_pl = Placement(topology, tuple(green))
    files = render_files(inv, green_pl)
    new_mf = manifest(files)
    old_sh = shared_files(cur.manifest, {i.id for i in cur_pl.instances})
    new_sh = shared_files(new_mf, {i.id for i in green})
    shared = [c for c in file_changes(old_sh, {k: v for k, v in new_sh.items() if k in old_sh})
              if not c.endswith("would be removed")]
    if shared:
        raise Refused("this change alters the generation and the gateway's or the admission layer's files at once",
                      evidence="\n".join(shared),
                      fix="change one at a time: the gateway or admission setting first (a rolling change), then "
                          "the generation")
    blue = [i for i in cur_pl.instances if i not in shrink]
    p0, d0 = len(cur_pl.role("prefill")), len(cur_pl.role("decode"))
    steps: list[ScaleStep] = []
    for x in shrink:
        p0, d0 = (p0 - 1, d0) if x.role == "prefill" else (p0, d0 - 1)
        steps.append(ScaleStep("drain", x, (p0, d0), "the old pool shrinks to make room"))
    for g in green:  # the new pool serves nothing until the front door moves to it
        steps.append(ScaleStep("add", g, (p0, d0), "the new generation's pool"))
    gp, gd = len(green_pl.role("prefill")), len(green_pl.role("decode"))
    for b in blue:
        steps.append(ScaleStep("drain", b, (gp, gd), "the old generation, after the front door moved"))
    hold = float(inv.vars.get("pdops_fence_hold_s", DEFAULT_HOLD_S) if hold_s is None else hold_s)
    fence = {"gateway": inv.gateway.hosts[-1], "others": list(inv.gateway.hosts[:-1]), "shifts": list(SHIFTS),
             "hold_s": hold, "shrink": [i.id for i in shrink], "admission_hosts": list(inv.admission.hosts)}
    plan = ScalePlan(inv, cur, cur_pl, green_pl, files, added=green, removed=list(cur_pl.instances), kept=[],
                     steps=steps, dip=dip, skip_checks=set(skip_checks or ()), seen=seen, generation=gen,
                     cordoned=sorted(avoid), fence=fence,
                     how=f"fenced (blue/green): the generation changes ({why}); old and new instances never pair")
    if dip and not allow_capacity_dip:
        raise Refused(f"a fenced rollout to {topology} needs {need} free slots; there are {need - len(shrink)}: the "
                      f"old pool would shrink by {', '.join(i.id for i in shrink)} first",
                      fix="pass --allow-capacity-dip to accept the temporary capacity, or add hosts",
                      evidence=plan.render())
    return replace(plan, run=fenced_steps(plan), rescue=fenced_rescue(plan))


def _shrink(cur_pl: Placement, k: int) -> list[Instance] | None:
    """`k` instances of the old pool to drain first, never its last prefill or decode (the highest
    ids of the larger role first); None when the floor frees too few."""
    left = {r: sorted(cur_pl.role(r), key=lambda i: int(i.id[1:])) for r in ROLES}
    out: list[Instance] = []
    while len(out) < k:
        role = max(ROLES, key=lambda r: len(left[r]))
        if len(left[role]) <= 1:
            return None
        out.append(left[role].pop())
    return out


def fenced_steps(plan: ScalePlan) -> list[Step]:
    """The runner's steps of a fenced rollout (module doc)."""
    inv, cur, tgt, f = plan.inv, plan.current, plan.target, plan.fence
    g, others, adms = f["gateway"], f["others"], f["admission_hosts"]
    adm = ", ".join(adms)  # where HAProxy runs: each gets the same commands
    at = adms[0] if len(adms) == 1 else None
    green = list(tgt.instances)
    shrink = [plan.current_placement.get(i) for i in f["shrink"]]
    blue = [i for i in plan.current_placement.instances if i.id not in f["shrink"]]
    interval = float(inv.vars.get("pdops_empty_check_interval_s", 5))

    def drains(insts, tag):
        out = []
        for x in insts:
            out += drain_steps(inv, x, (cur.instances.get(x.id) or {}).get("worker_id"),
                               wait_s=float(inv.drain_budget_s), interval_s=interval, prefix=f"{tag} {x.id}: ",
                               in_change=True)
        return out

    def old_pool_drains(insts):
        # after the commit no request reaches the old pool: its drains run side by side
        return side_by_side([drains([x], "drain") for x in insts], "drain")

    # a new instance on a slot the shrink frees is checked by that drain's verified stop (its ports closed,
    # its GPUs free), not now, while the old instance holds them by design: preflight checks the others
    freed = {slot_key(i) for i in shrink}
    pre = tuple(i for i in tgt.instances if slot_key(i) not in freed)
    pre_pl = Placement(Topology(sum(i.role == "prefill" for i in pre), sum(i.role == "decode" for i in pre)), pre)
    later = [i.id for i in tgt.instances if slot_key(i) in freed]
    out = [connect_step(plan.hosts), preflight_step(
        plan.skip_checks, pre_pl, plan.current_placement,
        note=f"; not yet {', '.join(later)}: their slots are {', '.join(i.id for i in shrink)}'s until the shrink's "
             "verified stop (ports closed, GPUs free) frees them" if freed else "")]
    out += delivery_steps(inv, tgt, plan.files, {"topology": str(tgt.topology), "from": cur.number, "fenced": True})
    out += drains(shrink, "shrink")
    out.append(Step("fence", g, f"take gateway {g} out of the front door: HAProxy on {adm} sets its server to drain "
                    f"(refused unless {', '.join(others)} is UP there), wait until nothing is in flight on it, then "
                    f"out of {g}'s start-up list and DELETE /workers on {g}: every worker of the old pool "
                    f"({', '.join(i.id for i in blue)}); {g} routes to nothing", float(inv.drain_budget_s) + 60,
                    kind="fence-gateway", params={"gateway": g, "others": others, "admission_hosts": adms,
                                                   "instances": [i.id for i in blue]}))
    out += start_steps(inv, green, restart=False, group="start new pool" if len(green) > 1 else None)
    pairs = [(p.id, d.id) for p in tgt.role("prefill") for d in tgt.role("decode")]
    out.append(canary_step("canary new pool", pairs, retry_once=True,
                           why="straight to each pair of the new generation, before it is registered"))
    out += register_steps(inv, green, group="register new pool" if len(green) > 1 else None, gateways=[g])
    for pct in f["shifts"]:
        share = (f"{g} weight {pct}, {', '.join(others)} weight {100 - pct}" if pct < 100
                 else f"{g} weight 100, {', '.join(others)} weight 0 (no new request)")
        out.append(Step(f"shift {pct}%", at, f"HAProxy on {adm}: {share}" + (f"; {g} set ready first and waited UP"
                        if pct == f["shifts"][0] else "") + f"; hold {f['hold_s']:g}s: the new pool's transfer and "
                        f"bootstrap failure counters and {g}'s PD failure counters must not rise, else the shift is "
                        f"undone ({g} drained, {', '.join(others)} back at weight 100) and the change fails",
                        f["hold_s"] + 60, kind="shift",
                        params={"gateway": g, "others": others, "admission_hosts": adms, "percent": pct,
                                "hold_s": f["hold_s"], "first": pct == f["shifts"][0],
                                "instances": [i.id for i in green]}))
    out.append(Step("commit", None, f"the whole front door is on the new generation (gateway {g}): from here the old "
                    "pool drains (side by side: no request reaches it), and a failure leaves the new generation "
                    "serving", 5, kind="fence-commit"))
    out += old_pool_drains(blue)
    out += register_steps(inv, green, group="join" if len(green) > 1 else None, gateways=others, prefix="join ")
    out.append(Step("front-door open", at, f"HAProxy on {adm}: every gateway ({', '.join(inv.gateway.hosts)}) ready at "
                    "weight 100", 60, kind="front-door-set",
                    params={"admission_hosts": adms, "weights": {h: FULL_WEIGHT for h in inv.gateway.hosts},
                            "ready": list(inv.gateway.hosts)}))
    out += front_door_step(inv)
    out.append(verify_running_step(tgt, inv, plan.files))
    out.append(Step("record", None, f"record revision ({tgt.topology}, the new generation) with the rollback record; "
                    "move `current` to it", kind="record-scale", params={"change": change_facts(plan)}))
    return out


def fenced_rescue(plan: ScalePlan) -> list[Step]:
    """What runs when a step of a fenced rollout fails: before `commit`, the old generation serves every
    request again (front door back to the other gateways, the new pool drained and stopped, the fenced
    gateway given the old pool back); after `commit`, the new generation serves through every gateway.
    Then what runs is recorded (pdops.ops.scale.rescue's R1 and R3, as any change)."""
    inv, f = plan.inv, plan.fence
    g, others, adms = f["gateway"], f["others"], f["admission_hosts"]
    adm = ", ".join(adms)  # where HAProxy runs: each gets the same commands
    at = adms[0] if len(adms) == 1 else None
    base = {s.kind: s for s in rescue_steps(plan)}
    out = [Step("front-door back", at, f"if the fence step ran: HAProxy on {adm}: {g} drained at weight 0, "
                f"{', '.join(others)} ready at weight 100: every new request goes to the old generation", 60,
                kind="front-door-set", params={"admission_hosts": adms, "weights": {g: 0, **{h: FULL_WEIGHT for h in others}},
                                               "drain": [g], "ready": others, "only_if_fenced": True},
                when=("committed", False))]
    out += undo_group(plan, fenced=True)  # the new pool is kept only once committed (a shrink is no reason)
    # never the old generation back after commit; the restore's other steps follow restore-check's outputs
    out += restore_steps(plan, [s.instance.id for s in plan.steps if s.kind in ("drain", "replace-out")],
                         when=("committed", False))
    out.append(Step("unfence", g, f"{g} gets the old pool's workers back (those serving: registered, in its start-up "
                    f"list), then HAProxy on {adm} sets it ready at weight 100", 120, kind="unfence-gateway",
                    params={"gateway": g, "admission_hosts": adms,
                            "instances": [i.id for i in plan.current_placement.instances]},
                    when=("committed", False)))
    out.append(Step("rescue leave old pool", None, f"the old pool's instances not yet drained leave {', '.join(others)} "
                    "(out of their start-up lists, DELETE /workers; not stopped: named out of service), so that no "
                    "gateway routes to both generations", 60 + 30 * len(plan.current_placement.instances),
                    kind="leave-old-pool", params={"gateways": others,
                                                   "instances": [i.id for i in plan.current_placement.instances]},
                    when=("committed", True)))
    out += register_steps(inv, list(plan.target.instances), group=None, gateways=others, prefix="rescue join ",
                          when=("committed", True))
    out.append(Step("rescue front-door open", at, f"HAProxy on {adm}: every gateway ready at weight 100 (the new "
                    "generation serves through each)", 60, kind="front-door-set",
                    params={"admission_hosts": adms, "weights": {h: FULL_WEIGHT for h in inv.gateway.hosts},
                            "ready": list(inv.gateway.hosts)}, when=("committed", True)))
    out.append(base["record-halt"])
    return out


__all__ = ["DEFAULT_HOLD_S", "SHIFTS", "fenced_rescue", "fenced_steps", "plan_fenced"]
