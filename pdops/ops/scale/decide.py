"""The change planner's decisions (pure), one each, every one returning new values from what it is
given; pdops.ops.scale.planner.plan_change composes them in this order:

- files: what the target runs (a rollback's recorded files, with the front door as the inventory has it);
- generation: each instance's generation before and after (a change of it is a fenced rollout);
- diff: which kept instances are replaced, and why (moved, files changed, observed not serving);
- gateways: which shared files change (a gateway restart, an admission reload; a unit rewrite refused)
  and which gateway hosts leave;
- ports: a replaced prefill takes its slot's other bootstrap port;
- surge: a role left with nothing serving during its replacements gets new instances first;
- ordering: adds, replacement waves, drains before the adds that need their GPUs, with the capacity
  after each step;
- floors: where serving capacity dips below the old and new counts, or to zero, and which roles serve
  nothing now."""

from __future__ import annotations

from dataclasses import dataclass

from pdops.errors import InvalidInput, Refused
from pdops.model.admission import UNIT as ADMISSION_UNIT
from pdops.model.generation import Generation, LAYOUT, ROLES as GEN_ROLES, digest, generation_diff, generations
from pdops.model.inventory import Inventory
from pdops.model.placement import Instance, Placement, gpu_slots, make_instance, remake, uses_alt_port
from pdops.model.render import GATEWAY_UNIT, UNIT_DIR, files_of, render_admission_files, render_files
from pdops.ops.scale.change import (GenerationChange, ROLES, ScaleStep, file_changes, gpu_range, gpu_set,
                                   instance_files, shared_files, slot_key)
from pdops.record.local import Revision


def refuse_moves_onto_held_slots(cur_pl: Placement, target_pl: Placement, why: dict[str, str],
                                 rollback_of: int | None) -> None:
    """A replaced instance that moves (a rollback returns to a recorded placement) is started in its wave,
    beside every instance that has not left yet: onto GPUs or an HTTP port another instance holds now, it
    would start while that one runs, and that one's process would answer its /health and its canary (seen
    in the soak: a rollback moved d01 onto the slot of p01, which it was to remove later; the canary timed
    out and the undo could not prove d01 stopped). Refused, nothing changed, naming both."""
    held: dict[tuple, str] = {}
    for c in cur_pl.instances:
        held.update({(r.host, g): c.id for r in c.ranks for g in r.gpus})
        held[(c.head.host, "port", c.http_port)] = c.id
    tgt = {i.id: i for i in target_pl.instances}
    clashes = []
    for iid, reason in why.items():
        if not reason.startswith("moves:"):
            continue
        new = tgt[iid]
        keys = [(r.host, g) for r in new.ranks for g in r.gpus] + [(new.head.host, "port", new.http_port)]
        others = sorted({held[k] for k in keys if k in held} - {iid})
        if others:
            clashes.append(f"{iid} moves to {'/'.join(new.hosts)} {new.url}, whose GPUs or port {', '.join(others)} "
                           "hold(s) now")
    if clashes:
        again = f"`inv rollback --to {rollback_of}`" if rollback_of else "this command"
        raise Refused("this change would start an instance beside the one that holds its GPUs or port: "
                      + "; ".join(clashes),
                      fix=f"stop the holder first (`inv drain --instance ID`), then run {again} again; "
                          "nothing was changed")


def generation_change(cur_snapshot: dict | None, cur_pl: Placement, files, target_pl: Placement):
    """The generation of each instance before (from the current revision's recorded files) and
    after (the target's files); None when the current revision's files are not at hand."""
    if cur_snapshot is None:
        return None
    old, new = generations(files_of(cur_snapshot), cur_pl), generations(files, target_pl)
    # A role with no instance now (its only decode drained: 1p0d) has no layout to compare: the kept
    # instances were started knowing nothing of it, so its fields are left out on both sides (else adding
    # the role back reads as a generation change, "decode TP unset -> 1")
    unknown = {f"{r}_{f.key}" for r in GEN_ROLES if not any(i.role == r for i in cur_pl.instances) for f in LAYOUT}
    if unknown:
        def known(g):
            f = {k: v for k, v in g.fields.items() if k not in unknown}
            return Generation(f, digest(f))
        old, new = {i: known(g) for i, g in old.items()}, {i: known(g) for i, g in new.items()}
    olds = {g.digest for g in old.values()}
    o = next(iter(old.values()), None)
    n = next((g for g in new.values() if g.digest not in olds), next(iter(new.values()), None))
    diff = generation_diff(o.fields, n.fields) if o and n else []
    return GenerationChange({i: g.digest for i, g in old.items()}, {i: g.digest for i, g in new.items()}, diff)


