"""`inv scale --topology 10p2d` and `inv rollback`: topology changes as verified plans.

A change adds or removes whole, homogeneous replicas; nothing is migrated and no role is
flipped. Plan (pure apart from reading the state dir): from the current revision to the
target placement, partition the instances into added, removed (drained) and kept (left
untouched: their rendered files are identical), order the steps so that new instances
are added and registered before old ones are drained, and give the serving capacity of
each role after every step. Where an added instance needs GPUs that a removed one holds,
the removal must come first: the plan names those GPUs and the temporary capacity and
requires ``--allow-capacity-dip``.

Do: under the cluster lock for the whole change; preflight; deliver the new revision's
files with Ansible (kept instances' files are identical, so nothing of theirs changes);
start and health-gate each added instance, canary its new P x D pairs directly, then
register it; drain each removed instance with the drain machinery (leave the gateway,
wait empty per request ID, two empty checks, stop by identity and verify); record ONE
revision with the full placement and the way back. ``current`` moves only when every
step succeeded. A failure before anything was drained undoes what this change added
(drained if it was registered, stopped and verified) and leaves ``current`` unchanged;
a failure after a drain records what is live as a ``partial`` revision, so ``inv status``
and the journal agree with the hosts.

Rollback is the same change towards a recorded revision's placement (same ids, same
slots), refused when its conditions no longer hold (inventory or rendered files changed).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

# imported for their step kinds' executors too (pdops.runner.EXECUTORS): a change walks them
import pdops.admission_ops  # noqa: F401
import pdops.deploy  # noqa: F401
import pdops.drain  # noqa: F401
import pdops.repair  # noqa: F401
from pdops.admission import UNIT as ADMISSION_UNIT
from pdops.admission import health_pause_command
from pdops import membership, orphans
from pdops.errors import DeployFailed, InvalidInput, PdopsError, Refused, ScaleFailed, Unverified
from pdops.gateway import GatewayClient
from pdops.hosts import HostPool
from pdops.inventory import Inventory
from pdops.observability import targets_step
from pdops.placement import Instance, Placement, gpu_slots, last_bootstrap_ports, make_instance
from pdops.render import RenderedFile, files_of, manifest, render_files, snapshot_of
from pdops.runner import Outcome, Plan, RunContext, Say, Step, register_executors, run_steps, walk
from pdops.state import Revision, StateDir, new_op_id
from pdops.topology import Topology

if TYPE_CHECKING:
    from pdops.observe import Seen

ROLES = ("prefill", "decode")




# ---------------------------------------------------------------- plan


def always_steps() -> list[Step]:
    """The `always` part of every change plan (pdops.runner.Plan.always)."""
    return [targets_step()]


@dataclass(frozen=True)
class ScaleStep:
    """One step of a change: add (start, health-gate, canary, register) or drain an instance."""

    kind: str  # "add" | "drain" | "replace-out" | "replace-in"
    instance: Instance
    capacity: tuple[int, int]  # (prefill, decode) serving after this step
    why: str = ""

    def describe(self) -> str:
        i = self.instance
        where = f"{'/'.join(i.hosts)} GPUs {_gpu_range(i.head.gpus)}"
        if self.kind == "add":
            return (f"add {i.id} ({i.role}) on {where}: start, wait {i.url}/health, canary its new P x D pairs, "
                    "register with the gateway")
        if self.kind == "replace-out":
            return f"replace {i.id} ({i.role}, {self.why}): drain the running process"
        if self.kind == "replace-in":
            return f"replace {i.id} ({i.role}, {self.why}): start from the new files, canary, register"
        return f"drain {i.id} ({i.role}) on {where}: leave the gateway, wait empty, two empty checks, verified stop"


@dataclass
class ScalePlan:
    inv: Inventory
    current: Revision
    current_placement: Placement
    target: Placement
    files: list[RenderedFile]
    added: list[Instance]
    removed: list[Instance]
    kept: list[Instance]
    steps: list[ScaleStep]
    dip: list[str] = field(default_factory=list)  # why the capacity dips (GPUs to free first)
    noop: str | None = None
    rollback_of: int | None = None
    skip_checks: set[str] = field(default_factory=set)
    kept_files: int = 0
    run: list = field(default_factory=list)  # the runner's steps (pdops.runner.Step), made by plan_change
    replaced: list[Instance] = field(default_factory=list)  # as they will run (same id and slot)
    why: dict[str, str] = field(default_factory=dict)  # replaced id -> what differs
    waves: list[list[str]] = field(default_factory=list)
    surge: list[tuple[str, str]] = field(default_factory=list)  # (old id, the new id that replaces it)
    max_unavailable: int = 1
    gateway_restart: list[str] = field(default_factory=list)  # the gateway's files that change (restart it)
    cordoned: list[str] = field(default_factory=list)  # hosts placement avoids after this change
    admission_reload: list[str] = field(default_factory=list)  # its config files that change (a graceful reload)
    base_snapshot: dict | None = field(default=None, repr=False)  # a rollback's target: its files and inventory
    rollback_inventory_hash: str | None = None
    # `inv repair`: {"instance", "state", "reasons", "down", "force_after", "since"} (pdops.repair)
    repair: dict | None = None
    state: object = field(default=None, repr=False, compare=False)  # the record it was read from
    seen: Seen | None = None  # what the hosts and the gateway reported when it was planned (None: not read)
    broken: list[str] = field(default_factory=list)  # roles with no serving instance before the change

    @property
    def start_capacity(self) -> tuple[int, int]:
        """(prefill, decode) serving before the change: what was observed serving (the record's count
        when nothing was read)."""
        ns = self.seen.not_serving if self.seen else {}
        return (sum(i.id not in ns for i in self.current_placement.role("prefill")),
                sum(i.id not in ns for i in self.current_placement.role("decode")))

    @property
    def operation(self) -> str:
        return "repair" if self.repair else "rollback" if self.rollback_of else "scale"

    @property
    def plan(self) -> Plan:
        op = self.operation
        return Plan(op, self.render().splitlines()[0], self.run,
                    head={"from": self.current.number, "to": str(self.target.topology), "rollback_of": self.rollback_of,
                          "added": [i.id for i in self.added], "removed": [i.id for i in self.removed],
                          "replaced": {i.id: self.why[i.id] for i in self.replaced}, "waves": self.waves,
                          "surge": self.surge, "max_unavailable": self.max_unavailable,
                          "kept": [i.id for i in self.kept], "dip": self.dip, "broken": self.broken,
                          **({"observed": {"not_serving": self.seen.not_serving, "gateway": self.seen.gateway}}
                             if self.seen is not None else {})},
                    rescue=rescue_steps(self), always=always_steps())

    @property
    def hosts(self) -> list[str]:
        """Hosts the change touches: every host of the target (Ansible delivers there) and of removed instances."""
        hs = {r.host for i in self.target.instances for r in i.ranks} | {self.inv.gateway.host}
        hs |= {h for i in self.removed for h in i.hosts}
        return sorted(hs)

    def min_capacity(self) -> tuple[int, int]:
        caps = [self.start_capacity] + [s.capacity for s in self.steps]
        return (min(c[0] for c in caps), min(c[1] for c in caps))

    def render(self) -> str:
        cur = self.current
        verb = f"rollback to revision {self.rollback_of}" if self.rollback_of else "scale"
        head = (f"plan: {verb}: {self.inv.cluster} from revision {cur.number} ({cur.topology}) "
                f"to {self.target.topology}")
        if self.repair:
            r = self.repair
            head = (f"plan: repair {r['instance']} of {self.inv.cluster} (revision {cur.number}, {cur.topology}): "
                    f"observed {r['state']}" + (f": {'; '.join(r['reasons'])}" if r["reasons"] else " (--force)"))
        if self.noop:
            return head + f"\nno change: {self.noop}"
        lines = [head]
        if self.seen is not None:
            if self.seen.gateway:
                lines.append(f"  observed: the gateway does not answer ({self.seen.gateway}): started first")
            changed = {i.id for i in self.replaced + self.removed} | {o for o, _ in self.surge}
            lines += [f"  observed: {i} does not serve ({why})" + ("" if i in changed else ": not part of this change")
                      for i, why in self.seen.not_serving.items()]
            if self.seen.all_serving:
                lines.append("  observed: every instance of the revision serves; the gateway answers")
        lines += [f"  floor: {b}" for b in self.broken]
        lines.append("  added:   " + (", ".join(f"{i.id} ({i.role}) on {'/'.join(i.hosts)} GPUs "
                                                f"{_gpu_range(i.head.gpus)}, {i.url}" for i in self.added) or "none"))
        lines.append("  removed: " + (", ".join(f"{i.id} ({i.role}) on {'/'.join(i.hosts)} GPUs "
                                                f"{_gpu_range(i.head.gpus)} (drained)" for i in self.removed) or "none"))
        old_by_id = {i.id: i for i in self.current_placement.instances}
        for i in self.replaced:
            o = old_by_id[i.id]
            port = (f"; bootstrap port {o.bootstrap_port} -> {i.bootstrap_port} (a port no decode has a cached "
                    "route to)" if o.bootstrap_port != i.bootstrap_port else "")
            lines.append(f"  replaced: {i.id} ({i.role}) on {'/'.join(i.hosts)}: {self.why[i.id]}{port}")
        for o, n in self.surge:
            lines.append(f"  surge:   {o} is replaced by {n} ({self.target.get(n).url}), started before {o} drains")
        was = sorted(cordoned_hosts(cur))
        if self.cordoned != was:
            lines.append(f"  cordoned: {', '.join(self.cordoned) or 'none'} (was {', '.join(was) or 'none'}): placement "
                         "avoids these hosts until `inv uncordon --host H`")
        if self.gateway_restart:
            lines.append(f"  gateway: restarted after the instances ({len(self.gateway_restart)} of its files change: "
                         + "; ".join(c.split(' (sha256')[0] for c in self.gateway_restart) + "); what is in flight "
                         "finishes first, requests arriving while it restarts are refused, every worker registered "
                         "again from its start-up list")
        if self.admission_reload:
            lines.append("  admission layer: reloaded gracefully at the end (HAProxy's master stays, old workers "
                         "finish their streams): " + "; ".join(c.split(' (sha256')[0] for c in self.admission_reload))
        if self.waves:
            lines.append(f"  rolling: {len(self.waves)} wave(s), at most {max(self.max_unavailable, 1)} per role out "
                         "at once: " + "; ".join(", ".join(w) for w in self.waves))
        lines.append("  kept:    " + (", ".join(i.id for i in self.kept) or "none")
                     + f" (untouched: {self.kept_files} rendered files identical to revision {cur.number})")
        p0, d0 = self.start_capacity
        lines.append(f"  serving now: {p0} prefill, {d0} decode; under the cluster lock, the steps:")
        cap_after = {}
        for st in self.steps:
            last = {"add": f"register {st.instance.id}", "drain": f"drain {st.instance.id}: verify-stop",
                    "replace-out": f"replace {st.instance.id}: verify-stop",
                    "replace-in": f"register {st.instance.id}"}[st.kind]
            cap_after[last] = st.capacity
        for n, st in enumerate(self.run, 1):
            cap = cap_after.get(st.name)
            lines.append(f"    {n:2d}. {st.line()}" + (f" => serving {cap[0]} prefill, {cap[1]} decode" if cap else ""))
        rescue = rescue_steps(self)
        if rescue:
            lines.append("  if a step fails, then (rescue), and the failure is reported:")
            lines += [f"    R{n}. {st.line()}" for n, st in enumerate(rescue, 1)]
        lines.append("  whatever the outcome, last (always):")
        lines += [f"    A{n}. {st.line()}" for n, st in enumerate(always_steps(), 1)]
        mp, md = self.min_capacity()
        tp, td = len(self.target.role("prefill")), len(self.target.role("decode"))
        lines.append(f"  lowest capacity during the change: {mp} prefill (old {p0}, new {tp}), "
                     f"{md} decode (old {d0}, new {td})")
        for d in self.dip:
            lines.append(f"  capacity dip (--allow-capacity-dip): {d}")
        if any(i.role == "prefill" for i in self.removed):
            lines.append("  note: a drained prefill's prefix cache is lost: cold inputs will be slower for a while")
        return "\n".join(lines)


def _gpu_range(gpus: tuple[int, ...]) -> str:
    g = list(gpus)
    if g and g == list(range(g[0], g[-1] + 1)) and len(g) > 1:
        return f"{g[0]}-{g[-1]}"
    return ",".join(map(str, g))


def _slot_key(inst: Instance) -> tuple:
    return (inst.hosts, inst.slot)


def _gpu_set(inst: Instance) -> set[tuple[str, int]]:
    return {(r.host, g) for r in inst.ranks for g in r.gpus}


_OWN_FILE = "pdops-{id}(-r[0-9]+)?\\.(service|sh|env)$"


def instance_files(mf: dict, inst_id: str) -> dict[tuple[str, str], dict]:
    """{(host, path): {sha256, mode}} of one instance's files (unit, launch script, env) in a manifest."""
    rx = re.compile(_OWN_FILE.format(id=re.escape(inst_id)))
    return {(h, p): m for h, files in mf.items() for p, m in files.items() if rx.search(p.rsplit("/", 1)[-1])}


