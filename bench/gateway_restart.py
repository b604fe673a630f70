"""Benchmark: the gateway's restart, before and after it moved to its own environment.

1. Gateway start to first routed request (no lab): smg launched as pdops renders it, then the
   start-up registration its unit runs (pdops.model.membership's host script) for one prefill and one
   decode sim, then `/generate` until one is answered 200. After: smg 1.13 from the gateway's own
   environment (.venv-gateway, as deployed now). Before: sglang-router 0.3.2 run by the engine's
   python (.venv, with torch and SGLang), as deployed before (installed with `pip --target` into
   .bench-gateway/ on first use; skipped when that fails). 5 runs each, median printed.
2. Gateway SIGKILL to every worker routed again (lab, 2 hosts, 1p1d): the unit's MainPID is
   killed; systemd restarts it (RestartSec=1) and its ExecStartPost registers the start-up list.
   5 kills, median and max printed. Takes the lab lock (/srv/pdops-lab.lock); leaves no lab.
Usage: python bench/gateway_restart.py [--runs 5] [--no-lab]
"""

import argparse
import fcntl
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdops.record import open_record  # noqa: E402
from pdops.model import membership  # noqa: E402
from pdops.sim.testing import spawn, free_port, http, start_sim  # noqa: E402


def first_routed(launch: list[str], python: Path, prefill, decode, work: Path, env: dict | None = None) -> float:
    port, prom = free_port(), free_port()
    wl = work / "workers.json"
    wl.write_text('{"workers": [' f'{{"instance": "p01", "url": "{prefill.url}", "worker_type": "prefill", '
                  f'"bootstrap_port": {prefill.bootstrap_port}}}, '
                  f'{{"instance": "d01", "url": "{decode.url}", "worker_type": "decode"}}]}}')
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    g = spawn([*launch, "launch", "--pd-disaggregation", "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), "--disable-retries",
               ] + (["--worker-startup-check-interval", "2"] if env is None else []), env, "gateway")
    try:
        subprocess.run([str(python), "-c", membership.SCRIPT, "register", "--file", str(wl), "--gateway", url],
                       check=True, capture_output=True, timeout=60)
        while time.perf_counter() - t0 < 60:
            try:
                if http("POST", url + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}},
                        timeout=5)[0] == 200:
                    return time.perf_counter() - t0
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.02)
        raise RuntimeError("no routed request within 60 s")
    finally:
        g.kill_all()


def local_part(runs: int) -> None:
    env = {"PDOPS_SIM_SHUTDOWN_POLL_S": "0.2"}
    p = start_sim(["--disaggregation-mode", "prefill"], env)
    d = start_sim(["--disaggregation-mode", "decode"], env)
    work = REPO / ".bench-gateway"
    work.mkdir(exist_ok=True)
    try:
        gw = REPO / ".venv-gateway" / "bin"
        engine_py = REPO / ".venv" / "bin" / "python"
        old = work / "sglang-router-0.3.2"
        cases = [("after: smg 1.13, its own environment (.venv-gateway)", [str(gw / "smg")], gw / "python", None)]
        if not old.exists():
            r = subprocess.run([str(engine_py), "-m", "pip", "install", "-q", "--no-deps", "--target", str(old),
                                "sglang-router==0.3.2"], capture_output=True, text=True)
            if r.returncode != 0:
                print(f"before: skipped: sglang-router 0.3.2 could not be installed: {r.stderr[-200:]}")
        if old.exists():
            cases.append(("before: sglang-router 0.3.2, the engine's environment (.venv)",
                          [str(engine_py), "-c", "import sys; from sglang_router.cli import main; sys.exit(main())"],
                          engine_py, {"PYTHONPATH": str(old)}))
        for label, launch, py, extra_env in cases:
            if not Path(launch[0]).exists():
                print(f"{label}: skipped: {launch[0]} missing (make env)")
                continue
            ts = [first_routed(launch, py, p, d, work, extra_env) for _ in range(runs)]
            print(f"gateway start -> first routed request, {label}: median {statistics.median(ts):.2f} s "
                  f"(min {min(ts):.2f}, max {max(ts):.2f}, {runs} runs)", flush=True)
    finally:
        p.stop()
        d.stop()


def lab_part(runs: int) -> None:
    import yaml

    from pdops.ops import deploy as dep
    from pdops import lab as lab_api
    from pdops.remote.gateway import GatewayClient
    from pdops.remote.hosts import connections
    from pdops.model.inventory import load_inventory, single_file_doc
    from pdops.model.render import GATEWAY_UNIT
    from pdops.model.topology import Topology

    with open("/srv/pdops-lab.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            lab_api.down()
            lab_api.up(2)
            where = lab_api.resolve_lab_dir() / "bench-gateway" / time.strftime("%H%M%S")
            where.mkdir(parents=True)
            doc = single_file_doc(lab_api.inventory_path())
            lab_api.own_record(doc, where)
            (where / "hosts.yml").write_text(yaml.safe_dump(doc))
            inv = load_inventory(where)
            with connections(inv) as conns:
                dep.execute_deploy(dep.plan_deploy(inv, Topology(1, 1), open_record(inv)), say=lambda s: None,
                                   **conns)
                pool = conns["pool"]
                client = GatewayClient(inv.gateway.first.url, timeout=2)
                urls = {w.url for w in client.list_workers() if w.routable}
                ts = []
                for _ in range(runs):
                    pid = pool.run(inv.gateway.first.host, f"systemctl show -p MainPID --value {GATEWAY_UNIT}").stdout.strip()
                    t0 = time.perf_counter()
                    pool.run(inv.gateway.first.host, f"kill -KILL {pid}")
                    while True:
                        try:
                            if {w.url for w in client.list_workers() if w.routable} == urls:
                                break
                        except Exception:  # noqa: BLE001 - down or restarting
                            pass
                        if time.perf_counter() - t0 > 60:
                            raise RuntimeError("the gateway did not serve every worker within 60 s of the kill: "
                                               + pool.run(inv.gateway.first.host, f"systemctl status {GATEWAY_UNIT} "
                                                          "--no-pager | tail -5", timeout=10).stdout)
                        time.sleep(0.05)
                    ts.append(time.perf_counter() - t0)
            print(f"gateway SIGKILL -> every worker routed again (lab 1p1d, RestartSec=1): median "
                  f"{statistics.median(ts):.2f} s, max {max(ts):.2f} s ({runs} kills)", flush=True)
        finally:
            lab_api.down()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-lab", action="store_true")
    a = ap.parse_args()
    local_part(a.runs)
    if not a.no_lab:
        lab_part(a.runs)


if __name__ == "__main__":
    main()
