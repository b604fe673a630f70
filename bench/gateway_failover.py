"""Benchmark: two gateways behind the admission layer, and a change of generation, under load
(issue #34 item 9; docs/gateway.md "Two or more gateways", docs/changes.md "A change of generation").

One lab cluster: 2p2d (TP8, one instance per lab host) on 8 hosts, smg on lab07 and lab08, HAProxy
on lab07 in front of both (a key, cap 16), the sim's decode step 10 ms. A closed loop of concurrent
streams goes through HAProxy for the length of each phase (each stream sends its next request when
its previous one ended; 0.1 s pause after a failed one, so a refusal is not retried in a tight loop).
Every request is a ledger row (pdops.remote.loadgen), never retried.

(a) a planned restart of every gateway: `health_check_interval_secs` changed in the inventory, then
    `inv deploy --topology 2p2d` (the gateways restart one at a time, each drained in HAProxy first):
    requests failed, and of those turned away (no token served).
(b) SIGKILL of one gateway (lab08) by its unit's MainPID: HAProxy's scur on gw-lab08 read just before
    the kill, the ledger rows in flight at the kill (on either gateway), requests failed, and failed
    ones started after the kill (docs: none). Then `inv deploy` records the restarted gateway (repair).
(c) a change of generation (the profile's bundle page_size 32): the fenced rollout (new pool of 2p2d on
    lab05-08, shifts 10/50/100% held `--fence-hold` s each): requests failed and its wall time; then a
    change that keeps the generation (`mem_fraction_static` 0.50 -> 0.45) on the same cluster, rolled in
    waves: requests failed and its wall time.
For each phase also: request IDs an engine received more than once (engine request logs; docs: none).

Prints a table with the date and the machine. Uses the lab of $PDOPS_LAB_SLOT (its dir and addresses),
takes `<lab dir>.lock` (slot 0: /srv/pdops-lab.lock, as the other lab benches), boots `--hosts` (8),
and powers the lab off at the end, whatever happens. Raw figures: <lab dir>/bench-failover/<time>/result.json.

Usage: PDOPS_LAB_SLOT=3 .venv/bin/python bench/gateway_failover.py [--streams 8] [--fence-hold 60]
       [--topology 2p2d] [--hosts 8]
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdops import lab as lab_api  # noqa: E402
from pdops.model.admission import parse_gateway_stats, stat_command  # noqa: E402
from pdops.model.inventory import load_inventory, single_file_doc  # noqa: E402
from pdops.model.placement import Placement  # noqa: E402
from pdops.model.render import GATEWAY_UNIT  # noqa: E402
from pdops.record import open_record  # noqa: E402
from pdops.remote.gateway import Gateways  # noqa: E402
from pdops.remote.hosts import HostPool  # noqa: E402
from pdops.sim.testing import wait_until  # noqa: E402

KEY = "pdops-bench-failover-" + "k" * 16
DEPLOY_TIMEOUT_S = 1200


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- the load ---------------------------------------------------------------------------------------

class ClosedLoop:
    """`streams` streaming requests through the admission layer, each sent when the stream's previous
    one ended, until stopped; every request is a ledger row."""

    def __init__(self, url: str, streams: int, prefix: str, max_new_tokens: int = 60, timeout: float = 60):
        self.url = url.rstrip("/") + "/generate"
        self.streams, self.prefix, self.max_new_tokens, self.timeout = streams, prefix, max_new_tokens, timeout
        self.rows: list = []
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._t = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # noqa: BLE001 - reported by __exit__
            self._error = exc

    async def _run(self) -> None:
        import aiohttp

        from pdops.remote.loadgen import LedgerRow, _one

        headers = {"Authorization": f"Bearer {KEY}"}
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, read_bufsize=1 << 20) as session:
            async def stream(w: int) -> None:
                i = 0
                while not self._stop.is_set():
                    row = LedgerRow(rid=f"{self.prefix}-{w:02d}-{i:05d}", stream=True, start=time.time())
                    self.rows.append(row)
                    body = {"text": f"bench failover {self.prefix} {w} {i}", "rid": row.rid, "stream": True,
                            "sampling_params": {"max_new_tokens": self.max_new_tokens, "ignore_eos": True}}
                    await _one(session, self.url, body, row, self.timeout, headers)
                    if not row.ok:
                        await asyncio.sleep(0.1)
                    i += 1
            await asyncio.gather(*(stream(w) for w in range(self.streams)))

    def ok_count(self) -> int:
        return sum(1 for r in list(self.rows) if r.ok)

    def __enter__(self) -> "ClosedLoop":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(timeout=self.timeout + 30)
        if self._t.is_alive():
            raise RuntimeError(f"load {self.prefix}: still running {self.timeout + 30:.0f} s after its stop")
        if self._error is not None and exc[0] is None:
            raise RuntimeError(f"load {self.prefix} failed: {self._error!r}")


def figures(rows: list) -> dict:
    failed = [r for r in rows if not r.ok]
    away = [r for r in failed if r.first_token is None]
    return {"requests": len(rows), "ok": len(rows) - len(failed), "failed": len(failed),
            "turned_away": len(away), "cut": len(failed) - len(away),
            "failures": Counter(f"{r.status}: {str(r.error or '')[:90]}" for r in failed).most_common(6)}


def warm(load: ClosedLoop, n: int = 10) -> None:
    """Until the loop has `n` requests served: load flows before the operation starts."""
    wait_until(lambda: load.ok_count() >= n, 60, f"{n} requests served through the admission layer")


# -- the cluster ------------------------------------------------------------------------------------

def inv_cli(inv_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """`inv <args> -i <inv_dir>` as an operator runs it; its wall time."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "invoke", *args, "-i", str(inv_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=DEPLOY_TIMEOUT_S, stdin=subprocess.DEVNULL)
    return proc, time.monotonic() - t0


