"""Preflight fan-out benchmark: `inv preflight` work on 1 lab host vs 16 (target: 16 < 2x 1).

Prints figures; it is not a timed test. Boots a 16-host lab, measures, and always takes the
lab down again (in a finally). Run it under the lab lock, as every lab command:

    flock /srv/pdops-lab.lock .venv/bin/python bench/preflight_scale.py [--runs N]

(it refuses to start when the lock is held by anyone but a parent of this process, and takes
it itself when nobody holds it). Each host is read with one batched SSH command and all hosts
in parallel, one connection per host, so 16 hosts should cost about one host's time. Also
times the P x D pairing matrix: 1p1d on 2 hosts vs 8p8d on 16. Each configuration gets one
untimed warm-up run (first SSH handshake and python start-up on fresh hosts).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from pdops import lab  # noqa: E402
from pdops.steps import preflight as pf  # noqa: E402
from pdops.remote.hosts import HostPool  # noqa: E402
from pdops.model.inventory import load_inventory, single_file_doc  # noqa: E402
from pdops.model.topology import parse_topology  # noqa: E402


def sub_inventory(src: Path, n: int, where: Path) -> Path:
    """The lab inventory restricted to its first n hosts (lab01 keeps the gateway)."""
    doc = single_file_doc(src)
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


LOCK = Path("/srv/pdops-lab.lock")


def _ancestors() -> set[int]:
    out, pid = set(), os.getpid()
    while pid > 1:
        out.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def hold_lab_lock():
    """The lab lock: held by a parent (`flock /srv/pdops-lab.lock ...`), else taken here; else refuse."""
    fh = LOCK.open("a")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fh  # nobody held it: held by this process until it exits
    except BlockingIOError:
        fh.close()
    ino = os.stat(LOCK).st_ino
    holders = set()
    for line in Path("/proc/locks").read_text().splitlines():
        f = line.split()
        if len(f) > 5 and f[1] == "FLOCK" and f[5].rsplit(":", 1)[-1] == str(ino):
            holders.add(int(f[4]))
    if holders & _ancestors():
        return None
    raise SystemExit(f"the lab lock {LOCK} is held by pid(s) {sorted(holders)}, not by a parent of this "
                     "process: another lab run is going on; run this as `flock /srv/pdops-lab.lock ...`")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    _lock = hold_lab_lock()  # noqa: F841 (kept open for the whole run)
    try:
        t0 = time.monotonic()
        lab.up(16)
        print(f"lab of 16 hosts up in {time.monotonic() - t0:.1f}s")
        src = lab.inventory_path()
        work = lab.resolve_lab_dir() / "bench-preflight"
        rows = []
        for label, n, topo in (("host checks", 1, None), ("host checks", 16, None),
                               ("with pairing", 2, "1p1d"), ("with pairing", 16, "8p8d")):
            inv_dir = sub_inventory(src, n, work / f"{n}-{topo}")
            time_preflight(inv_dir, topo, 1)  # warm-up, untimed
            times, rep = time_preflight(inv_dir, topo, args.runs)
            rows.append((label, n, topo, times, rep))
            print(f"{label:13s} {n:2d} host(s) {topo or '-':5s} median {statistics.median(times):6.2f}s "
                  f"(runs {', '.join(f'{t:.2f}' for t in times)}) -> {rep.verdict()}")
        one, sixteen = statistics.median(rows[0][3]), statistics.median(rows[1][3])
        two_p, sixteen_p = statistics.median(rows[2][3]), statistics.median(rows[3][3])
        print(f"16 / 1 hosts (host checks): {sixteen / one:.2f}x (target < 2x)")
        print(f"16 / 2 hosts (with pairing 8p8d vs 1p1d): {sixteen_p / two_p:.2f}x")
        ok = sixteen < 2 * one and all(r[4].ok for r in rows)
        return 0 if ok else 1
    finally:
        t0 = time.monotonic()
        lab.down()
        print(f"lab down in {time.monotonic() - t0:.1f}s")


if __name__ == "__main__":
    raise SystemExit(main())
