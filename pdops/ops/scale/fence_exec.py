"""A fenced rollout carried out (pdops.ops.scale.fenced): the executors of its own step kinds. Each
reads its step, the outputs it declares, HAProxy's runtime API on the admission host, the
gateways and the engines now."""

from __future__ import annotations

import time

from pdops.errors import PdopsError, Unverified
from pdops.facts import engine as engine_facts
from pdops.model import membership
from pdops.model.admission import server_state_command
from pdops.remote.gateway import deadline_in
from pdops.model.admission import FULL_WEIGHT
from pdops.remote.haproxy import gateway_stats, require_another_up, runtime, set_front_door, wait_gateways_up
from pdops.remote.hosts import http_json
from pdops.steps.actions import register_one
from pdops.steps.stopping import leave_gateway
from pdops.reads.looks import FAILURE_COUNTERS, GATEWAY_COUNTERS
from pdops.plans import Outcome, Step
from pdops.runner import RunContext


def _set_front_door(ctx: RunContext, adms: list[str], *, weights: dict[str, int], drain=(), ready=()) -> list[str]:
    return set_front_door(ctx.pool, adms, weights=weights, drain=drain, ready=ready)


def _stat(ctx: RunContext, adm: str, g: str):
    stats = gateway_stats(ctx.pool, adm)
    if g not in stats:
        raise Unverified(f"HAProxy on {adm} has no server for gateway {g}: its running config is not this "
                         "revision's", fix=f"systemctl reload pdops-admission.service on {adm}, then `inv verify`")
    return stats[g]


def do_fence_gateway(ctx: RunContext, step: Step) -> Outcome:
    """The new generation's gateway leaves the front door and drops the old pool's workers."""
    g, others, adms = step.params["gateway"], step.params["others"], step.params["admission_hosts"]
    adm = ", ".join(adms)
    up = require_another_up(ctx.pool, adms, others, g, "fencing")
    ctx.give(step, "fence", {"gateway": g, "dropped": []})  # from here the rescue puts the front door back
    for a in adms:
        runtime(ctx.pool, a, server_state_command(g, "drain"), f"drain gateway {g}")
    deadline = ctx.deadline(step)
    while (left := sum(_stat(ctx, a, g).sessions for a in adms)) > 0:
        if time.monotonic() > deadline:
            raise Unverified(f"gateway {g} still carries {left} request(s) through HAProxy at the deadline")
        time.sleep(0.5)
    ids = step.params["instances"]
    membership.update_one(ctx.pool, g, remove=ids)
    client = ctx.gateways.client(g)
    urls = {ctx.old_placement.get(i).url.rstrip("/"): i for i in ids}
    dropped = []
    for w in client.list_workers():
        if w.url.rstrip("/") in urls:
            client.remove_worker(w.id)
            dropped.append(urls[w.url.rstrip("/")])
    for w in client.list_workers():
        if w.url.rstrip("/") in urls:
            client.wait_worker_gone(w.id, deadline_in(30))
    ctx.give(step, "fence", {"gateway": g, "dropped": dropped})
    ctx.say(f"  gateway {g} out of the front door (0 in flight), routes to nothing: dropped {', '.join(dropped)}")
    return Outcome(evidence={"gateway": g, "others_up": up, "dropped": dropped},
                   verified=[f"HAProxy on {adm} sends gateway {g} no new request and it carries none",
                             f"{g} lists none of the old pool ({', '.join(ids)}), nor does its start-up list"])


def _failures(ctx: RunContext, g: str, ids: list[str]) -> dict[str, float]:
    """The new pool's transfer and bootstrap failure counters and the gateway's PD failure counters,
    by name: what must stay flat while a shift holds. A source that does not answer is a failure."""
    out: dict[str, float] = {}
    for iid in ids:
        inst = ctx.placement.get(iid)
        status, text = http_json("GET", f"{inst.url}{engine_facts.METRICS_PATH}", timeout=5)
        if status != 200 or not isinstance(text, str):
            raise Unverified(f"{iid} /metrics answered HTTP {status} while the front door moves to it")
        m = engine_facts.parse_metrics(text)
        out.update({f"{iid} {k}": engine_facts.counter(m, n) for k, n in FAILURE_COUNTERS.items()})
    node = ctx.inv.gateway.node(g)
    status, text = http_json("GET", node.metrics_url, timeout=5)
    if status != 200 or not isinstance(text, str):
        raise Unverified(f"gateway {g} metrics answered HTTP {status} while the front door moves to it")
    m = engine_facts.parse_metrics(text)
    # absent until the first failure (docs/gateway.md): absent counts as 0
    out.update({f"gateway {g} {k}": engine_facts.counter(m, n) if n in m else 0.0 for k, n in GATEWAY_COUNTERS.items()})
    return out


