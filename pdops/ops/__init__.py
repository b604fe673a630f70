"""OPERATIONS layer: each operation's pure planner (inventory + record + observation in, a
``pdops.plans.Plan`` out) and the executors of its step kinds, each named in the one table of kinds
(``pdops.kinds.KINDS``). deploy, scale/rollback, drain/stop, repair, probe, sweep, bench,
admission key rotation and the Prometheus targets step. Imports everything below it; only the
CLI and the lab import it. The planner modules of each (``plan``, ``planner``, ``steps``,
``model``...) import no connection (the `planners-reach-no-host` contract)."""