def _shared_files(mf: dict, ids: set[str]) -> dict[tuple[str, str], dict]:
    own = set()
    for i in ids:
        own |= set(instance_files(mf, i))
    return {(h, p): m for h, files in mf.items() for p, m in files.items() if (h, p) not in own}


def _file_changes(old: dict, new: dict) -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        if k not in new:
            out.append(f"{k[0]}:{k[1]} would be removed")
        elif k not in old:
            out.append(f"{k[0]}:{k[1]} would be added")
        elif old[k].get("sha256") != new[k].get("sha256") or old[k].get("mode") != new[k].get("mode"):
            out.append(f"{k[0]}:{k[1]} changed (sha256 {str(old[k].get('sha256'))[:12]} -> "
                       f"{str(new[k].get('sha256'))[:12]})")
    return out


def _refuse_changed_inventory(inv: Inventory, cur: Revision) -> None:
    if cur.inventory_hash != inv.digest:
        raise Refused(f"the inventory changed since revision {cur.number} was deployed "
                      f"(digest {cur.inventory_hash[:12]} -> {inv.digest[:12]})",
                      fix="restore the inventory of the running revision; a topology change keeps the inventory")


def _current(inv: Inventory, state: StateDir, what: str) -> Revision:
    cur = state.current_revision()
    if cur is None:
        raise Refused(f"{inv.cluster} has no current revision: nothing to {what}",
                      fix="deploy first (`inv deploy --topology 1p1d`)")
    return cur


