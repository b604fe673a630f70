"""pdops command line: `inv --list` shows every task; `inv --help <task>` its options.

Thin by design: each task lives in pdops/cli/<area>.py, parses its arguments, calls
one pdops function and prints the result.
"""

from invoke import Collection

from pdops.cli import admission, audit, bench, core, lab, preflight, probe, prometheus, report, scale, state

ns = Collection.from_module(core)
for t in (bench.bench, bench.sweep, bench.capacity, preflight.preflight, scale.scale, scale.rollback,
          scale.history, scale.diff, state.journal, state.unlock, probe.probe, report.report):
    ns.add_task(t)
ns.add_collection(Collection.from_module(lab), name="lab")
ns.add_collection(Collection(state.push, state.show, state.migrate, state.restore, state.etcd_up), name="state")
ns.add_collection(Collection.from_module(audit), name="audit")
ns.add_collection(Collection.from_module(admission), name="admission")
ns.add_collection(Collection.from_module(prometheus), name="prometheus")  # the fleet's Prometheus and Grafana files
