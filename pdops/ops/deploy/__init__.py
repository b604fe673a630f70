"""`inv deploy`: render, deliver with Ansible, start in order, health-gate, register, canary, record.

Plan (pure, printable with --dry-run) and do (walks the plan over Fabric, journals every
step with its evidence, stops at the first failure and says what it left running).
`current` moves only after every step succeeded.

The package, by concern (each module imports only those listed before it):
- ``steps``: the step builders deploy and a change share (pure);
- ``actions``: what a step does on the hosts and the gateway (deliver, start, register, canary);
- ``plan``: plan_deploy and plan_reconcile;
- ``execute``: the executors, the records of a deploy and of a repair, the walk under the lock.
The cluster's record is opened by the caller (``pdops.record.open_record``) and passed in.
"""

from __future__ import annotations

from pdops.ops.deploy.actions import (both_sides, canary_pairs, configs_of, deliver, processes_of, register,
                                  running_evidence, start_gateway)
from pdops.ops.deploy.execute import do_canary, execute_deploy, walk_deploy
from pdops.ops.deploy.plan import DeployPlan, plan_deploy, plan_reconcile
from pdops.ops.deploy.steps import (canary_step, connect_step, delivery_steps, preflight_step, register_steps, start_steps,
                                verify_running_step)

__all__ = ["DeployPlan", "both_sides", "canary_pairs", "canary_step", "configs_of", "connect_step", "deliver",
           "delivery_steps", "do_canary", "execute_deploy", "processes_of", "plan_deploy", "plan_reconcile",
           "preflight_step", "register", "register_steps", "running_evidence", "start_gateway", "start_steps",
           "verify_running_step", "walk_deploy"]
