"""The PD failure counters `inv status` compares "since the last look": read from each engine's and
each gateway's /metrics, remembered per instance and MainPID in this operator machine's cache
(``cache/status-look.json``); a first look at a process counts from its start. `inv repair` decides
from the same baseline the last `inv status` compared with, and moves it past the fault it repaired
(:func:`move_baseline`). Reads hosts; writes only the operator's cache."""

from __future__ import annotations

import json
import time
from pathlib import Path

from pdops.facts import engine as engine_facts
from pdops.fanout import run_parallel
from pdops.model.inventory import Inventory
from pdops.model.render import GATEWAY_UNIT
from pdops.record.local import local_dir
from pdops.remote.hosts import http_json

FAILURE_COUNTERS = {"bootstrap_failed": "sglang:num_bootstrap_failed_reqs_total",
                    "transfer_failed": "sglang:num_transfer_failed_reqs_total"}
# the gateway's own, where its /metrics has them (smg 1.13; absent series are left out, not zero)
GATEWAY_COUNTERS = {"bootstrap_failed": "smg_pd_bootstrap_failures_total",
                    "transfer_failed": "smg_pd_kv_transfer_failures_total",
                    "worker_errors": "smg_worker_errors_total"}


def look_path(inv: Inventory) -> Path:
    return local_dir(inv) / "cache" / "status-look.json"


def read_looks(inv: Inventory) -> dict:
    """The last looks this operator machine remembers ({} when there are none, or they are unreadable)."""
    try:
        return json.loads(look_path(inv).read_text())
    except (OSError, ValueError):
        return {}


def write_looks(inv: Inventory, doc: dict) -> None:
    """Replace the remembered looks at once (a write that fails leaves the old ones: the next look counts
    from the processes' start, or from the older look, again)."""
    path = look_path(inv)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)
    except OSError:
        pass


def counter_deltas(inv: Inventory, seen: dict[str, dict], *, write: bool = True) -> dict[str, dict[str, int]]:
    """{instance: {counter: increase since the last look at the same MainPID (else since its start)}};
    then (`write`) this look becomes the last one. Without `write` (`inv repair` deciding) the
    baseline is the one the last look compared with: what that `inv status` showed still counts."""
    last = read_looks(inv)
    out = {}
    for iid, now in seen.items():
        before = (last.get(iid) or {}) if write else ((last.get(iid) or {}).get("prev") or {})
        same = before.get("pid") == now["pid"]
        out[iid] = {k: max(0, int(now["counters"][k] - (before.get("counters", {}).get(k, 0) if same else 0)))
                    for k in now["counters"]}
    if not write:
        return out
    write_looks(inv, {**last, **{iid: {**now, "prev": {k: v for k, v in (last.get(iid) or {}).items() if k != "prev"}}
                                 for iid, now in seen.items()}})
    return out


def engine_reads(inst) -> tuple[engine_facts.EngineLoads, dict[str, float]]:
    status, doc = http_json("GET", f"{inst.url}{engine_facts.LOADS_PATH}", timeout=5)
    if status != 200:
        raise RuntimeError(f"HTTP {status}")
    loads = engine_facts.parse_loads(doc)
    counters = {}
    status, text = http_json("GET", f"{inst.url}{engine_facts.METRICS_PATH}", timeout=5)
    if status == 200 and isinstance(text, str):
        metrics = engine_facts.parse_metrics(text)
        counters = {k: engine_facts.counter(metrics, name) for k, name in FAILURE_COUNTERS.items()}
    return loads, counters


def gateway_counters(node) -> dict[str, float]:
    """One gateway's PD failure counters from its Prometheus endpoint, those it exports."""
    status, text = http_json("GET", node.metrics_url, timeout=5)
    if status != 200 or not isinstance(text, str):
        raise RuntimeError(f"HTTP {status}")
    metrics = engine_facts.parse_metrics(text)
    return {k: engine_facts.counter(metrics, name) for k, name in GATEWAY_COUNTERS.items() if name in metrics}


def move_baseline(inv: Inventory, pool, placement) -> dict[str, dict[str, int]]:
    """After an operation verified every instance routable again (`inv repair`): the PD failure counters
    read now become the last look of `inv status` (and the one `inv repair` decides from), so failures
    that fell inside the fault the operation named are reported with it, not as new. Returns what it
    absorbed: {instance or gateway: {counter: increase since the last look}}."""
    seen: dict[str, dict] = {}
    now = time.time()
    reads = run_parallel(list(placement.instances), engine_reads)
    for inst in placement.instances:
        r = reads.get(inst)
        if not (isinstance(r, tuple) and r[1]):
            continue
        host, unit = inst.head.host, inst.units[0][1]
        pid = pool.unit_states(host, [unit])[unit].main_pid
        seen[inst.id] = {"pid": pid, "counters": r[1], "at": now}
    counters = run_parallel(list(inv.gateway.nodes), gateway_counters)
    for node in inv.gateway.nodes:
        c = counters.get(node)
        if isinstance(c, dict) and c:
            pid = pool.unit_states(node.host, [GATEWAY_UNIT])[GATEWAY_UNIT].main_pid
            seen[gateway_key(inv, node.host)] = {"pid": pid, "counters": c, "at": now}
    absorbed = counter_deltas(inv, seen, write=True)
    # this look is the last one and, since `inv repair` decides from the look before the last, that one too
    write_looks(inv, {**read_looks(inv), **{k: {**v, "prev": dict(v)} for k, v in seen.items()}})
    return {k: {c: d for c, d in v.items() if d > 0} for k, v in absorbed.items() if any(d > 0 for d in v.values())}


def gateway_key(inv: Inventory, host: str) -> str:
    """The name a gateway's counters are remembered under between looks ("gateway" when it is the only one)."""
    return "gateway" if len(inv.gateway.hosts) == 1 else f"gateway {host}"


def breakers_open_since(inv: Inventory, open_now: dict[str, str], *, write: bool = True) -> dict[str, float]:
    """{"<gateway host> <worker URL>": when this operator machine's looks first saw its breaker not
    closed} for the breakers not closed now (`open_now`: the same keys -> their state); the ones
    closed again are forgotten. smg exports no time of opening: this is "open since, at the latest"."""
    doc = read_looks(inv)
    before = doc.get("_breakers_open") or {}
    now = time.time()
    since = {k: float(before.get(k) or now) for k in open_now}
    if write and since != before:
        write_looks(inv, {**doc, "_breakers_open": since})
    return since
