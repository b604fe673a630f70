"""`inv status`: what runs where and what happened to it, each row ending in a state word and
the command to run. Read-only.

Decided from observation (pdops.reads.observe: systemd on every host, the gateway's /workers and its
start-up list), each engine's /v1/loads and /metrics, and the processes in each unit's cgroup,
compared with the identity the current revision recorded:

- ``down``: a unit is not active (failed, stopped, or between systemd's automatic restarts);
- ``restarted``: a unit's MainPID is not the recorded one: the process pdops started and
  verified is gone, systemd started another (its peers and the gateway may hold stale state);
- ``not registered``: the gateway does not list it (or the gateway is down);
- ``degraded``: it runs and is registered, but the gateway marks it unhealthy or not ready or its
  circuit breaker is open (a request sent now would not be routed there), its
  PD failure counters rose since the last look, its process runs other files than the
  revision's, a process in its cgroup is not under MainPID, or its engine does not answer;
- ``unknown``: systemd on one of its hosts could not be read (SSH): nothing is concluded;
- ``ok``: none of these.

Failure counters "since the last look" are kept per instance and MainPID in this operator
machine's cache (``cache/status-look.json``); a first look at a process counts from its start.
`inv repair` decides from the same baseline the last `inv status` compared with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdops.errors import PdopsError, Unreachable
from pdops.remote.gateway import Gateways
from pdops.remote.hosts import HostPool, http_json
from pdops.model.inventory import Inventory
from pdops.fanout import run_parallel
from pdops.reads.looks import breakers_open_since, counter_deltas, engine_reads, gateway_counters, gateway_key
from pdops.reads import orphans as orphans_mod
from pdops.reads.observe import observe
from pdops.model.placement import Placement
from pdops.record import lock_line
from pdops.model.build import format_table

STATES = ("ok", "restarted", "degraded", "down", "not registered", "unknown")
QUEUES = ("running", "waiting", "prefill_bootstrap", "prefill_inflight", "decode_prealloc", "decode_transfer")


def record_doc(record) -> dict:
    """Where the record was read from, whether it is the cached copy (and then the banner that says which
    store cannot be reached and how to bring it back), who holds the lock."""
    cached = getattr(record, "cached", None)
    return {"location": getattr(record, "location", str(record.path)), "cached": cached,
            "banner": record.cache_banner() if cached else None,
            "lock": record.lock_holder() if hasattr(record, "lock_holder") else None}


@dataclass
class InstanceHealth:
    """What one instance's row says, from its observation; pure, so each state word is tested."""

    state: str
    reasons: list[str] = field(default_factory=list)
    action: str | None = None


