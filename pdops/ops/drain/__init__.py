"""`inv drain --instance p07` and `inv stop --instance p07` (rule 4 of docs/design/architecture.md).

Drain, in order: leave the gateway (remove by worker id, verify gone); wait until the
instance's in-flight work is finished, per request ID and per queue on every rank; two
independent empty-state checks separated in time; stop by identity (unit -> MainPID ->
cgroup, process tree with start times recorded first) and prove it stopped; record a
new revision without the instance, with the way back. Plan first, `--dry-run` prints it.

The package, by concern (each module imports only those listed before it):
- ``stopping``: reading an instance (queues, emptiness) and stopping it by identity, proven;
  the survivors of a stop;
- ``plan``: the drain's and the stop's plans, the drain sub-plan a change embeds, and the plan
  that ends a stop's survivors;
- ``execute``: the executors of those step kinds and the walk under the lock.
"""

from pdops.ops.drain.execute import execute_drain, execute_kill_survivors
from pdops.ops.drain.plan import GONE_WAIT_S, DrainPlan, KillPlan, drain_steps, plan_drain, plan_kill_survivors
from pdops.ops.drain.stopping import EmptyReading, describe_survivor, kill_command, verify_stopped

__all__ = ["GONE_WAIT_S", "DrainPlan", "EmptyReading", "KillPlan", "describe_survivor", "drain_steps", "execute_drain",
           "execute_kill_survivors", "kill_command", "plan_drain", "plan_kill_survivors", "verify_stopped"]
