"""What one step of a plan may hand the steps after it: the one table of output names and what
each holds. A step kind declares in the table of kinds (pdops.kinds.KINDS) the
names it gives and needs; nothing else passes between executors."""

OUTPUTS: dict[str, str] = {
    "build": "the folder of this operation's rendered files (a Path)",
    "started": "the host:unit names this operation started (a list)",
    "started_instances": "instance id -> the Instance this operation started",
    "healthy": "the ids of the instances whose start passed its health gate (a set)",
    "main_pids": "instance id -> {host:unit: MainPID} read when it turned healthy",
    "posted": "the ids of the instances whose registration was sent to the gateway (a set)",
    "workers": "instance id -> the gateway's worker id of its registration",
    "running": "host:unit -> what verify-running read (MainPID, its config id, ...)",
    "left_gateway": "the ids of the instances a change took out of the gateway (a list)",
    "drained": "the ids of the instances a change drained and stopped (a list)",
    "replaced_out": "the ids of the instances whose old process a change stopped (a list)",
    "drain_state": "instance id -> {already_stopped (read at its drain's first step), idents (record-identity), "
                   "seconds (stop)}",
    "accepted_loss": "instance id -> the request ids a --force-after drain stopped with",
    "lost_work": "instance id -> {lost, failed}: the request ids an ended process never finished",
    "orphans_ended": "prefill id -> the rids of the orphaned halves `end-orphans` aborted (empty: none)",
    "halt": "what a halted change's rescue found: the instances it kept ({kept_added}) and those out of service ({down})",
    "restore": "the ids of the instances a halted change took out of the gateway, did not stop, and found running (a set)",
    "restore_canaried": "of `restore`, the ids whose canary passed: to be registered again (a set)",
    "restored": "the ids of the instances a halted change's rescue registered again (a set)",
    "not_restored": "why each instance to restore was not: its canary or its registration failed (a list)",
    "undo_drain": "the ids of the instances a halted change started and registered, which its rescue drains (a set)",
    "undo_stop": "the ids of the instances a halted change started, never registered, which its rescue stops (a set)",
    "halt_record": "what a halted change's failed verdict records (current, partial, live, replaced, out of service, "
                   "...), and its verdict line is written from (pdops.kinds.FAILURE_LINES)",
    "revision": "the number of the revision this operation recorded and made current (its verdict reports it)",
    "topology": "the topology of the revision a change recorded (its verdict reports it)",
    "lost": "a repair: the request ids the repaired instance's ended process lost (its verdict reports them)",
    "admission_keys": "admission host -> what its check read: {main_pid, added, revoked} (a key rotation)",
    "canary_evidence": "what a probe's canary saw (its first attempt failed or not)",
    "bench_mark": "the record's mark when a bench starts (pdops.ops.bench.run.RevisionMark): current, newest, pointer",
    "bench_rows": "a bench's ledger rows, one per request sent, with when the load started and ended",
    "bench_check": "the record's mark before and after a bench, and why the run is invalid (None: unchanged)",
    "bench_result": "a bench run written: its folder, manifest, rows and figures (pdops.ops.bench.run.BenchResult)",
    "probe_result": "a probe's measured outcome per request",
    "probe_keep": "whether a probe keeps its bundle (--keep and every request ok)",
    "plan_verdicts": "walk-plan step id -> the verdict of the plan it walked (e.g. the revision recorded)",
    "sweep_matrix": "the sweep's Matrix being filled (pdops.ops.sweep.matrix): every cell, its runs and state",
    "sweep_failed_rows": "ratio -> why its sweep-scale step failed (its runs are not made)",
    "fence": "a fenced rollout's gateway for the new generation, out of the front door, and the old pool's "
             "workers it dropped ({gateway, dropped})",
    "shifted": "the share of new requests (percent) a fenced rollout last gave the new generation's gateway",
    "committed": "a fenced rollout moved the whole front door to the new generation; the old pool drains (True)",
    "source_record": "the whole record a migration copies: revisions, snapshots, current, journal lines (a dict)",
    "etcd_running": "the etcd members already running the unit pdops renders (a list of hosts)",
}

# The outputs an operation's verdict reports, as its steps gave them (pdops.runner.walk_body): what
# the operator reads after it (`inv deploy` prints the revision), never written by an executor itself.
REPORTED: tuple[str, ...] = ("revision", "topology", "lost")