def judge(o, *, gateway_down: bool, loads_error: str | None, failures: dict[str, int],
          strays: list[str], orphans: list = ()) -> InstanceHealth:
    """The state word of one instance (pdops.reads.observation.InstanceObservation `o`), the evidence for
    it, and the command to run. `failures`: counter name -> increase since the last look;
    `orphans`: a prefill's orphaned halves (pdops.reads.orphans.Orphan)."""
    repair = f"inv repair --instance {o.id}"
    unread = [f"{k}: {s}" for k, s in o.units.items() if isinstance(s, str)]
    if unread:
        hosts = sorted({k.split(":", 1)[0] for k in unread})
        return InstanceHealth("unknown", unread, f"check SSH to {', '.join(hosts)}, then `inv status` again")
    if o.edited:
        # the deploy puts the revision's files back, and replaces what may run the edit (or other files)
        return InstanceHealth("down" if o.down else "restarted" if o.restarted else "degraded",
                              [f"unit {d}" for d in o.down] + o.restarted + list(o.stale) + o.edited,
                              "inv deploy --topology <the current one> (puts back the revision's files"
                              + ("; then replaces it)" if o.runs_edited or o.stale else "; nothing restarted)"))
    if o.down:
        return InstanceHealth("down", [f"unit {d}" for d in o.down], repair)
    if o.restarted:
        return InstanceHealth("restarted", o.restarted + ["the process pdops started and verified is gone; "
                                                          "peers and the gateway may hold its old state"], repair)
    if gateway_down:
        return InstanceHealth("not registered", ["no gateway answers"], "see the gateway rows")
    if o.workers and all(w is None for w in o.workers.values()):
        return InstanceHealth("not registered", ["not in the gateway's /workers" if len(o.workers) == 1
                                                 else "in no gateway's /workers"], repair)
    reasons = []
    if o.gateway_problem:
        reasons.append(o.gateway_problem)
    if o.list_problem():
        reasons.append(o.list_problem(consequence=True))
    reasons += [f"{n} +{d} since the last look" for n, d in failures.items() if d > 0]
    reasons += [f"stray process in its cgroup, not under MainPID: {s}" for s in strays]
    if loads_error:
        reasons.append(f"engine does not answer /v1/loads: {loads_error}")
    if reasons:
        if o.breaker_only and len(reasons) == 1 and not orphans:
            # its engine is healthy: a new registration closes the breaker (smg has no other way)
            return InstanceHealth("degraded", reasons, "inv deploy --topology <the current one> (registers it "
                                  "again: a closed circuit, no restart)")
        return InstanceHealth("degraded", reasons + orphan_reasons(orphans), repair)
    if orphans:
        return InstanceHealth("degraded", orphan_reasons(orphans),
                              "inv end-orphans (ends them now, named; or wait for the timeout)")
    if o.stale:
        return InstanceHealth("degraded", list(o.stale), "inv deploy --topology <the current one> (replaces it)")
    return InstanceHealth("ok")


def orphan_reasons(orphans) -> list[str]:
    if not orphans:
        return []
    last = max((o.ends_by for o in orphans if o.ends_by), default=None)
    until = f"; they end by timeout at {time.strftime('%H:%M:%S', time.localtime(last))}" if last else ""
    return [f"{len(orphans)} orphaned request(s) waiting for a decode side that is gone (restarted, ended or "
            f"failed them): {', '.join(o.rid for o in orphans)}{until}"]



def prometheus_rates(url: str, cluster: str) -> dict[str, dict[str, float]]:
    """{instance: {"tpm_5m", "failures_per_s_5m"}} from a Prometheus that loads pdops's rules: the last
    5 minutes' TPM (input on prefills, output on decodes) and PD failure rate per instance."""
    import urllib.parse


    c = cluster.replace("\\", "\\\\").replace('"', '\\"')
    queries = {
        "tpm_5m": f'60 * sum by (instance) (rate(sglang:prompt_tokens_total{{cluster="{c}",role="prefill"}}[5m]) or '
                  f'rate(sglang:generation_tokens_total{{cluster="{c}",role="decode"}}[5m]))',
        # summed by name: either counter is absent until its first increment (`a + b` would be empty)
        "failures_per_s_5m": f'sum by (instance) (rate({{__name__=~"sglang:num_(bootstrap|transfer)_failed_reqs_total",'
                             f'cluster="{c}"}}[5m]))',
    }
    out: dict[str, dict[str, float]] = {}
    for key, expr in queries.items():
        status, doc = http_json("GET", f"{url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': expr})}",
                                timeout=10)
        if status != 200 or not isinstance(doc, dict) or doc.get("status") != "success":
            raise Unreachable(f"Prometheus {url} answered {status} to {expr!r}: {str(doc)[:200]}")
        for s in doc["data"]["result"]:
            out.setdefault(s["metric"].get("instance", "?"), {})[key] = float(s["value"][1])
    return out


def _instance_strays(o, obs) -> list[str] | str:
    """Processes in the instance's running units' cgroups that are not their MainPID or MainPID's
    descendants (read with the observation, one round trip per host), or why they could not be read."""
    out = []
    for key, st in o.units.items():
        host = key.split(":", 1)[0]
        if getattr(st, "active_state", None) != "active":
            continue
        if host in obs.identity_errors:
            return obs.identity_errors[host]
        ident = obs.identities.get(key)
        if ident is None:
            return f"{key} not in the cgroup read"
        out += [f"{key} {s}" for s in ident.strays]
    return out


