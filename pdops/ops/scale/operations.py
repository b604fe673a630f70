"""The operations that are one change, each planned by `plan_change` (pdops.ops.scale.planner) from
the record and the inventory (pure apart from reading the record): scale, apply (a deploy's pending
change), `drain --host` and uncordon (host maintenance), rollback (to a recorded revision's files)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdops.errors import InvalidInput, Refused
from pdops.model.inventory import Inventory
from pdops.model.placement import Placement, gpu_slots, make_instance, place_change
from pdops.model.render import manifest, render_files
from pdops.record.local import Revision, StateDir
from pdops.model.topology import Topology

from pdops.ops.scale.change import (ROLES, ScalePlan, cordoned_hosts, current_revision_of, file_changes,
                                   instance_files, refuse_changed_inventory, slot_key)
from pdops.ops.scale.decide import generation_change
from pdops.ops.scale.planner import plan_change

if TYPE_CHECKING:
    from pdops.reads.observation import Seen


def plan_apply(inv: Inventory, target: Topology, record: StateDir, *, allow_capacity_dip: bool = False,
               skip_checks: set[str] | None = None, max_unavailable: int = 1, force: bool = False,
               replace_ids: dict[str, str] | None = None, avoid: frozenset[str] | None = None,
               seen: Seen | None = None, unfenced: bool = False, shift_hold_s: float | None = None) -> ScalePlan:
    """What `inv deploy --topology T` (or `inv scale`) does on a live cluster: the smallest change from
    the current revision to what the inventory, `target` and this pdops render now. Reads only the record."""
    cur = current_revision_of(inv, record, "change")
    cur_pl = Placement.from_dict(cur.placement)
    cordoned = frozenset(avoid if avoid is not None else cordoned_hosts(cur))
    target_pl = place_change(inv, target, cur_pl, avoid=cordoned, last_ports=(cur.extra or {}).get("last_bootstrap"))
    return plan_change(inv, cur, target_pl, allow_capacity_dip=allow_capacity_dip, skip_checks=skip_checks,
                       max_unavailable=max_unavailable, force=force, replace_ids=replace_ids, seen=seen,
                       cur_snapshot=record.revision_snapshot(cur.number), unfenced=unfenced,
                       shift_hold_s=shift_hold_s)


def plan_drain_host(inv: Inventory, record: StateDir, host: str, *, force: bool = False,
                    skip_checks: set[str] | None = None, seen: Seen | None = None) -> ScalePlan:
    """`inv drain --host H` (maintenance): every instance with a rank on H leaves it. Where free
    slots off the cordoned hosts allow, each is replaced there first (a new id, started and
    registered before the old one drains); else it is drained and the role shrinks, refused when a
    role would be left with no serving instance unless `force`. H is cordoned in the revision."""

    inv.host(host)  # InvalidInput naming the hosts when unknown
    cur = current_revision_of(inv, record, "drain")
    cur_pl = Placement.from_dict(cur.placement)
    cordoned = sorted(set(cordoned_hosts(cur)) | {host})
    leaving = [i for i in cur_pl.instances if host in i.hosts]
    staying = [i for i in cur_pl.instances if host not in i.hosts]
    used = {slot_key(i) for i in cur_pl.instances}
    free = [sl for sl in gpu_slots(inv) if (tuple(h.name for h in sl[0]), sl[1]) not in used
            and not {h.name for h in sl[0]} & set(cordoned)]
    out = list(staying)
    moved = []
    for old in leaving:
        if not free:
            continue
        taken = {int(i.id[1:]) for i in out + leaving if i.role == old.role}
        n = 1
        while n in taken:
            n += 1
        new = make_instance(inv, old.role, n, free.pop(0))
        out.append(new)
        moved.append((old.id, new.id))
    out.sort(key=lambda i: (ROLES.index(i.role), int(i.id[1:])))
    target = Placement(Topology(sum(i.role == "prefill" for i in out), sum(i.role == "decode" for i in out)), tuple(out))
    zero = [r for r in ROLES if not target.role(r)]
    if zero and not force:
        raise Refused(f"draining {host} ({', '.join(i.id for i in leaving)}) would leave no serving "
                      f"{' and no '.join(zero)} instance, and no free slot off the cordoned hosts takes its place",
                      fix="add a host (or uncordon one) so the instance moves there first, or --force")
    refuse_generation_change(inv, record, cur, target, f"drain --host {host}")
    return plan_change(inv, cur, target, skip_checks=skip_checks, force=force, cordoned=cordoned,
                       allow_capacity_dip=True, seen=seen, cur_snapshot=record.revision_snapshot(cur.number),
                       moves=moved)


def refuse_generation_change(inv: Inventory, record: StateDir, cur, target: Placement, what: str) -> None:
    """Host maintenance moves instances; it does not carry a change of generation (model, page size, KV
    dtype, SGLang pin) that the inventory on disk holds and no deploy has applied: rolled in waves, its
    instances would be paired with the old generation's. Refused, naming the fields and the command
    that fences it (docs/changes.md)."""
    snap = record.revision_snapshot(cur.number)
    if snap is None:
        return  # a revision recorded before snapshots: its generation is not known (the plan says so)
    gen = generation_change(snap, Placement.from_dict(cur.placement), render_files(inv, target), target)
    if gen is not None and gen.changes:
        raise Refused(f"`inv {what}` would start instances of another generation than revision {cur.number}'s "
                      f"({'; '.join(gen.diff) or 'the engines differ'}): the inventory on disk holds a change no deploy "
                      "has applied, and host maintenance does not fence one; nothing was changed",
                      fix=f"apply it first, fenced (blue/green): `inv deploy --topology {cur.topology}` (docs/changes.md), "
                          f"then `inv {what}`; or restore the inventory of revision {cur.number}")


def plan_uncordon(inv: Inventory, record: StateDir, host: str) -> ScalePlan:
    """`inv uncordon --host H`: placement may use H again (nothing starts there by itself)."""
    inv.host(host)
    cur = current_revision_of(inv, record, "uncordon")
    was = cordoned_hosts(cur)
    if host not in was:
        raise Refused(f"{host} is not cordoned in revision {cur.number} (cordoned: {', '.join(was) or 'none'})",
                      fix="`inv status` shows the cordoned hosts")
    pl = Placement.from_dict(cur.placement)
    refuse_generation_change(inv, record, cur, pl, f"uncordon --host {host}")
    return plan_change(inv, cur, pl, cordoned=[h for h in was if h != host],
                       cur_snapshot=record.revision_snapshot(cur.number))


def plan_scale(inv: Inventory, target: Topology, record: StateDir, *, allow_capacity_dip: bool = False,
               skip_checks: set[str] | None = None, max_unavailable: int = 1, force: bool = False,
               seen: Seen | None = None, unfenced: bool = False, shift_hold_s: float | None = None) -> ScalePlan:
    """`inv scale --topology T`: the same planner as `inv deploy` of a live cluster (plan_apply)."""
    return plan_apply(inv, target, record, allow_capacity_dip=allow_capacity_dip, skip_checks=skip_checks,
                      max_unavailable=max_unavailable, force=force, seen=seen, unfenced=unfenced,
                      shift_hold_s=shift_hold_s)


def rollback_conditions(inv: Inventory, cur: Revision, tgt: Revision) -> list[str]:
    """What changed since `tgt` that makes returning to it unsafe (empty: the conditions hold)."""
    changed: list[str] = []
    if not inv.matches(tgt.inventory_hash):
        changed.append(f"inventory digest {tgt.inventory_hash[:12]} at revision {tgt.number}, "
                       f"{inv.digest[:12]} now")
    tgt_pl = Placement.from_dict(tgt.placement)
    names = {h.name: h for h in inv.hosts}
    for i in tgt_pl.instances:
        for r in i.ranks:
            h = names.get(r.host)
            if h is None:
                changed.append(f"host {r.host} of {i.id} is no longer in the inventory")
            elif h.data_addr != r.data_addr:
                changed.append(f"host {r.host} of {i.id}: data address {r.data_addr} -> {h.data_addr}")
    if not changed:
        try:
            again = place_change(inv, tgt_pl.topology, tgt_pl)
            if again != tgt_pl:
                changed.append(f"revision {tgt.number}'s placement no longer follows from the inventory")
        except InvalidInput as exc:
            changed.append(exc.message)
    cur_pl = Placement.from_dict(cur.placement)
    cur_by_id = {i.id: i for i in cur_pl.instances}
    for i in tgt_pl.instances:
        if i.id in cur_by_id and cur_by_id[i.id] != i:
            changed.append(f"{i.id} runs on {'/'.join(cur_by_id[i.id].hosts)} slot {cur_by_id[i.id].slot} now, "
                           f"on {'/'.join(i.hosts)} slot {i.slot} in revision {tgt.number}")
    if not changed:
        new_mf = manifest(render_files(inv, tgt_pl))
        for i in tgt_pl.instances:
            if i.id not in cur_by_id:
                changed += [f"{i.id}: {c}" for c in
                            file_changes(instance_files(tgt.manifest, i.id), instance_files(new_mf, i.id))]
    return changed


def plan_rollback(inv: Inventory, record: StateDir, to: int | None = None, *, allow_capacity_dip: bool = False,
                  skip_checks: set[str] | None = None, max_unavailable: int = 1, force: bool = False,
                  seen: Seen | None = None, unfenced: bool = False, shift_hold_s: float | None = None) -> ScalePlan:
    """A change back to the previous deployed revision (or revision `to`): to its recorded placement
    and the files recorded with it (its snapshot), whatever the inventory on disk renders now; only
    its hosts must still be in the inventory (to be reached). A revision recorded before snapshots:
    returned to only while the inventory and the rendering are unchanged (Refused naming what changed)."""
    cur = current_revision_of(inv, record, "roll back")
    if to is None:
        tgt = record.previous()
        if tgt is None:
            raise Refused(f"{inv.cluster} has no deployed revision before revision {cur.number}: nothing to roll "
                          "back to", fix="`inv history` lists the recorded revisions")
    else:
        try:
            n = int(to)
        except (TypeError, ValueError):
            raise InvalidInput("--to", f"{to!r} is not a revision number", fix="see `inv history`") from None
        if n == cur.number:
            raise Refused(f"revision {n} is already current: nothing to roll back",
                          fix="name an earlier revision (`inv history`)")
        tgt = record.read_revision(n)
        if tgt.outcome != "deployed":
            raise Refused(f"revision {n} ended '{tgt.outcome}': only a deployed revision can be returned to",
                          fix="choose a revision whose outcome is deployed (`inv history`)")
    snap = record.revision_snapshot(tgt.number)
    if snap is not None:
        tgt_pl = Placement.from_dict(tgt.placement)
        known = {h.name for h in inv.hosts}
        gone = sorted({h for i in tgt_pl.instances for h in i.hosts} - known)
        if gone:
            raise Refused(f"cannot roll back to revision {tgt.number}: its hosts {', '.join(gone)} are not in the "
                          "inventory, so they cannot be reached", fix="add them back to the inventory (the files and "
                          f"placement of revision {tgt.number} are recorded; only the hosts' addresses are read from it)")
        return plan_change(inv, cur, tgt_pl, allow_capacity_dip=allow_capacity_dip, skip_checks=skip_checks,
                           rollback_of=tgt.number, snapshot=snap, max_unavailable=max_unavailable, force=force,
                           seen=seen, cur_snapshot=record.revision_snapshot(cur.number), unfenced=unfenced,
                           shift_hold_s=shift_hold_s, inventory_hash=tgt.inventory_hash)
    refuse_changed_inventory(inv, cur)
    changed = rollback_conditions(inv, cur, tgt)
    if changed:
        raise Refused(f"cannot roll back to revision {tgt.number} ({tgt.topology}): its rollback conditions no "
                      "longer hold", evidence="\n".join(changed),
                      fix="restore what changed, or plan the change as a new scale (`inv scale --topology "
                          f"{tgt.topology}`)")
    return plan_change(inv, cur, Placement.from_dict(tgt.placement), allow_capacity_dip=allow_capacity_dip,
                       skip_checks=skip_checks, rollback_of=tgt.number, seen=seen)
