"""`inv scale --topology 10p2d` and `inv rollback`: topology changes as verified plans.

A change adds or removes whole, homogeneous replicas; nothing is migrated and no role is
flipped. Plan (pure apart from reading the state dir): from the current revision to the
target placement, partition the instances into added, removed (drained) and kept (left
untouched: their rendered files are identical), order the steps so that new instances
are added and registered before old ones are drained, and give the serving capacity of
each role after every step. Where an added instance needs GPUs that a removed one holds,
the removal must come first: the plan names those GPUs and the temporary capacity and
requires ``--allow-capacity-dip``.

Do: under the cluster lock for the whole change; preflight; deliver the new revision's
files with Ansible (kept instances' files are identical, so nothing of theirs changes);
start and health-gate each added instance, canary its new P x D pairs directly, then
register it; drain each removed instance with the drain machinery (leave the gateway,
wait empty per request ID, two empty checks, stop by identity and verify); record ONE
revision with the full placement and the way back. ``current`` moves only when every
step succeeded. A failure before anything was drained undoes what this change added
(drained if it was registered, stopped and verified) and leaves ``current`` unchanged;
a failure after a drain records what is live as a ``partial`` revision, so ``inv status``
and the journal agree with the hosts.

Rollback is the same change towards a recorded revision's placement (same ids, same
slots), refused when its conditions no longer hold (inventory or rendered files changed).

The package, by concern (each module imports only those listed before it):
- ``model``: ScaleStep, ScalePlan and how it prints, ChangeFacts (what its record and rescue
  steps carry); comparing two revisions' files;
- ``steps``: a plan compiled into the runner's steps (adds, waves, drains, the gateway first,
  the rescue: R1 undo-decide and each started instance's undo plan, R2 the restore steps, R3 record-halt);
- ``revision``: the revision a change records (by its `record-scale` step; a sweep's plan writes it to a
  forecast to plan the rows after it);
- ``execute``: the executors of a change's own kinds, the walk under the lock;
- ``rescue``: the executors of the rescue's kinds;
- ``fenced``: a change of generation planned as a fenced (blue/green) rollout, its steps and rescue;
- ``fence_exec``: the executors of a fenced rollout's own kinds;
- ``decide``: the change planner's decisions, one each (files, generation, which instances are
  replaced, shared files and retired gateways, ports, surge, ordering, floors);
- ``planner``: plan_change, the change planner, composed of those decisions; it hands a change of
  generation to ``fenced``;
- ``operations``: the operations that are one change (scale, apply, rollback, ``drain --host``,
  uncordon), each planned by plan_change.
"""

from pdops.ops.scale.execute import execute_scale
from pdops.ops.scale.change import ScalePlan, ScaleStep, cordoned_hosts, instance_files, union_placement
from pdops.ops.scale.operations import (plan_apply, plan_drain_host, plan_rollback, plan_scale, plan_uncordon,
                                        rollback_conditions)
from pdops.ops.scale.planner import compile_steps, plan_change

__all__ = ["ScalePlan", "ScaleStep", "compile_steps", "cordoned_hosts", "execute_scale", "instance_files", "plan_apply",
           "plan_change", "plan_drain_host", "plan_rollback", "plan_scale", "plan_uncordon", "rollback_conditions",
           "union_placement"]
