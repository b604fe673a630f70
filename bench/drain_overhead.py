"""Benchmark: drain overhead = drain wall time - remaining time of the longest in-flight request.

Deploys 2p2d on a 4-host lab (takes /srv/pdops-lab.lock; leaves no lab), starts long
streams through the gateway, drains d02 and then p02, and prints the overhead of each
against the goal: under two empty-check intervals plus one second.
"""

import fcntl
import sys
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdops.record import open_record  # noqa: E402
from pdops.ops import deploy as dep  # noqa: E402
from pdops.ops import drain as dr  # noqa: E402
from pdops import lab as lab_api  # noqa: E402
from pdops.remote.hosts import connections  # noqa: E402
from pdops.model.inventory import load_inventory, single_file_doc  # noqa: E402
from pdops.remote.loadgen import send  # noqa: E402
from pdops.model.topology import Topology  # noqa: E402

INTERVAL_S = 1.0


def drain_with_load(inv, state, instance: str, prompt: str | None) -> float:
    rows: list = []
    t = threading.Thread(target=lambda: rows.extend(send(
        inv.gateway.first.url, requests=12, concurrency=12, max_new_tokens=150, stream_every=1, prompt=prompt,
        rid_prefix=f"bench-{instance}")))
    t.start()
    time.sleep(0.5)  # let the streams get routed (this is a benchmark, not a readiness check)
    plan = dr.plan_drain(inv, state, instance, interval_s=INTERVAL_S)
    t0 = time.time()
    with connections(inv) as conns:
        dr.execute_drain(plan, state, say=lambda s: None, **conns)
    t1 = time.time()
    t.join()
    longest_end = max((r.end for r in rows if r.end), default=t0)
    remaining = max(0.0, longest_end - t0)
    overhead = (t1 - t0) - remaining
    failed = sum(not r.ok for r in rows)
    print(f"drain {instance}: wall {t1 - t0:.2f} s, longest in-flight request had {remaining:.2f} s left, "
          f"overhead {overhead:.2f} s (goal < {2 * INTERVAL_S + 1:.1f} s: "
          f"{'met' if overhead < 2 * INTERVAL_S + 1 else 'NOT met'}); failed requests: {failed}")
    return overhead


def main() -> None:
    with open("/srv/pdops-lab.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            lab_api.up(4)
            where = lab_api.resolve_lab_dir() / "bench-drain" / time.strftime("%H%M%S")
            where.mkdir(parents=True)
            doc = single_file_doc(lab_api.inventory_path())
            lab_api.own_record(doc, where)
            prof = yaml.safe_load((REPO / "pdops/profiles/lab-sim.yml").read_text())
            prof.setdefault("env", {}).update({"PDOPS_SIM_DECODE_STEP_MS": "20"})
            (where / "profiles").mkdir()
            (where / "profiles" / "p.yml").write_text(yaml.safe_dump(prof))
            doc["all"]["vars"]["pdops_profile"] = "profiles/p.yml"
            (where / "hosts.yml").write_text(yaml.safe_dump(doc))
            inv = load_inventory(where)
            state = open_record(inv)
            with connections(inv) as conns:
                dep.execute_deploy(dep.plan_deploy(inv, Topology(2, 2), state), say=lambda s: None, **conns)
            drain_with_load(inv, state, "d02", None)
            drain_with_load(inv, state, "p02", " ".join(["tok"] * 4000))
        finally:
            lab_api.down()


if __name__ == "__main__":
    main()
