"""`inv status`: what runs where, is it registered, healthy, busy. Read-only."""

from __future__ import annotations

from pdops.errors import PdopsError
from pdops.facts import engine as engine_facts
from pdops.gateway import GatewayClient
from pdops.hosts import HostPool, http_json
from pdops.inventory import Inventory
from pdops.placement import Placement
from pdops.render import GATEWAY_UNIT
from pdops.runner import run_parallel


def record_doc(state) -> dict:
    """Where the record was read from, whether it is the cached copy, who holds the lock."""
    return {"location": getattr(state, "location", str(state.path)), "cached": getattr(state, "cached", None),
            "lock": state.lock_holder() if hasattr(state, "lock_holder") else None}


def collect_status(inv: Inventory, state) -> dict:
    """Read every source (systemd on each host, the gateway's /workers, each engine's /v1/loads)."""
    rev = state.current_revision()
    record = record_doc(state)
    if rev is None:
        return {"cluster": inv.cluster, "revision": None, "instances": [], "gateway": None, "record": record,
                "note": "nothing deployed yet (no current revision)"}
    pl = Placement.from_dict(rev.placement)
    by_host: dict[str, list[str]] = {inv.gateway.host: [GATEWAY_UNIT]}
    for inst in pl.instances:
        for h, u in inst.units:
            by_host.setdefault(h, []).append(u)
    with HostPool(inv) as pool:
        unit_res = run_parallel(list(by_host), lambda h: pool.unit_states(h, by_host[h]))
    client = GatewayClient(inv.gateway.url, api_key_file=inv.gateway.api_key_file)
    try:
        workers = {w.url: w for w in client.list_workers()}
        gw_error = None
    except PdopsError as exc:
        workers, gw_error = {}, exc.message

    def loads(inst):
        status, doc = http_json("GET", f"{inst.url}{engine_facts.LOADS_PATH}", timeout=5)
        if status != 200:
            raise RuntimeError(f"HTTP {status}")
        return engine_facts.parse_loads(doc)

    load_res = run_parallel(list(pl.instances), loads)
    rows = []
    for inst in pl.instances:
        units = []
        for h, u in inst.units:
            r = unit_res.get(h)
            st = r.get(u) if isinstance(r, dict) else None
            units.append({"host": h, "unit": u, "state": f"{st.active_state}/{st.sub_state}" if st else f"unknown ({r})",
                          "main_pid": st.main_pid if st else None})
        w = workers.get(inst.url)
        lr = load_res.get(inst)
        q = {}
        if isinstance(lr, engine_facts.EngineLoads):
            for name in ("running", "waiting", "prefill_bootstrap", "prefill_inflight", "decode_prealloc",
                         "decode_transfer"):
                try:
                    q[name] = lr.total(name)
                except Exception:  # noqa: BLE001 - a field this engine does not report
                    q[name] = None
        rows.append({
            "instance": inst.id, "role": inst.role, "hosts": list(inst.hosts), "ranks": inst.nnodes,
            "units": units, "url": inst.url,
            "worker_id": w.id if w else None, "registered": w is not None,
            "healthy": bool(w and w.routable), "gateway_status": w.status if w else None,
            "recorded_worker_id": (rev.instances.get(inst.id) or {}).get("worker_id"),
            "queues": q, "loads_error": None if isinstance(lr, engine_facts.EngineLoads) else str(lr),
        })
    g = unit_res.get(inv.gateway.host)
    gst = g.get(GATEWAY_UNIT) if isinstance(g, dict) else None
    gateway = {"host": inv.gateway.host, "url": inv.gateway.url,
               "state": f"{gst.active_state}/{gst.sub_state}" if gst else "unknown",
               "main_pid": gst.main_pid if gst else None, "workers": len(workers), "error": gw_error}
    return {"cluster": inv.cluster, "revision": rev.number, "topology": rev.topology, "instances": rows,
            "gateway": gateway, "record": record, "cordoned": list((rev.extra or {}).get("cordoned", []))}


def record_lines(record: dict | None) -> list[str]:
    """The record's lines of `inv status` and `inv history`: the cached-copy banner, the lock."""
    from pdops.record import lock_line

    if not record:
        return []
    out = []
    c = record.get("cached")
    if c:
        out.append(f"READ-ONLY CACHED COPY of the record (fetched {c['fetched_at']}): the state host cannot be "
                   f"reached ({c['reason']}); no change can run until it can")
    if record.get("lock"):
        out.append(lock_line(record["lock"]))
    return out


def format_status(doc: dict) -> str:
    from pdops.planning import format_table

    banner = record_lines(doc.get("record"))
    if doc["revision"] is None:
        return "\n".join(banner + [f"{doc['cluster']}: {doc['note']}"])
    rows = []
    for r in doc["instances"]:
        q = r["queues"]
        rows.append({
            "instance": r["instance"], "role": r["role"], "hosts": ",".join(r["hosts"]),
            "unit": ",".join(u["state"] for u in r["units"]),
            "mainpid": ",".join(str(u["main_pid"]) for u in r["units"]),
            "worker": (r["worker_id"] or "-")[:12], "gw_health": "healthy" if r["healthy"] else
            (r.get("gateway_status") or "unhealthy" if r["registered"] else "NOT REGISTERED"),
            "run": q.get("running", "?"), "wait": q.get("waiting", "?"),
            "kv_in_flight": (q.get("prefill_inflight") or 0) + (q.get("decode_transfer") or 0) if q else "?",
        })
    g = doc["gateway"]
    head = (f"{doc['cluster']}: revision {doc['revision']} ({doc['topology']}); gateway {g['url']} on {g['host']}: "
            f"{g['state']}, MainPID {g['main_pid']}, {g['workers']} workers" + (f" (error: {g['error']})" if g["error"] else ""))
    healthy = sum(1 for r in doc["instances"] if r["healthy"])
    tail = f"{healthy}/{len(doc['instances'])} instances registered and healthy"
    if doc.get("cordoned"):
        tail += f"; cordoned (placement avoids them; `inv uncordon --host H`): {', '.join(doc['cordoned'])}"
    where = f"record: {doc['record']['location']}" if doc.get("record") else ""
    return "\n".join(banner + [head, format_table(rows), tail] + ([where] if where else []))
