"""`inv repair --instance d01`: a verified restart of one instance, as one planned change.

It is the change planner's replacement (pdops.ops.scale) aimed at one instance with the revision's
own files: leave the gateway, drain what can be drained (the drain's deadline and its
`--force-after` rule; an instance observed down has nothing to wait for), verified stop, start,
health, canary through its P x D pairs, register, verify what runs, record. Before the drain it
names the work the instance lost: request IDs its ended processes received and never finished
(from the engine's request log in the unit's journal, one invocation per process), marked failed
in the journal and never sent again.

Its peers forget the old process: a repaired prefill starts on its slot's other bootstrap port
(no decode holds a cached route to it); a repaired decode gets a new transfer session (SGLang's
prefills key what they keep of a decode by its session id, so nothing stale is reused).
"""

from __future__ import annotations

import datetime as _dt
import re

from pdops.errors import InvalidInput, Refused
from pdops.steps.builders import end_orphans_step
from pdops.model.inventory import Inventory
from pdops.model.render import manifest, render_files
from pdops.ops import scale as sc
from pdops.model.placement import Placement
from pdops.plans import Plan
from pdops.ops.operate import run_operation
from pdops.steps.builders import baseline_step, connect_step
from pdops.reads.observation import Seen
from pdops.reads.status import read_status
from pdops.remote.hosts import connections

INSTANCE_ID = re.compile(r"^[pd]\d{2,}$")


def check_instance_id(value) -> str:
    """The operator's `--instance` value, checked before any connection."""
    if not value:
        raise InvalidInput("--instance", "missing", fix="name the instance, e.g. --instance d01 (see `inv status`)")
    v = str(value).strip()
    if not INSTANCE_ID.match(v):
        raise InvalidInput("--instance", f"{value!r} is not an instance id", fix="e.g. --instance p01 or d02 "
                           "(`inv status` lists them)")
    return v


def _epoch(iso: str) -> float:
    try:
        t = _dt.datetime.fromisoformat(str(iso).replace("Z", "+00:00"))
    except ValueError:
        return 0.0
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return t.timestamp()


def plan_repair(inv: Inventory, record, instance_id: str, status_doc: dict, *, force: bool = False,
                force_after: bool = False, wait_s: float | None = None, seen=None):
    """The repair plan of one instance, decided from `status_doc` (pdops.reads.status.read_status, read
    now) and `seen` (pdops.reads.observation.Seen of the same reading; None: not read): a gateway that does not
    answer is started first; another instance that does not serve is named, left as it is, and no
    canary pair goes through it. Returns a ScalePlan, or a str saying why there is nothing to do."""

    iid = check_instance_id(instance_id)
    rev = record.current_revision()
    if rev is None:
        raise Refused("nothing is deployed (no current revision)", fix="`inv deploy --topology T` first")
    pl = Placement.from_dict(rev.placement)
    ids = [i.id for i in pl.instances]
    if iid not in ids:
        raise InvalidInput("--instance", f"{iid} is not an instance of revision {rev.number} ({rev.topology})",
                           fix=f"one of: {', '.join(ids)}")
    rows = {r["instance"]: r for r in status_doc["instances"]}
    row = rows[iid]
    if row["state"] == "unknown":
        raise Refused(f"{iid} cannot be judged: {'; '.join(row['reasons'])}",
                      fix=row.get("action") or "restore SSH to its hosts, then `inv status` again")
    if row["state"] == "ok" and not force:
        return (f"{iid} is ok (unit active with its recorded MainPID, registered and healthy in the gateway, no PD "
                "failure since the last look, no stray process): nothing to repair; --force restarts it anyway")
    serving = row["registered"] and row["healthy"] and row["state"] not in ("down",)
    others = [r["instance"] for r in status_doc["instances"]
              if r["role"] == row["role"] and r["instance"] != iid and r["healthy"]]
    if serving and not others and not force:
        raise Refused(f"{iid} is the last serving {row['role']} instance and it still serves (observed "
                      f"{row['state']}: {'; '.join(row['reasons']) or 'ok'}): restarting it leaves no {row['role']} "
                      "for the time of the restart",
                      fix=f"--force to accept that, or add a {row['role']} first (`inv scale`)")
    # the revision's own files: the inventory on disk must still render them
    now = manifest(render_files(inv, pl))
    changes = [f"{k}: {'changed' if k in now and k in rev.manifest else 'added' if k in now else 'removed'}"
               for k in sorted(set(now) | set(rev.manifest)) if now.get(k) != rev.manifest.get(k)]
    if changes:
        raise Refused(f"the inventory on disk renders other files than revision {rev.number}: a repair restarts "
                      "with the revision's files and changes nothing else",
                      evidence="\n".join(changes[:20]),
                      fix=f"`inv deploy --topology {rev.topology}` applies the inventory's changes (it replaces what "
                          "differs), or restore the inventory of the running revision")
    why = f"repair ({row['state']}" + (f": {row['reasons'][0]}" if row["reasons"] else "") + ")"
    # the repair's own floor check is above (the planner's is overridden); the serving guard at leave-gateway
    # stays unless the operator forced
    plan = sc.plan_change(inv, rev, pl, replace_ids={iid: why}, max_unavailable=1, force=True, seen=seen,
                          restart_not_serving=False, guard=not force,
                          repair={"instance": iid, "state": row["state"], "reasons": list(row["reasons"]),
                                  "down": row["state"] == "down", "force_after": bool(force_after),
                                  "since": _epoch(rev.created), "wait_s": wait_s})
    if [i.id for i in plan.replaced] != [iid] or plan.added or plan.removed or plan.gateway_restart:
        raise Refused(f"repairing {iid} would change more than {iid}",
                      evidence=plan.render(), fix=f"`inv deploy --topology {rev.topology}` plans the whole difference")
    return plan


