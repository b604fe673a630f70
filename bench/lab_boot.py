"""Lab boot benchmark: boot time for 1, 4, 16 and 64 hosts, memory per host, the 16/4 ratio.

Prints figures; it is not a timed test. Hosts boot in parallel (in waves of
pdops.lab.lifecycle.BOOT_PARALLEL), so 16 hosts should take well under 4x the time of 4. Memory per
host is read with the largest size up (the sum of RSS in each host's cgroup tree: its systemd,
journald, sshd; no engine), with the machine's MemAvailable before and after. Uses the lab dir of
`inv lab.up` ($PDOPS_LAB_DIR or /srv/pdops-lab, per $PDOPS_LAB_SLOT) and refuses to run while a lab
is up there (it would take it down).
Usage: python bench/lab_boot.py [--runs N] [--sizes 1,4,16,64]
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
    ap.add_argument("--sizes", default="1,4,16,64")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    if any(s.up for s in lab.status()):
        print("a lab is up in", lab.resolve_lab_dir(), "- run `inv lab.down` first", file=sys.stderr)
        return 1
    times: dict[int, list[float]] = {}
    mem: list[int] = []
    avail: list[int] = []
    try:
        for n in sizes:
            for _ in range(args.runs):
                lab.down()
                before = psutil.virtual_memory().available
                t0 = time.monotonic()
                lab.up(n)
                times.setdefault(n, []).append(time.monotonic() - t0)
            if n == sizes[-1]:
                mem, avail = rss_per_host(n), [before, psutil.virtual_memory().available]
    finally:
        lab.down()
    print(f"lab boot (up to systemd 'running', sshd answering), median of {args.runs}:")
    for n, ts in times.items():
        print(f"  {n:>2} host(s): {statistics.median(ts):6.2f} s   (runs: {', '.join(f'{t:.2f}' for t in ts)})")
    med = {n: statistics.median(ts) for n, ts in times.items()}
    for a, b in ((1, 4), (4, 16), (16, 64)):
        if a in med and b in med:
            print(f"  ratio {b}/{a}: {med[b] / med[a]:5.2f}x  (serial would be {b // a}x)")
    if mem:
        mib = [m / 2**20 for m in mem]
        print(f"memory per host (sum RSS of its cgroup tree, {sizes[-1]} hosts up): "
              f"median {statistics.median(mib):.1f} MiB, min {min(mib):.1f}, max {max(mib):.1f}; "
              f"MemAvailable {avail[0] / 2**30:.1f} GiB before, {avail[1] / 2**30:.1f} GiB after "
              f"({(avail[0] - avail[1]) / 2**20 / sizes[-1]:.1f} MiB per host)")
    left = lab.lab_processes()
    print(f"after lab.down: {len(left)} lab processes, {len(lab.lab_cgroup_dirs())} pdops-lab cgroup dirs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