def waves_why(gen) -> str:
    if gen is None:
        return "in waves (the current revision's files are not at hand: its generation is not compared)"
    if gen.changes:
        return ("in waves although the generation changes (--unfenced): until the last wave, a request that pairs "
                "an old instance with a new one fails its KV transfer")
    return "in waves: the generation is unchanged, old and new instances may pair"


def _surge(inv: Inventory, target_pl: Placement, reps: list[Instance], cur_pl: Placement, role: str,
           chained: bool = False):
    """Each of `reps` replaced by a new instance (the lowest unused id), started before the old one
    drains: on a free slot, then on the slot the previous surge's old instance frees (a chain: one
    free slot is enough; the planner orders each drain before the add that needs its GPUs). A
    prefill on a slot an instance of `cur_pl` holds takes the other bootstrap port. (pl, None):
    no free slot at all."""

    in_target = {slot_key(i) for i in target_pl.instances if i not in reps}
    tgt_ids = {i.id for i in target_pl.instances if i not in reps}
    held_now = {slot_key(i) for i in cur_pl.instances}
    key = lambda sl: (tuple(h.name for h in sl[0]), sl[1])  # noqa: E731
    free = [sl for sl in gpu_slots(inv) if key(sl) not in in_target and key(sl) not in held_now]
    # slots an instance leaving the placement holds: free once it drained (an earlier surge in this
    # change covers it), the chain's next links
    freed = [sl for sl in gpu_slots(inv) if key(sl) not in in_target and key(sl) in held_now and
             all(i.id not in tgt_ids for i in cur_pl.instances if slot_key(i) == key(sl))
             and not any(slot_key(r) == key(sl) for r in reps)]
    if not free and not (chained and freed):
        return target_pl, None
    free += freed
    by_key = {(tuple(h.name for h in sl[0]), sl[1]): sl for sl in gpu_slots(inv)}
    held = {slot_key(i): i for i in cur_pl.instances}
    taken = {int(i.id[1:]) for i in target_pl.role(role)} | {int(i.id[1:]) for i in cur_pl.role(role)}
    made, n = [], 0
    insts = [i for i in target_pl.instances if i not in reps]
    for old in reps:
        n += 1
        while n in taken:
            n += 1
        taken.add(n)
        sl = free.pop(0)
        prev = held.get((tuple(h.name for h in sl[0]), sl[1]))
        alt = role == "prefill" and prev is not None and prev.role == "prefill" and \
            prev.bootstrap_port == inv.ports.bootstrap_base + inv.ports.stride * sl[1]
        new = make_instance(inv, role, n, sl, alt)
        made.append((old, new))
        insts.append(new)
        free.append(by_key[slot_key(old)])  # freed once `old` drains
    insts.sort(key=lambda i: (ROLES.index(i.role), int(i.id[1:])))
    return Placement(target_pl.topology, tuple(insts)), made


def check_max_unavailable(max_unavailable) -> None:
    if isinstance(max_unavailable, bool) or not isinstance(max_unavailable, int) or max_unavailable < 0:
        raise InvalidInput("--max-unavailable", f"{max_unavailable!r} is not a whole number >= 0",
                           fix="instances per role out at once during a rolling change: 1 (default), or 0 to surge "
                               "every replacement into free GPUs")


def target_files(inv: Inventory, target_pl: Placement, snapshot: dict | None) -> list:
    """What the target runs: a rollback returns to the files recorded with its target (its snapshot),
    not to what the inventory on disk renders now. A snapshot keeps no admission file (its key map
    holds keys): the front door is the inventory's now, rendered, so the revision records every file
    the cluster runs (a later deploy compares against the truth)."""
    if snapshot is None:
        return render_files(inv, target_pl)
    files = files_of(snapshot)
    if inv.admission is not None:
        adm = render_admission_files(inv, inv.admission)
        held = {(f.host, f.path) for f in adm}
        files = [f for f in files if (f.host, f.path) not in held] + adm
    return files


