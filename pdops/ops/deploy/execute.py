"""Carrying a deploy out: the walk under the lock, and `inv deploy` whole (operate_deploy). What its
steps do is in pdops.steps (serve, record), shared with every operation."""

from __future__ import annotations

from pdops.errors import PdopsError, Refused
from pdops.remote.gateway import Gateways
from pdops.remote.hosts import HostPool, connections
from pdops.plans import Plan
from pdops.runner import RunContext, Say
from pdops.ops.deploy.plan import DeployPlan, plan_reconcile
from pdops.ops.operate import operate, run_operation
from pdops.ops.scale import execute_scale
from pdops.reads.observe import observe



def execute_deploy(plan: DeployPlan, say: Say = print, *, pool: HostPool, gateways: Gateways,
                   op: str | None = None) -> dict:
    """Walk a deploy plan under the cluster lock (pdops.ops.operate.run_operation; `op`: an operation
    whose lock the caller holds, `inv sweep` between its rows). Returns the verdict: the new revision,
    what was verified and what could not be (skipped checks never count as verified). Raises with a
    verdict on failure. `pool` and `gateway` are the operation's connections, opened by the caller
    (pdops.remote.hosts.connections)."""
    if plan.change is not None:  # the deploy is a rolling change of the live cluster: the change's walk
        raise PdopsError("a deploy plan whose `change` is a rolling change was given to execute_deploy: nothing "
                         "was run", fix="walk plan.change with pdops.ops.scale.execute_scale (as `inv deploy` does)")
    if plan.record is None:
        raise PdopsError("a deploy plan without the record it was read from (plan it with plan_deploy): nothing was run",
                         fix="a pdops bug to report")
    if plan.live is not None and not plan.steps:
        raise Refused(f"revision {plan.live.number} is live with these files: what to repair is decided from "
                      "observation", fix="plan it with plan_reconcile (as `inv deploy` does)")
    return run_operation(plan.plan, plan.inv, plan.record, say, pool=pool, gateways=gateways, kind="deploy",
                         basis=plan.basis, context={"placement": plan.placement}, failed=_deploy_failed, op=op,
                         lock_held=op is not None)


def _deploy_failed(ctx: RunContext, exc: PdopsError) -> tuple[str, dict]:
    """The failure verdict's evidence (after the plan's rescue ran): what runs, what is current."""
    return "failed", {"left_running": ctx.output("started", []), "current": ctx.record.current(), "completed": ctx.done}


def deploy_failed_line(ctx: RunContext, plan: Plan) -> str:
    """A failed deploy's line (pdops.kinds.FAILURE_LINES "deploy-failed"), once its rescue ran: what is
    current, and the units it started, left running for inspection."""
    current = ctx.record.current()
    return (f"  current revision unchanged: {current if current is not None else 'none'}; "
            f"units started by this deploy (left for inspection): {', '.join(ctx.output('started', [])) or 'nothing'}")


def operate_deploy(inv, record, make_plan, *, dry_run: bool, say: Say = print) -> tuple[str, object, dict | None]:
    """`inv deploy`, the whole of it (the CLI prints what it returns): `make_plan(seen)` -> a DeployPlan.
    A change of the live cluster (topology, inventory, files) is planned and walked as any change
    (pdops.ops.operate); a first deploy is walked as planned; a deploy of the live revision decides what to
    repair from what runs now (plan_reconcile), and processes found running other files are replaced as a
    change. Returns (how: "change", "repair" or "deploy"; the plan printed; its verdict, None when nothing was
    walked)."""
    plan = make_plan(None)
    if plan.change is not None:  # a rolling change: planned again from what runs now
        change, v = operate(inv, record, lambda seen: make_plan(seen).change,
                            lambda p, conns: execute_scale(p, record, **conns), dry_run=dry_run, first=plan.change,
                            say=say)
        return "change", change, v
    if plan.live is None:
        say(plan.render())
        if dry_run:
            return "deploy", plan, None
        with connections(inv) as conns:
            return "deploy", plan, execute_deploy(plan, say, **conns)
    with connections(inv) as conns:  # the live topology and files: decide from what runs now
        plan = plan_reconcile(plan, observe(plan.inv, plan.live, conns["pool"], conns["gateways"]))
        say(plan.render())
        if plan.change is not None:  # processes that run other files: replaced, rolling
            return "change", plan.change, None if dry_run else execute_scale(plan.change, record, **conns)
        if dry_run or plan.noop:
            return "repair", plan, None
        return "repair", plan, execute_deploy(plan, say, **conns)