def plan_change(inv: Inventory, cur: Revision, target_pl: Placement, *, allow_capacity_dip: bool = False,
                skip_checks: set[str] | None = None, rollback_of: int | None = None, max_unavailable: int = 1,
                force: bool = False, replace_ids: dict[str, str] | None = None,
                cordoned: list[str] | None = None, snapshot: dict | None = None, seen: Seen | None = None,
                restart_not_serving: bool = True) -> ScalePlan:
    """The ordered, capacity-annotated change from revision `cur` to `target_pl` (pure): each instance
    is kept (same placement, identical files), replaced (same id and slot; its files, its placement or,
    in `replace_ids`, what its processes were observed to run differ: drained, then started from the
    new files, a prefill on its slot's other bootstrap port), added or removed. Replacements roll in
    waves of at most `max_unavailable` per role; a role that would be left with no serving instance
    surges into a free slot (new id, started before the old one drains) or is refused unless `force`.

    `seen` (pdops.observe.Seen): what serves now. An instance of the revision that does not serve is
    replaced (started again), first in its role, and counts for no floor; one whose units are not
    running is not waited for (nothing runs to drain); a role of which nothing serves is said in the
    plan, not refused; a gateway that does not answer is started as the first step.
    `restart_not_serving=False` (`inv repair`, one instance): what does not serve counts for no floor
    and no canary pair, but only `replace_ids` are started again."""
    from pdops.preflight import validate_skip

    skip_checks = validate_skip(skip_checks)
    if isinstance(max_unavailable, bool) or not isinstance(max_unavailable, int) or max_unavailable < 0:
        raise InvalidInput("--max-unavailable", f"{max_unavailable!r} is not a whole number >= 0",
                           fix="instances per role out at once during a rolling change: 1 (default), or 0 to surge "
                               "every replacement into free GPUs")
    replace_ids = dict(replace_ids or {})
    cur_pl = Placement.from_dict(cur.placement)
    cur_by_id = {i.id: i for i in cur_pl.instances}
    not_serving = {k: v for k, v in (seen.not_serving if seen else {}).items() if k in cur_by_id}
    for iid, reason in not_serving.items() if restart_not_serving else ():
        replace_ids.setdefault(iid, f"observed not serving ({reason}): started again")
    tgt_ids = {i.id for i in target_pl.instances}
    # a rollback returns to the files recorded with its target (its snapshot), not to what the
    # inventory on disk renders now
    files = files_of(snapshot) if snapshot is not None else render_files(inv, target_pl)
    new_mf = manifest(files)
    # which kept ids run other files or another placement now: replaced
    why: dict[str, str] = {}
    for i in target_pl.instances:
        if i.id not in cur_by_id:
            continue
        old = cur_by_id[i.id]
        changes = _file_changes(instance_files(cur.manifest, i.id), instance_files(new_mf, i.id))
        if old.ranks != i.ranks or old.http_port != i.http_port or old.dist_init_port != i.dist_init_port:
            why[i.id] = f"moves: {'/'.join(old.hosts)} {old.url} -> {'/'.join(i.hosts)} {i.url}"
        elif changes:
            why[i.id] = f"{len(changes)} file(s) changed: " + "; ".join(c.split(" (sha256")[0] for c in changes)
        elif i.id in replace_ids:
            why[i.id] = replace_ids[i.id]
    # shared files (the gateway's, the admission layer's) must not change under a change plan
    old_sh = _shared_files(cur.manifest, set(cur_by_id))
    new_sh = _shared_files(new_mf, tgt_ids)
    shared = [c for c in _file_changes(old_sh, {k: v for k, v in new_sh.items() if k in old_sh})
              if not c.endswith("would be removed")]

    adm_paths = set()
    if inv.admission is not None:
        from pdops.render import render_admission_files

        adm_paths = {f"{f.host}:{f.path}" for f in render_admission_files(inv, inv.admission)}
    adm_changes = [c for c in shared if c.split(" ", 1)[0] in adm_paths]
    unit_changes = [c for c in adm_changes if ADMISSION_UNIT in c]
    if unit_changes:
        raise Refused(f"the change would rewrite the admission layer's unit ({ADMISSION_UNIT}) of revision "
                      f"{cur.number}: applying it means a restart, which cuts every stream through it",
                      evidence="\n".join(unit_changes),
                      fix="keep the settings that render the unit as they are for this change, or restart the "
                          "admission layer in a maintenance window")
    gateway_restart = [c for c in shared if c not in adm_changes]
    # a replaced prefill takes its slot's other bootstrap port: no decode has a cached route to it
    if snapshot is None and any(cur_by_id[i].role == "prefill" for i in why):
        from pdops.placement import remake, uses_alt_port

        target_pl = Placement(target_pl.topology, tuple(
            remake(inv, i, alt=not uses_alt_port(inv, cur_by_id[i.id])) if i.id in why and i.role == "prefill" else i
            for i in target_pl.instances))
        files = render_files(inv, target_pl)
        new_mf = manifest(files)
    # surge: a role whose every instance is replaced with nothing left serving, or --max-unavailable 0.
    # An instance the change adds on free GPUs (no removed instance holds them) is started and
    # registered before any replacement (the step order below), so it serves through them: it
    # counts, and the replacements go in place after it instead of surging.
    surge: list[tuple[str, str]] = []
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
            _gpu_set(i) & _gpu_set(r) or _slot_key(i) == _slot_key(r) for r in leaving)]
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
        files = render_files(inv, target_pl)
        new_mf = manifest(files)
        tgt_ids = {i.id for i in target_pl.instances}
    added = [i for i in target_pl.instances if i.id not in cur_by_id]
    removed = [i for i in cur_pl.instances if i.id not in tgt_ids]
    replaced = sorted((i for i in target_pl.instances if i.id in why), key=lambda i: i.id not in not_serving)
    kept = [i for i in target_pl.instances if i.id in cur_by_id and i.id not in why]
    n_kept_files = sum(len(instance_files(new_mf, i.id)) for i in kept)
    cordoned = sorted(cordoned_hosts(cur) if cordoned is None else cordoned)
    cordon_change = cordoned != sorted(cordoned_hosts(cur))
    gateway_down = bool(seen and seen.gateway)
    if not added and not removed and not replaced and not gateway_restart and not cordon_change and not adm_changes \
            and not gateway_down:
        return ScalePlan(inv, cur, cur_pl, target_pl, files, [], [], kept, [], kept_files=n_kept_files,
                         noop=f"revision {cur.number} is already {cur.topology} with this placement and these "
                              "rendered files: nothing to add, replace or drain", rollback_of=rollback_of,
                         skip_checks=skip_checks)
    # Which removals must come before which adds (the add needs GPUs or ports a removed instance holds)
    needs: dict[str, list[Instance]] = {}
    for a in added:
        held = [r for r in removed if _gpu_set(a) & _gpu_set(r) or (_slot_key(a) == _slot_key(r))]
        if held:
            needs[a.id] = held
    # capacity counts what serves now: taking out an instance that does not serve costs nothing
    p, d = (sum(i.id not in not_serving for i in cur_pl.role(r)) for r in ROLES)
    cap = {"prefill": p, "decode": d}
    serving0 = dict(cap)
    steps: list[ScaleStep] = []
    drained: set[str] = set()

    def step(kind: str, inst: Instance, why_: str = "", delta: int | None = None) -> None:
        if kind in ("drain", "replace-out") and inst.id in not_serving:
            delta = 0
        cap[inst.role] += (1 if kind == "add" else -1) if delta is None else delta
        steps.append(ScaleStep(kind, inst, (cap["prefill"], cap["decode"]), why_))

    for a in added:
        if a.id not in needs:
            step("add", a, f"surge replacement of {dict((n, o) for o, n in surge)[a.id]}"
                 if a.id in {n for _, n in surge} else "")
    # replacement waves: at most max_unavailable per role out at once (at least one: --force or surge)
    # per role: at most max_unavailable, and never all of a role's instances at once (one keeps serving)
    k = {r: min(max(max_unavailable, 1), max(sum(i.id in cur_by_id for i in target_pl.role(r)) - 1, 1))
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
            gpus = sorted(_gpu_set(a) & _gpu_set(r))
            hosts = sorted({h for h, _ in gpus})
            where = "; ".join(f"{h} GPUs {_gpu_range(tuple(g for hh, g in gpus if hh == h))}" for h in hosts)
            step("drain", r, f"frees {where} for {a.id}")
            drained.add(r.id)
            # a surge chain drains the old instance its earlier replacement already covers: no dip;
            # nor does draining one that does not serve now
            if r.id not in not_serving and (a.id not in {n for _, n in surge} or
                                            cap[r.role] < min(serving0[r.role], len(target_pl.role(r.role)))):
                dip.append(f"{a.id} ({a.role}) needs {where}, held by {r.id} ({r.role}): {r.id} is drained first; "
                           f"serving drops to {cap['prefill']} prefill + {cap['decode']} decode "
                           f"({cap['prefill'] + cap['decode']} instances) until {a.id} is registered")
        step("add", a, f"on the GPUs freed by {', '.join(r.id for r in needs[a.id])}")
    for r in removed:
        if r.id not in drained:
            step("drain", r)
            drained.add(r.id)
    new_count = {"prefill": len(target_pl.role("prefill")), "decode": len(target_pl.role("decode"))}
    old_count = {"prefill": p, "decode": d}
    zero, broken = [], []
    for role_i, role in enumerate(ROLES):
        # a rolling replacement's own dip (at most max_unavailable) is the plan's, not a capacity dip
        low = min((s.capacity[role_i] for s in steps if not s.kind.startswith("replace")), default=old_count[role])
        if low < min(old_count[role], new_count[role]):
            dip.append(f"{role} capacity drops to {low} (old {old_count[role]}, new {new_count[role]})")
        if old_count[role] == 0:  # a floor already broken: the change is the way back, not refused
            first = next((s.instance.id for s in steps if s.instance.role == role and s.kind in ("add", "replace-in")),
                         None)
            broken.append(f"no {role} serves now" + (f" ({', '.join(i for i in not_serving if cur_by_id[i].role == role)} "
                                                    "observed not serving)" if cur_pl.role(role) else "")
                          + (f": this change brings {first} up first" if first else ": this change starts none"))
        elif min((s.capacity[role_i] for s in steps), default=old_count[role]) < 1:
            zero.append(role)
    plan = ScalePlan(inv, cur, cur_pl, target_pl, files, added, removed, kept, steps, dip=dip,
                     rollback_of=rollback_of, skip_checks=skip_checks, kept_files=n_kept_files,
                     replaced=replaced, why=why, waves=[[i.id for i in w] for w in waves], surge=surge,
                     max_unavailable=max_unavailable, gateway_restart=gateway_restart, cordoned=cordoned,
                     base_snapshot=snapshot, admission_reload=adm_changes, seen=seen, broken=broken)
    plan.run = runner_steps(plan)
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


def _surge(inv: Inventory, target_pl: Placement, reps: list[Instance], cur_pl: Placement, role: str,
           chained: bool = False):
    """Each of `reps` replaced by a new instance (the lowest unused id), started before the old one
    drains: on a free slot, then on the slot the previous surge's old instance frees (a chain: one
    free slot is enough; the planner orders each drain before the add that needs its GPUs). A
    prefill on a slot an instance of `cur_pl` holds takes the other bootstrap port. (pl, None):
    no free slot at all."""

    in_target = {_slot_key(i) for i in target_pl.instances if i not in reps}
    tgt_ids = {i.id for i in target_pl.instances if i not in reps}
    held_now = {_slot_key(i) for i in cur_pl.instances}
    key = lambda sl: (tuple(h.name for h in sl[0]), sl[1])  # noqa: E731
    free = [sl for sl in gpu_slots(inv) if key(sl) not in in_target and key(sl) not in held_now]
    # slots an instance leaving the placement holds: free once it drained (an earlier surge in this
    # change covers it), the chain's next links
    freed = [sl for sl in gpu_slots(inv) if key(sl) not in in_target and key(sl) in held_now and
             all(i.id not in tgt_ids for i in cur_pl.instances if _slot_key(i) == key(sl))
             and not any(_slot_key(r) == key(sl) for r in reps)]
    if not free and not (chained and freed):
        return target_pl, None
    free += freed
    by_key = {(tuple(h.name for h in sl[0]), sl[1]): sl for sl in gpu_slots(inv)}
    held = {_slot_key(i): i for i in cur_pl.instances}
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
        free.append(by_key[_slot_key(old)])  # freed once `old` drains
    insts.sort(key=lambda i: (ROLES.index(i.role), int(i.id[1:])))
    return Placement(target_pl.topology, tuple(insts)), made


def plan_apply(inv: Inventory, target: Topology, state: StateDir, *, allow_capacity_dip: bool = False,
               skip_checks: set[str] | None = None, max_unavailable: int = 1, force: bool = False,
               replace_ids: dict[str, str] | None = None, avoid: frozenset[str] | None = None,
               seen: Seen | None = None) -> ScalePlan:
    """What `inv deploy --topology T` (or `inv scale`) does on a live cluster: the smallest change from
    the current revision to what the inventory, `target` and this pdops render now. Reads only the record."""
    from pdops.placement import place_change

    cur = _current(inv, state, "change")
    cur_pl = Placement.from_dict(cur.placement)
    cordoned = frozenset(avoid if avoid is not None else cordoned_hosts(cur))
    target_pl = place_change(inv, target, cur_pl, avoid=cordoned, last_ports=(cur.extra or {}).get("last_bootstrap"))
    return plan_change(inv, cur, target_pl, allow_capacity_dip=allow_capacity_dip, skip_checks=skip_checks,
                       max_unavailable=max_unavailable, force=force, replace_ids=replace_ids, seen=seen)


def cordoned_hosts(rev: Revision) -> list[str]:
    return list((rev.extra or {}).get("cordoned", []))


def plan_drain_host(inv: Inventory, state: StateDir, host: str, *, force: bool = False,
                    skip_checks: set[str] | None = None, seen: Seen | None = None) -> ScalePlan:
    """`inv drain --host H` (maintenance): every instance with a rank on H leaves it. Where free
    slots off the cordoned hosts allow, each is replaced there first (a new id, started and
    registered before the old one drains); else it is drained and the role shrinks, refused when a
    role would be left with no serving instance unless `force`. H is cordoned in the revision."""

    inv.host(host)  # InvalidInput naming the hosts when unknown
    cur = _current(inv, state, "drain")
    cur_pl = Placement.from_dict(cur.placement)
    cordoned = sorted(set(cordoned_hosts(cur)) | {host})
    leaving = [i for i in cur_pl.instances if host in i.hosts]
    staying = [i for i in cur_pl.instances if host not in i.hosts]
    used = {_slot_key(i) for i in cur_pl.instances}
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
    plan = plan_change(inv, cur, target, skip_checks=skip_checks, force=force, cordoned=cordoned,
                       allow_capacity_dip=True, seen=seen)
    plan.surge = moved
    return plan


def plan_uncordon(inv: Inventory, state: StateDir, host: str) -> ScalePlan:
    """`inv uncordon --host H`: placement may use H again (nothing starts there by itself)."""
    inv.host(host)
    cur = _current(inv, state, "uncordon")
    was = cordoned_hosts(cur)
    if host not in was:
        raise Refused(f"{host} is not cordoned in revision {cur.number} (cordoned: {', '.join(was) or 'none'})",
                      fix="`inv status` shows the cordoned hosts")
    return plan_change(inv, cur, Placement.from_dict(cur.placement), cordoned=[h for h in was if h != host])


def plan_scale(inv: Inventory, target: Topology, state: StateDir, *, allow_capacity_dip: bool = False,
               skip_checks: set[str] | None = None, max_unavailable: int = 1, force: bool = False,
               seen: Seen | None = None) -> ScalePlan:
    """`inv scale --topology T`: the same planner as `inv deploy` of a live cluster (plan_apply)."""
    return plan_apply(inv, target, state, allow_capacity_dip=allow_capacity_dip, skip_checks=skip_checks,
                      max_unavailable=max_unavailable, force=force, seen=seen)


def rollback_conditions(inv: Inventory, cur: Revision, tgt: Revision) -> list[str]:
    """What changed since `tgt` that makes returning to it unsafe (empty: the conditions hold)."""
    changed: list[str] = []
    if tgt.inventory_hash != inv.digest:
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
            from pdops.placement import place_change

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
                            _file_changes(instance_files(tgt.manifest, i.id), instance_files(new_mf, i.id))]
    return changed


