"""A sweep's rows: each row's deploy or change planned before the sweep starts, printed in full, and
walked only as printed.

Each row brings the cluster to its topology: a deploy when nothing is live, else the change planner's
change (allowed to dip capacity: the sweep owns the cluster). The first row is planned from the
record as it is; each later row from the revision the row before it is to record, forecast by that
row's own record function writing to a :class:`pdops.record.forecast.Forecast` (never to the record).
A forecast cannot know what only running gives (worker ids, MainPIDs): its plans name a worker by
its URL, and their revision numbers follow the record's last (the record may give others).

When a row starts, it is planned again from the record and what serves as they are then
(:func:`plan_row`, the same function: an instance that does not serve now is replaced, so the row
differs) and walked only if its decisions are the printed ones (:func:`differences`: the deploy or
change, the target placement, every rendered file, every step by id, kind and host, rescue and
always steps included). Otherwise nothing of it runs: the row fails with the differences named.
After a row that failed, the rows planned from the revision it was to record are not tried at all
(pdops.ops.sweep.execute.do_sweep_scale).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdops.errors import InvalidInput, PdopsError, Refused
from pdops.model.render import manifest
from pdops.model.topology import Topology
from pdops.ops.deploy.plan import plan_deploy
from pdops.ops.scale.change import change_facts
from pdops.ops.scale.operations import plan_scale
from pdops.ops.scale.revision import record_change
from pdops.reads.observation import Seen
from pdops.record.forecast import Forecast
from pdops.steps.revisions import record_deploy

DEPLOY, CHANGE, NOTHING = "deploy", "change", "nothing"


@dataclass(frozen=True)
class Row:
    """One row's way to its topology, as planned from `basis` (None: nothing live), a revision that
    exists only in a forecast when `forecast`."""

    ratio: str
    topology: Topology
    how: str  # DEPLOY, CHANGE or NOTHING (the cluster runs the topology already)
    plan: object  # pdops.ops.deploy.DeployPlan or pdops.ops.scale.ScalePlan
    basis: int | None
    forecast: bool = False

    def origin(self) -> str:
        if self.basis is None:
            return "nothing live"
        if self.forecast:
            return f"revision {self.basis}, the one the row before is to record (forecast)"
        return f"revision {self.basis}"

    def summary(self) -> str:
        what = {DEPLOY: f"deploy {self.topology}", CHANGE: f"the change to {self.topology}",
                NOTHING: f"nothing to change ({self.topology} runs)"}[self.how]
        return f"{what}, planned from {self.origin()}"

    def render(self) -> str:
        """Its first line names the row (a plan prints it as the step's own line), then the whole plan."""
        return f"{self.ratio}: {self.summary()}\n{self.plan.render()}"

    def decisions(self) -> dict:
        """What must be the same for the plan made when the row starts to be the one printed."""
        target = self.plan.placement if self.how == DEPLOY else self.plan.target
        steps = [] if self.how == NOTHING else [(s.name, s.kind, s.host) for s in self.plan.plan.all_steps()]
        return {"how": self.how, "placement": target.to_dict(), "files": manifest(self.plan.files), "steps": steps}


def plan_row(inv, ratio: str, topology: Topology, record, seen: Seen | None = None) -> Row:
    """The row's deploy (nothing live) or change, from what `record` holds now (a forecast or the real one)
    and, when the row starts, what serves now (`seen`: an instance that does not serve is replaced)."""
    cur = record.current_revision()
    forecast = isinstance(record, Forecast) and record.is_forecast(record.current())
    if cur is None:
        return Row(ratio, topology, DEPLOY, plan_deploy(inv, topology, record), None, forecast)
    plan = plan_scale(inv, topology, record, allow_capacity_dip=True, seen=seen)
    return Row(ratio, topology, NOTHING if plan.noop else CHANGE, plan, cur.number, forecast)


def forecast_rows(inv, rows: list[tuple[str, Topology]], record) -> tuple[dict[str, Row], dict[str, str]]:
    """Every row planned in order, each from the revision the one before is to record; reads `record`,
    writes nothing. Returns the rows, and the ratios whose row cannot be planned with the reason (their
    cells are not tried: the next row is forecast from the revision before them)."""
    fc = Forecast(record)
    out, refused = {}, {}
    for ratio, topo in rows:
        try:
            row = plan_row(inv, ratio, topo, fc)
        except (InvalidInput, Refused) as exc:
            what = "change" if fc.current() is not None else "deploy"
            refused[ratio] = f"its {what} cannot be planned: {exc.message}"
            continue
        out[ratio] = row
        if row.how == DEPLOY:
            pl = row.plan.placement
            record_deploy(fc, inv, pl, row.plan.files, None, workers={i.id: None for i in pl.instances}, build=None,
                          running={}, main_pids={})
        elif row.how == CHANGE:
            fc.set_current(record_change(change_facts(row.plan), fc, None, {}, None).number)
    return out, refused


def differences(printed: Row, now: Row) -> list[str]:
    """How the row planned now differs from the printed one (empty: it is the printed one)."""
    a, b = printed.decisions(), now.decisions()
    out = []
    if a["how"] != b["how"]:
        out.append(f"printed: {printed.summary()}; now: {now.summary()}")
    if a["placement"] != b["placement"]:
        out.append("the target placement differs")
    files = sorted({f"{h}:{p}" for h in set(a["files"]) | set(b["files"])
                    for p in set(a["files"].get(h, {})) | set(b["files"].get(h, {}))
                    if a["files"].get(h, {}).get(p) != b["files"].get(h, {}).get(p)})
    if files:
        out.append(f"{len(files)} rendered file(s) differ: {', '.join(files[:3])}"
                   + (", ..." if len(files) > 3 else ""))
    if a["steps"] != b["steps"]:
        gone = [s[0] for s in a["steps"] if s not in b["steps"]]
        new = [s[0] for s in b["steps"] if s not in a["steps"]]
        out.append("the steps differ" + (f"; printed only: {', '.join(gone[:4])}" if gone else "")
                   + (f"; now only: {', '.join(new[:4])}" if new else "") + ("" if gone or new else " in order"))
    return out


def replan(inv, printed: Row | None, topology: Topology, record, seen: Seen | None = None) -> Row:
    """The row planned again from the record and what serves as it is now (`seen`); Refused, naming how,
    unless it is the printed one."""
    if printed is None:
        raise PdopsError(f"a sweep row to {topology} without its printed plan: nothing was run",
                         fix="a pdops bug to report")
    now = plan_row(inv, printed.ratio, topology, record, seen)
    diff = differences(printed, now)
    if diff:
        seen = seen or Seen()
        observed = [f"{i} does not serve ({why})" for i, why in sorted(seen.not_serving.items())]
        observed += [f"gateway {g} does not answer ({why})" for g, why in sorted(seen.gateways_down.items())]
        raise Refused(f"the row's {now.how} planned now, from {now.origin()}, is not the one printed (planned from "
                      f"{printed.origin()}): {'; '.join(diff)}"
                      + (f"; observed now: {'; '.join(observed)}" if observed else "") + "; nothing of it was run",
                      fix="see the journal for the row before it; run the sweep again for the rows left")
    return now
