"""The probe's plan (pure apart from reading the record): on a spare pair, or on a serving pair taken
out of the gateway and restored (or kept) by the change planner."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pdops.errors import InvalidInput, PdopsError, Refused
from pdops.model.inventory import Inventory
from pdops.model.placement import Instance, Placement, place_change
from pdops.ops import scale as sc
from pdops.steps.builders import canary_step, connect_step, delivery_steps, drain_steps, preflight_step, start_steps
from pdops.ops.scale import instance_files, union_placement
from pdops.plans import Plan, Step

from pdops.ops.probe.bundle import Bundle, DEFAULT_TIMEOUT_S, changed_variables, parse_workload
from pdops.model.commands import engine_args
from pdops.model.render import manifest, render_files
from pdops.model.topology import Topology


# ---------------------------------------------------------------- the plan

@dataclass
class ProbePlan:
    inv: Inventory
    probe_inv: Inventory  # the inventory with the bundle's flags on the probed instances
    record: object
    rev: object
    bundle: Bundle
    mode: str  # "spare" | "instances"
    pair: tuple[Instance, Instance]
    baseline: Placement
    workload: tuple[int, int]
    requests: int
    concurrency: int
    timeout_s: float
    keep: bool
    variables: list[dict]
    steps: list[Step] = field(default_factory=list)
    files: list = field(default_factory=list)  # the probed instances' files, rendered with the bundle
    # the way back, whatever the probe did (and after an interrupt): a spare pair's removal; or the
    # change that restores the pair's files (and, with --keep, the one that keeps the bundle),
    # each a `walk-plan` step run only if `probe_keep` says so
    always: list[Step] = field(default_factory=list)

    @property
    def plan(self) -> Plan:
        p, d = self.pair
        return Plan("probe", f"plan: probe bundle {self.bundle.name!r} on {p.id} x {d.id} ({self.mode})", self.steps,
                    head={"bundle": self.bundle.as_dict(), "mode": self.mode, "pair": self.ids},
                    always=self.always, always_on_interrupt=True)

    @property
    def ids(self) -> list[str]:
        return [i.id for i in self.pair]

    def render(self) -> str:
        p, d = self.pair
        head = (f"plan: probe bundle {self.bundle.name!r} ({self.bundle.path}) on {self.inv.cluster} "
                f"(revision {self.rev.number}, {self.rev.topology}): {self.mode} pair {p.id} x {d.id}")
        lines = [head]
        n = len(self.variables)
        if n:
            lines.append(f"  changes {n} variable(s) against the baseline" + (" (multi-variable: it cannot prove "
                         "what any one of them does)" if n > 1 else "") + ":")
            lines += [f"    {v['flag']}: {v['baseline']} -> {v['candidate']}" for v in self.variables]
        else:
            lines.append("  changes no variable against the baseline: a control probe")
        i, o = self.workload
        lines.append(f"  {self.requests} request(s) of {i} input / {o} output tokens, {self.concurrency} at once, "
                     f"straight to the pair (never through the gateway, never retried), each within "
                     f"{self.timeout_s:g}s")
        if self.mode == "spare":
            lines.append(f"  {p.id} on {'/'.join(p.hosts)}, {d.id} on {'/'.join(d.hosts)}: free GPUs; never "
                         "registered; stopped and removed afterwards; the revision's instances are not touched")
        else:
            lines.append(f"  {p.id} and {d.id} leave the gateway for the probe (the rest serves); afterwards "
                         + ("they restart on the bundle, recorded as a new revision (--keep, only if every "
                            "request is ok)" if self.keep else "the revision's own files, recorded as a new "
                            "revision (same files, new processes)"))
        lines.append("  steps, then the way back (always: whatever the probe did, and after Ctrl-C):")
        lines += ["  " + ln for ln in self.plan.render().splitlines()[1:]]
        lines.append("  nothing is ever called best: the outcome is a candidate's, for this workload, this window")
        return "\n".join(lines)


def _refuse_other_files(inv: Inventory, rev) -> None:
    now = manifest(render_files(inv, Placement.from_dict(rev.placement)))
    changes = [k for k in sorted(set(now) | set(rev.manifest)) if now.get(k) != rev.manifest.get(k)]
    if changes:
        raise Refused(f"the inventory on disk renders other files than revision {rev.number}: a probe against it "
                      "would change more than the bundle", evidence="\n".join(changes[:20]),
                      fix=f"`inv deploy --topology {rev.topology}` first, or restore the running revision's inventory")


def check_options(*, instances, spare: bool, requests, concurrency, keep: bool) -> int:
    """The operator's options, checked before anything is read (the record is over SSH); returns the
    concurrency."""
    if isinstance(requests, bool) or not isinstance(requests, int) or not 1 <= requests <= 64:
        raise InvalidInput("--requests", f"{requests!r} is not 1..64", fix="a few long requests: 4")
    conc = requests if concurrency is None else concurrency
    if isinstance(conc, bool) or not isinstance(conc, int) or not 1 <= conc <= requests:
        raise InvalidInput("--concurrency", f"{conc!r} is not 1..{requests}", fix="at most --requests")
    if bool(spare) == bool(instances):
        raise InvalidInput("--instances/--spare", "give exactly one of --instances p01,d01 and --spare",
                           fix="--spare starts a pair on free GPUs; --instances takes a serving pair out for the probe")
    if keep and spare:
        raise InvalidInput("--keep", "a spare pair is removed after its probe; there is nothing to keep",
                           fix="probe on --instances p01,d01 --keep to keep a bundle on that pair")
    if instances is not None and not re.fullmatch(r"[pd]\d{2,3}(,[pd]\d{2,3})*", str(instances).replace(" ", "")):
        raise InvalidInput("--instances", f"{instances!r} is not a list of instance ids", fix="e.g. --instances p01,d01")
    return conc


def plan_probe(inv: Inventory, record, bundle: Bundle, *, instances: str | None = None, spare: bool = False,
               requests: int = 4, concurrency: int | None = None, workload=None, keep: bool = False,
               timeout_s: float | None = None) -> ProbePlan:
    """The probe's plan, from the record only (pure apart from reading it)."""
    import dataclasses


    conc = check_options(instances=instances, spare=spare, requests=requests, concurrency=concurrency, keep=keep)
    tmo = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    work = parse_workload(workload, inv.profile)
    rev = record.current_revision()
    if rev is None:
        raise Refused(f"{inv.cluster} has no current revision: nothing to probe against",
                      fix="deploy first (`inv deploy --topology 1p1d`)")
    cur_pl = Placement.from_dict(rev.placement)
    interval = float(inv.vars.get("pdops_empty_check_interval_s", 5))
    if spare:
        _refuse_other_files(inv, rev)
        target = Topology(len(cur_pl.role("prefill")) + 1, len(cur_pl.role("decode")) + 1)

        try:
            grown = place_change(inv, target, cur_pl, avoid=frozenset(sc.cordoned_hosts(rev)),
                                 last_ports=(rev.extra or {}).get("last_bootstrap"))
        except PdopsError as exc:
            raise Refused(f"no free GPUs for a spare prefill x decode pair: {exc.message}",
                          fix="add a host, or probe on --instances p01,d01 (it leaves the gateway for the probe)") from None
        new = [i for i in grown.instances if i.id not in {c.id for c in cur_pl.instances}]
        p = next(i for i in new if i.role == "prefill")
        d = next(i for i in new if i.role == "decode")
        pair_pl = Placement(Topology(1, 1), (p, d))
    else:
        ids = [x.strip() for x in str(instances).split(",") if x.strip()]
        known = {i.id: i for i in cur_pl.instances}
        bad = [x for x in ids if x not in known]
        if bad or len(ids) != 2:
            raise InvalidInput("--instances", f"{instances!r}: " + (f"{', '.join(bad)} not in revision {rev.number}"
                               if bad else "name one prefill and one decode"),
                               fix=f"a pair of revision {rev.number}: {', '.join(known)}")
        roles = sorted(known[x].role for x in ids)
        if roles != ["decode", "prefill"]:
            raise InvalidInput("--instances", f"{instances!r} is not one prefill and one decode",
                               fix="e.g. --instances p01,d01")
        p = next(known[x] for x in ids if known[x].role == "prefill")
        d = next(known[x] for x in ids if known[x].role == "decode")
        for x in (p, d):
            if len(cur_pl.role(x.role)) < 2:
                raise Refused(f"{x.id} is the last serving {x.role} instance: probing it leaves no {x.role} "
                              "for the time of the probe",
                              fix="--spare starts a pair on free GPUs instead (add a host if there is none)")
        _refuse_other_files(inv, rev)
        pair_pl = Placement(Topology(1, 1), (p, d))
    overrides = {p.id: bundle.flags, d.id: bundle.flags}
    probe_inv = dataclasses.replace(inv, engine_overrides=overrides)
    full_pl = Placement(cur_pl.topology, cur_pl.instances + ((p, d) if spare else ()))
    mf_files = render_files(probe_inv, full_pl)
    mf = manifest(mf_files)
    own = set(instance_files(mf, p.id)) | set(instance_files(mf, d.id))
    # a spare on a host the revision does not use also needs that host's shared files (the slice)
    had = {(h, path) for h, fs in rev.manifest.items() for path in fs}
    hosts_of_pair = {r.host for i in (p, d) for r in i.ranks}
    own |= {(f.host, f.path) for f in mf_files if f.host in hosts_of_pair and (f.host, f.path) not in had}
    files = [f for f in mf_files if (f.host, f.path) in own]
    base_args = engine_args(inv, full_pl, p, p.ranks[0])
    variables = changed_variables(base_args, bundle)
    hosts = sorted({r.host for i in cur_pl.instances + (p, d) for r in i.ranks} | set(inv.gateway.hosts))
    steps = [connect_step(hosts)]
    if spare:
        steps.append(preflight_step(set(), pair_pl, cur_pl))
    else:
        for x in (p, d):
            wid = (rev.instances.get(x.id) or {}).get("worker_id")
            subs = drain_steps(inv, x, wid, wait_s=float(inv.drain_budget_s), interval_s=interval,
                               prefix=f"probe-out {x.id}: ", in_change=True)
            steps += subs
    steps += delivery_steps(probe_inv, pair_pl, files, {"probe": bundle.name, "from": rev.number},
                            note=f" (only {p.id}'s and {d.id}'s files, with the bundle's flags)")
    steps += start_steps(probe_inv, [p, d], restart=False, group="probe-start")
    steps.append(canary_step("probe-canary", [(p.id, d.id)], retry_once=True, kind="probe-canary",
                             why="before the long requests: a pair that cannot serve a short one proves nothing"))
    i_tok, o_tok = work
    steps.append(Step("probe-requests", None, f"{requests} request(s) of {i_tok}/{o_tok} tokens straight to {p.id} x "
                      f"{d.id} ({conc} at once), each row in the ledger; then each rank's journal of the window: "
                      "outcomes and failure signatures" + ("; probe_keep: every request ok and none mixed (--keep)"
                                                           if keep else ""), tmo + 120, kind="probe-requests",
                      params={"pair": (p, d), "workload": work, "requests": requests, "concurrency": conc,
                              "timeout_s": tmo, "keep": keep}))
    plan = ProbePlan(inv, probe_inv, record, rev, bundle, "spare" if spare else "instances", (p, d), cur_pl, work,
                     requests, conc, tmo, keep, variables, steps, files)
    return dataclasses.replace(plan, always=way_back_steps(plan))  # its way back is planned from the plan itself