def plan_rollback(inv: Inventory, state: StateDir, to: int | None = None, *, allow_capacity_dip: bool = False,
                  skip_checks: set[str] | None = None, max_unavailable: int = 1, force: bool = False,
                  seen: Seen | None = None) -> ScalePlan:
    """A change back to the previous deployed revision (or revision `to`): to its recorded placement
    and the files recorded with it (its snapshot), whatever the inventory on disk renders now; only
    its hosts must still be in the inventory (to be reached). A revision recorded before snapshots:
    returned to only while the inventory and the rendering are unchanged (Refused naming what changed)."""
    cur = _current(inv, state, "roll back")
    if to is None:
        tgt = state.previous()
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
        tgt = state.read_revision(n)
        if tgt.outcome != "deployed":
            raise Refused(f"revision {n} ended '{tgt.outcome}': only a deployed revision can be returned to",
                          fix="choose a revision whose outcome is deployed (`inv history`)")
    snap = state.revision_snapshot(tgt.number)
    if snap is not None:
        tgt_pl = Placement.from_dict(tgt.placement)
        known = {h.name for h in inv.hosts}
        gone = sorted({h for i in tgt_pl.instances for h in i.hosts} - known)
        if gone:
            raise Refused(f"cannot roll back to revision {tgt.number}: its hosts {', '.join(gone)} are not in the "
                          "inventory, so they cannot be reached", fix="add them back to the inventory (the files and "
                          f"placement of revision {tgt.number} are recorded; only the hosts' addresses are read from it)")
        plan = plan_change(inv, cur, tgt_pl, allow_capacity_dip=allow_capacity_dip, skip_checks=skip_checks,
                           rollback_of=tgt.number, snapshot=snap, max_unavailable=max_unavailable, force=force,
                           seen=seen)
        plan.rollback_inventory_hash = tgt.inventory_hash
        return plan
    _refuse_changed_inventory(inv, cur)
    changed = rollback_conditions(inv, cur, tgt)
    if changed:
        raise Refused(f"cannot roll back to revision {tgt.number} ({tgt.topology}): its rollback conditions no "
                      "longer hold", evidence="\n".join(changed),
                      fix="restore what changed, or plan the change as a new scale (`inv scale --topology "
                          f"{tgt.topology}`)")
    return plan_change(inv, cur, Placement.from_dict(tgt.placement), allow_capacity_dip=allow_capacity_dip,
                       skip_checks=skip_checks, rollback_of=tgt.number, seen=seen)


