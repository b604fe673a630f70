"""Benchmark: the runner's own overhead per step during a 16-host deploy on the lab.

Boots 16 lab hosts, deploys 15p1d (sim "model load" 0) through the runner, and for every
batch of steps compares the batch's wall time with the time spent inside its executors
(the steps' commands and waits): the difference is the runner's own work (fan-out, journal
writes with fsync, progress). Goal: under 2% of the deploy's wall time. Takes the lab lock
(/srv/pdops-lab.lock); leaves no lab. Usage: python bench/runner_overhead.py [--hosts 16]
"""

import argparse
import fcntl
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdops.record import open_record  # noqa: E402
from pdops.ops import deploy as dep  # noqa: E402
from pdops import lab as lab_api  # noqa: E402
from pdops.remote.hosts import connections  # noqa: E402
from pdops.runner import RunContext, walk  # noqa: E402
from pdops.model.topology import Topology  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from deploy_overhead import lab_inventory  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=16)
    n = ap.parse_args().hosts
    work = lab_api.resolve_lab_dir() / "bench-runner" / time.strftime("%H%M%S")
    with open("/srv/pdops-lab.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            lab_api.down()
            lab_api.up(n)
            inv = lab_inventory(work)
            state = open_record(inv)
            plan = dep.plan_deploy(inv, Topology(n - 1, 1), state)
            with connections(inv) as conns:
                pool, gateways = conns["pool"], conns["gateways"]
                ctx = RunContext(inv, state, "bench-deploy", lambda s: None, pool, gateways, placement=plan.placement)
                t0 = time.perf_counter()
                with state.lock("deploy", op_id=ctx.op):
                    walk(plan.plan, ctx)
                wall = time.perf_counter() - t0
        finally:
            lab_api.down()
    rows = ctx.timing
    print(f"{'batch':<48} {'steps':>5} {'wall s':>8} {'inside s':>9} {'runner ms/step':>15}")
    total_over = 0.0
    for r in rows:
        over = max(0.0, r["wall_s"] - r["inside_s"])
        total_over += over
        name = r["steps"][0] if len(r["steps"]) == 1 else f"{r['steps'][0]} .. ({len(r['steps'])} in parallel)"
        print(f"{name:<48} {len(r['steps']):>5} {r['wall_s']:>8.2f} {r['inside_s']:>9.2f} "
              f"{1000 * over / len(r['steps']):>15.1f}")
    steps = sum(len(r["steps"]) for r in rows)
    share = 100 * total_over / wall
    print(f"\n{n}-host deploy ({n - 1}p1d, {steps} steps): wall {wall:.1f} s, runner overhead {total_over * 1000:.0f} ms "
          f"({1000 * total_over / steps:.1f} ms per step) = {share:.2f}% of the wall time "
          f"(goal < 2%: {'met' if share < 2 else 'NOT met'})")


if __name__ == "__main__":
    main()