def do_shift(ctx: RunContext, step: Step) -> Outcome:
    """Move a share of new requests to the new generation's gateway and hold it with the new pool's
    failure counters flat; on a rise, or the gateway not UP, the shift is undone and the step fails."""
    g, others, adms = step.params["gateway"], step.params["others"], step.params["admission_hosts"]
    adm = ", ".join(adms)
    pct, hold = int(step.params["percent"]), float(step.params["hold_s"])
    ids = step.params["instances"]
    ctx.get(step, "fence")
    back = {"weights": {g: 0, **{h: FULL_WEIGHT for h in others}}, "drain": [g], "ready": others}
    try:
        if step.params.get("first"):
            _set_front_door(ctx, adms, weights={g: 0}, ready=[g])
            for a in adms:
                wait_gateways_up(ctx.pool, a, [g], 30)
        base = _failures(ctx, g, ids)
        _set_front_door(ctx, adms, weights={g: pct, **{h: 100 - pct for h in others}})
        ctx.give(step, "shifted", pct)
        t0 = time.monotonic()
        stats = gateway_stats(ctx.pool, adms[0])
        while True:
            now = _failures(ctx, g, ids)
            rose = {k: v - base.get(k, 0.0) for k, v in now.items() if v > base.get(k, 0.0)}
            if rose:
                raise Unverified(f"the new generation's failure counters rose during the {pct}% shift: "
                                 + ", ".join(f"{k} +{v:g}" for k, v in rose.items()))
            for a in adms:
                st = _stat(ctx, a, g)
                if not st.up:
                    raise Unverified(f"gateway {g} is {st.status} in HAProxy on {a} during the {pct}% shift")
            if time.monotonic() - t0 >= hold:
                break
            time.sleep(min(1.0, max(0.0, hold - (time.monotonic() - t0))))
    except BaseException:
        try:  # undone whatever failed: every new request to the old generation again
            _set_front_door(ctx, adms, **back)
            ctx.give(step, "shifted", 0)
        except PdopsError as exc:
            ctx.say(f"  also: the shift could not be undone: {exc.message}; fix: {exc.fix}")
        raise
    ctx.say(f"  {pct}% of new requests to gateway {g} (the new generation), held {hold:g}s: no failure counted")
    return Outcome(evidence={"percent": pct, "hold_s": hold, "counters": base,
                             "sessions": {h: s.sessions for h, s in stats.items()}},
                   verified=[f"HAProxy on {adm}: {g} weight {pct}, {', '.join(others)} weight {100 - pct}",
                             f"held {hold:g}s: the new pool's and {g}'s failure counters did not rise"])


def do_fence_commit(ctx: RunContext, step: Step) -> Outcome:
    if ctx.get(step, "shifted") != 100:
        raise Unverified("the front door is not wholly on the new generation: the old pool must not drain")
    ctx.give(step, "committed", True)
    return Outcome(evidence={"committed": True}, verified=["every new request goes to the new generation"])


def do_unfence_gateway(ctx: RunContext, step: Step) -> Outcome:
    """Rescue before `commit`: the fenced gateway serves the old pool again."""
    g, adms = step.params["gateway"], step.params["admission_hosts"]
    fenced = ctx.get(step, "fence", None)
    if not fenced:
        return Outcome.noop(f"gateway {g} was not taken out of the front door")
    client = ctx.gateways.client(g)
    new_urls = {i.url.rstrip("/") for i in ctx.placement.instances if i.id not in step.params["instances"]}
    still = [w.url for w in client.list_workers() if w.url.rstrip("/") in new_urls]
    if still:
        raise Unverified(f"gateway {g} still routes to the new generation ({', '.join(still)}): it stays out of the "
                         "front door (drained) rather than serve both generations",
                         fix=f"remove those workers from {g} (or let `inv deploy` finish the change), then set it "
                             "ready in HAProxy")
    back, failed = [], []
    deadline = deadline_in(max(ctx.deadline(step) - time.monotonic() - 30, 15))
    for iid in step.params["instances"]:
        inst = ctx.old_placement.get(iid)
        try:
            status = http_json("GET", f"{inst.url}/health", timeout=5)[0]
        except PdopsError:
            status = None
        if status != 200:
            failed.append(f"{iid}: /health answered {status}")
            continue
        try:
            register_one(client, inst, ctx.say, deadline)
            back.append(inst)
        except PdopsError as exc:
            failed.append(f"{iid}: {exc.message}")
    if back:
        membership.update_one(ctx.pool, g, add=back)
    _set_front_door(ctx, adms, weights={g: FULL_WEIGHT}, ready=[g])
    for a in adms:
        wait_gateways_up(ctx.pool, a, [g], 30)
    ev = {"gateway": g, "registered": [i.id for i in back], "not": failed}
    if failed and not back:
        exc = Unverified(f"gateway {g} got none of the old pool back", evidence="\n".join(failed))
        exc.journal_evidence = ev
        raise exc
    return Outcome(evidence=ev, verified=[f"{g} routes to {', '.join(i.id for i in back)} again and is UP in HAProxy"],
                   unverified=[f"not back on {g}: {f}" for f in failed])


def do_leave_old_pool(ctx: RunContext, step: Step) -> Outcome:
    """Rescue after `commit`: what of the old pool is not yet drained leaves the other gateways before
    the new pool joins them (no gateway may route to both generations). Not stopped: named."""
    drained = set(ctx.get(step, "drained", []))
    left = [i for i in step.params["instances"] if i not in drained]
    if not left:
        return Outcome.noop("every instance of the old pool was drained")
    membership.update(ctx.pool, ctx.inv, remove=left, hosts=step.params["gateways"])
    removed = {}
    for h in step.params["gateways"]:
        client = ctx.gateways.client(h)
        for iid in left:
            ids = leave_gateway(client, ctx.old_placement.get(iid), None, deadline_s=30)
            if ids:
                removed.setdefault(h, []).extend(ids)
    ctx.say(f"  out of {', '.join(step.params['gateways'])}, still running, out of service: {', '.join(left)}")
    return Outcome(evidence={"out_of_service": left, "removed": removed},
                   verified=[f"{', '.join(left)} in no gateway's /workers or start-up list of "
                             f"{', '.join(step.params['gateways'])}"],
                   unverified=[f"{', '.join(left)} still running (out of service): `inv deploy` drains them"])
