"""`inv drain --instance p07` and `inv stop --instance p07` (rule 4 of docs/design/architecture.md).

Drain, in order: leave the gateway (remove by worker id, verify gone); wait until the
instance's in-flight work is finished, per request ID and per queue on every rank; two
independent empty-state checks separated in time; stop by identity (unit -> MainPID ->
cgroup, process tree with start times recorded first) and prove it stopped; record a
new revision without the instance, with the way back. Plan first, `--dry-run` prints it.

The package, by concern (each module imports only those listed before it; the drain sub-plan every
change embeds, its executors and the stop by identity are in pdops.steps: builders.drain_steps,
stop, stopping):
- ``plan``: the drain's and the stop's plans, and the plan that ends a stop's survivors;
- ``execute``: the walk under the lock.
"""

from pdops.ops.drain.execute import execute_drain, execute_kill_survivors
from pdops.ops.drain.plan import DrainPlan, KillPlan, plan_drain, plan_kill_survivors

__all__ = ["DrainPlan", "KillPlan", "execute_drain", "execute_kill_survivors", "plan_drain", "plan_kill_survivors"]