def plan_end_orphans(inv: Inventory, record) -> tuple[Plan, Placement]:
    """`inv end-orphans`: every prefill's halves that no decode holds (pdops.reads.orphans), ended by rid
    and named. Read-only until the walk: which requests are orphaned is read when the step runs."""
    rev = record.current_revision()
    if rev is None:
        raise Refused(f"{inv.cluster} has no current revision: no prefill to look at",
                      fix="deploy first (`inv deploy --topology 1p1d`)")
    pl = Placement.from_dict(rev.placement)
    hosts = sorted({h for i in pl.instances for h in i.hosts})
    return Plan("end-orphans", f"plan: end the orphaned halves of {inv.cluster} (revision {rev.number}, {rev.topology})",
                [connect_step(hosts), end_orphans_step([p.id for p in pl.role("prefill")]),
                 baseline_step(when=("orphans_ended", True))],
                head={"revision": rev.number}), pl


def execute_end_orphans(plan: Plan, pl: Placement, inv: Inventory, record, say=print, *, pool, gateways) -> dict:
    """Walk it under the cluster lock; the verdict names what was ended."""
    return run_operation(plan, inv, record, say, pool=pool, gateways=gateways, context={"placement": pl})


def repair(inv: Inventory, record, instance_id: str, *, force: bool = False, force_after: bool = False,
           wait_s: float | None = None, dry_run: bool = False, say=print) -> tuple[Plan | str, dict | None]:
    """`inv repair`: read the cluster as `inv status` does (systemd, the gateways, each instance's
    state word), plan the repair of `instance_id` from that, print it, and walk it (a change of one
    instance). Returns (the plan, or why nothing is to be done; the verdict, None when nothing was
    walked); the verdict's `headline` says what was repaired and what was lost."""
    doc, obs = read_status(inv, record, remember=False)
    plan = plan_repair(inv, record, instance_id, doc, force=force, force_after=force_after, wait_s=wait_s,
                       seen=Seen.of(obs) if obs is not None else None)
    if isinstance(plan, str):
        say(f"no change: {plan}")
        return plan, None
    say(plan.render())
    if dry_run:
        return plan, None
    with connections(inv) as conns:
        v = sc.execute_scale(plan, record, say, **conns)
    lost = v.get("lost") or []
    v["headline"] = (f"repaired {instance_id} (observed {plan.repair['state']}) as revision {v['revision']}, now "
                     f"current; {len(lost)} request(s) lost with its ended process"
                     + (f": {', '.join(lost)}" if lost else ""))
    return plan, v


def end_orphans(inv: Inventory, record, *, dry_run: bool = False, say=print) -> dict | None:
    """`inv end-orphans`: plan, print, and (unless `dry_run`) walk; the verdict, None when not walked."""
    plan, pl = plan_end_orphans(inv, record)
    say(plan.render())
    if dry_run:
        return None
    with connections(inv) as conns:
        return execute_end_orphans(plan, pl, inv, record, say, **conns)
