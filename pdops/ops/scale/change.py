"""What a change is, as data: `ScaleStep`, `ScalePlan` (and how `--dry-run` prints it), and the
helpers that compare two revisions' files. Pure: no host, no executor."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdops.errors import Refused
from pdops.model.inventory import Inventory
from pdops.steps.builders import targets_step
from pdops.model.placement import Instance, Placement
from pdops.model.render import RenderedFile
from pdops.plans import Plan, Step
from pdops.record.local import Revision, StateDir


if TYPE_CHECKING:
    from pdops.reads.observation import Seen

ROLES = ("prefill", "decode")


def always_steps() -> list[Step]:
    """The `always` part of every change plan (pdops.plans.Plan.always)."""
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
        where = f"{'/'.join(i.hosts)} GPUs {gpu_range(i.head.gpus)}"
        if self.kind == "add":
            return (f"add {i.id} ({i.role}) on {where}: start, wait {i.url}/health, canary its new P x D pairs, "
                    "register with the gateway")
        if self.kind == "replace-out":
            return f"replace {i.id} ({i.role}, {self.why}): drain the running process"
        if self.kind == "replace-in":
            return f"replace {i.id} ({i.role}, {self.why}): start from the new files, canary, register"
        return f"drain {i.id} ({i.role}) on {where}: leave the gateway, wait empty, two empty checks, verified stop"


@dataclass(frozen=True)
class GenerationChange:
    """The generation (pdops.model.generation) of each instance before and after a change: whether
    the old and the new instances can exchange KV, i.e. whether a rolling change may pair them."""

    old: dict[str, str]  # instance id -> digest, from the current revision's recorded files
    new: dict[str, str]  # instance id -> digest, from the target's files
    diff: list[str]  # what differs ("page size 64 -> 32"), empty when nothing does

    @property
    def changes(self) -> bool:
        return bool(set(self.new.values()) - set(self.old.values()))

    def line(self) -> str:
        old, new = sorted(set(self.old.values())), sorted(set(self.new.values()))
        if not self.changes:
            return f"generation: unchanged ({', '.join(new)}): old and new instances exchange KV as before"
        return (f"generation: {', '.join(old)} -> {', '.join(new)} ({'; '.join(self.diff)}): a prefill of one and "
                "a decode of the other cannot exchange KV")


@dataclass(frozen=True)
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
    run: list = field(default_factory=list)  # the runner's steps (pdops.plans.Step), made by plan_change
    rescue: list = field(default_factory=list)  # what runs if one of them fails (pdops.ops.scale.rescue)
    replaced: list[Instance] = field(default_factory=list)  # as they will run (same id and slot)
    why: dict[str, str] = field(default_factory=dict)  # replaced id -> what differs
    waves: list[list[str]] = field(default_factory=list)
    surge: list[tuple[str, str]] = field(default_factory=list)  # (old id, the new id that replaces it)
    max_unavailable: int = 1
    gateway_restart: list[str] = field(default_factory=list)  # the gateway's files that change (restart it)
    retired_gateways: list[str] = field(default_factory=list)  # gateway hosts no longer named: stopped, disabled
    cordoned: list[str] = field(default_factory=list)  # hosts placement avoids after this change
    admission_reload: list[str] = field(default_factory=list)  # its config files that change (a graceful reload)
    base_snapshot: dict | None = field(default=None, repr=False)  # a rollback's target: its files and inventory
    rollback_inventory_hash: str | None = None
    # `inv repair`: {"instance", "state", "reasons", "down", "force_after", "since"} (pdops.ops.repair)
    repair: dict | None = None
    seen: Seen | None = None  # what the hosts and the gateway reported when it was planned (None: not read)
    broken: list[str] = field(default_factory=list)  # roles with no serving instance before the change
    generation: GenerationChange | None = None  # None: not compared (the current revision's files not at hand)
    how: str = ""  # how the planner rolls the change (waves, or fenced) and why
    # a fenced rollout (pdops.ops.scale.fenced): {gateway, others, shifts, hold_s, shrink, admission_host}
    fence: dict | None = None
    force: bool = False  # the operator accepted a role with no serving instance (--force): no serving guard
    # what a deploy observed and replaces with this change (plan_reconcile): its failures are the fault's
    fault: str | None = None

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
        return Plan(op, self.headline(), self.run,
                    head={"from": self.current.number, "to": str(self.target.topology), "rollback_of": self.rollback_of,
                          "added": [i.id for i in self.added], "removed": [i.id for i in self.removed],
                          "replaced": {i.id: self.why[i.id] for i in self.replaced}, "waves": self.waves,
                          "surge": self.surge, "max_unavailable": self.max_unavailable,
                          "kept": [i.id for i in self.kept], "dip": self.dip, "broken": self.broken,
                          **({"generation": {"old": self.generation.old, "new": self.generation.new,
                                             "diff": self.generation.diff}} if self.generation else {}),
                          **({"fence": self.fence} if self.fence else {}),
                          **({"observed": {"not_serving": self.seen.not_serving, "gateway": self.seen.gateway}}
                             if self.seen is not None else {})},
                    rescue=self.rescue, always=always_steps(), suffix=self._capacity_after(),
                    failure_line="halted-change")

    def _capacity_after(self) -> dict[str, str]:
        """Step id -> the serving capacity after it, for the steps that change it."""
        out = {}
        for st in self.steps:
            last = {"add": f"register {st.instance.id}", "drain": f"drain {st.instance.id}: verify-stop",
                    "replace-out": f"replace {st.instance.id}: verify-stop",
                    "replace-in": f"register {st.instance.id}"}[st.kind]
            out[last] = f" => serving {st.capacity[0]} prefill, {st.capacity[1]} decode"
        return out

    @property
    def hosts(self) -> list[str]:
        """Hosts the change touches: every host of the target (Ansible delivers there) and of removed instances."""
        hs = {r.host for i in self.target.instances for r in i.ranks} | set(self.inv.gateway.hosts)
        hs |= {h for i in self.removed for h in i.hosts}
        return sorted(hs)

    def min_capacity(self) -> tuple[int, int]:
        caps = [self.start_capacity] + [s.capacity for s in self.steps]
        return (min(c[0] for c in caps), min(c[1] for c in caps))

    def headline(self) -> str:
        cur = self.current
        verb = f"rollback to revision {self.rollback_of}" if self.rollback_of else "scale"
        head = (f"plan: {verb}: {self.inv.cluster} from revision {cur.number} ({cur.topology}) "
                f"to {self.target.topology}")
        if self.repair:
            r = self.repair
            head = (f"plan: repair {r['instance']} of {self.inv.cluster} (revision {cur.number}, {cur.topology}): "
                    f"observed {r['state']}" + (f": {'; '.join(r['reasons'])}" if r["reasons"] else " (--force)"))
        return head

    def render(self) -> str:
        cur = self.current
        head = self.headline()
        if self.noop:
            return head + f"\nno change: {self.noop}"
        lines = [head]
        if self.seen is not None:
            if self.seen.gateway:
                which = "the gateway" if len(self.inv.gateway.nodes) == 1 else \
                    f"gateway {', '.join(sorted(self.seen.gateways_down))}"
                lines.append(f"  observed: {which} does not answer ({self.seen.gateway}): started first")
            changed = {i.id for i in self.replaced + self.removed} | {o for o, _ in self.surge}
            lines += [f"  observed: {i} does not serve ({why})" + ("" if i in changed else ": not part of this change")
                      for i, why in self.seen.not_serving.items()]
            if self.seen.all_serving:
                lines.append("  observed: every instance of the revision serves; "
                             + ("the gateway answers" if len(self.inv.gateway.nodes) == 1 else "every gateway answers"))
        lines += [f"  floor: {b}" for b in self.broken]
        if self.generation is not None:
            lines.append(f"  {self.generation.line()}")
        if self.how:
            lines.append(f"  rolled {self.how}")
        if self.fence:
            f = self.fence
            lines.append(f"  fenced: the new pool ({', '.join(i.id for i in self.added)}) on free slots, registered "
                         f"with gateway {f['gateway']} only, which first leaves the front door and drops the old pool; "
                         f"traffic moves to it in steps ({', '.join(f'{p}%' for p in f['shifts'])}, each held "
                         f"{f['hold_s']:g}s with the new pool's failure counters flat); then the old pool "
                         f"({', '.join(i.id for i in self.removed)}) drains and {', '.join(f['others'])} get the new "
                         "pool. Before `commit` a failure leaves the old generation serving every request; after it, "
                         "the new one")
        lines.append("  added:   " + (", ".join(f"{i.id} ({i.role}) on {'/'.join(i.hosts)} GPUs "
                                                f"{gpu_range(i.head.gpus)}, {i.url}" for i in self.added) or "none"))
        lines.append("  removed: " + (", ".join(f"{i.id} ({i.role}) on {'/'.join(i.hosts)} GPUs "
                                                f"{gpu_range(i.head.gpus)} (drained)" for i in self.removed) or "none"))
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
            adm, n = self.inv.admission, len(self.inv.gateway.nodes)
            meanwhile = ("each gateway in turn leaves HAProxy first (drained) and comes back once it lists every "
                         "worker: none is refused" if adm and n > 1 else
                         "a stand-in smg takes its place in HAProxy first (make before break: none is refused)" if adm
                         else "requests arriving while it restarts are refused")
            lines.append(f"  gateway: restarted after the instances ({len(self.gateway_restart)} of its files change: "
                         + "; ".join(c.split(' (sha256')[0] for c in self.gateway_restart) + "); what is in flight "
                         f"finishes first, {meanwhile}, every worker registered again from its start-up list")
        for h in self.retired_gateways:
            lines.append(f"  gateway: {h} leaves (no longer in pdops_gateway.hosts): its unit stopped and disabled, its "
                         "files removed" + ("" if h in {x.name for x in self.inv.hosts} else
                                            "; the host is not in the inventory, so pdops cannot reach it: if it "
                                            "comes back, `systemctl disable --now pdops-gateway.service` there"))
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
        lines += ["  " + ln for ln in self.plan.render().splitlines()[1:]]
        mp, md = self.min_capacity()
        tp, td = len(self.target.role("prefill")), len(self.target.role("decode"))
        lines.append(f"  lowest capacity during the change: {mp} prefill (old {p0}, new {tp}), "
                     f"{md} decode (old {d0}, new {td})")
        for d in self.dip:
            lines.append(f"  capacity dip (--allow-capacity-dip): {d}")
        if any(i.role == "prefill" for i in self.removed):
            lines.append("  note: a drained prefill's prefix cache is lost: cold inputs will be slower for a while")
        return "\n".join(lines)


def gpu_range(gpus: tuple[int, ...]) -> str:
    g = list(gpus)
    if g and g == list(range(g[0], g[-1] + 1)) and len(g) > 1:
        return f"{g[0]}-{g[-1]}"
    return ",".join(map(str, g))


def slot_key(inst: Instance) -> tuple:
    return (inst.hosts, inst.slot)


def gpu_set(inst: Instance) -> set[tuple[str, int]]:
    return {(r.host, g) for r in inst.ranks for g in r.gpus}


_OWN_FILE = "pdops-{id}(-r[0-9]+)?\\.(service|sh|env)$"


def instance_files(mf: dict, inst_id: str) -> dict[tuple[str, str], dict]:
    """{(host, path): {sha256, mode}} of one instance's files (unit, launch script, env) in a manifest."""
    rx = re.compile(_OWN_FILE.format(id=re.escape(inst_id)))
    return {(h, p): m for h, files in mf.items() for p, m in files.items() if rx.search(p.rsplit("/", 1)[-1])}