def runner_steps(plan: ScalePlan) -> list[Step]:
    """The steps the runner walks for a change (pure): connect, preflight, render, deliver; then
    each add (consecutive adds start in parallel; each is canaried with the pairs it will serve,
    then registered) and each drain (the drain sub-plan, ids prefixed `drain <id>: `); record."""
    from pdops.deploy import canary_step, connect_step, delivery_steps, preflight_step, register_steps, start_steps
    from pdops.drain import drain_steps

    inv, cur, tgt = plan.inv, plan.current, plan.target
    first = gateway_start_steps(plan)
    if not plan.steps and not plan.gateway_restart and not plan.admission_reload:
        # only the cordons change: what runs is checked, then the revision records them
        from pdops.deploy import verify_running_step

        return first + [verify_running_step(tgt, inv),
                        Step("record", None, f"record revision ({tgt.topology}) with hosts cordoned: "
                             f"{', '.join(plan.cordoned) or 'none'}; move `current` to it", kind="record-scale")]
    # instances that take GPUs a removed one holds are checked after that one is drained (its ports
    # and GPUs are busy now, by design): preflight checks the others
    later = {s.instance.id for s in plan.steps if s.kind == "add" and s.why and not s.why.startswith("surge")}
    later |= {i.id for i in plan.replaced}  # their ports are the running processes' until the wave drains them
    pre = tuple(i for i in tgt.instances if i.id not in later)
    pre_pl = Placement(Topology(sum(i.role == "prefill" for i in pre), sum(i.role == "decode" for i in pre)), pre)
    out = [connect_step(plan.hosts)] + first + [preflight_step(plan.skip_checks, pre_pl, plan.current_placement)]
    out += delivery_steps(inv, tgt, plan.files, {"topology": str(tgt.topology), "from": cur.number})
    if plan.replaced:
        out[-1].params["hold"] = [i.id for i in plan.replaced]
        out[-1].description += (f"; not yet the files of {', '.join(i.id for i in plan.replaced)}: each gets its "
                                "own files in its wave, after its old process stopped")
    live = {i.id for i in plan.current_placement.instances} - set(plan.seen.not_serving if plan.seen else ())
    down = plan.seen.down if plan.seen else frozenset()
    interval = float(inv.vars.get("pdops_empty_check_interval_s", 5))
    i, batch_no = 0, 0
    while i < len(plan.steps):
        batch = []
        while i < len(plan.steps) and plan.steps[i].kind == "add":
            batch.append(plan.steps[i].instance)
            i += 1
        if batch:
            batch_no += 1
            out += start_steps(inv, batch, restart=False, group=f"start-{batch_no}" if len(batch) > 1 else None)
            for x in batch:
                other = "decode" if x.role == "prefill" else "prefill"
                peers = [o for o in tgt.role(other) if o.id in live]
                pairs = [(x.id, o.id) if x.role == "prefill" else (o.id, x.id) for o in peers]
                if pairs:
                    out.append(canary_step(f"canary {x.id}", pairs, retry_once=True, instance=x.id,
                                           why="straight to each pair before it is registered (one retry per pair)"))
                out += register_steps(inv, [x], group=None)
                live.add(x.id)
            continue
        if plan.steps[i].kind == "replace-out":
            wave = []
            while i < len(plan.steps) and plan.steps[i].kind.startswith("replace"):
                if plan.steps[i].kind == "replace-out":
                    wave.append(plan.steps[i].instance)
                i += 1
                if i < len(plan.steps) and plan.steps[i].kind == "replace-out" and \
                        plan.steps[i - 1].kind == "replace-in":
                    break  # the next wave
            out += wave_steps(plan, wave, live)
            continue
        s = plan.steps[i]
        i += 1
        wid = (cur.instances.get(s.instance.id) or {}).get("worker_id")
        out += drain_steps(inv, s.instance, wid, wait_s=float(inv.drain_budget_s), interval_s=interval,
                           prefix=f"drain {s.instance.id}: ", in_change=True, wait=s.instance.id not in down)
        live.discard(s.instance.id)
    from pdops.deploy import verify_running_step
    from pdops.render import GATEWAY_UNIT, gateway_grace_s

    if plan.gateway_restart:
        out.append(Step("gateway-restart", inv.gateway.host, f"systemctl restart {GATEWAY_UNIT}: smg finishes what is "
                        f"in flight (up to {gateway_grace_s(inv)}s), the new process starts from the new files and "
                        "registers every worker of its start-up list; wait until /workers lists each healthy and ready"
                        + (f"; the admission layer on {inv.admission.host} keeps the gateway in service meanwhile "
                           "(HAProxy's health check of it paused through the runtime API until the new gateway "
                           "lists every worker healthy, resumed whatever the outcome; refused connections retried)" if inv.admission else ""),
                        gateway_grace_s(inv) + 120, kind="gateway-restart",
                        params={"instances": [i.id for i in tgt.instances],
                                "admission_host": inv.admission.host if inv.admission else None}))
    if plan.admission_reload:
        host = inv.admission.host
        out.append(Step("admission-check", host, f"{ADMISSION_UNIT} is active; its master's MainPID", 30,
                        kind="admission-check"))
        out.append(Step("admission-reload", host, f"systemctl reload {ADMISSION_UNIT} (haproxy -c, then USR2: old "
                        "workers finish their streams); the master MainPID must stay", 60, kind="admission-reload"))
    rep = plan.repair or {}
    if rep and plan.current_placement.get(rep["instance"]).role == "decode":
        # the halves the ended decode process left on the prefills wait for a side that is gone
        out.append(orphans.end_step([p.id for p in tgt.role("prefill")]))
    out.append(verify_running_step(tgt, inv))
    out.append(Step("record", None, f"record revision ({tgt.topology}) with the rollback record; move `current` to it",
                    kind="record-scale"))
    return out


def gateway_start_steps(plan: ScalePlan) -> list[Step]:
    """A gateway observed not answering is started before anything else (it registers its start-up
    list itself after each start); the change goes on once it lists every instance that serves."""
    seen = plan.seen
    if not seen or not seen.gateway:
        return []
    from pdops.render import GATEWAY_UNIT

    inv = plan.inv
    serving = {i.id: i.url for i in plan.current_placement.instances if i.id not in seen.not_serving}
    # what this change starts again leaves the start-up list first: a worker the gateway queues while
    # its engine is down is retried in the background and may be listed later with its old identity
    # (a prefill's old bootstrap port); each is listed again once registered
    unlist = [i for i in seen.not_serving if i in {x.id for x in plan.replaced + plan.removed}]
    verb = "restart" if seen.gateway_active else "start"
    return [Step("gateway", inv.gateway.host, f"observed: {seen.gateway}; "
                 + (f"{', '.join(unlist)} out of its start-up list (started again by this change, listed again once "
                    "registered); " if unlist else "")
                 + f"{verb} {GATEWAY_UNIT} (after each start it registers its start-up list), wait for "
                 f"{inv.gateway.url}/health" + (f" and until it lists {', '.join(serving)} healthy and ready"
                                                if serving else ""),
                 60 + 15 * len(serving), kind="gateway",
                 params={"restart": seen.gateway_active, "clear_list": False, "wait_for": serving, "unlist": unlist})]


def wave_steps(plan: ScalePlan, wave: list[Instance], live: set[str]) -> list[Step]:
    """One wave of a rolling replacement: drain the wave's running processes side by side (the drain
    sub-plan of each, step for step in parallel), deliver their new files, start them, canary every
    pair through them, register them. `live` (ids serving) is updated."""
    from pdops.deploy import canary_step, register_steps, start_steps
    from pdops.drain import drain_steps

    inv, cur = plan.inv, plan.current
    old = {i.id: i for i in plan.current_placement.instances}
    down = plan.seen.down if plan.seen else frozenset()
    ids = [i.id for i in wave]
    tag = "+".join(ids)
    interval = float(inv.vars.get("pdops_empty_check_interval_s", 5))
    rep = plan.repair or {}
    subs = [drain_steps(inv, old[i.id], (cur.instances.get(i.id) or {}).get("worker_id"),
                        wait_s=float(rep.get("wait_s") or inv.drain_budget_s), interval_s=interval,
                        prefix=f"replace {i.id}: ", in_change=True, extra={"old": True},
                        force_after=bool(rep.get("force_after")),
                        wait=not (rep.get("down") and rep.get("instance") == i.id) and i.id not in down) for i in wave]
    out: list[Step] = []
    for i in wave:
        if rep.get("instance") == i.id:
            from pdops.repair import lost_work_step

            out.append(lost_work_step(old[i.id], rep))
    for n, row in enumerate(zip(*subs)):
        for st in row:
            st.group = f"out {tag} {n}" if len(row) > 1 else None
            out.append(st)
    live -= set(ids)
    out.append(Step(f"deliver {tag}", None, f"the new files of {', '.join(ids)} (units, launch scripts, 0600 env "
                    "files) with Ansible; daemon-reload; enable", kind="deliver-wave", params={"instances": ids}))
    out += start_steps(inv, wave, restart=False, group=f"start {tag}" if len(wave) > 1 else None)
    pairs = []
    for p in plan.target.role("prefill"):
        for d in plan.target.role("decode"):
            if {p.id, d.id} & set(ids) and {p.id, d.id} <= live | set(ids):
                pairs.append((p.id, d.id))
    if pairs:
        out.append(canary_step(f"canary {tag}", pairs, retry_once=True, instance=ids[0] if len(ids) == 1 else None,
                               why="straight to each pair before registration (no decode knows the new bootstrap "
                                   "address; one retry per pair all the same)"))
    out += register_steps(inv, wave, group=f"register {tag}" if len(wave) > 1 else None)
    live |= set(ids)
    return out


def union_placement(plan: ScalePlan) -> Placement:
    """Every instance a change names (kept, added and removed), for the executors' lookups; a replaced
    one as it will run (its running process: `old_placement`)."""
    ids = {i.id for i in plan.target.instances}
    return Placement(plan.target.topology, plan.target.instances
                     + tuple(i for i in plan.current_placement.instances if i.id not in ids))


