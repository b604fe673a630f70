"""Benchmark: what the cluster's record costs an operation, in each of its two stores (docs/state.md,
issue #36): the SSH state host (lab01, over SSH) and etcd (three members on lab01-lab03).

Boots a 3-host lab (the lab of $PDOPS_LAB_SLOT: its dir and addresses; takes `<lab dir>.lock`) and
brings etcd up on it with `inv state.etcd-up` (a subprocess, as an operator runs it). Each store is
measured in records of its own (derived inventories of the lab's: a state dir of its own on lab01,
or a key prefix of its own in etcd, so each starts empty; their cluster is `bench-record`, so the
etcd members' data dir is the bench's own). For each store it prints the median and
max of:
  (a) one read of the record by a fresh command (`open_record(inv, backend=...).current()`),
  (b) taking and releasing the cluster lock (a fresh record each time),
  (c) one journal line written under the lock;
then the wall time of `inv journal --last 50` run as a subprocess (median of --cli-runs) on a
journal of 10 lines and on one of 100,000 lines (--ops operations of 20 lines each, seeded through
the lock's session 500 lines a request; how long the seeding took is printed), and of
`inv journal --op <the oldest operation>` at 100,000 lines; the ratio 100k / 10 of `--last 50`
against the goal (within 2x); the journal's size (journal.jsonl on lab01; etcd's db size). Also
the local record (a StateDir on this machine's disk), as before.

Powers the lab off at the end, whatever happens, after stopping and removing the etcd members it
started and the records it wrote (--keep keeps them, for a look). Raw figures:
<lab dir>/bench-record/<time>/result.json. Takes 1.5-2 minutes on a 2-core machine. The `inv journal`
runs of the 10-line and the 100,000-line journals alternate, so that the machine's other work
weighs on both alike.

Usage: PDOPS_LAB_SLOT=3 .venv/bin/python bench/record_overhead.py [--rounds 20] [--ops 5000] [--cli-runs 5] [--keep]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdops import lab as lab_api  # noqa: E402
from pdops.model.etcd_member import DATA_ROOT, UNIT, UNIT_PATH  # noqa: E402
from pdops.model.inventory import load_inventory, single_file_doc  # noqa: E402
from pdops.record import open_record, operations  # noqa: E402
from pdops.record.local import StateDir  # noqa: E402
from pdops.remote import etcd as E  # noqa: E402
from pdops.remote.hosts import HostPool  # noqa: E402

CLUSTER = "bench-record"  # the bench's records (and its etcd members' data dir) are no one else's
MEMBERS = ["lab01", "lab02", "lab03"]
STEPS_PER_OP = 20
BATCH = 500
KINDS = ["deploy", "scale", "drain", "probe", "change"]


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def timed(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def row(name: str, xs: list[float]) -> str:
    return f"  {name:<48} median {statistics.median(xs) * 1000:8.1f} ms   max {max(xs) * 1000:8.1f} ms   (n={len(xs)})"


def derive(lab_doc: dict, where: Path, backend: str, prefix: str | None = None) -> Path:
    """A copy of the lab's inventory with a record of its own: a state dir of its own on lab01 and
    an operator dir of its own here (pdops.lab.own_record), and with etcd a key prefix of its own."""
    doc = json.loads(json.dumps(lab_doc))
    where.mkdir(parents=True)
    lab_api.own_record(doc, where)
    v = doc["all"]["vars"]
    v["pdops_cluster"] = CLUSTER
    v["pdops_state"]["host"] = "lab01"
    if backend == "etcd":
        v["pdops_state"].update(backend="etcd", etcd={"members": MEMBERS, "prefix": prefix})
    (where / "hosts.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return where


def measure(make, rounds: int) -> dict[str, list[float]]:
    """(a), (b), (c): `make()` opens the record as a fresh command does."""
    res = {"(a) read the record (fresh command)": timed(lambda: make().current(), rounds)}

    def lock_cycle():
        r = make()
        with r.lock("bench", say=lambda s: None):
            pass

    res["(b) take + release the cluster lock"] = timed(lock_cycle, rounds)
    r = make()
    with r.lock("bench", say=lambda s: None) as lk:
        j = r.journal()
        res["(c) one journal line under the lock"] = timed(lambda: j.step(lk.op_id, "bench", "ok", {"x": 1}),
                                                           rounds * 10)
    return res


def operation_lines(k: int, t0: datetime) -> tuple[str, list[str]]:
    """Operation k of the seeded journal: lock.held, plan, 17 steps, verdict (20 lines), each with a
    small evidence dict, as pdops writes them (`json.dumps(rec, sort_keys=True)`). Every fifth
    operation is a probe, its steps `probe-result` (a tagged step: etcd indexes it once more)."""
    kind = KINDS[k % len(KINDS)]
    start = t0 + timedelta(minutes=3 * k)
    op = f"{kind}-{start:%Y%m%dT%H%M%SZ}-{k:06x}"
    recs = [("lock.held", "ok", {"operator": "oncall", "machine": "laptop-7", "operation": kind, "client_pid": 4100 + k,
                                 "ssh_client": "10.0.0.9", "state_pid": 9000 + k,
                                 "since": f"{start:%Y-%m-%dT%H:%M:%SZ}"}),
            ("plan", "ok", {"summary": f"plan: {kind} 2p2d on lab01-lab03", "steps": STEPS_PER_OP - 3})]
    for i in range(STEPS_PER_OP - 3):
        step = "probe-result" if kind == "probe" else f"{kind}-step-{i}"
        recs.append((step, "ok", {"host": MEMBERS[i % 3], "instance": f"p{i % 4 + 1:02d}",
                                  "took_s": round(0.1 * i + 0.37, 2), "changed": i % 2 == 0}))
    recs.append(("verdict", "ok", {"verified": [f"{kind} done"], "unverified": []}))
    lines = [json.dumps({"ts": f"{start + timedelta(seconds=i):%Y-%m-%dT%H:%M:%SZ}", "op_id": op, "step": s,
                         "status": st, "evidence": ev}, sort_keys=True) for i, (s, st, ev) in enumerate(recs)]
    return op, lines


def seed(inv_dir: Path, backend: str, ops: int) -> tuple[float, str, int]:
    """Seed `ops` operations of 20 lines, BATCH lines a request under one lock; (seconds, the oldest
    seeded op id, lines in the journal)."""
    t0 = datetime(2024, 1, 1, tzinfo=timezone.utc)
    first, lines = None, []
    for k in range(ops):
        op, ls = operation_lines(k, t0)
        first = first or op
        lines += ls
    r = open_record(load_inventory(inv_dir), backend=backend)
    start = time.perf_counter()
    with r.lock("bench-seed", say=lambda s: None):
        for i in range(0, len(lines), BATCH):
            r._session.request({"op": "journal", "lines": lines[i:i + BATCH]})
            if (i // BATCH) % 40 == 39:
                say(f"  {backend}: {i + BATCH:,} lines in {time.perf_counter() - start:.0f} s")
    took = time.perf_counter() - start
    r.close()
    return took, first, len(lines) + 1  # and the seeding operation's own lock.held


def seed_small(inv_dir: Path, backend: str) -> tuple[str, int]:
    """A journal of 10 lines: one operation (its lock.held and 9 steps)."""
    r = open_record(load_inventory(inv_dir), backend=backend)
    with r.lock("bench-small", say=lambda s: None) as lk:
        j = r.journal()
        for i in range(9):
            j.step(lk.op_id, f"step-{i}", "ok", {"host": MEMBERS[i % 3], "took_s": 0.5})
        op = lk.op_id
    r.close()
    return op, 10


def inv_cli(*args: str, timeout: float = 600) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"`inv {' '.join(args)}` failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n"
                           f"{p.stderr[-3000:]}")
    return wall, p


def journal_size(inv_dir: Path, backend: str, pool: HostPool) -> int | None:
    """Bytes of journal.jsonl on the state host; for etcd, the db size of lab01's member (all prefixes)."""
    inv = load_inventory(inv_dir)
    try:
        if backend == "host":
            res = pool.run(inv.state.host, f"stat -c %s {inv.state.dir}/journal.jsonl")
            return int(res.stdout.strip())
        ep = inv.state.etcd.endpoints[0]
        c = E.Etcd([ep])
        try:
            return int(c.status(ep)["dbSize"])
        finally:
            c.close()
    except Exception as e:  # noqa: BLE001 - a size is a nicety, not the bench
        say(f"  (no size for {backend}: {e})")
        return None