def collect_status(inv: Inventory, record, *, remember: bool = True, prometheus: str | None = None) -> dict:
    """Read every source and judge each instance and the gateway (see the module's doc)."""
    return read_status(inv, record, remember=remember, prometheus=prometheus)[0]


def read_status(inv: Inventory, record, *, remember: bool = True, prometheus: str | None = None):
    """`collect_status`'s document and the Observation (pdops.reads.observe) it judged; None when nothing is
    deployed. `remember=False` (`inv repair` deciding): compare with the last look, do not become it."""

    rev = record.current_revision()
    where = record_doc(record)
    if rev is None:
        return {"cluster": inv.cluster, "revision": None, "instances": [], "gateways": [], "record": where,
                "note": "nothing deployed yet (no current revision)", "ok": True}, None
    with HostPool(inv) as pool:
        obs = observe(inv, rev, pool, Gateways.of(inv), cgroups=True)
        reads = run_parallel([o.instance for o in obs.instances], engine_reads)
        # orphaned halves wait in a prefill's bootstrap (or KV-sending) queue: its request log is read
        # only where those are not empty, or where its queues could not be read
        holding = [o.id for o in obs.instances if o.instance.role == "prefill" and (
            not isinstance(reads.get(o.instance), tuple)
            or reads[o.instance][0].total("prefill_bootstrap") or reads[o.instance][0].total("prefill_inflight"))]
        try:
            orphaned = (orphans_mod.read(pool, Placement.from_dict(rev.placement), inv, prefills=holding) if holding
                        else orphans_mod.Reading())
        except PdopsError as exc:
            orphaned = orphans_mod.Reading({}, [exc.message])
    counters = run_parallel(list(inv.gateway.nodes), gateway_counters)
    seen = {}
    for o in obs.instances:
        r = reads.get(o.instance)
        if isinstance(r, tuple) and r[1]:
            seen[o.id] = {"pid": o.main_pids.get(f"{o.instance.head.host}:{o.instance.units[0][1]}"),
                          "counters": r[1], "at": time.time()}
    for g in obs.gateways:
        c = counters.get(inv.gateway.node(g.host))
        if isinstance(c, dict) and c:
            seen[gateway_key(inv, g.host)] = {"pid": getattr(g.unit, "main_pid", None), "counters": c, "at": time.time()}
    deltas = counter_deltas(inv, seen, write=remember)
    open_now = {f"{h} {w.url.rstrip('/')}": w.breaker.state for o in obs.instances for h, w in o.workers.items()
                if w is not None and w.breaker is not None and w.breaker.state != "closed"}
    since = breakers_open_since(inv, open_now, write=remember)
    # no gateway answers for its workers: /workers does not answer or systemd says so; a unit that
    # cannot be read (SSH) is not evidence of either
    gateway_down = not any(g.error is None and not (hasattr(g.unit, "active_state") and g.unit.active_state != "active")
                           for g in obs.gateways)
    rows = []
    for o in obs.instances:
        r = reads.get(o.instance)
        loads_error = None if isinstance(r, tuple) else str(getattr(r, "message", r))
        q = {}
        if isinstance(r, tuple):
            for name in QUEUES:
                try:
                    q[name] = r[0].total(name)
                except Exception:  # noqa: BLE001 - a field this engine does not report
                    q[name] = None
        sr = _instance_strays(o, obs)
        strays = sr if isinstance(sr, list) else []
        h = judge(o, gateway_down=gateway_down, loads_error=loads_error, failures=deltas.get(o.id, {}),
                  strays=strays, orphans=orphaned.orphans.get(o.id, []))
        url = o.instance.url.rstrip("/")
        first = [f"{gw} since {time.strftime('%H:%M:%S', time.localtime(since[f'{gw} {url}']))}"
                 for gw in sorted(o.workers) if f"{gw} {url}" in since]
        if first:
            h = InstanceHealth(h.state, h.reasons + [f"circuit not closed on gateway {', '.join(first)} (first seen by "
                                                     "`inv status`; smg exports no time of opening)"], h.action)
        if not isinstance(sr, list):
            why = f"its cgroup could not be read: {sr}"
            h = InstanceHealth("unknown", [why], f"check SSH to {o.instance.head.host}, then `inv status` again") \
                if h.state == "ok" else InstanceHealth(h.state, h.reasons + [why], h.action)
        inst, w = o.instance, o.worker
        probs = o.gateway_problems()
        units = []
        for hst, u in inst.units:
            st = o.units.get(f"{hst}:{u}")
            units.append({"host": hst, "unit": u,
                          "state": f"{st.active_state}/{st.sub_state}" if hasattr(st, "active_state") else
                          f"unknown ({st})", "main_pid": getattr(st, "main_pid", None),
                          "recorded_pid": o.recorded_pids.get(f"{hst}:{u}"),
                          "n_restarts": getattr(st, "n_restarts", None)})
        rows.append({
            "instance": inst.id, "role": inst.role, "hosts": list(inst.hosts), "ranks": inst.nnodes,
            "units": units, "url": inst.url,
            "worker_id": w.id if w else None, "registered": w is not None,
            "healthy": bool(o.workers) and not probs, "gateway_status": w.status if w else None,
            "gateways": {h: (x.status if x else None) for h, x in o.workers.items()},
            "breakers": {h: x.breaker.state for h, x in o.workers.items() if x is not None and x.breaker is not None},
            "recorded_worker_id": (rev.instances.get(inst.id) or {}).get("worker_id"),
            "queues": q, "loads_error": loads_error,
            "failures": (seen.get(inst.id) or {}).get("counters", {}), "failures_since_last_look": deltas.get(inst.id, {}),
            "orphaned": [{"rid": x.rid, "age_s": x.age_s, "ends_by": x.ends_by}
                         for x in orphaned.orphans.get(o.id, [])],
            "state": h.state, "reasons": h.reasons, "action": h.action,
        })
    gateways = [_gateway_row(inv, rev, obs, g, counters.get(inv.gateway.node(g.host)),
                             deltas.get(gateway_key(inv, g.host), {})) for g in obs.gateways]
    warnings = front_door_warnings(inv)
    if prometheus:
        try:
            rates, perr = prometheus_rates(prometheus, inv.cluster), None
        except Exception as exc:  # noqa: BLE001 - an optional source: said, not fatal
            rates, perr = {}, str(getattr(exc, "message", exc))
        for r in rows:
            r["prometheus"] = rates.get(r["instance"], {})
        for g in gateways:
            g["prometheus_error"] = perr
    ok = (all(g["state"] == "ok" for g in gateways) and all(r["state"] == "ok" for r in rows) and not obs.front_door
          and not obs.admission_down and not obs.store_down)
    return {"cluster": inv.cluster, "revision": rev.number, "topology": rev.topology, "instances": rows,
            "gateways": gateways, "front_door": list(obs.front_door), "admission_down": obs.admission_findings(),
            "store_down": obs.store_findings(),
            "warnings": warnings, "record": where, "cordoned": list((rev.extra or {}).get("cordoned", [])),
            "orphans_unread": orphaned.unknown, "ok": ok, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, obs


def front_door_warnings(inv: Inventory) -> list[str]:
    """What `inv status` warns about the way in: one gateway is a single point of failure; several
    without the admission layer need clients that know every gateway (docs/gateway.md)."""
    n = len(inv.gateway.nodes)
    if inv.admission is not None:
        if n == 1:
            return [f"single point of failure: one gateway ({inv.gateway.first.host}); when it crashes or its host "
                    "is down the admission layer answers 503 (name two or more in pdops_gateway.hosts)"]
        return []
    if n == 1:
        return [f"single point of failure: one gateway ({inv.gateway.first.host}) and no admission layer in "
                "front; when it is down nothing is served (name two or more in pdops_gateway.hosts, and give "
                "clients every URL or put pdops_admission in front)"]
    return [f"no admission layer in front of the {n} gateways: each client must be given every gateway URL "
            f"({', '.join(g.url for g in inv.gateway.nodes)}) and try the next on a refused connection "
            "(docs/gateway.md)"]


def _gateway_row(inv: Inventory, rev, obs, g, counters, rose: dict) -> dict:
    """One gateway's row of `inv status`: its unit, its view of the workers, what it lacks or routes
    to that the revision does not know, its failure counters."""
    gu = g.unit
    gu_read = hasattr(gu, "active_state")
    reasons = []
    if g.down and (g.error is not None or gu_read):
        gstate = "down"
        reasons.append(f"unit {gu.active_state}/{gu.sub_state}" if gu_read else str(gu))
        if g.error:
            reasons.append(g.error)
    elif not gu_read:
        gstate = "unknown"
        reasons.append(f"its unit: {gu}; /workers answers ({len(g.workers)} workers)")
    else:
        reasons += [x for x in (g.stale,) if x]
        reasons += [f"routes to {w.describe()}, which revision {rev.number} does not know"
                    for w in g.unknown_workers(obs.instances)]
        lacks = [o.id for o in obs.instances if g.host in o.gateway_problems()]
        if lacks:
            reasons.append(f"does not route to {', '.join(lacks)}")
        if g.start_list_error:
            reasons.append(f"start-up list unreadable: {g.start_list_error}")
        gstate = "degraded" if reasons else "ok"
    node = inv.gateway.node(g.host)
    lost = not gu_read and len(inv.gateway.hosts) > 1  # its host does not answer SSH either
    action = {"down": (f"its host does not answer: runbook gateway-host-lost (inv deploy --topology {rev.topology} "
                       "once it is back; or take it out of pdops_gateway.hosts)") if lost else
                      f"inv deploy --topology {rev.topology} (starts it and registers every worker; runbook "
                      "gateway-crashed)",
              "degraded": f"inv deploy --topology {rev.topology}",
              "unknown": f"check SSH to {g.host}, then `inv status` again"}.get(gstate)
    return {"host": g.host, "url": node.url,
            "unit_state": f"{gu.active_state}/{gu.sub_state}" if gu_read else "unknown",
            "main_pid": getattr(gu, "main_pid", None), "n_restarts": getattr(gu, "n_restarts", None),
            "workers": len(g.workers), "error": g.error,
            "failures": counters if isinstance(counters, dict) else {}, "failures_since_last_look": rose,
            "failures_error": None if isinstance(counters, dict) else str(getattr(counters, "message", counters)),
            "state": gstate, "reasons": reasons, "action": action}


def record_lines(record: dict | None) -> list[str]:
    """The record's lines of `inv status` and `inv history`: the cached-copy banner, the lock."""

    if not record:
        return []
    out = []
    if record.get("cached"):
        out.append(record["banner"])
    if record.get("lock"):
        out.append(lock_line(record["lock"]))
    return out


def _num(v, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def format_status(doc: dict) -> str:
    banner = record_lines(doc.get("record"))
    if doc["revision"] is None:
        return "\n".join(banner + [f"{doc['cluster']}: {doc['note']}"])
    rows = []
    for r in doc["instances"]:
        q = r["queues"]
        f = r.get("failures") or {}
        rows.append({
            "instance": r["instance"], "role": r["role"], "hosts": ",".join(r["hosts"]),
            "unit": ",".join(u["state"] for u in r["units"]),
            "mainpid": ",".join(str(u["main_pid"]) for u in r["units"]),
            "restarts": ",".join(str(u.get("n_restarts", "?")) for u in r["units"]),
            "worker": (r["worker_id"] or "-")[:12], "gw_health": "healthy" if r["healthy"] else
            next((f"circuit {b}" for b in (r.get("breakers") or {}).values() if b != "closed"), None) or
            (r.get("gateway_status") or "unhealthy" if r["registered"] else "-"),
            "run": q.get("running", "?"), "wait": q.get("waiting", "?"),
            "kv_in_flight": (q.get("prefill_inflight") or 0) + (q.get("decode_transfer") or 0) if q else "?",
            "fail_boot/xfer": f"{int(f.get('bootstrap_failed', 0))}/{int(f.get('transfer_failed', 0))}" if f else "?",
            **({"tpm_5m": _num(r["prometheus"].get("tpm_5m")),
                "fail/s_5m": _num(r["prometheus"].get("failures_per_s_5m"), 3)} if "prometheus" in r else {}),
            "state": r["state"],
        })
    gws = doc["gateways"]
    head = f"{doc['cluster']}: revision {doc['revision']} ({doc['topology']})"
    glines = []
    for g in gws:
        line = (f"gateway {g['url']} on {g['host']}: {g['unit_state']}, MainPID {g['main_pid']}, {g['workers']} "
                f"workers: {g['state']}" + (f" (error: {g['error']})" if g["error"] else ""))
        rose = {k: v for k, v in (g.get("failures_since_last_look") or {}).items() if v}
        if rose:
            line += "; counted since the last look: " + ", ".join(f"{k} +{v}" for k, v in rose.items())
        glines.append(line)
    if len(gws) == 1:
        head += "; " + glines.pop()
    lines = banner + [head] + glines + [format_table(rows)]
    for r in doc["instances"]:
        if r["state"] != "ok":
            lines.append(f"{r['instance']} {r['state']}: {'; '.join(r['reasons'])}"
                         + (f"\n  -> {r['action']}" if r.get("action") else ""))
    for g in gws:
        if g["state"] != "ok":
            lines.append(f"gateway{'' if len(gws) == 1 else ' ' + g['host']} {g['state']}: {'; '.join(g['reasons'])}"
                         + (f"\n  -> {g['action']}" if g["action"] else ""))
    for f in doc.get("front_door", []):
        lines.append(f"front door not as deployed: {f}\n  -> inv deploy --topology {doc['topology']} (sets every "
                     "gateway ready at its weight)")
    for f in doc.get("admission_down", []):
        lines.append(f"front door closed: {f}\n  -> inv deploy --topology {doc['topology']} (starts it)")
    cached = bool((doc.get("record") or {}).get("cached"))  # no member answered: the banner above has the fix
    for f in doc.get("store_down", []):
        lines.append(f"record store degraded: {f}" + ("" if cached else
                                                      f"\n  -> inv deploy --topology {doc['topology']} (starts it)"))
    lines += [f"warning: {w}" for w in doc.get("warnings", [])]
    if (doc.get("record") or {}).get("lock"):
        lines.append("note: a change holds the cluster lock (above): what differs from the current revision may be "
                     "its work in progress (a fenced rollout's gateway routes only to the new pool); act on it "
                     "only once the lock is released")
    healthy = sum(1 for r in doc["instances"] if r["healthy"])
    tail = f"{healthy}/{len(doc['instances'])} instances registered and healthy"
    bad = [r["instance"] for r in doc["instances"] if r["state"] != "ok"] + [
        f"gateway {g['host']}" if len(gws) > 1 else "gateway" for g in gws if g["state"] != "ok"] + (
        ["front door"] if doc.get("front_door") or doc.get("admission_down") else []) + (
        ["record store"] if doc.get("store_down") else [])
    tail += f"; not ok: {', '.join(bad)}" if bad else "; all ok"
    if doc.get("cordoned"):
        tail += f"; cordoned (placement avoids them; `inv uncordon --host H`): {', '.join(doc['cordoned'])}"
    where = f"record: {doc['record']['location']}" if doc.get("record") else ""
    return "\n".join(lines + [tail] + ([where] if where else []))