def way_back_steps(plan: ProbePlan) -> list[Step]:
    """The probe's way back as `walk-plan` steps (pure): each walks a plan made now from the record,
    which the probe does not change before it."""
    if plan.mode == "spare":
        back = Plan("probe-remove", "remove the spare pair", restore_steps(plan))
        return [Step("probe-remove", None, f"take the spare pair {' and '.join(plan.ids)} away and verify the "
                     "revision untouched (the steps below)", None, kind="walk-plan",
                     params={"plan": back, "inv": plan.inv})]
    def walk_change(name: str, keep: bool, what: str) -> Step:
        ch = change_after(plan, keep)
        return Step(name, None, what, None, kind="walk-plan", when=("probe_keep", keep),
                    params={"plan": ch.plan, "inv": plan.probe_inv if keep else plan.inv,
                            "placement": union_placement(ch), "old_placement": ch.current_placement,
                            "replacing": [i.id for i in ch.replaced]})

    out = [walk_change("restore", False, f"{' and '.join(plan.ids)} back on revision {plan.rev.number}'s files: the "
                       "change below (drain, verified stop, start, canary, register, a new revision)")]
    if plan.keep:
        out.append(walk_change("keep", True, f"{' and '.join(plan.ids)} kept on the bundle: the change below, "
                               "recorded as a new revision"))
    return out