def per_backend(backend: str, dirs: dict[str, Path], a, pool: HostPool, res: dict) -> None:
    out = res.setdefault(backend, {})
    say(f"{backend}: (a) (b) (c), {a.rounds} rounds, in {dirs['micro'].name}")
    inv = load_inventory(dirs["micro"])
    out["micro"] = measure(lambda: open_record(inv, backend=backend), a.rounds)

    small_op, out["small_lines"] = seed_small(dirs["small"], backend)
    out["size_small"] = journal_size(dirs["small"], backend, pool)
    if backend == "etcd":
        out["db_before_seed"] = journal_size(dirs["big"], backend, pool)
    say(f"{backend}: seeding {a.ops:,} operations x {STEPS_PER_OP} lines, {BATCH} a request")
    took, oldest, n_big = seed(dirs["big"], backend, a.ops)
    out.update(seed_s=took, big_lines=n_big, oldest_op=oldest)
    say(f"{backend}: seeded {n_big:,} lines in {took:.1f} s")
    out["size_big"] = journal_size(dirs["big"], backend, pool)

    # small and big in turn, so that the machine's other work (and etcd's own, after the seeding)
    # weighs on both alike
    say(f"{backend}: `inv journal --last 50` and `--op` at {out['small_lines']} and {n_big:,} lines, "
        f"{a.cli_runs} runs each, in turn")
    for k in ("startup", "last50_small", "last50_big", "op_small", "op_big", "last50_inproc_small",
              "last50_inproc_big"):
        out[k] = []
    inv_small, inv_big = load_inventory(dirs["small"]), load_inventory(dirs["big"])
    for _ in range(a.cli_runs):
        out["startup"].append(inv_cli("--help", "journal")[0])  # the process start alone
        w, p = inv_cli("journal", "--last", "50", "-i", str(dirs["small"]))
        out["last50_small"].append(w)
        out["last50_small_rows"] = p.stdout.count(small_op)
        w, p = inv_cli("journal", "--last", "50", "-i", str(dirs["big"]))
        out["last50_big"].append(w)
        out["last50_big_rows"] = len(set(re.findall(r"\b(?:%s)-\d{8}T\d{6}Z-[0-9a-f]{6}\b" % "|".join(KINDS),
                                                    p.stdout)))
        out["op_small"].append(inv_cli("journal", "--op", small_op, "-i", str(dirs["small"]))[0])
        w, p = inv_cli("journal", "--op", oldest, "-i", str(dirs["big"]))
        out["op_big"].append(w)
        out["op_big_steps"] = len([ln for ln in p.stdout.splitlines() if ln.strip()])
        # the same listing in this process, without a process start: what the store itself costs
        for key, inv_k in (("small", inv_small), ("big", inv_big)):
            out[f"last50_inproc_{key}"] += timed(
                lambda: operations(open_record(inv_k, backend=backend).journal(), last=50), 1)
    out["read_big"] = timed(lambda: open_record(inv_big, backend=backend).current(), a.rounds)