def _admission_health_check(pool, host: str, *, paused: bool) -> None:
    """Pause or resume HAProxy's health check of the gateway (runtime API); Unverified with the
    way out when HAProxy answers anything but its empty success."""
    answer = pool.run(host, health_pause_command(paused), timeout=15).stdout.strip()
    if answer:
        verb = "pause" if paused else "resume"
        raise Unverified(f"admission layer on {host}: HAProxy did not {verb} its health check of the gateway: {answer}",
                         fix=f"systemctl reload {ADMISSION_UNIT} on {host} re-reads its config (checks on); "
                             "then run the change again")


def do_gateway_restart(ctx: RunContext, step: Step) -> Outcome:
    """Restart the gateway on its new files; every instance of the target back in its /workers."""
    from pdops.facts import q
    from pdops.gateway import deadline_in
    from pdops.render import GATEWAY_UNIT

    inv, pool, gw = ctx.inv, ctx.pool, ctx.gateway
    old_pid = pool.unit_states(inv.gateway.host, [GATEWAY_UNIT])[GATEWAY_UNIT].main_pid
    adm_host = step.params.get("admission_host")
    if adm_host:
        _admission_health_check(pool, adm_host, paused=True)
    t0 = time.monotonic()
    try:
        pool.run(inv.gateway.host, f"systemctl restart {q(GATEWAY_UNIT)}", timeout=step.deadline)
        restarted_s = round(time.monotonic() - t0, 2)
        st = pool.unit_states(inv.gateway.host, [GATEWAY_UNIT])[GATEWAY_UNIT]
        if st.active_state != "active" or st.main_pid == old_pid:
            raise Unverified(f"gateway {GATEWAY_UNIT} is {st.active_state}/{st.sub_state} (MainPID {st.main_pid}, was "
                             f"{old_pid}) after the restart", evidence=pool.journal_tail(inv.gateway.host, GATEWAY_UNIT))
        deadline = deadline_in(max(step.deadline - (time.monotonic() - t0), 30))
        pl = ctx.data["placement"]
        for iid in step.params["instances"]:
            gw.wait_worker_healthy(pl.get(iid).url, deadline)
    except BaseException:
        if adm_host:  # back whatever the restart did: HAProxy must see a gateway that is really down
            try:
                _admission_health_check(pool, adm_host, paused=False)
            except PdopsError as exc:
                ctx.say(f"  also: {exc.message}; fix: {exc.fix}")
        raise
    if adm_host:  # resumed once the new gateway serves: a check in its start-up would mark it DOWN
        _admission_health_check(pool, adm_host, paused=False)
    ctx.say(f"  gateway restarted in {restarted_s}s (MainPID {old_pid} -> {st.main_pid}); "
            f"{len(step.params['instances'])} worker(s) healthy and ready again")
    held = ([f"the admission layer on {adm_host} kept the gateway in service through the restart (HAProxy's "
             "health check of it paused, then resumed: both acknowledged)"] if adm_host else [])
    return Outcome(evidence={"old_main_pid": old_pid, "main_pid": st.main_pid, "restart_s": restarted_s,
                             "ready_s": round(time.monotonic() - t0, 2),
                             **({"admission_health_check": f"paused and resumed on {adm_host}"} if adm_host else {})},
                   verified=[f"gateway restarted from the new files (MainPID {st.main_pid}); every instance listed "
                             "healthy and ready by /workers again"] + held)


def do_deliver_wave(ctx: RunContext, step: Step) -> Outcome:
    """The own files of a wave's instances (their old processes are stopped by now)."""
    from pdops.deploy import deliver

    plan: ScalePlan = ctx.data["scale_plan"]
    ids = step.params["instances"]
    own = set()
    mf = manifest(plan.files)
    for i in ids:
        own |= set(instance_files(mf, i))
    files = [f for f in plan.files if (f.host, f.path) in own]
    sub = Placement(plan.target.topology, tuple(plan.target.get(i) for i in ids))
    ev = deliver(ctx.inv, sub, files, ctx.data["build"], None, ctx.say)
    return Outcome(evidence=ev, verified=[f"the new files of {', '.join(ids)} in place (Ansible)"])


def do_record_scale(ctx: RunContext, step: Step) -> Outcome:
    plan: ScalePlan = ctx.data["scale_plan"]
    rev = _record(plan, ctx.state, ctx.op, ctx.data.get("workers", {}), ctx.data.get("build"), ctx.data.get("main_pids"),
                  ctx.data.get("running"))
    ctx.state.set_current(rev.number)
    ctx.data["verdict"] = {"revision": rev.number, "topology": str(plan.target.topology)}
    return Outcome(evidence={"revision": rev.number},
                   verified=[f"revision {rev.number} ({plan.target.topology}) recorded and current; kept "
                             f"{', '.join(i.id for i in plan.kept) or 'none'} untouched "
                             f"({plan.kept_files} rendered files identical)"])


# the kinds made here; a change also walks deploy's, drain's, repair's and the admission layer's
# kinds, registered by those modules (imported at the top of this one)
register_executors({"record-scale": do_record_scale, "deliver-wave": do_deliver_wave, "gateway-restart": do_gateway_restart})


def execute_scale(plan: ScalePlan, state: StateDir, say: Say = print, *, pool: HostPool,
                  gateway: GatewayClient) -> dict:
    """Walk a scale or rollback plan with the runner; returns the verdict (with the new revision).
    Raises ScaleFailed with a verdict on failure, after undoing what it can."""
    if plan.noop:
        raise Refused(f"nothing to do: {plan.noop}")
    kind = plan.operation
    op = new_op_id(kind)
    with state.lock(kind, op_id=op):
        state.check_basis(plan.current.number)
        return walk_scale(plan, state, op, say, pool=pool, gateway=gateway)


def walk_scale(plan: ScalePlan, state: StateDir, op: str, say: Say = print, *, pool: HostPool,
               gateway: GatewayClient) -> dict:
    """Walk a change plan under a lock the caller holds (`execute_scale`, or `inv probe` between its
    own steps); the verdict, or ScaleFailed with the failure verdict its rescue steps wrote."""
    ctx = RunContext(plan.inv, state, op, say, pool, gateway, {"placement": union_placement(plan), "scale_plan": plan,
                                                               "old_placement": plan.current_placement,
                                                               "replacing": {i.id for i in plan.replaced},
                                                               "target": plan.target})
    try:
        verdict = walk(plan.plan, ctx)
    except PdopsError as exc:
        if isinstance(exc, DeployFailed):  # a shared step (start, canary, register) failed in a change
            exc = ScaleFailed(exc.message, evidence=exc.evidence, fix=exc.fix)
        exc.message += "\n" + ctx.data.get("halt_verdict", "verdict: the rescue did not finish (see the journal: "
                                                            f"`inv history --op {op}`); read `inv status`")
        raise exc from None
    ctx.journal.step(op, "verdict", "ok", verdict)
    return verdict


def undo_steps(inst: Instance, plan: ScalePlan, *, registered: bool, listened: bool, worker_id: str | None) -> list[Step]:
    """Undo of one added instance: drain it if it was registered, else the verified stop alone."""
    from pdops.drain import drain_steps

    inv = plan.inv
    return drain_steps(inv, inst, worker_id, wait_s=float(inv.drain_budget_s),
                       interval_s=float(inv.vars.get("pdops_empty_check_interval_s", 5)), gateway=registered,
                       prefix=f"undo {inst.id}: ", check_ports=listened, resume=False)


def _instances_doc(plan: ScalePlan, pl: Placement, workers: dict[str, str | None],
                   main_pids: dict | None = None) -> dict:
    """Each instance's record: kept ones as recorded, added ones new; the MainPIDs of what this
    change started (pdops.observe compares them with what systemd reports later)."""
    out = {}
    main_pids = main_pids or {}
    for i in pl.instances:
        if i.id in plan.current.instances and i.id not in plan.why:
            out[i.id] = dict(plan.current.instances[i.id])
            if i.id in workers:
                out[i.id]["worker_id"] = workers[i.id]
        else:
            out[i.id] = {"role": i.role, "hosts": list(i.hosts), "units": [list(u) for u in i.units],
                         "worker_id": workers.get(i.id), "url": i.url}
        if i.id in main_pids:
            out[i.id]["main_pids"] = main_pids[i.id]
    return out


