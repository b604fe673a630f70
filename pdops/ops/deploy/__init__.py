"""`inv deploy`: render, deliver with Ansible, start in order, health-gate, register, canary, record.

Plan (pure, printable with --dry-run) and do (walks the plan over Fabric, journals every
step with its evidence, stops at the first failure and says what it left running).
`current` moves only after every step succeeded.

The package, by concern (each module imports only those listed before it; the step builders and
what the steps do on the hosts, shared with every operation, are in pdops.steps):
- ``plan``: plan_deploy and plan_reconcile;
- ``execute``: the walk under the lock, and `inv deploy` whole (observe, plan, walk).
The cluster's record is opened by the caller (``pdops.record.open_record``) and passed in.
"""

from __future__ import annotations

from pdops.ops.deploy.execute import execute_deploy, operate_deploy
from pdops.ops.deploy.plan import DeployPlan, plan_deploy, plan_reconcile

__all__ = ["DeployPlan", "execute_deploy", "operate_deploy", "plan_deploy", "plan_reconcile"]