def restore_steps(plan: ProbePlan) -> list[Step]:
    """After a spare pair's probe: the pair's verified stop, its files removed, the revision verified."""

    inv = plan.inv
    out = []
    for x in plan.pair:
        out += drain_steps(inv, x, None, wait_s=float(inv.drain_budget_s), interval_s=0, gateway=False,
                           prefix=f"probe-remove {x.id}: ", resume=False)
    out.append(Step("probe-remove-files", None, f"remove {', '.join(plan.ids)}'s units, launch scripts and env files "
                    "(Ansible); daemon-reload", 300, kind="probe-remove-files",
                    params={"files": list(plan.files), "placement": plan.baseline, "ids": plan.ids}))
    out.append(Step("probe-verify-baseline", None, f"every unit of revision {plan.rev.number} active and its MainPID "
                    "the recorded one, started from the revision's files; the spare pair's units gone", 60,
                    kind="probe-verify-baseline", verifies="the baseline runs as recorded",
                    params={"revision": plan.rev, "placement": plan.baseline, "pair": plan.pair}))
    return out


def change_after(plan: ProbePlan, keep: bool):
    """The instances mode's way back (or forward, `keep`): the change planner's replacement of the
    pair, a new revision."""

    why = (f"keep probe bundle {plan.bundle.name!r}" if keep
           else f"restore the baseline after probing bundle {plan.bundle.name!r}")
    inv = plan.probe_inv if keep else plan.inv
    ch = sc.plan_change(inv, plan.rev, plan.baseline, replace_ids={i: why for i in plan.ids}, max_unavailable=1,
                        force=True)
    if sorted(i.id for i in ch.replaced) != sorted(plan.ids) or ch.added or ch.removed or ch.gateway_restart:
        raise Refused(f"the way back from the probe would change more than {', '.join(plan.ids)}",
                      evidence=ch.render())
    for st in ch.run:
        st.name = ("keep: " if keep else "restore: ") + st.name
    return ch
