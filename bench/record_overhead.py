"""Benchmark: what the shared record costs an operation (docs/state.md), against the local record.

Boots a 2-host lab; the record lives on lab01 and is reached over SSH, as in production.
Prints the median and max of: one read of the record (a fresh command's snapshot), taking and
releasing the cluster lock, one journal line written under the lock; the same for a local
StateDir on this machine. Takes the lab lock (/srv/pdops-lab.lock); leaves no lab.
Usage: python bench/record_overhead.py [--rounds 20]
"""

import argparse
import fcntl
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdops.record import open_record  # noqa: E402
from pdops import lab as lab_api  # noqa: E402
from pdops.model.inventory import load_inventory, single_file_doc  # noqa: E402
from pdops.record.local import StateDir  # noqa: E402


def timed(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def row(name: str, xs: list[float]) -> str:
    return f"  {name:<44} median {statistics.median(xs) * 1000:8.1f} ms   max {max(xs) * 1000:8.1f} ms   (n={len(xs)})"


def measure(make, rounds: int) -> dict[str, list[float]]:
    res = {"read the record (fresh command)": timed(lambda: make().current(), rounds)}

    def lock_cycle():
        r = make()
        with r.lock("bench", say=lambda s: None):
            pass

    res["take + release the cluster lock"] = timed(lock_cycle, rounds)
    r = make()
    with r.lock("bench", say=lambda s: None) as lk:
        j = r.journal()
        res["one journal line under the lock"] = timed(lambda: j.step(lk.op_id, "bench", "ok", {"x": 1}), rounds * 10)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    rounds = ap.parse_args().rounds
    with open("/srv/pdops-lab.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            lab_api.down()
            lab_api.up(2)
            where = lab_api.resolve_lab_dir() / "bench-record" / time.strftime("%H%M%S")
            where.mkdir(parents=True)
            doc = lab_api.own_record(single_file_doc(lab_api.inventory_path()), where)
            (where / "hosts.yml").write_text(yaml.safe_dump(doc))
            inv = load_inventory(where)
            shared = measure(lambda: open_record(inv), rounds)
        finally:
            lab_api.down()
    with tempfile.TemporaryDirectory(dir="/srv") as d:
        local = measure(lambda: StateDir("bench", Path(d)), rounds)
    print(f"shared record on {inv.state.host}:{inv.state.dir} over SSH (lab, loopback):")
    for k, xs in shared.items():
        print(row(k, xs))
    print("local record (this machine's disk, as before):")
    for k, xs in local.items():
        print(row(k, xs))
    extra = (statistics.median(shared["take + release the cluster lock"])
             + statistics.median(shared["read the record (fresh command)"]))
    print(f"added to each change: about {extra:.2f} s once, plus "
          f"{statistics.median(shared['one journal line under the lock']) * 1000:.1f} ms per journalled step")


if __name__ == "__main__":
    main()