def replacements(cur: Revision, cur_pl: Placement, target_pl: Placement, new_mf: dict,
                 replace_ids: dict[str, str]) -> dict[str, str]:
    """{id: why} of the kept ids that run another placement or other files now, or that `replace_ids`
    names (observed not serving, or what its processes run differs)."""
    cur_by_id = {i.id: i for i in cur_pl.instances}
    why: dict[str, str] = {}
    for i in target_pl.instances:
        if i.id not in cur_by_id:
            continue
        old = cur_by_id[i.id]
        changes = file_changes(instance_files(cur.manifest, i.id), instance_files(new_mf, i.id))
        if old.ranks != i.ranks or old.http_port != i.http_port or old.dist_init_port != i.dist_init_port:
            why[i.id] = f"moves: {'/'.join(old.hosts)} {old.url} -> {'/'.join(i.hosts)} {i.url}"
        elif changes:
            why[i.id] = f"{len(changes)} file(s) changed: " + "; ".join(c.split(" (sha256")[0] for c in changes)
        elif i.id in replace_ids:
            why[i.id] = replace_ids[i.id]
    return why


def shared_changes(inv: Inventory, cur: Revision, cur_pl: Placement, target_pl: Placement,
                   new_mf: dict) -> tuple[list[str], list[str]]:
    """(gateway restart, admission reload): the changed files the instances share (the gateway's, the
    admission layer's). A rewrite of the admission layer's unit is refused: applying it is a restart,
    which cuts every stream through it."""
    old_sh = shared_files(cur.manifest, {i.id for i in cur_pl.instances})
    new_sh = shared_files(new_mf, {i.id for i in target_pl.instances})
    shared = [c for c in file_changes(old_sh, {k: v for k, v in new_sh.items() if k in old_sh})
              if not c.endswith("would be removed")]
    adm_paths = set()
    if inv.admission is not None:
        adm_paths = {f"{f.host}:{f.path}" for f in render_admission_files(inv, inv.admission)}
    adm_changes = [c for c in shared if c.split(" ", 1)[0] in adm_paths]
    unit_changes = [c for c in adm_changes if ADMISSION_UNIT in c]
    if unit_changes:
        raise Refused(f"the change would rewrite the admission layer's unit ({ADMISSION_UNIT}) of revision "
                      f"{cur.number}: applying it means a restart, which cuts every stream through it",
                      evidence="\n".join(unit_changes),
                      fix="keep the settings that render the unit as they are for this change, or restart the "
                          "admission layer in a maintenance window")
    return [c for c in shared if c not in adm_changes], adm_changes


def retired_gateways(inv: Inventory, cur: Revision, cur_pl: Placement, target_pl: Placement,
                     why: dict[str, str]) -> list[str]:
    """The gateway hosts no longer named (pdops_gateway.hosts): their unit is stopped, disabled, their
    files removed. Refused beside a change of instances: a drain would not remove its workers from a
    gateway no longer named."""
    retired = sorted(h for h, paths in cur.manifest.items()
                     if f"{UNIT_DIR}/{GATEWAY_UNIT}" in paths and h not in inv.gateway.hosts)
    if retired and ({i.id for i in cur_pl.instances} ^ {i.id for i in target_pl.instances} or why):
        raise Refused(f"this change takes gateway(s) {', '.join(retired)} out and changes instances at once: a drain "
                      "would not remove its workers from a gateway no longer named",
                      fix="take the gateway out in a change of its own (the inventory's instances as they are), "
                          "then change the instances")
    return retired


def other_bootstrap_ports(inv: Inventory, cur_pl: Placement, target_pl: Placement, why: dict[str, str]) -> Placement:
    """A replaced prefill takes its slot's other bootstrap port: no decode has a cached route to it."""
    cur_by_id = {i.id: i for i in cur_pl.instances}
    if not any(cur_by_id[i].role == "prefill" for i in why):
        return target_pl
    return Placement(target_pl.topology, tuple(
        remake(inv, i, alt=not uses_alt_port(inv, cur_by_id[i.id])) if i.id in why and i.role == "prefill" else i
        for i in target_pl.instances))