def shared_files(mf: dict, ids: set[str]) -> dict[tuple[str, str], dict]:
    own = set()
    for i in ids:
        own |= set(instance_files(mf, i))
    return {(h, p): m for h, files in mf.items() for p, m in files.items() if (h, p) not in own}


def file_changes(old: dict, new: dict) -> list[str]:
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


def refuse_changed_inventory(inv: Inventory, cur: Revision) -> None:
    if not inv.matches(cur.inventory_hash):
        raise Refused(f"the inventory changed since revision {cur.number} was deployed "
                      f"(digest {cur.inventory_hash[:12]} -> {inv.digest[:12]})",
                      fix=f"restore the inventory of the running revision, or apply this one first: `inv deploy "
                          f"--topology {cur.topology}`; a topology change keeps the inventory")


def current_revision_of(inv: Inventory, record: StateDir, what: str) -> Revision:
    cur = record.current_revision()
    if cur is None:
        raise Refused(f"{inv.cluster} has no current revision: nothing to {what}",
                      fix="deploy first (`inv deploy --topology 1p1d`)")
    return cur


def cordoned_hosts(rev: Revision) -> list[str]:
    return list((rev.extra or {}).get("cordoned", []))


@dataclass(frozen=True)
class ChangeFacts:
    """What a change decided, as its record and rescue steps carry it (step.params["change"]): the
    revision it starts from, the target, the files, what it adds, removes, replaces and keeps. No
    steps and no observation: an executor reads these and the outputs it declares, never the plan."""

    inv: Inventory
    current: Revision
    current_placement: Placement
    target: Placement
    files: tuple
    added: tuple
    removed: tuple
    kept: tuple
    replaced: tuple
    why: dict
    kept_files: int
    dip: tuple
    surge: tuple
    cordoned: tuple
    rollback_of: int | None
    base_snapshot: dict | None
    rollback_inventory_hash: str | None
    repair: dict | None


def change_facts(plan: ScalePlan) -> ChangeFacts:
    return ChangeFacts(plan.inv, plan.current, plan.current_placement, plan.target, tuple(plan.files), tuple(plan.added),
                       tuple(plan.removed), tuple(plan.kept), tuple(plan.replaced), dict(plan.why), plan.kept_files,
                       tuple(plan.dip), tuple(plan.surge), tuple(plan.cordoned), plan.rollback_of, plan.base_snapshot,
                       plan.rollback_inventory_hash, dict(plan.repair) if plan.repair else None)


def union_placement(plan: ScalePlan) -> Placement:
    """Every instance a change names (kept, added and removed), for the executors' lookups; a replaced
    one as it will run (its running process: `old_placement`)."""
    ids = {i.id for i in plan.target.instances}
    return Placement(plan.target.topology, plan.target.instances
                     + tuple(i for i in plan.current_placement.instances if i.id not in ids))