def must(proc: subprocess.CompletedProcess, what: str, *expect: str) -> None:
    out = proc.stdout + proc.stderr
    missing = [e for e in expect if e not in proc.stdout]
    if proc.returncode != 0 or missing:
        raise RuntimeError(f"{what}: exit {proc.returncode}, missing {missing}\n{out[-4000:]}")


def derive(where: Path, gateways: list[str], fence_hold: float) -> Path:
    doc = single_file_doc(lab_api.inventory_path())
    lab_api.own_record(doc, where)
    keys = where / "admission.keys"
    keys.touch(mode=0o600)
    keys.write_text(KEY + "\n")
    prof = yaml.safe_load((REPO / "pdops/profiles/lab-sim.yml").read_text())
    prof["env"]["PDOPS_SIM_DECODE_STEP_MS"] = "10"
    (where / "profiles").mkdir()
    (where / "profiles" / "p.yml").write_text(yaml.safe_dump(prof))
    v = doc["all"]["vars"]
    v["pdops_profile"] = "profiles/p.yml"
    v["pdops_gateway"].pop("host", None)
    v["pdops_gateway"]["hosts"] = list(gateways)
    v["pdops_admission"] = {"host": gateways[0], "port": 18090, "cap": 16, "queue": 16, "queue_timeout_s": 60,
                            "overflow_status": 429, "api_keys_file": str(keys)}
    v["pdops_fence_hold_s"] = fence_hold
    (where / "hosts.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return where


def edit(path: Path, fn) -> None:
    doc = yaml.safe_load(path.read_text())
    fn(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def main_pid(pool: HostPool, host: str) -> int:
    return int(pool.run(host, f"systemctl show -p MainPID --value {GATEWAY_UNIT}").stdout.strip() or 0)


def routable(inv) -> dict[str, set[str]]:
    out = {}
    for h, c in Gateways.of(inv, timeout=2).clients.items():
        try:
            out[h] = {w.url for w in c.list_workers() if w.routable}
        except Exception:  # noqa: BLE001 - down or restarting
            out[h] = set()
    return out


def live(inv_dir: Path) -> Placement:
    return Placement.from_dict(open_record(load_inventory(inv_dir)).current_revision().placement)


def replayed(inv_dir: Path, pool: HostPool, prefix: str) -> int:
    """Request IDs starting with `prefix` that an engine (any instance any revision names) received
    more than once, by its request log (every invocation of its unit)."""
    st = open_record(load_inventory(inv_dir))
    units = {(h, u) for n in st.revision_numbers()
             for i in Placement.from_dict(st.read_revision(n).placement).instances for h, u in i.units[:1]}
    twice = 0
    for host, unit in sorted(units):
        n: Counter = Counter()
        for line in pool.run(host, f"journalctl -u {unit} -o cat --no-pager", timeout=120).stdout.splitlines():
            if '"request.received"' in line and prefix in line:
                try:
                    n[json.loads(line[line.find("{"):])["rid"]] += 1
                except (ValueError, KeyError):
                    continue
        twice += sum(1 for rid, k in n.items() if rid.startswith(prefix) and k > 1)
    return twice


def slowest_steps(inv_dir: Path, n: int = 6) -> list:
    """The newest change's journalled steps that took longest: (step, seconds from the previous record)."""
    try:
        j = open_record(load_inventory(inv_dir)).journal()
        op = [o for o in j.operations() if o.startswith("scale-")][-1]
        recs = [r for r in j.read(op) if "ts" in r]
        ts = [datetime.fromisoformat(r["ts"]).timestamp() for r in recs]
        gaps = [(recs[i]["step"], round(ts[i] - ts[i - 1], 1)) for i in range(1, len(recs))]
        return sorted(gaps, key=lambda g: -g[1])[:n]
    except Exception as exc:  # noqa: BLE001 - a detail of the report, never its failure
        return [f"unavailable: {exc!r}"]


# -- the phases -------------------------------------------------------------------------------------

def planned_restart(inv_dir: Path, pool: HostPool, gateways: list[str], topo: str, streams: int) -> dict:
    inv = load_inventory(inv_dir)
    before = {h: main_pid(pool, h) for h in gateways}
    edit(inv_dir / "hosts.yml",
         lambda d: d["all"]["vars"]["pdops_gateway"].__setitem__("health_check_interval_secs", 6))
    with ClosedLoop(inv.admission.url, streams, "fo-restart") as load:
        warm(load)
        proc, wall = inv_cli(inv_dir, "deploy", "--topology", topo)
        time.sleep(2)
    must(proc, "(a) the planned restart", *(f"gateway on {h} restarted in" for h in gateways))
    after = {h: main_pid(pool, h) for h in gateways}
    if any(after[h] == before[h] for h in gateways):
        raise RuntimeError(f"(a) a gateway kept its MainPID: {before} -> {after}")
    restarts = [ln.strip() for ln in proc.stdout.splitlines() if "restarted in" in ln]
    out = {**figures(load.rows), "deploy_s": round(wall, 1), "restarts": restarts,
           "replayed": replayed(inv_dir, pool, "fo-restart")}
    say(f"(a) planned restart of {', '.join(gateways)}: deploy {wall:.1f} s; {out['requests']} requests, "
        f"{out['failed']} failed ({out['turned_away']} turned away); {'; '.join(restarts)}")
    return out


def gateway_kill(inv_dir: Path, pool: HostPool, victim: str, topo: str, streams: int) -> dict:
    inv = load_inventory(inv_dir)
    urls = {i.url for i in live(inv_dir).instances}
    wait_until(lambda: routable(inv)[victim] == urls, 60, f"{victim} routing to every worker")
    adm = inv.admission.host
    pid = main_pid(pool, victim)
    pool.run(adm, "true")
    pool.run(victim, "true")  # both connections open before the kill: the stat and the kill back to back
    with ClosedLoop(inv.admission.url, streams, "fo-kill") as load:
        warm(load)
        wait_until(lambda: parse_gateway_stats(pool.run(adm, stat_command()).stdout)[victim].sessions >= 1, 30,
                 f"a request in flight on gw-{victim}")
        stat = parse_gateway_stats(pool.run(adm, stat_command()).stdout)
        killed_at = time.time()
        pool.run(victim, f"kill -KILL {pid}")
        t0, restarted_s, back_s = time.monotonic(), None, None
        while back_s is None:  # systemd's restart (a new MainPID), then every worker routable on it again
            if restarted_s is None and main_pid(pool, victim) not in (0, pid):
                restarted_s = time.monotonic() - t0
            if routable(inv)[victim] == urls:
                back_s = time.monotonic() - t0
            elif time.monotonic() - t0 > 60:
                raise RuntimeError(f"{victim} not routing to every worker 60 s after the kill: {routable(inv)}")
            time.sleep(0.1)
        time.sleep(3)
    rows = load.rows
    in_flight = [r for r in rows if r.start < killed_at and (r.end or killed_at + 1) > killed_at]
    failed = [r for r in rows if not r.ok]
    out = {**figures(rows), "scur_victim": stat[victim].sessions,
           "scur_other": {h: s.sessions for h, s in stat.items() if h != victim},
           "in_flight_ledger": len(in_flight),
           "failed_started_after_kill": sum(1 for r in failed if r.start >= killed_at),
           "restarted_s": restarted_s and round(restarted_s, 2), "back_s": round(back_s, 2),
           "replayed": replayed(inv_dir, pool, "fo-kill")}
    say(f"(b) SIGKILL of gateway {victim} (MainPID {pid}): scur on gw-{victim} {out['scur_victim']} just before "
        f"(others {out['scur_other']}), {len(in_flight)} in flight in the ledger; {out['requests']} requests, "
        f"{out['failed']} failed ({out['failed_started_after_kill']} started after the kill); new MainPID after "
        f"{out['restarted_s']} s, every worker routable on it again after {back_s:.1f} s")
    proc, wall = inv_cli(inv_dir, "deploy", "--topology", topo)
    must(proc, "(b) the repair after the kill", "repair revision")
    out["repair_s"] = round(wall, 1)
    return out


def generation_change(inv_dir: Path, pool: HostPool, topo: str, streams: int, hold: float) -> dict:
    inv = load_inventory(inv_dir)
    prof = inv_dir / "profiles" / "p.yml"
    res = {}
    before = {i.id for i in live(inv_dir).instances}
    edit(prof, lambda d: d["bundle"].__setitem__("page_size", 32))
    dry, _ = inv_cli(inv_dir, "deploy", "--topology", topo, "--dry-run")
    must(dry, "(c) the fenced dry run", "rolled fenced (blue/green)")
    with ClosedLoop(inv.admission.url, streams, "fo-fenced") as load:
        warm(load)
        proc, wall = inv_cli(inv_dir, "deploy", "--topology", topo)
        time.sleep(2)
    must(proc, "(c) the fenced rollout", " commit — ", " front-door open — ")
    after = {i.id for i in live(inv_dir).instances}
    res["fenced"] = {**figures(load.rows), "wall_s": round(wall, 1), "holds_s": 3 * hold,
                     "slowest_steps": slowest_steps(inv_dir),
                     "pools": f"{sorted(before)} -> {sorted(after)}", "replayed": replayed(inv_dir, pool, "fo-fenced")}
    f = res["fenced"]
    say(f"(c) fenced rollout (page size unset -> 32), {sorted(before)} -> {sorted(after)}: {wall:.1f} s "
        f"(of which 3 x {hold:g} s holds); {f['requests']} requests, {f['failed']} failed; slowest steps "
        f"{f['slowest_steps']}")

    edit(prof, lambda d: d["bundle"].__setitem__("mem_fraction_static", 0.45))
    dry, _ = inv_cli(inv_dir, "deploy", "--topology", topo, "--dry-run")
    must(dry, "(c) the wave dry run", "generation: unchanged", "rolled in waves")
    waves = next((ln.strip() for ln in dry.stdout.splitlines() if "wave(s)" in ln), "")
    with ClosedLoop(inv.admission.url, streams, "fo-waves") as load:
        warm(load)
        proc, wall = inv_cli(inv_dir, "deploy", "--topology", topo)
        time.sleep(2)
    must(proc, "(c) the wave rollout")
    res["waves"] = {**figures(load.rows), "wall_s": round(wall, 1), "waves": waves,
                    "slowest_steps": slowest_steps(inv_dir),
                    "replayed": replayed(inv_dir, pool, "fo-waves")}
    w = res["waves"]
    say(f"(c) wave rollout (mem_fraction_static 0.50 -> 0.45; {waves}): {wall:.1f} s; {w['requests']} requests, "
        f"{w['failed']} failed; slowest steps {w['slowest_steps']}")
    return res


# -- the report -------------------------------------------------------------------------------------

def mem_available_mib() -> int:
    return int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) // 1024


def machine() -> str:
    mem = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
               if ln.startswith("MemTotal:"))
    load1 = os.getloadavg()[0]
    return f"{os.cpu_count()} cores (nproc), {mem / 1024 / 1024:.1f} GiB memory, load average {load1:.2f} at the end"