def surges(inv: Inventory, cur_pl: Placement, target_pl: Placement, why: dict[str, str], not_serving: dict, *,
           max_unavailable: int, force: bool, snapshot: dict | None):
    """(target placement, [(old id, new id)], why): a role whose every instance is replaced with
    nothing left serving, or --max-unavailable 0, gets a new instance started before each old one
    drains (the old one leaves `why`: it is removed, not replaced). An instance the change adds on
    free GPUs (no removed instance holds them) is started and registered before any replacement, so it
    serves through them: it counts, and the replacements go in place after it instead of surging.
    Refused where no slot is free, or for a rollback's recorded files (unless `force`)."""
    cur_by_id = {i.id: i for i in cur_pl.instances}
    why = dict(why)
    surge: list[tuple[str, str]] = []
    tgt_ids = {i.id for i in target_pl.instances}
    replaced_by_role = {r: [i for i in target_pl.role(r) if i.id in why] for r in ROLES}
    leaving = [r for r in cur_pl.instances if r.id not in tgt_ids]
    for role in ROLES:
        reps = replaced_by_role[role]
        if not reps:
            continue
        if not [i for i in cur_pl.role(role) if i.id not in not_serving]:
            continue  # nothing of this role serves now: no floor to keep (said in the plan)
        existing = [i for i in target_pl.role(role) if i.id in cur_by_id]
        added_first = [i for i in target_pl.role(role) if i.id not in cur_by_id and not any(
            gpu_set(i) & gpu_set(r) or slot_key(i) == slot_key(r) for r in leaving)]
        serving = len(existing) + len(added_first)
        if max_unavailable >= 1 and (serving > 1 or force):
            continue
        if snapshot is not None:
            if force or max_unavailable >= 1 and serving > 1:
                continue
            raise Refused(f"returning to the recorded files replaces {', '.join(i.id for i in reps)}, the only "
                          f"{role} instance(s): that would leave no serving {role}",
                          fix="--force to accept it for the time of the replacement")
        target_pl, made = _surge(inv, target_pl, reps, cur_pl, role, chained=bool(surge))
        if made is None:
            if max_unavailable == 0:
                raise Refused(f"--max-unavailable 0: every {role} replacement must start before its old instance "
                              f"drains, and the inventory has no free slot for a {role} instance to start on",
                              fix="add a host (or free GPUs), or allow one out at a time: --max-unavailable 1")
            raise Refused(f"replacing {', '.join(i.id for i in reps)} would leave no serving {role} instance and "
                          "there is no free slot to start a replacement first (surge)",
                          fix="add a host to the inventory so the new instance starts beside the old one, or "
                              "--force to accept serving no " + role + " during the replacement")
        for old_i, new_i in made:
            surge.append((old_i.id, new_i.id))
            why.pop(old_i.id, None)
    return target_pl, surge, why


@dataclass(frozen=True)
class Order:
    steps: list[ScaleStep]
    waves: list[list[Instance]]
    dip: list[str]  # drains before adds that cost serving capacity, said


