"""Benchmark: deploy overhead (without engine load time) for 2, 4, 8 and 16 lab hosts.

Boots a lab of N hosts, deploys (N-1)p1d (one TP8 instance per host) with the sim's
"model load" set to 0, and reports the deploy's wall time; goal: 16 hosts under 2x the
4-host time (parallel fan-out). Takes the lab lock (/srv/pdops-lab.lock); leaves no lab.
Also prints the marginal cost of each added host, (T16 - T4) / 12 (goal under 0.5 s).
Usage: python bench/deploy_overhead.py [--sizes 2,4,8,16]
"""

import argparse
import fcntl
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdops.record import open_record  # noqa: E402
from pdops.ops import deploy as dep  # noqa: E402
from pdops import lab as lab_api  # noqa: E402
from pdops.remote.hosts import connections  # noqa: E402
from pdops.model.inventory import load_inventory, single_file_doc  # noqa: E402
from pdops.model.topology import Topology  # noqa: E402


def lab_inventory(where: Path):
    """The running lab's inventory with its own state dir under `where` and the sim's model load at 0."""
    where.mkdir(parents=True, exist_ok=True)
    doc = single_file_doc(lab_api.inventory_path())
    lab_api.own_record(doc, where)
    (where / "profiles").mkdir(exist_ok=True)
    prof = yaml.safe_load((REPO / "pdops/profiles/lab-sim.yml").read_text())
    prof.setdefault("env", {})["PDOPS_SIM_STARTUP_S"] = "0"
    (where / "profiles" / "p.yml").write_text(yaml.safe_dump(prof))
    doc["all"]["vars"]["pdops_profile"] = "profiles/p.yml"
    (where / "hosts.yml").write_text(yaml.safe_dump(doc))
    return load_inventory(where)


def deploy_once(n: int, work: Path) -> float:
    lab_api.up(n)
    inv = lab_inventory(work / f"n{n}")
    plan = dep.plan_deploy(inv, Topology(n - 1, 1), open_record(inv))
    t0 = time.perf_counter()
    with connections(inv) as conns:
        dep.execute_deploy(plan, say=lambda s: None, **conns)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2,4,8,16")
    sizes = [int(x) for x in ap.parse_args().sizes.split(",")]
    work = lab_api.resolve_lab_dir() / "bench-deploy"
    with open("/srv/pdops-lab.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        times = {}
        try:
            for n in sizes:
                lab_api.down()
                times[n] = deploy_once(n, work / time.strftime("%H%M%S"))
                print(f"{n:3d} hosts: deploy of {n - 1}p1d took {times[n]:.1f} s", flush=True)
        finally:
            lab_api.down()
    if 4 in times and 16 in times:
        r = times[16] / times[4]
        per_host = (times[16] - times[4]) / 12
        print(f"16 hosts / 4 hosts = {r:.2f} (goal < 2.0: {'met' if r < 2 else 'NOT met'})")
        print(f"marginal cost of each added host (T16 - T4) / 12 = {per_host:.2f} s "
              f"(goal < 0.5 s: {'met' if per_host < 0.5 else 'NOT met'})")
    for n in sizes:
        if n != sizes[0]:
            print(f"{n} / {sizes[0]} hosts = {times[n] / times[sizes[0]]:.2f}")


if __name__ == "__main__":
    main()
