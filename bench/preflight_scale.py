"""Preflight fan-out benchmark: `inv preflight` work on 1 lab host vs 16 (target: 16 < 2x 1).

Prints figures; it is not a timed test. Needs a lab of at least 16 hosts
(`inv lab.up --hosts 16`, or pass --boot to bring one up here and leave it up); it never
takes a lab down. Each host is read with one batched SSH command and all hosts in
parallel, one connection per host, so 16 hosts should cost about one host's time.
Also times the P x D pairing matrix: 1p1d on 2 hosts vs 8p8d on 16.
Usage: python bench/preflight_scale.py [--runs N] [--boot]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from pdops import lab  # noqa: E402
from pdops import preflight as pf  # noqa: E402
from pdops.hosts import HostPool  # noqa: E402
from pdops.inventory import load_inventory  # noqa: E402
from pdops.topology import parse_topology  # noqa: E402


def sub_inventory(src: Path, n: int, where: Path) -> Path:
    """The lab inventory restricted to its first n hosts (lab01 keeps the gateway)."""
    doc = yaml.safe_load(src.read_text())
    hosts = doc["all"]["children"]["gpu_hosts"]["hosts"]
    keep = list(hosts)[:n]
    doc["all"]["children"]["gpu_hosts"]["hosts"] = {k: hosts[k] for k in keep}
    where.mkdir(parents=True, exist_ok=True)
    (where / "hosts.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return where


def time_preflight(inv_dir: Path, topology: str | None, runs: int) -> tuple[list[float], pf.PreflightReport]:
    inv = load_inventory(inv_dir)
    topo = parse_topology(topology) if topology else None
    times, report = [], None
    for _ in range(runs):
        t0 = time.monotonic()
        with HostPool(inv) as pool:  # connections included: that is what an operator waits for
            report = pf.run_preflight(inv, topo, pool, set())
        times.append(time.monotonic() - t0)
    return times, report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--boot", action="store_true", help="bring up 16 lab hosts first (left up)")
    args = ap.parse_args()
    if args.boot:
        lab.up(16)
    src = lab.inventory_path()
    if not src.is_file() or len(load_inventory(src.parent).hosts) < 16:
        print("needs a lab of 16 hosts: inv lab.up --hosts 16 (or --boot)", file=sys.stderr)
        return 2
    work = lab.resolve_lab_dir() / "bench-preflight"
    rows = []
    for label, n, topo in (("host checks", 1, None), ("host checks", 16, None),
                           ("with pairing", 2, "1p1d"), ("with pairing", 16, "8p8d")):
        times, rep = time_preflight(sub_inventory(src, n, work / f"{n}-{topo}"), topo, args.runs)
        rows.append((label, n, topo, times, rep))
        print(f"{label:13s} {n:2d} host(s) {topo or '-':5s} median {statistics.median(times):6.2f}s "
              f"(runs {', '.join(f'{t:.2f}' for t in times)}) -> {rep.verdict()}")
    one, sixteen = statistics.median(rows[0][3]), statistics.median(rows[1][3])
    two_p, sixteen_p = statistics.median(rows[2][3]), statistics.median(rows[3][3])
    print(f"16 / 1 hosts (host checks): {sixteen / one:.2f}x (target < 2x)")
    print(f"16 / 2 hosts (with pairing 8p8d vs 1p1d): {sixteen_p / two_p:.2f}x")
    return 0 if sixteen < 2 * one else 1


if __name__ == "__main__":
    raise SystemExit(main())