def order_steps(cur_pl: Placement, target_pl: Placement, added: list[Instance], removed: list[Instance],
                replaced: list[Instance], not_serving: dict, surge: list[tuple[str, str]],
                max_unavailable: int) -> Order:
    """The change's steps in order, each with the capacity (prefill, decode) serving after it: adds on
    free GPUs first; then the replacements in waves (at most `max_unavailable` per role out at once,
    never all of a role's instances); then each add that needs GPUs or ports a removed instance holds,
    after that instance's drain; then the other removals. Capacity counts what serves now: taking out
    an instance that does not serve costs nothing."""
    cur_ids = {i.id for i in cur_pl.instances}
    needs: dict[str, list[Instance]] = {}
    for a in added:
        held = [r for r in removed if gpu_set(a) & gpu_set(r) or (slot_key(a) == slot_key(r))]
        if held:
            needs[a.id] = held
    cap = {r: sum(i.id not in not_serving for i in cur_pl.role(r)) for r in ROLES}
    serving0 = dict(cap)
    steps: list[ScaleStep] = []
    drained: set[str] = set()
    surged = dict((n, o) for o, n in surge)

    def step(kind: str, inst: Instance, why_: str = "", delta: int | None = None) -> None:
        if kind in ("drain", "replace-out") and inst.id in not_serving:
            delta = 0
        cap[inst.role] += (1 if kind == "add" else -1) if delta is None else delta
        steps.append(ScaleStep(kind, inst, (cap["prefill"], cap["decode"]), why_))

    for a in added:
        if a.id not in needs:
            step("add", a, f"surge replacement of {surged[a.id]}" if a.id in surged else "")
    k = {r: min(max(max_unavailable, 1), max(sum(i.id in cur_ids for i in target_pl.role(r)) - 1, 1))
         for r in ROLES}
    waves: list[list[Instance]] = []
    by_role = {r: [i for i in replaced if i.role == r] for r in ROLES}
    while any(by_role.values()):
        wave = []
        for r in ROLES:
            take, by_role[r] = by_role[r][:k[r]], by_role[r][k[r]:]
            wave += take
        waves.append(wave)
    for n, wave in enumerate(waves, 1):
        for i in wave:
            step("replace-out", i, f"wave {n}", delta=-1)
        for i in wave:
            step("replace-in", i, f"wave {n}", delta=+1)
    dip: list[str] = []
    for a in added:
        if a.id not in needs:
            continue
        for r in needs[a.id]:
            if r.id in drained:
                continue
            gpus = sorted(gpu_set(a) & gpu_set(r))
            hosts = sorted({h for h, _ in gpus})
            where = "; ".join(f"{h} GPUs {gpu_range(tuple(g for hh, g in gpus if hh == h))}" for h in hosts)
            step("drain", r, f"frees {where} for {a.id}")
            drained.add(r.id)
            # a surge chain drains the old instance its earlier replacement already covers: no dip;
            # nor does draining one that does not serve now
            if r.id not in not_serving and (a.id not in surged or
                                            cap[r.role] < min(serving0[r.role], len(target_pl.role(r.role)))):
                dip.append(f"{a.id} ({a.role}) needs {where}, held by {r.id} ({r.role}): {r.id} is drained first; "
                           f"serving drops to {cap['prefill']} prefill + {cap['decode']} decode "
                           f"({cap['prefill'] + cap['decode']} instances) until {a.id} is registered")
        step("add", a, f"on the GPUs freed by {', '.join(r.id for r in needs[a.id])}")
    for r in removed:
        if r.id not in drained:
            step("drain", r)
            drained.add(r.id)
    return Order(steps, waves, dip)


def floors(cur_pl: Placement, target_pl: Placement, steps: list[ScaleStep],
           not_serving: dict) -> tuple[list[str], list[str], list[str]]:
    """(dips, roles left with zero serving at some step, roles of which nothing serves now): a rolling
    replacement's own dip (at most max_unavailable) is the plan's, not a capacity dip; a floor already
    broken is said (the change is the way back), not refused."""
    old_count = {r: sum(i.id not in not_serving for i in cur_pl.role(r)) for r in ROLES}
    dip, zero, broken = [], [], []
    for role_i, role in enumerate(ROLES):
        new_count = len(target_pl.role(role))
        low = min((s.capacity[role_i] for s in steps if not s.kind.startswith("replace")), default=old_count[role])
        if low < min(old_count[role], new_count):
            dip.append(f"{role} capacity drops to {low} (old {old_count[role]}, new {new_count})")
        if old_count[role] == 0:
            first = next((s.instance.id for s in steps if s.instance.role == role and s.kind in ("add", "replace-in")),
                         None)
            down = [i for i in not_serving if i in {c.id for c in cur_pl.role(role)}]
            broken.append(f"no {role} serves now" + (f" ({', '.join(down)} observed not serving)"
                                                    if cur_pl.role(role) else "")
                          + (f": this change brings {first} up first" if first else ": this change starts none"))
        elif min((s.capacity[role_i] for s in steps), default=old_count[role]) < 1:
            zero.append(role)
    return dip, zero, broken
