"""Every step kind a plan may hold, bound to the one function that carries it out, and the outputs
(pdops.outputs) its steps give and read: the one place where kinds meet executors.

An executor is named here as ``"module:function"`` and imported by the runner the first time a walk
needs it (pdops.runner.executor), never registered by importing its module: which modules an
operation imports says nothing about which kinds it can run, and no module is imported only for a
side effect. A plan whose kinds are not all here is refused before its first step
(pdops.runner.walk); tests/unit/ops/test_plans.py resolves every entry and checks every output name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Kind:
    executor: Any  # "module:function" (a test may bind a function itself)
    gives: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()


KINDS: dict[str, Kind] = {
    # pdops.ops.admission_keys
    "admission-check": Kind("pdops.ops.admission_keys:do_check_unit", gives=("admission_keys",)),
    "deliver-keys": Kind("pdops.ops.admission_keys:do_deliver_keys"),
    "admission-reload": Kind("pdops.ops.admission_keys:do_reload", needs=("admission_keys",)),
    "verify-keys": Kind("pdops.ops.admission_keys:do_verify_keys", needs=("admission_keys",)),
    # pdops.steps.serve
    "connect": Kind("pdops.steps.serve:do_connect"),
    "preflight": Kind("pdops.steps.serve:do_preflight"),
    "render": Kind("pdops.steps.serve:do_render", gives=("build",)),
    "deliver": Kind("pdops.steps.serve:do_deliver", needs=("build",)),
    "gateway": Kind("pdops.steps.serve:do_gateway", gives=("started",)),
    "admission": Kind("pdops.steps.serve:do_admission"),
    "start": Kind("pdops.steps.serve:do_start", gives=("started_instances", "started", "healthy", "main_pids")),
    "wait-healthy": Kind("pdops.steps.serve:do_wait_healthy"),
    "canary": Kind("pdops.steps.serve:do_canary", needs=("started_instances?",)),
    "register": Kind("pdops.steps.serve:do_register", gives=("posted", "workers")),
    "gateway-list": Kind("pdops.steps.serve:do_gateway_list", needs=("workers",)),
    "close-breakers": Kind("pdops.steps.serve:do_close_breakers"),
    "verify-running": Kind("pdops.steps.serve:do_verify_running", gives=("running",)),
    "undo-register": Kind("pdops.steps.serve:do_undo_register", needs=("workers?", "posted?")),
    "front-door-ready": Kind("pdops.steps.serve:do_front_door_ready"),
    "front-door-set": Kind("pdops.steps.serve:do_front_door_set", needs=("fence?",)),
    # pdops.steps.stop
    "leave-gateway": Kind("pdops.steps.stop:do_leave_gateway", gives=("drain_state", "left_gateway"), needs=("drain_state?",)),
    "wait-empty": Kind("pdops.steps.stop:do_wait_empty", gives=("drain_state", "accepted_loss"), needs=("drain_state?",)),
    "empty-check": Kind("pdops.steps.stop:do_empty_check", gives=("drain_state",), needs=("drain_state?", "accepted_loss?")),
    "record-identity": Kind("pdops.steps.stop:do_record_identity", gives=("drain_state",), needs=("drain_state?",)),
    "stop": Kind("pdops.steps.stop:do_stop", gives=("drain_state",), needs=("drain_state?",)),
    "verify-stop": Kind("pdops.steps.stop:do_verify_stop", gives=("drain_state", "drained", "replaced_out"), needs=("drain_state?",)),
    "check-units": Kind("pdops.steps.stop:do_check_units"),
    "kill-survivors": Kind("pdops.steps.stop:do_kill_survivors"),
    "verify-gone": Kind("pdops.steps.stop:do_verify_gone"),
    # pdops.steps.record
    "record-deploy": Kind("pdops.steps.record:do_record_deploy", gives=("revision",), needs=("workers", "build", "running", "main_pids?")),
    "record-repair": Kind("pdops.steps.record:do_record_repair", gives=("revision",), needs=("workers?", "running?")),
    "record-drain": Kind("pdops.steps.record:do_record_drain"),
    "lost-work": Kind("pdops.steps.record:do_lost_work", gives=("lost_work",)),
    "status-baseline": Kind("pdops.steps.record:do_status_baseline"),
    # pdops.ops.probe.execute
    "probe-canary": Kind("pdops.ops.probe.execute:do_probe_canary", gives=("canary_evidence",), needs=("started_instances?",)),
    "probe-requests": Kind("pdops.ops.probe.execute:do_probe_requests", gives=("probe_result", "probe_keep"), needs=("canary_evidence?",)),
    "probe-remove-files": Kind("pdops.ops.probe.execute:do_probe_remove_files"),
    "probe-verify-baseline": Kind("pdops.ops.probe.execute:do_probe_verify_baseline"),
    # pdops.ops.record_store
    "record-read": Kind("pdops.ops.record_store:do_record_read", gives=("source_record",)),
    "record-check-target": Kind("pdops.ops.record_store:do_record_check_target", needs=("source_record",)),
    "record-copy": Kind("pdops.ops.record_store:do_record_copy", needs=("source_record",)),
    "record-verify-copy": Kind("pdops.ops.record_store:do_record_verify_copy", needs=("source_record",)),
    "record-mark-moved": Kind("pdops.ops.record_store:do_record_mark_moved"),
    "record-check-empty": Kind("pdops.ops.record_store:do_record_check_empty"),
    "record-restore": Kind("pdops.ops.record_store:do_record_restore"),
    "record-verify-restore": Kind("pdops.ops.record_store:do_record_verify_restore"),
    "etcd-check-members": Kind("pdops.ops.record_store:do_etcd_check_members", gives=("etcd_running",)),
    "etcd-deliver": Kind("pdops.ops.record_store:do_etcd_deliver"),
    "etcd-start": Kind("pdops.ops.record_store:do_etcd_start", needs=("etcd_running",)),
    "etcd-check-quorum": Kind("pdops.ops.record_store:do_etcd_check_quorum"),
    "etcd-member-start": Kind("pdops.ops.record_store:do_etcd_member_start"),
    # pdops.ops.scale.execute
    "retire-gateway": Kind("pdops.ops.scale.execute:do_retire_gateway"),
    "record-scale": Kind("pdops.ops.scale.execute:do_record_scale", gives=("revision", "topology", "lost"), needs=("workers?", "build?", "main_pids?", "running?", "lost_work?")),
    "deliver-wave": Kind("pdops.ops.scale.execute:do_deliver_wave", needs=("build",)),
    "gateway-restart": Kind("pdops.ops.scale.execute:do_gateway_restart"),
    # pdops.ops.scale.fence_exec
    "fence-gateway": Kind("pdops.ops.scale.fence_exec:do_fence_gateway", gives=("fence",)),
    "shift": Kind("pdops.ops.scale.fence_exec:do_shift", gives=("shifted",), needs=("fence",)),
    "fence-commit": Kind("pdops.ops.scale.fence_exec:do_fence_commit", gives=("committed",), needs=("shifted",)),
    "unfence-gateway": Kind("pdops.ops.scale.fence_exec:do_unfence_gateway", needs=("fence?",)),
    "leave-old-pool": Kind("pdops.ops.scale.fence_exec:do_leave_old_pool", needs=("drained?",)),
    # pdops.ops.scale.rescue
    "undo-decide": Kind("pdops.ops.scale.rescue:do_undo_decide", gives=("halt", "undo_drain", "undo_stop"), needs=("started_instances?", "workers?", "posted?", "drained?", "replaced_out?", "committed?")),
    "restore-check": Kind("pdops.ops.scale.rescue:do_restore_check", gives=("restore", "halt"), needs=("drained?", "replaced_out?", "left_gateway?")),
    "restore-canary": Kind("pdops.ops.scale.rescue:do_restore_canary", gives=("restore_canaried", "not_restored"), needs=("restore?",)),
    "restore-register": Kind("pdops.ops.scale.rescue:do_restore_register", gives=("workers", "restored", "not_restored")),
    "restore-list": Kind("pdops.ops.scale.rescue:do_restore_list", needs=("restored?",)),
    "record-halt": Kind("pdops.ops.scale.rescue:do_record_halt", gives=("halt_record",), needs=("drained?", "replaced_out?", "left_gateway?", "halt?", "workers?", "main_pids?", "plan_verdicts?", "undo_drain?", "undo_stop?", "restored?", "not_restored?")),
    # pdops.ops.bench.run
    "bench-mark": Kind("pdops.ops.bench.run:do_bench_mark", gives=("bench_mark",)),
    "bench-load": Kind("pdops.ops.bench.run:do_bench_load", gives=("bench_rows",)),
    "bench-check": Kind("pdops.ops.bench.run:do_bench_check", gives=("bench_check",), needs=("bench_mark",)),
    "bench-write": Kind("pdops.ops.bench.run:do_bench_write", gives=("bench_result",), needs=("bench_rows", "bench_check")),
    # pdops.ops.sweep.execute
    "open-matrix": Kind("pdops.ops.sweep.execute:do_open_matrix", gives=("sweep_matrix",)),
    "sweep-scale": Kind("pdops.ops.sweep.execute:do_sweep_scale", gives=("sweep_failed_rows",),
                        needs=("sweep_matrix", "sweep_failed_rows?")),
    "sweep-run": Kind("pdops.ops.sweep.execute:do_sweep_run", needs=("sweep_matrix", "sweep_failed_rows?")),
    "write-matrix": Kind("pdops.ops.sweep.execute:do_write_matrix", needs=("sweep_matrix?",)),
    # pdops.steps.targets
    "publish-targets": Kind("pdops.steps.targets:do_publish_targets"),
    # pdops.steps.orphans
    "end-orphans": Kind("pdops.steps.orphans:do_end_orphans", gives=("orphans_ended",)),
    # pdops.runner
    "walk-plan": Kind("pdops.runner:do_walk_plan", gives=("plan_verdicts",)),
}


# What a failed walk adds to its error once its rescue has run, by the name a plan gives it
# (pdops.plans.Plan.failure_line): "module:function" (a test may bind a function itself) of the walk's
# context, read once the walk is over (its outputs, the record), and the plan; imported when needed
# (pdops.runner.failure_line); and what the dry run says it writes.
FAILURE_LINES: dict[str, tuple[str, str]] = {
    "halted-change": ("pdops.ops.scale.rescue:halted_change_line",
                      "the verdict line of a halted change (what is current, what runs, what was undone)"),
    "deploy-failed": ("pdops.ops.deploy.execute:deploy_failed_line",
                      "the revision current and the units this deploy started (left for inspection)"),
    "drain-interrupted": ("pdops.ops.drain.execute:drain_interrupted_line",
                          "that the instance is not recorded as stopped, the last step completed and how to resume"),
}