def unit_present(lab_dir: Path) -> list[str]:
    """Members whose host dir already has the etcd unit: someone else's, so the bench starts no etcd."""
    return [h for i, h in enumerate(MEMBERS, 1) if (lab_api.host_dir(lab_dir, i) / "units" / UNIT).exists()]


def clean_up(lab_inv: Path, state_dirs: list[str], started_etcd: bool) -> None:
    """Stop and remove the etcd members this bench started, and the record dirs it wrote on lab01."""
    inv = load_inventory(lab_inv)
    with HostPool(inv) as pool:
        if started_etcd:
            for h in MEMBERS:
                pool.run(h, f"systemctl disable --now {UNIT} >/dev/null 2>&1; rm -f {UNIT_PATH}; "
                            f"systemctl daemon-reload; rm -rf {DATA_ROOT}/{CLUSTER}", timeout=120)
        if state_dirs:
            pool.run("lab01", "rm -rf " + " ".join(state_dirs), timeout=120)


def fmt_ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:.0f} ms (max {max(xs) * 1000:.0f})"


def report(res: dict, local: dict[str, list[float]] | None, a) -> None:
    print()
    print(f"record overhead, {res['date']}, {os.cpu_count()} cores, lab slot {res['slot']} (3 hosts); bench took "
          f"{res['took_s']:.0f} s; etcd-up (subprocess) {res.get('etcd_up_s', float('nan')):.1f} s")
    for backend, label in (("host", "state host lab01 over SSH"), ("etcd", "etcd, 3 members on lab01-lab03")):
        r = res.get(backend)
        if not r or "micro" not in r:
            continue
        print(f"{backend}: {label}")
        for k, xs in r["micro"].items():
            print(row(k, xs))
        if "read_big" in r:
            print(row(f"(a) read the record, journal at {r['big_lines']:,} lines", r["read_big"]))
    if local:
        print("local record (a StateDir on this machine's disk, as before):")
        for k, xs in local.items():
            print(row(k, xs))
    print()
    print(f"`inv journal -i INV` as a subprocess, median (max) of {a.cli_runs}, small and big in turn; "
          "`start`: `inv --help journal`, the process start alone")
    big = next((f"{res[b]['big_lines'] // 1000}k" for b in ("host", "etcd") if "big_lines" in res.get(b, {})), "big")
    hdr = (f"  {'store':<6} {'seed ' + big:>10} {'start':>16} {'--last 50 @10':>20} {'--last 50 @' + big:>20} "
           f"{'ratio':>6} {'--op @10':>18} {'--op old @' + big:>20} {'in-process --last 50 @10 / @' + big:>34} "
           f"{'size @' + big:>12}")
    print(hdr)
    for backend in ("host", "etcd"):
        r = res.get(backend)
        if not r or "last50_big" not in r:
            continue
        ratio = statistics.median(r["last50_big"]) / statistics.median(r["last50_small"])
        r["ratio"] = ratio
        size = r.get("size_big")
        if backend == "etcd" and size is not None and r.get("db_before_seed"):
            size_s = f"{size / 1e6:.0f} MB db"
        else:
            size_s = f"{size / 1e6:.1f} MB" if size else "?"
        inproc = (f"{statistics.median(r['last50_inproc_small']) * 1000:.0f} / "
                  f"{statistics.median(r['last50_inproc_big']) * 1000:.0f} ms")
        print(f"  {backend:<6} {r['seed_s']:>9.0f}s {fmt_ms(r['startup']):>16} {fmt_ms(r['last50_small']):>20} "
              f"{fmt_ms(r['last50_big']):>20} {ratio:>5.2f}x {fmt_ms(r['op_small']):>18} {fmt_ms(r['op_big']):>20} "
              f"{inproc:>34} {size_s:>12}")
    print()
    for backend in ("host", "etcd"):
        r = res.get(backend)
        if not r or "ratio" not in r:
            continue
        ok = r["ratio"] <= 2.0
        print(f"goal: `inv journal --last 50` at {r['big_lines']:,} lines within 2x of {r['small_lines']} lines: "
              f"{backend}: {r['ratio']:.2f}x -> {'met' if ok else 'NOT met'}  (rows listed: {r['last50_small_rows']} "
              f"op at 10 lines, {r['last50_big_rows']} ops at {r['big_lines']:,}; `--op` of the oldest printed "
              f"{r['op_big_steps']} steps)")
        if backend == "etcd":
            print(f"  etcd db size: {r.get('db_before_seed') or 0:,} bytes before seeding, {r.get('size_big') or 0:,} "
                  f"after (every prefix of the bench and etcd's history; not compacted)")
        else:
            print(f"  journal.jsonl on lab01: {r.get('size_small') or 0:,} bytes at 10 lines, "
                  f"{r.get('size_big') or 0:,} at {r['big_lines']:,}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--ops", type=int, default=5000, help="operations of 20 lines seeded (5000: 100,000 lines)")
    ap.add_argument("--cli-runs", type=int, default=5)
    ap.add_argument("--backends", default="host,etcd")
    ap.add_argument("--keep", action="store_true", help="leave the etcd members and the records (the lab goes down)")
    a = ap.parse_args()
    backends = [b for b in a.backends.split(",") if b]
    t_start = time.monotonic()
    lab_dir = lab_api.resolve_lab_dir()
    res: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "slot": lab_api.slot(),
                 "ops": a.ops, "batch": BATCH}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    where = lab_dir / "bench-record" / stamp
    state_dirs: list[str] = []
    started_etcd = False
    with open(f"{lab_dir}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            say(f"lab slot {lab_api.slot()} ({lab_dir}): booting 3 hosts")
            lab_api.down()
            lab_api.up(3)
            lab_inv = lab_api.inventory_path()
            lab_doc = single_file_doc(lab_inv)
            dirs = {b: {k: derive(lab_doc, where / f"{b}-{k}", b, f"/pdops/{CLUSTER}/{stamp}/{k}/")
                        for k in ("micro", "small", "big")} for b in backends}
            for b in dirs.values():
                for d in b.values():
                    state_dirs.append(load_inventory(d).state.dir)
            if "etcd" in backends:
                theirs = unit_present(lab_dir)
                if theirs:
                    raise RuntimeError(f"{UNIT} is already on {theirs} of lab slot {lab_api.slot()}: not this bench's")
                say("etcd: `inv state.etcd-up` (3 members on lab01-lab03)")
                started_etcd = True
                res["etcd_up_s"], p = inv_cli("state.etcd-up", "-i", str(dirs["etcd"]["big"]))
                say(f"etcd: up in {res['etcd_up_s']:.1f} s: {p.stdout.strip().splitlines()[-1]}")
            with HostPool(load_inventory(lab_inv)) as pool:
                for b in backends:
                    per_backend(b, dirs[b], a, pool, res)
        finally:
            res["took_s"] = time.monotonic() - t_start
            if where.is_dir():
                (where / "result.json").write_text(json.dumps(res, indent=1, default=str))
            if not a.keep:
                try:
                    clean_up(lab_api.inventory_path(), state_dirs, started_etcd)
                except Exception as e:  # noqa: BLE001 - the lab goes down regardless
                    say(f"clean-up failed: {e}")
            lab_api.down()
            say(f"lab slot {lab_api.slot()} down")
    with tempfile.TemporaryDirectory(dir="/srv") as d:
        local = measure(lambda: StateDir("bench", Path(d)), a.rounds)
    res["took_s"] = time.monotonic() - t_start
    report(res, local, a)
    if where.is_dir():
        (where / "result.json").write_text(json.dumps(res, indent=1, default=str))
        print(f"raw figures: {where / 'result.json'}")


if __name__ == "__main__":
    main()
