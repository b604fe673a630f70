"""Benchmark: real SGLang 0.5.23 + Mooncake on the lab's CPU beside pdops.sim (issue 50).

For each engine (the lab's sim profile, then the real CPU profile: docs/lab.md), on a 2-host lab
(takes /srv/pdops-lab.lock; leaves no lab) and through pdops's own CLI as an operator runs it:
- start: `inv deploy --topology 1p1d`, its wall time and each engine's start to a healthy /health;
- a drain with a stream in flight: `inv drain --instance d01 --force` while one long stream runs
  through the gateway; the drain's wall time, the stream's remaining time at the drain's start, and
  the overhead (drain wall time - that remaining time);
- the deploy that adds d01 back, then `inv stop --instance d01` (the verified stop alone: SIGTERM,
  which SGLang answers by finishing what it holds) with a stream in flight: its wall time, and
  whether the stream got its whole answer.
Printed as one table; figures of an idle machine and a loaded one differ, nothing is asserted.
"""

import fcntl
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdops import lab as lab_api  # noqa: E402
from pdops.model.inventory import load_inventory, single_file_doc  # noqa: E402
from pdops.remote.loadgen import send  # noqa: E402

ENGINES = {
    "sim": {},
    "real": {"pdops_engine": "sglang", "pdops_profile": "lab-sglang-cpu", "pdops_engine_python": "auto",
             "pdops_start_timeout_s": 240},
}


def inv(where: Path, *args: str) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "invoke", *args, "-i", str(where)], cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    return time.time() - t0, p


def cluster(name: str, engine_vars: dict) -> Path:
    where = lab_api.resolve_lab_dir() / "bench-real" / f"{name}-{time.strftime('%H%M%S')}"
    where.mkdir(parents=True)
    doc = single_file_doc(lab_api.inventory_path())
    lab_api.own_record(doc, where)
    doc["all"]["vars"].update(engine_vars)
    (where / "hosts.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return where


def measure(name: str, engine_vars: dict) -> dict:
    where = cluster(name, engine_vars)
    wall, dep = inv(where, "deploy", "--topology", "1p1d")
    if dep.returncode != 0:
        raise SystemExit(f"{name}: deploy exited {dep.returncode}\n{dep.stdout[-3000:]}{dep.stderr[-2000:]}")
    starts = {m.group(1): float(m.group(2)) for m in re.finditer(r"(p01|d01) healthy in (\d+\.\d+)s", dep.stdout)}
    url = load_inventory(where).gateway.nodes[0].url

    def with_stream(*args: str):
        rows: list = []
        t = threading.Thread(target=lambda: rows.extend(send(url, requests=1, concurrency=1, max_new_tokens=1500,
                                                             stream_every=1, rid_prefix=f"bench-{name}-{args[0]}")))
        t.start()
        time.sleep(1.0)  # the stream is under way (a benchmark, not a readiness check)
        t0 = time.time()
        took, p = inv(where, *args)
        t.join(timeout=600)
        row = rows[0] if rows else None
        left = max(0.0, row.end - t0) if row and row.end else float("nan")
        return took, p.returncode, left, bool(row and row.ok)

    drain_s, drain_rc, drain_left, drain_ok = with_stream("drain", "--instance", "d01", "--force")
    back_s, back = inv(where, "deploy", "--topology", "1p1d")
    stop_s, stop_rc, stop_left, stop_ok = with_stream("stop", "--instance", "d01")
    return {"engine": name, "deploy_s": wall, "p01_start_s": starts.get("p01"), "d01_start_s": starts.get("d01"),
            "drain_s": drain_s, "stream_left_s": drain_left, "overhead_s": drain_s - drain_left,
            "drain_ok": drain_rc == 0 and drain_ok, "redeploy_s": back_s if back.returncode == 0 else float("nan"),
            "stop_s": stop_s, "stop_stream_ok": stop_rc == 0 and stop_ok}


def stop_units(n: int) -> None:
    for i in range(1, n + 1):
        subprocess.run(["ssh", "-i", str(lab_api.ssh_key_path(lab_api.resolve_lab_dir())), "-o", "StrictHostKeyChecking=no",
                        "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", f"root@{lab_api.host_address(i)}",
                        "units=$(systemctl list-units --all --plain --no-legend 'pdops-*' | awk '{print $1}'); "
                        "[ -z \"$units\" ] || systemctl disable --now $units"], capture_output=True, timeout=120)


def main() -> None:
    with open("/srv/pdops-lab.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lab_api.up(2)
        try:
            out = []
            for name, engine_vars in ENGINES.items():
                stop_units(2)
                out.append(measure(name, engine_vars))
            stop_units(2)
        finally:
            lab_api.down()
    cols = ["engine", "deploy_s", "p01_start_s", "d01_start_s", "drain_s", "stream_left_s", "overhead_s", "drain_ok",
            "redeploy_s", "stop_s", "stop_stream_ok"]
    print("  ".join(f"{c:>13}" for c in cols))
    for r in out:
        print("  ".join(f"{r[c]:>13.1f}" if isinstance(r[c], float) else f"{str(r[c]):>13}" for c in cols))


if __name__ == "__main__":
    main()
