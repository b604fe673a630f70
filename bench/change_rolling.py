"""Benchmark: day-2 changes on the lab (takes /srv/pdops-lab.lock; leaves no lab).

1. A prefill re-added at a slot drained moments before (4p1d -> 3p1d -> 4p1d on 5 hosts, the
   case where a decode still holds a route to the old process): the time from the new
   instance's start to its registration, against 2x its start-to-healthy time plus one canary's
   time, and whether its first canary passed.
2. A rolling change of every instance of a 4p4d cluster (8 hosts; a parameter-bundle change,
   one instance per role at a time) under load: its overhead beyond the drains and engine starts
   (per wave, the longer of its drains and of its starts), and the fewest serving instances per
   role the gateway listed while it ran.
"""

import fcntl
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdops.record import open_record  # noqa: E402
from pdops.ops import deploy as dep  # noqa: E402
from pdops import lab as lab_api  # noqa: E402
from pdops.ops import scale as sc  # noqa: E402
from pdops.remote.gateway import GatewayClient  # noqa: E402
from pdops.remote.hosts import connections  # noqa: E402
from pdops.model.inventory import load_inventory, single_file_doc  # noqa: E402
from pdops.remote.loadgen import send  # noqa: E402
from pdops.model.topology import parse_topology  # noqa: E402

QUIET = {"say": lambda s: None}


def cluster(hosts: int, name: str):
    lab_api.up(hosts)
    where = lab_api.resolve_lab_dir() / name / time.strftime("%H%M%S")
    where.mkdir(parents=True)
    doc = single_file_doc(lab_api.inventory_path())
    lab_api.own_record(doc, where)
    prof = yaml.safe_load((REPO / "pdops/profiles/lab-sim.yml").read_text())
    (where / "p.yml").write_text(yaml.safe_dump(prof))
    doc["all"]["vars"]["pdops_profile"] = "p.yml"
    (where / "hosts.yml").write_text(yaml.safe_dump(doc))
    return where


def journal(state):
    state.refresh()
    j = state.journal()
    return j.read(j.operations()[-1])


def ts(rec) -> float:
    return datetime.fromisoformat(rec["ts"]).timestamp()


def change(inv, state, topo: str, **kw) -> float:
    plan = sc.plan_apply(inv, parse_topology(topo), state, **kw)
    t0 = time.time()
    with connections(inv) as conns:
        sc.execute_scale(plan, state, **QUIET, **conns)
    return time.time() - t0


def deployed(hosts: int, name: str, topo: str):
    """A fresh lab cluster of `hosts` hosts with `topo` deployed: (its dir, inventory, record)."""
    where = cluster(hosts, name)
    inv = load_inventory(where)
    state = open_record(inv)
    with connections(inv) as conns:
        dep.execute_deploy(dep.plan_deploy(inv, parse_topology(topo), state), **QUIET, **conns)
    state.refresh()
    return where, inv, state


def re_added_prefill() -> None:
    where, inv, state = deployed(5, "bench-change-readd", "4p1d")
    # traffic through every pair, so d01 holds a route to p04's bootstrap address
    send(inv.gateway.first.url, requests=16, concurrency=8, max_new_tokens=8, rid_prefix="bench-warm")
    change(inv, state, "3p1d")
    state.refresh()
    change(inv, state, "4p1d")  # at once: the decode's heartbeats have not given up on the old p04
    recs = {r["step"]: r for r in journal(state)}
    start, canary, reg = recs["start p04"], recs["canary p04"], recs["register p04"]
    healthy = start["evidence"]["ready_s"]
    canary_s = canary["evidence"]["seconds"]
    start_to_reg = ts(reg) - (ts(start) - start["evidence"]["seconds"])
    goal = 2 * healthy + canary_s
    first = "passed" if "first_attempt_failed" not in canary["evidence"] else \
        f"FAILED ({canary['evidence']['first_attempt_failed']})"
    port = state.current_revision().placement
    p04 = next(i for i in port["instances"] if i["id"] == "p04")
    print(f"re-added p04 (3p1d -> 4p1d right after 4p1d -> 3p1d): start to healthy {healthy:.2f} s, canary "
          f"{canary_s:.2f} s, start to registered {start_to_reg:.2f} s; goal <= 2 x healthy + canary = {goal:.2f} s: "
          f"{'met' if start_to_reg <= goal else 'NOT met'} (ratio {start_to_reg / goal:.2f}); first canary {first}; "
          f"bootstrap port {p04['bootstrap_port']} (the drained p04 had the other one)")


def rolling_4p4d() -> None:
    where, inv, state = deployed(8, "bench-change-rolling", "4p4d")
    prof = yaml.safe_load((where / "p.yml").read_text())
    prof["bundle"]["max_running_requests"] = 48
    (where / "p.yml").write_text(yaml.safe_dump(prof))
    inv = load_inventory(where)
    seen = {"prefill": 99, "decode": 99}
    stop = threading.Event()
    gw = GatewayClient(inv.gateway.first.url)

    def watch():
        while not stop.is_set():
            try:
                ws = gw.list_workers()
                for role in seen:
                    seen[role] = min(seen[role], sum(1 for w in ws if w.routable and w.worker_type == role))
            except Exception:  # noqa: BLE001 - a missed sample
                pass
            time.sleep(0.2)

    rows: list = []
    load = threading.Thread(target=lambda: rows.extend(send(
        inv.gateway.first.url, requests=400, concurrency=6, max_new_tokens=16, stream_every=2, rid_prefix="bench-roll",
        timeout=120)))
    w = threading.Thread(target=watch)
    w.start()
    load.start()
    wall = change(inv, state, "4p4d")
    stop.set()
    w.join()
    load.join()
    recs = journal(state)
    by = {r["step"]: r for r in recs}
    waves = [[s for s in st.split(": ")[0].split()[1].split("+")] for st in by if st.startswith("deliver ")]
    inside = 0.0
    naive = 0.0
    for wave in waves:
        drains = [ts(by[f"replace {i}: verify-stop"]) - (ts(by[f"replace {i}: leave-gateway"])
                  - by[f"replace {i}: leave-gateway"]["evidence"]["seconds"]) for i in wave]
        starts = [by[f"start {i}"]["evidence"]["seconds"] for i in wave]
        inside += max(drains) + max(starts)
        naive += sum(drains) + sum(starts)
    failed = sum(not r.ok for r in rows)
    print(f"rolling change of every instance of 4p4d ({len(waves)} waves, 1 per role at a time): wall {wall:.1f} s; "
          f"drains + engine starts {inside:.1f} s (per wave the longer of each; {naive:.1f} s summed one by one); "
          f"overhead {wall - inside:.1f} s ({(wall - inside) / len(waves):.1f} s per wave: preflight, deliveries, "
          f"canaries, registrations, verify-running, record); fewest serving: {seen['prefill']} prefill, "
          f"{seen['decode']} decode (of 4 each); load: {len(rows)} requests, {failed} failed")


def main() -> None:
    with open("/srv/pdops-lab.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            re_added_prefill()
            lab_api.down()
            rolling_4p4d()
        finally:
            lab_api.down()


if __name__ == "__main__":
    main()
