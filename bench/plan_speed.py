"""Benchmark: `inv plan --topology 12p4d -i inventory/rtx6000d` wall time, as an operator runs it.

The inventory is read with ansible-core's InventoryManager and VariableManager (imported once,
only when an inventory is loaded). Goal: under 1 s on this machine. Before Ansible read the
inventory (pdops's own YAML merge) it took 0.33 s (issue figure) and 0.54 s measured here
with the same interpreter. Usage: python bench/plan_speed.py [--runs 7]
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    runs = ap.parse_args().runs
    cmd = [sys.executable, "-m", "invoke", "plan", "--topology", "12p4d", "-i", "inventory/rtx6000d"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)  # warm the file cache, untimed
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(f"inv plan --topology 12p4d -i inventory/rtx6000d: median {med:.2f} s over {runs} runs "
          f"(min {min(times):.2f}, max {max(times):.2f}); goal < 1 s: {'met' if med < 1 else 'NOT met'}")


if __name__ == "__main__":
    main()