def _record(plan: ScalePlan, state: StateDir, op: str, workers: dict, build, main_pids: dict | None = None,
            running: dict | None = None) -> Revision:
    from pdops.deploy import configs_of, gateway_pid_of

    cur, tgt = plan.current, plan.target
    new_mf = manifest(plan.files)
    rollback = {
        "to_revision": cur.number, "to_topology": cur.topology,
        "restore": [i.id for i in plan.removed], "drain": [i.id for i in plan.added],
        "replace": [i.id for i in plan.replaced],
        "how": "`inv rollback`: add back what was removed (start, health-gate, canary, register), then drain what "
               "was added",
        "holds_while": f"the inventory digest is {cur.inventory_hash[:12]} and the rendered files of the restored "
                       f"instances match revision {cur.number}'s manifest",
        "inventory_hash": cur.inventory_hash,
        "files": {f"{h}:{p}": m for i in plan.removed for (h, p), m in instance_files(cur.manifest, i.id).items()},
    }
    extra = {"gateway": plan.inv.gateway.url, "build": str(build) if build else None, "rollback": rollback,
             "configs": configs_of(running or {}), **gateway_pid_of(running or {}, plan.inv),
             "cordoned": list(plan.cordoned),
             "last_bootstrap": last_bootstrap_ports((cur.extra or {}).get("last_bootstrap") or
                                                    last_bootstrap_ports({}, plan.current_placement), tgt),
             "scale": {"from_revision": cur.number, "from_topology": cur.topology,
                       "added": [i.id for i in plan.added], "removed": [i.id for i in plan.removed],
                       "replaced": {i.id: plan.why[i.id] for i in plan.replaced}, "surge": plan.surge,
                       "kept": [i.id for i in plan.kept], "capacity_dip": plan.dip}}
    if plan.rollback_of:
        extra["rollback_of"] = plan.rollback_of
    if plan.repair:
        extra["repair"] = {k: plan.repair.get(k) for k in ("instance", "state", "reasons", "lost", "failed")}
    if plan.base_snapshot is not None:  # a rollback: what runs is the target's rendering
        snap = {**plan.base_snapshot, "files": snapshot_of(plan.inv, plan.files)["files"]}
        inv_hash = plan.rollback_inventory_hash or plan.inv.digest
    else:
        snap, inv_hash = snapshot_of(plan.inv, plan.files), plan.inv.digest
    return state.write_revision(topology=str(tgt.topology), inventory_hash=inv_hash,
                                placement=tgt.to_dict(), manifest=new_mf,
                                instances=_instances_doc(plan, tgt, workers, main_pids), outcome="deployed", op_id=op,
                                extra=extra, snapshot=snap)


# ---------------------------------------------------------------- a halted change (the plan's rescue)
#
# What a failed step leaves is read from what the walk did (the steps that ran) and from what the
# hosts and the gateway report now; the three rescue steps are declared by the plan and printed by
# `--dry-run`: R1 undoes what the change added and cannot keep, R2 puts back in service every
# instance the change took out of the gateway but did not stop, R3 records what runs.

def rescue_steps(plan: ScalePlan) -> list[Step]:
    """The rescue of a change (pure): which instances each rescue step may touch is decided here;
    which of them it does touch depends on how far the walk got, and each step names the steps it
    reads that from."""
    if plan.noop or not (plan.steps or plan.gateway_restart or plan.admission_reload):
        return []
    inv = plan.inv
    out: list[Step] = []
    started = [s.instance.id for s in plan.steps if s.kind in ("add", "replace-in")]
    if started:
        budget = float(inv.drain_budget_s) + inv.stop_timeout_s + 180
        out.append(Step("undo-added", None, f"each of {', '.join(started)} that its `start` step started: kept if it "
                        "serves in place of one already drained or replaced (its `register` step passed), otherwise "
                        "drained if its `register` step ran (leave the gateway, wait empty, verified stop), else the "
                        "verified stop alone", budget * len(started), kind="undo-added",
                        params={"instances": started}))
    taken_out = [s.instance.id for s in plan.steps if s.kind in ("drain", "replace-out")]
    if taken_out:
        out.append(Step("restore-service", inv.gateway.host, f"each of {', '.join(taken_out)} whose `leave-gateway` "
                        "step ran and whose `stop` step did not: if its units are active and its /health answers, a "
                        "canary through it and the instances the gateway serves, then registered again and back in "
                        "the gateway's start-up list; otherwise named out of service",
                        120 + 60 * len(taken_out), kind="restore-service", params={"instances": taken_out}))
    out.append(Step("record-halt", None, f"if the walk stopped or replaced an instance: record a `partial` revision "
                    "that describes what runs (replaced instances by their new files, the others by revision "
                    f"{plan.current.number}'s), and move `current` to it; otherwise "
                    f"revision {plan.current.number} stays current. The verdict names what was replaced, restored, "
                    "undone and left out of service", 60, kind="record-halt"))
    return out


def do_undo_added(ctx: RunContext, step: Step) -> Outcome:
    """R1: an added instance that is registered stays only if a drain or a replacement already
    happened (undoing it would drop capacity further); a replaced instance registered with its new
    files serves on. Everything else this change started is drained (if registered) or stopped."""
    plan: ScalePlan = ctx.data["scale_plan"]
    d = ctx.data
    started = {i: inst for i, inst in d.get("started_instances", {}).items() if i in step.params["instances"]}
    workers, posted, healthy = d.get("workers", {}), d.get("posted", set()), d.get("healthy", set())
    changed = d.get("drained") or d.get("replaced_out")
    replaced_ids = {i.id for i in plan.replaced}
    kept, undone, left = [], [], []
    for iid, inst in reversed(list(started.items())):
        if (changed or iid in replaced_ids) and iid in workers:
            kept.append(iid)
            continue
        try:
            run_steps(undo_steps(inst, plan, registered=iid in posted, listened=iid in healthy,
                                 worker_id=workers.get(iid)), ctx, progress=False)
            undone.append(f"{iid} (drained and stopped, verified)" if iid in posted
                          else f"{iid} (never registered; stopped, verified)")
        except PdopsError as e2:
            left.append(f"{iid}: undo failed: {e2.message}")
    d["halt"] = {**d.get("halt", {}), "kept_added": kept, "undone": undone, "left": left}
    if not started:
        return Outcome.noop("no start step ran")
    if left:
        exc = Unverified("not every added instance was undone", evidence="\n".join(left))
        exc.journal_evidence = {"kept": kept, "undone": undone, "left": left}
        raise exc
    return Outcome(evidence={"kept": kept, "undone": undone},
                   verified=[f"undone: {u}" for u in undone] + [f"kept, serving: {k}" for k in kept])


def do_restore_service(ctx: RunContext, step: Step) -> Outcome:
    """R2: an instance out of the gateway whose process was not stopped goes back in service, after
    a canary through it; one whose units are not active (or whose /health does not answer) is named
    out of service. Read from systemd, the instance and the gateway now."""
    from pdops.deploy import canary_pairs, register
    from pdops.hosts import http_json

    d = ctx.data
    stopped = set(d.get("drained", [])) | set(d.get("replaced_out", []))
    cands = [i for i in step.params["instances"] if i in d.get("left_gateway", []) and i not in stopped]
    halt = d.setdefault("halt", {})
    if not cands:
        return Outcome.noop("no instance left the gateway without being stopped")
    old: Placement = d["old_placement"]
    running, down = [], []
    for iid in cands:
        inst = old.get(iid)
        states = [ctx.pool.unit_states(h, [u])[u] for h, u in inst.units]
        try:
            health = http_json("GET", f"{inst.url}/health", timeout=5)[0]
        except PdopsError:
            health = None
        (running if all(st.is_active for st in states) and health == 200 else down).append(inst)
    halt["down"] = [i.id for i in down]
    deadline = ctx.deadline(step)
    by_url = {i.url.rstrip("/"): i for i in union_placement(d["scale_plan"]).instances + old.instances}
    serving_now = [by_url[w.url.rstrip("/")] for w in ctx.gateway.list_workers()
                   if w.routable and w.url.rstrip("/") in by_url]
    restored: dict[str, str] = {}
    failed: list[str] = [f"{i.id}: units not active or /health not answering" for i in down]
    back = list(running)
    if back:
        pairs = []
        for x in back:
            for o in serving_now + back:
                if o.role != x.role and o.id != x.id:
                    pair = (x, o) if x.role == "prefill" else (o, x)
                    if pair not in pairs:
                        pairs.append(pair)
        if pairs:
            try:
                canary_pairs(pairs, ctx.say, retry_once=True, deadline_s=max(deadline - time.monotonic(), 30))
            except PdopsError as exc:
                failed += [f"{x.id}: canary failed: {exc.message}" for x in back]
                back = []
    for x in back:
        try:  # register() waits out the worker the drain left draining at this URL
            restored[x.id] = register(ctx.gateway, x, ctx.say, max(deadline - time.monotonic(), 15))
        except PdopsError as exc:
            failed.append(f"{x.id}: not registered again: {exc.message}")
    if restored:
        membership.update(ctx.pool, ctx.inv, add=[old.get(i) for i in restored])
        d.setdefault("workers", {}).update(restored)
    halt["restored"] = sorted(restored)
    halt["not_restored"] = failed
    ev = {"restored": restored, "not_restored": failed}
    if failed and not restored:
        exc = Unverified("no instance taken out of the gateway could be put back", evidence="\n".join(failed))
        exc.journal_evidence = ev
        raise exc
    return Outcome(evidence=ev, verified=[f"{i} back in service: canaried, registered (worker {w}), in the "
                                          "gateway's start-up list" for i, w in restored.items()],
                   unverified=[f"not back in service: {f}" for f in failed])


