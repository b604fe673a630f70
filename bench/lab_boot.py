"""Lab boot benchmark: boot time for 1, 4 and 16 hosts, memory per host, the 16/4 ratio.

Prints figures; it is not a timed test. Hosts boot in parallel, so 16 hosts should take
well under 4x the time of 4. Uses the lab dir of `inv lab.up` ($PDOPS_LAB_DIR or
/srv/pdops-lab) and refuses to run while a lab is up there (it would take it down).
Usage: python bench/lab_boot.py [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

from pdops import lab  # noqa: E402


def rss_per_host(n: int) -> list[int]:
    """Sum of RSS (bytes) of every process in each host's cgroup subtree."""
    mounts = lab.cgroup_mounts()
    out = []
    for i in range(1, n + 1):
        total = 0
        for pid in lab.host_cgroup_pids(i, mounts):
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                pass
        out.append(total)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="boots per size (median reported)")
    args = ap.parse_args()
    if any(s.up for s in lab.status()):
        print("a lab is up in", lab.resolve_lab_dir(), "- run `inv lab.down` first", file=sys.stderr)
        return 1
    times: dict[int, list[float]] = {}
    mem: list[int] = []
    try:
        for n in (1, 4, 16):
            for _ in range(args.runs):
                lab.down()
                t0 = time.monotonic()
                lab.up(n)
                times.setdefault(n, []).append(time.monotonic() - t0)
            if n == 16:
                mem = rss_per_host(n)
    finally:
        lab.down()
    print(f"lab boot (up to systemd 'running', sshd answering), median of {args.runs}:")
    for n, ts in times.items():
        print(f"  {n:>2} host(s): {statistics.median(ts):6.2f} s   (runs: {', '.join(f'{t:.2f}' for t in ts)})")
    t1, t4, t16 = (statistics.median(times[n]) for n in (1, 4, 16))
    print(f"  ratio 4/1:  {t4 / t1:5.2f}x  (serial would be 4x)")
    print(f"  ratio 16/4: {t16 / t4:5.2f}x  (serial would be 4x)")
    if mem:
        mib = [m / 2**20 for m in mem]
        print(f"memory per host (sum RSS of its cgroup tree, 16 hosts up): "
              f"median {statistics.median(mib):.1f} MiB, min {min(mib):.1f}, max {max(mib):.1f}")
    left = lab.lab_processes()
    print(f"after lab.down: {len(left)} lab processes, {len(lab.lab_cgroup_dirs())} pdops-lab cgroup dirs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
