"""Carrying a drain or a stop out: the walk under the lock (its steps' executors are pdops.steps.stop
and pdops.steps.record)."""

from __future__ import annotations

from pdops.errors import PdopsError
from pdops.remote.gateway import Gateways
from pdops.remote.hosts import HostPool
from pdops.model.placement import Placement
from pdops.runner import RunContext, Say
from pdops.ops.operate import run_operation
from pdops.record.local import StateDir
from pdops.ops.drain.plan import DrainPlan, KillPlan
from pdops.plans import Plan


def execute_kill_survivors(plan: KillPlan, record: StateDir, say: Say = print, *, pool: HostPool,
                           gateways: Gateways) -> dict:
    """End the recorded survivors by PID and start time, then verify the stop again (with the runner)."""
    def finish(ctx: RunContext, verdict: dict) -> None:
        verdict["instance"] = plan.instance.id
        verdict["notes"].append(f"{plan.instance.id} is still in revision {plan.rev.number}: `inv drain --instance "
                                f"{plan.instance.id}` resumes the drain and records it")

    return run_operation(plan.plan, plan.inv, record, say, pool=pool, gateways=gateways, kind="stop",
                         basis=plan.rev.number, context={"placement": Placement.from_dict(plan.rev.placement)},
                         finish=finish)


def drain_interrupted_line(ctx: RunContext, plan: Plan) -> str:
    """An interrupted drain's line (pdops.kinds.FAILURE_LINES "drain-interrupted"): the instance is not
    recorded as stopped; the last step completed; the same command resumes it."""
    last = ctx.done[-1] if ctx.done else "none"
    return (f"  {plan.head['instance']} is NOT recorded as stopped; last completed step: {last}; current revision: "
            f"{ctx.record.current()}. Re-run the same command to resume (each step re-checks what is already done).")


# ---------------------------------------------------------------- doing: one executor per step kind


def execute_drain(plan: DrainPlan, record: StateDir, say: Say = print, *, pool: HostPool,
                  gateways: Gateways) -> dict:
    """Walk a drain (or stop) plan with the runner. An interruption (SSH lost, engine unreachable,
    a check failing) ends with a journalled verdict naming the last completed step; the instance
    is never recorded as stopped unless the stop was verified. Re-running the same drain resumes:
    a worker already removed is a no-op, an instance already stopped is only accepted when an
    earlier drain of it passed both empty checks."""
    def failed(ctx: RunContext, exc: PdopsError) -> tuple[str, dict]:
        return "interrupted", {"last_completed_step": ctx.done[-1] if ctx.done else "none",
                               "current": record.current()}

    return run_operation(plan.plan, plan.inv, record, say, pool=pool, gateways=gateways, basis=plan.rev.number,
                         context={"placement": plan.placement}, failed=failed,
                         finish=lambda ctx, verdict: verdict.update(instance=plan.instance.id))