def do_record_halt(ctx: RunContext, step: Step) -> Outcome:
    """R3: what runs after the rescue, recorded (a `partial` revision when something was stopped or
    replaced), and the failure verdict journalled."""
    plan: ScalePlan = ctx.data["scale_plan"]
    exc = ctx.failure
    err = exc if isinstance(exc, PdopsError) else PdopsError(f"{type(exc).__name__}: {exc}")
    d = ctx.data
    halt = d.setdefault("halt", {})
    removed_ids = {i.id for i in plan.removed} | {i.id for i in plan.replaced}
    drained = [i for i in d.get("drained", []) if i in removed_ids]
    replaced_out = list(d.get("replaced_out", []))
    down = list(halt.get("down", []))
    restored = list(halt.get("restored", []))
    out_of_gateway = [i for i in d.get("left_gateway", []) if i not in drained and i not in replaced_out
                      and i not in down and i not in restored]
    if replaced_out:
        verdict, rev = _halt_rolling(plan, ctx, err, drained + down, replaced_out)
    elif drained or down:
        verdict, rev = _halt_partial(plan, ctx, err, drained + down)
    else:
        live = [i.id for i in plan.current_placement.instances]
        verdict, rev = (f"verdict: the change stopped; current revision unchanged: {plan.current.number} "
                        f"({plan.current.topology}); live now: {', '.join(live)}"), None
    verdict += f"; undone: {', '.join(halt.get('undone', [])) or 'nothing was started'}"
    if restored:
        verdict += f"; back in service (were out of the gateway, never stopped): {', '.join(restored)}"
    if down:
        verdict += f"; out of service (left the gateway, not running now): {', '.join(down)}"
    if out_of_gateway:
        verdict += (f"; OUT OF THE GATEWAY but running, not restored: {', '.join(out_of_gateway)} "
                    "(`inv deploy` puts them back)")
    if halt.get("left"):
        verdict += "; NOT undone: " + "; ".join(halt["left"])
    d["halt_verdict"] = verdict
    ctx.journal.step(ctx.op, "verdict", "failed", {
        "error": err.render(), "current": rev.number if rev else plan.current.number, "partial": rev is not None,
        "live": sorted(rev.instances) if rev else [i.id for i in plan.current_placement.instances],
        "replaced": halt.get("replaced", []), "out_of_service": halt.get("out_of_service", []) + down,
        "restored": restored, "out_of_gateway": out_of_gateway, "undone": halt.get("undone", []),
        "left": halt.get("left", [])})
    if rev is None:
        return Outcome.noop(f"nothing was stopped or replaced: revision {plan.current.number} stays current")
    return Outcome(evidence={"revision": rev.number, "partial": True},
                   verified=[f"revision {rev.number} (partial) recorded and current"])


def _halt_partial(plan: ScalePlan, ctx: RunContext, exc: PdopsError, drained: list[str]):
    """Something was drained (or is down): the old revision no longer describes the hosts."""
    halt = ctx.data["halt"]
    kept_added = set(halt.get("kept_added", []))
    cur = plan.current
    live_insts = [i for i in plan.current_placement.instances if i.id not in drained]
    live_insts += [i for i in plan.target.instances if i.id in kept_added]
    order = {i.id: n for n, i in enumerate(plan.target.instances)}
    live_insts.sort(key=lambda i: (i.role != "prefill", order.get(i.id, 999), i.id))
    pl = Placement(Topology(sum(i.role == "prefill" for i in live_insts), sum(i.role == "decode" for i in live_insts)),
                   tuple(live_insts))
    all_mf = manifest(render_files(plan.inv, pl))
    rev = ctx.state.write_revision(topology=str(pl.topology), inventory_hash=plan.inv.digest, placement=pl.to_dict(),
                                   manifest=all_mf, instances=_instances_doc(plan, pl, dict(ctx.data.get("workers", {}))),
                                   outcome="partial", op_id=ctx.op,
                                   extra={"scale_failed": exc.message, "from_revision": cur.number,
                                          "target": str(plan.target.topology), "drained": drained,
                                          "gateway": plan.inv.gateway.url, "rollback": {"to_revision": cur.number}})
    ctx.state.set_current(rev.number)
    return (f"verdict: the change stopped after draining {', '.join(drained)}; `current` moved to revision "
            f"{rev.number} (partial, {pl.topology}) to describe what is live: {', '.join(i.id for i in live_insts)}; "
            f"`inv rollback` returns to revision {cur.number}"), rev


def _halt_rolling(plan: ScalePlan, ctx: RunContext, exc: PdopsError, drained: list[str], replaced_out: list[str]):
    """The rollout halted after replacing (or taking out) some instances: record what is live as a
    `partial` revision whose every instance is described by the files its process runs: the ones not
    yet replaced by revision `current` (their files were never touched), the replaced ones by the new
    files. `inv rollback` returns to revision `current`."""
    from pdops.render import config_ids

    halt = ctx.data["halt"]
    kept_added = set(halt.get("kept_added", []))
    cur = plan.current
    cur_pl = plan.current_placement
    done = [i for i in replaced_out if i in kept_added]
    out_now = [i for i in replaced_out if i not in kept_added]
    halt["replaced"], halt["out_of_service"] = done, out_now
    live_insts = [i for i in cur_pl.instances if i.id not in drained and i.id not in replaced_out]
    live_insts += [plan.target.get(i) for i in kept_added]
    live_insts.sort(key=lambda i: (ROLES.index(i.role), int(i.id[1:])))
    pl = Placement(Topology(sum(i.role == "prefill" for i in live_insts), sum(i.role == "decode" for i in live_insts)),
                   tuple(live_insts))
    new_mf, new_cfg = manifest(plan.files), config_ids(plan.files)
    old_cfg = (cur.extra or {}).get("configs") or {}
    mf: dict = {}
    cfg: dict = {}
    for (h, p), m in _shared_files(new_mf, {i.id for i in plan.target.instances}).items():
        mf.setdefault(h, {})[p] = m
    for i in live_insts:
        src_mf, src_cfg = (new_mf, new_cfg) if i.id in kept_added else (cur.manifest, old_cfg)
        for (h, p), m in instance_files(src_mf, i.id).items():
            mf.setdefault(h, {})[p] = m
        for h, u in i.units:
            if f"{h}:{u}" in src_cfg:
                cfg[f"{h}:{u}"] = src_cfg[f"{h}:{u}"]
    gw_key = next((k for k in old_cfg if k.endswith(":pdops-gateway.service")), None)
    if gw_key:
        cfg[gw_key] = old_cfg[gw_key]
    rev = ctx.state.write_revision(
        topology=str(pl.topology), inventory_hash=plan.inv.digest, placement=pl.to_dict(),
        manifest={h: dict(sorted(v.items())) for h, v in sorted(mf.items())},
        instances=_instances_doc(plan, pl, dict(ctx.data.get("workers", {})), ctx.data.get("main_pids", {})),
        outcome="partial", op_id=ctx.op,
        extra={"scale_failed": exc.message, "from_revision": cur.number, "target": str(plan.target.topology),
               "drained": drained, "replaced": done, "out_of_service": out_now, "gateway": plan.inv.gateway.url,
               "configs": dict(sorted(cfg.items())), "cordoned": cordoned_hosts(cur),
               "last_bootstrap": last_bootstrap_ports((cur.extra or {}).get("last_bootstrap") or
                                                      last_bootstrap_ports({}, cur_pl), pl),
               "rollback": {"to_revision": cur.number}})
    ctx.state.set_current(rev.number)
    not_yet = [i.id for i in plan.replaced if i.id not in replaced_out]
    return (f"verdict: the rollout halted; replaced with the new files: {', '.join(done) or 'none'}; "
            f"out of service (old process stopped, new one not serving): {', '.join(out_now) or 'none'}; "
            f"still serving revision {cur.number}'s files, untouched: {', '.join(not_yet) or 'none'}; `current` "
            f"moved to revision {rev.number} (partial, {pl.topology}) to describe what is live; `inv rollback` "
            f"returns to revision {cur.number}"), rev


register_executors({"undo-added": do_undo_added, "restore-service": do_restore_service, "record-halt": do_record_halt})
