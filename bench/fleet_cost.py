"""Benchmark: what the operator machine spends per host, apart from the hosts' own work (issue #35).

For each size N (default 4, 16, 32, 64) it boots a lab of N hosts, deploys one TP8 instance per host
(N - N/4 prefill, N/4 decode, at least 2: 2p2d, 12p4d, 24p8d, 48p16d; the sim's model load 0 s) and runs, as an
operator does, each command as its own `inv` process:

    deploy         the first deploy of the topology
    status         `inv status`, 3 runs (median)
    verify         `inv verify`, 3 runs (median)
    change         a rolling change of every instance (the profile's mem_fraction_static), waves of
                   --max-unavailable max(1, N/8) per role; --change-runs (2) of them (median)
    drain          `inv drain --instance p01`

Each command runs in a cgroup of its own (cgroup v1 cpuacct, else cgroup2's cpu.stat), so its CPU
seconds are those of the operator's whole process tree: pdops, `ansible-playbook` and its forks,
ssh, and ssh's ControlPersist masters that outlive the command (ended by PID from that cgroup once
read). The lab hosts' processes run in the lab's own cgroups: their CPU is printed apart, read from
the same accounting. Marginal cost per host: (X(N) - X(4)) / (N - 4). A change's CPU is also given
per replaced instance. Where the operator's CPU went is printed per step for the largest size (wall
and operator CPU from the command's journal: the runner records both per batch of steps).

Goals (operator CPU, marginal per host, on this machine; issue #35): deploy < 0.3 CPU-s; a rolling
change < 0.3 CPU-s per replaced instance; `inv status` < 0.05 CPU-s and < 3 s wall on 64 hosts;
`inv verify` < 10 s wall on 64 hosts; a drain's wall on N hosts within 10% of its wall on 4.

Uses the lab of $PDOPS_LAB_SLOT, takes `<lab dir>.lock` and powers the lab off at the end, whatever
happens. Raw figures: <lab dir>/bench-fleet/<time>/result.json.
Usage: PDOPS_LAB_SLOT=2 .venv/bin/python bench/fleet_cost.py [--sizes 4,16,32,64] [--runs 3]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdops import lab as lab_api  # noqa: E402
from pdops.model.inventory import load_inventory, single_file_doc  # noqa: E402
from pdops.record import open_record, operations  # noqa: E402

INV = str(Path(sys.executable).parent / "inv")
OP_TIMEOUT_S = 1800
GOALS = {"deploy": 0.3, "change": 0.3, "status": 0.05}


# ------------------------------------------------------------------ the operator's own accounting

def _cpu_root() -> tuple[Path, str]:
    """The cgroup hierarchy to count in and its usage file: v1 cpuacct (ns), else cgroup2 (usec)."""
    v1 = Path("/sys/fs/cgroup/cpuacct")
    if (v1 / "cpuacct.usage").exists():
        return v1, "cpuacct.usage"
    for v2 in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if (v2 / "cgroup.procs").exists() and (v2 / "cgroup.controllers").exists():
            return v2, "cpu.stat"
    raise SystemExit("no cpuacct or cgroup2 hierarchy to count the operator's CPU in")


def _usage_s(cg: Path, usage: str) -> float:
    text = (cg / usage).read_text()
    if usage == "cpuacct.usage":
        return int(text) / 1e9
    return next(int(line.split()[1]) for line in text.splitlines() if line.startswith("usage_usec")) / 1e6


def _end_leftovers(cg: Path) -> int:
    """SIGTERM what the command left in its cgroup (ssh ControlPersist masters), by PID; wait for it."""
    pids = [int(p) for p in (cg / "cgroup.procs").read_text().split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while (cg / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(pids)


def run_op(inv_dir: Path, *args: str) -> dict:
    """`inv <args> -i <inv_dir>` in a cgroup of its own: wall s, operator CPU s (the cgroup), its exit."""
    root, usage = _cpu_root()
    cg = root / "pdops-bench-operator" / f"{os.getpid()}-{time.monotonic_ns()}"
    cg.mkdir(parents=True)
    try:
        procs = str(cg / "cgroup.procs")

        def enter() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        # as on an operator's machine: Python's bytecode cache on (a sandbox may set
        # PYTHONDONTWRITEBYTECODE, and every command would compile pdops again)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        t0 = time.monotonic()
        proc = subprocess.run([INV, *args, "-i", str(inv_dir)], cwd=REPO, capture_output=True, text=True, env=env,
                              timeout=OP_TIMEOUT_S, stdin=subprocess.DEVNULL, preexec_fn=enter)
        wall = time.monotonic() - t0
        cpu = _usage_s(cg, usage)  # read before the leftovers end: their exit is not the command's work
        left = _end_leftovers(cg)
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    if proc.returncode != 0:
        raise RuntimeError(f"inv {' '.join(args)}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-4000:]}")
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "leftovers": left}


def hosts_cpu_s(n: int) -> float:
    """CPU seconds of every lab host's processes so far (the lab's cgroups in the same accounting)."""
    root, usage = _cpu_root()
    total = 0.0
    for i in range(1, n + 1):
        cg = root / lab_api.cgroup_group() / f"h{i}"
        if cg.exists():
            total += _usage_s(cg, usage)
    return total


# ------------------------------------------------------------------ the cluster

def topology(n: int) -> str:
    """N - N/4 prefill and N/4 decode (at least 2: a wave leaves one serving), one per host."""
    d = max(2, n // 4)
    return f"{n - d}p{d}d"


def derive(where: Path, mem_fraction: float) -> Path:
    """The running lab's inventory, a record of its own, the sim's model load 0 s."""
    where.mkdir(parents=True, exist_ok=True)
    doc = single_file_doc(lab_api.inventory_path())
    lab_api.own_record(doc, where)
    prof = yaml.safe_load((REPO / "pdops/profiles/lab-sim.yml").read_text())
    prof.setdefault("env", {})["PDOPS_SIM_STARTUP_S"] = "0"
    prof["bundle"]["mem_fraction_static"] = mem_fraction
    (where / "profiles").mkdir(exist_ok=True)
    (where / "profiles" / "p.yml").write_text(yaml.safe_dump(prof))
    doc["all"]["vars"]["pdops_profile"] = "profiles/p.yml"
    (where / "hosts.yml").write_text(yaml.safe_dump(doc))
    return where


def set_mem_fraction(inv_dir: Path, value: float) -> None:
    p = inv_dir / "profiles" / "p.yml"
    prof = yaml.safe_load(p.read_text())
    prof["bundle"]["mem_fraction_static"] = value
    p.write_text(yaml.safe_dump(prof))


def step_costs(inv_dir: Path, k: int = 8) -> list[dict]:
    """The newest operation's steps grouped by what they do (instance ids and wave members folded:
    "replace p07: stop" -> "replace X: stop"), summed: wall s, operator CPU s (the runner's evidence:
    a parallel batch's CPU counted once), how many; the k costliest by CPU."""
    j = open_record(load_inventory(inv_dir)).journal()
    op = operations(j)[-1]["op_id"]
    groups: dict[str, dict] = {}
    seen_batches: set = set()
    for s in j.read(op):
        ev = s.get("evidence") or {}
        if "seconds" not in ev:
            continue
        name = re.sub(r"\b[pd]\d+(\+[pd]\d+)*\b", "X", str(s.get("step")))
        cpu = ev.get("operator_cpu_s")
        if cpu is None and "batch_operator_cpu_s" in ev:  # a parallel batch: once per batch
            key = (ev["batch_operator_cpu_s"], name)
            cpu = 0.0 if key in seen_batches else ev["batch_operator_cpu_s"]
            seen_batches.add(key)
        g = groups.setdefault(name, {"step": name, "wall_s": 0.0, "cpu_s": 0.0, "n": 0})
        g["wall_s"] += ev["seconds"]
        g["cpu_s"] += cpu or 0.0
        g["n"] += 1
    return sorted(groups.values(), key=lambda g: -g["cpu_s"])[:k]


def measure(n: int, runs: int, change_runs: int, work: Path) -> dict:
    lab_api.down()
    t0 = time.monotonic()
    lab_api.up(n)
    out: dict = {"hosts": n, "topology": topology(n), "boot_s": round(time.monotonic() - t0, 1)}
    inv_dir = derive(work / f"n{n}", 0.5)
    mu = max(1, n // 8)

    def op(name: str, *args: str, breakdown: bool = True) -> dict:
        h0 = hosts_cpu_s(n)
        r = run_op(inv_dir, *args)
        r["hosts_cpu_s"] = round(hosts_cpu_s(n) - h0, 2)
        if breakdown:
            r["steps"] = step_costs(inv_dir)
        print(f"  {n:3d} hosts  {name:<7} wall {r['wall_s']:7.2f} s   operator CPU {r['cpu_s']:7.2f} s   "
              f"hosts' CPU {r['hosts_cpu_s']:7.2f} s", flush=True)
        return r

    out["deploy"] = op("deploy", "deploy", "--topology", topology(n))
    for name in ("status", "verify"):
        rs = [op(name, name, breakdown=False) for _ in range(runs)]
        out[name] = {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s", "hosts_cpu_s")}
        out[name]["runs"] = rs
    rs = []
    for k in range(change_runs):  # mem_fraction_static 0.45, 0.50, 0.45...: every instance replaced each time
        set_mem_fraction(inv_dir, 0.45 if k % 2 == 0 else 0.5)
        rs.append(op("change", "deploy", "--topology", topology(n), "--max-unavailable", str(mu)))
    out["change"] = {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s", "hosts_cpu_s")}
    out["change"].update(runs=rs, steps=min(rs, key=lambda r: abs(r["cpu_s"] - out["change"]["cpu_s"]))["steps"],
                         replaced=n, max_unavailable=mu)
    out["drain"] = op("drain", "drain", "--instance", "p01")
    return out


# ------------------------------------------------------------------ the report

def report(res: dict) -> str:
    sizes = sorted(int(k) for k in res["sizes"])
    by = {n: res["sizes"][str(n)] for n in sizes}
    lines = [f"operator cost per command, {res['date']}, {res['machine']} (wall s / operator CPU s / hosts' CPU s)",
             f"{'hosts':>5} {'topology':>9} " + " ".join(f"{c:>24}" for c in ("deploy", "status", "verify",
                                                                              "change", "drain"))]
    for n in sizes:
        r = by[n]
        lines.append(f"{n:5d} {r['topology']:>9} " + " ".join(
            f"{r[c]['wall_s']:7.2f} /{r[c]['cpu_s']:7.2f} /{r[c]['hosts_cpu_s']:7.1f}"
            for c in ("deploy", "status", "verify", "change", "drain")))
    if 4 in by and len(sizes) > 1:
        lines.append("marginal operator CPU per added host, (X(N) - X(4)) / (N - 4), CPU-s:")
        for n in sizes:
            if n == 4:
                continue
            m = {c: (by[n][c]["cpu_s"] - by[4][c]["cpu_s"]) / (n - 4) for c in ("deploy", "status", "verify", "change")}
            per_replaced = (by[n]["change"]["cpu_s"] - by[4]["change"]["cpu_s"]) / (n - 4)
            lines.append(f"  {n:3d} hosts: deploy {m['deploy']:.3f} (goal < 0.3: {ok(m['deploy'] < 0.3)}), "
                         f"status {m['status']:.4f} (goal < 0.05: {ok(m['status'] < 0.05)}), "
                         f"verify {m['verify']:.4f}, change {per_replaced:.3f} per replaced instance "
                         f"(goal < 0.3: {ok(per_replaced < 0.3)})")
        big = by[sizes[-1]]
        lines.append(f"  `inv status` on {sizes[-1]} hosts: {big['status']['wall_s']:.2f} s wall (goal < 3 s: "
                     f"{ok(big['status']['wall_s'] < 3)}); `inv verify`: {big['verify']['wall_s']:.2f} s "
                     f"(goal < 10 s: {ok(big['verify']['wall_s'] < 10)})")
        d4 = by[4]["drain"]["wall_s"]
        for n in sizes[1:]:
            r = by[n]["drain"]["wall_s"] / d4
            lines.append(f"  drain p01 on {n} hosts / on 4: {r:.2f} (goal within 10%: {ok(abs(r - 1) <= 0.10)})")
    lines.append(f"where the operator's CPU went on {sizes[-1]} hosts, by step (x how many: wall s / CPU s, summed):")
    big = by[sizes[-1]]
    for c in ("deploy", "change", "drain"):
        steps = ", ".join(f"{s['step']} x{s['n']} {s['wall_s']:.1f}/{s['cpu_s']:.2f}" for s in big[c].get("steps", []))
        lines.append(f"  {c} ({big[c]['cpu_s']:.2f} CPU-s in all): {steps}")
    return "\n".join(lines)


def ok(b: bool) -> str:
    return "met" if b else "NOT met"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4,16,32,64")
    ap.add_argument("--runs", type=int, default=3, help="runs of status and verify (median)")
    ap.add_argument("--change-runs", type=int, default=2, help="rolling changes of every instance (median)")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    lab_dir = lab_api.resolve_lab_dir()
    work = lab_dir / "bench-fleet" / time.strftime("%Y%m%d-%H%M%S")
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB",
           "sizes": {}}
    # pdops's bytecode compiled first, as pip leaves an installed package (else the first command
    # measured, 4 hosts' deploy, pays for compiling what every later one reads from the cache)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "pdops")], check=True,
                   env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
    with open(f"{lab_dir}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            for n in sizes:
                print(f"lab slot {lab_api.slot()}: {n} hosts, {topology(n)}", flush=True)
                res["sizes"][str(n)] = measure(n, a.runs, a.change_runs, work)
                work.mkdir(parents=True, exist_ok=True)
                (work / "result.json").write_text(json.dumps(res, indent=1))
        finally:
            lab_api.down()
    print()
    print(report(res))
    print(f"raw figures: {work / 'result.json'}")


if __name__ == "__main__":
    main()