def code_state() -> str:
    """The commit the bench ran on, and how many tracked files differed from it (another engineer's
    work in progress is measured with it)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "diff", "HEAD", "--name-only"], cwd=REPO, capture_output=True, text=True,
                               timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    return head + (f" + uncommitted changes in {len(dirty)} files" if dirty else "")


def table(r: dict, streams: int, hold: float, topo: str, took: float) -> str:
    a, b = r.get("a"), r.get("b")
    c = r.get("c") or {}
    rows = [("phase", "requests", "failed", "turned away", "replayed", "other")]
    if a:
        rows.append(("(a) planned restart of both gateways", a["requests"], a["failed"], a["turned_away"],
                     a["replayed"], f"deploy {a['deploy_s']} s"))
    if b:
        rows.append(("(b) SIGKILL of one gateway", b["requests"], b["failed"], b["turned_away"], b["replayed"],
                     f"scur {b['scur_victim']} on it just before; {b['in_flight_ledger']} in flight (ledger, both); "
                     f"{b['failed_started_after_kill']} failed started after; restarted {b['restarted_s']} s, "
                     f"routable again {b['back_s']} s"))
    if "fenced" in c:
        f = c["fenced"]
        rows.append(("(c) fenced generation change", f["requests"], f["failed"], f["turned_away"], f["replayed"],
                     f"wall {f['wall_s']} s (holds 3 x {hold:g} s)"))
    if "waves" in c:
        w = c["waves"]
        rows.append(("(c) same-generation change in waves", w["requests"], w["failed"], w["turned_away"],
                     w["replayed"], f"wall {w['wall_s']} s"))
    widths = [max(len(str(x[i])) for x in rows) for i in range(5)]
    lines = ["  ".join(str(x[i]).ljust(widths[i]) if i == 0 else str(x[i]).rjust(widths[i]) for i in range(5))
             + "  " + str(x[5]) for x in rows]
    head = (f"gateway failover bench, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {machine()}\n"
            f"lab slot {lab_api.slot()}, {topo}, 2 gateways behind HAProxy, {streams} closed-loop streams "
            f"(60 tokens, decode step 10 ms), one run; code {r.get('code')}; bench took {took / 60:.1f} min")
    return head + "\n" + "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--topology", default="2p2d")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--fence-hold", type=float, default=60.0, help="pdops_fence_hold_s (the product's default: 60)")
    ap.add_argument("--skip", default="", help="phases to skip, e.g. a,b")
    a = ap.parse_args()
    t_start = time.monotonic()
    lab_dir = lab_api.resolve_lab_dir()
    gateways = [lab_api.host_name(a.hosts - 1), lab_api.host_name(a.hosts)]
    result: dict = {"topology": a.topology, "streams": a.streams, "fence_hold_s": a.fence_hold,
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "code": code_state()}
    with open(f"{lab_dir}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            say(f"lab slot {lab_api.slot()} ({lab_dir}): booting {a.hosts} hosts")
            lab_api.up(a.hosts)
            where = lab_dir / "bench-failover" / time.strftime("%Y%m%d-%H%M%S")
            where.mkdir(parents=True)
            inv_dir = derive(where, gateways, a.fence_hold)
            proc, wall = inv_cli(inv_dir, "deploy", "--topology", a.topology)
            must(proc, "the first deploy")
            result["first_deploy_s"] = round(wall, 1)
            say(f"deployed {a.topology} with gateways {gateways} behind HAProxy on {gateways[0]} in {wall:.1f} s: "
                f"{sorted(i.id + '@' + i.units[0][0] for i in live(inv_dir).instances)}; "
                f"memory available {mem_available_mib()} MiB")
            inv = load_inventory(inv_dir)
            with HostPool(inv) as pool:
                if "a" not in a.skip:
                    result["a"] = planned_restart(inv_dir, pool, gateways, a.topology, a.streams)
                if "b" not in a.skip:
                    result["b"] = gateway_kill(inv_dir, pool, gateways[-1], a.topology, a.streams)
                if "c" not in a.skip:
                    result["c"] = generation_change(inv_dir, pool, a.topology, a.streams, a.fence_hold)
        finally:
            result["took_s"] = round(time.monotonic() - t_start, 1)
            try:
                lab_api.down()
            finally:
                if "where" in locals():
                    (where / "result.json").write_text(json.dumps(result, indent=1, default=str))
    print()
    print(table(result, a.streams, a.fence_hold, a.topology, result["took_s"]))
    for k in ("a", "b"):
        if result.get(k, {}).get("failures"):
            print(f"  ({k}) failures: {result[k]['failures']}")
    for k, v in (result.get("c") or {}).items():
        if v.get("failures"):
            print(f"  (c {k}) failures: {v['failures']}")


if __name__ == "__main__":
    main()
