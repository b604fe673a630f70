"""Carrying a probe out: its executors, and the walk under the lock with its way back."""

from __future__ import annotations

import time

from pdops.steps.serve import do_canary
from pdops.steps.actions import deliver, running_evidence
from pdops.errors import PdopsError, Unverified
from pdops.model.placement import Placement
from pdops.plans import Outcome, Step
from pdops.runner import RunContext
from pdops.record.journal import now_iso
from pdops.record.local import default_operator, new_op_id
from pdops.ops.operate import run_operation

from pdops.ops.probe.plan import ProbePlan
from pdops.ops.probe.signatures import attribute_crash, classify, merge_signatures, mixed_reasons, result_line, signatures
from pdops.facts import q
from pdops.remote.loadgen import send_pair
from pdops.model.render import files_of, render_files
from pdops.model.prompts import make_prompt


# ---------------------------------------------------------------- doing

def _journal_command(unit: str, since: float) -> str:
    return f"journalctl -u {q(unit)} --since @{int(since)} -o cat --no-pager"


def do_probe_requests(ctx: RunContext, step: Step) -> Outcome:
    par = step.params
    p, d = par["pair"]
    pool = ctx.pool
    units = [(h, u) for x in (p, d) for h, u in x.units]
    before = {f"{h}:{u}": pool.unit_states(h, [u])[u].main_pid for h, u in units}
    t0 = time.time()
    i_tok, o_tok = par["workload"]
    ctx.say(f"  probe: {par['requests']} request(s) of {i_tok}/{o_tok} tokens to {p.id} x {d.id} ...")
    rows = send_pair(p.url, d.url, p.head.data_addr, p.bootstrap_port, requests=par["requests"],
                     concurrency=par["concurrency"], prompt_for=lambda k: make_prompt(i_tok, 7919 * (k + 1)),
                     max_new_tokens=o_tok, timeout=par["timeout_s"], rid_prefix=f"pdops-probe-{ctx.op[-8:]}")
    groups, read_errors = [], []
    for h, u in units:
        try:
            text = pool.run(h, _journal_command(u, t0 - 1), timeout=60).stdout
        except PdopsError as exc:
            read_errors.append(f"{h}:{u}: {exc.message}")
            continue
        groups.append(signatures(text, f"{h}:{u}"))
    sigs = merge_signatures(groups)
    after = {f"{h}:{u}": pool.unit_states(h, [u])[u].main_pid for h, u in units}
    restarts = [k for k in before if after.get(k) != before[k]]
    outcomes = attribute_crash([classify(r, sigs) for r in rows], restarts, sigs)
    canary_retried = bool(((ctx.get(step, "canary_evidence") or {}).get("first_attempt_failed")))
    doc = {"outcomes": [{"rid": r.rid, "outcome": o, "status": r.status, "http_status": r.http_status,
                         "prefill": (r.extra or {}).get("prefill"), "error": (r.error or "")[:300],
                         "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                         "seconds": round((r.end or t0) - r.start, 2)} for r, o in zip(rows, outcomes)],
           "result": result_line(outcomes), "signatures": sigs, "restarts": restarts,
           "mixed_reasons": mixed_reasons(outcomes, restarts, canary_retried, sigs), "window": [t0, time.time()],
           "journal_unread": read_errors}
    ctx.give(step, "probe_result", doc)
    all_ok = bool(outcomes) and all(o == "ok" for o in outcomes) and not doc["mixed_reasons"]
    ctx.give(step, "probe_keep", bool(step.params.get("keep")) and all_ok)
    ctx.say(f"  probe result: {doc['result']}" + (f"; mixed: {'; '.join(doc['mixed_reasons'])}"
                                                  if doc["mixed_reasons"] else ""))
    verified = [f"{len(rows)} request(s) answered or ended, each in the ledger: {doc['result']}",
                f"failure signatures read from {len(groups)} rank journal(s): {len(sigs)}"]
    return Outcome(evidence=doc, verified=verified,
                   unverified=[f"journal not read: {e}" for e in read_errors])


def do_probe_remove_files(ctx: RunContext, step: Step) -> Outcome:
    remove: dict[str, list[str]] = {}
    for f in step.params["files"]:
        remove.setdefault(f.host, []).append(f.path)
    ev = deliver(ctx.inv, step.params["placement"], [], None, remove, ctx.say)  # removal only: no build read
    return Outcome(evidence=ev, verified=[f"{', '.join(step.params['ids'])}'s files removed "
                                          f"({sum(map(len, remove.values()))})"])


def do_probe_verify_baseline(ctx: RunContext, step: Step) -> Outcome:
    rev, baseline = step.params["revision"], step.params["placement"]
    snap = ctx.record.revision_snapshot(rev.number)
    if snap is not None:
        files = files_of(snap)
    else:  # checked at plan time: the inventory renders the revision's files

        files = render_files(ctx.inv, baseline)
    ev = running_evidence(ctx.pool, ctx.inv, baseline, files)
    moved = []
    for i in baseline.instances:
        rec = (rev.instances.get(i.id) or {}).get("main_pids") or {}
        for k, pid in rec.items():
            now = (ev.get(k) or {}).get("main_pid")
            if now is not None and pid and int(now) != int(pid):
                moved.append(f"{k} MainPID {now}, recorded {pid}")
    left = []
    for x in step.params["pair"]:
        for h, u in x.units:
            st = ctx.pool.unit_states(h, [u])[u]
            if st.active_state not in ("inactive", "failed") or st.load_state not in ("not-found", "masked", ""):
                if st.active_state == "active" or st.load_state == "loaded":
                    left.append(f"{h}:{u} is {st.load_state}/{st.active_state}")
    if moved or left:
        raise Unverified("the baseline is not as recorded after the probe: " + "; ".join(moved + left),
                         fix="`inv status` shows what runs; `inv repair` or `inv stop` what differs")
    return Outcome(evidence={"units": ev},
                   verified=[f"revision {rev.number}: {len(ev)} unit(s) active with their recorded MainPIDs and "
                             "the revision's files; the spare pair's units gone"])


def do_probe_canary(ctx: RunContext, step: Step) -> Outcome:
    """The deploy canary through the probed pair; its evidence kept for the result table."""
    out = do_canary(ctx, step)
    ctx.give(step, "canary_evidence", out.evidence)
    return out


# the kinds made here; a probe also walks deploy's, drain's and a change's kinds (scale, imported above)


def next_probe_id(journal) -> str:
    n = len(journal.tagged("step:probe-result"))
    return f"T{n + 1}"


def _back_failures(plan: ProbePlan, ctx: RunContext) -> list[str]:
    """The way back's steps (the plan's `always`) that failed, each with its error."""
    return [f for f in ctx.after_failed if f.split(":", 1)[0] in {s.name for s in plan.always}]


def _way_back_failed(plan: ProbePlan, ctx: RunContext, verdict: dict) -> str | None:
    """The verdict is `failed` when the way back did not complete, though every probe step passed: the
    pair may still run the bundle (the probe-result record says so too, and the command fails)."""
    back = _back_failures(plan, ctx)
    if back:
        verdict["error"] = "the way back did not complete: " + "; ".join(back)
        return "failed"
    return None


def execute_probe(plan: ProbePlan, say=print, *, pool, gateways) -> dict:
    """Walk a probe's one plan as every operation is walked (pdops.ops.operate.run_operation: under the
    cluster lock, from the revision it was planned from, one verdict in the journal): its steps, then its
    way back (the plan's `always` steps: they run whether the probe's own steps passed or not, and after
    Ctrl-C). Its number (T1, T2, ...) is read from the journal under that lock, before the walk, so that
    two probes never share one. A step that fails is the probe's result, not the command's error: the
    probe-result record (journalled under the lock, after the verdict) says what was measured and where
    the pair is now; only a way back that did not complete is raised."""
    p, d = plan.pair
    union = Placement(plan.baseline.topology, plan.baseline.instances + ((p, d) if plan.mode == "spare" else ()))
    op = new_op_id("probe")
    out: dict = {}  # the probe's number, and once the walk has ended its result record

    def number(journal) -> dict:
        out["pid"] = next_probe_id(journal)
        say(f"probe {out['pid']}: bundle {plan.bundle.name!r}, {len(plan.variables)} variable(s) changed")
        return {"probe": out["pid"]}

    def result(ctx: RunContext, verdict: dict | None, exc: BaseException | None) -> None:
        pid = out["pid"]
        if isinstance(exc, KeyboardInterrupt):  # the way back ran (always_on_interrupt): no candidate left behind
            failure: PdopsError | None = PdopsError("interrupted by the operator")
            say(f"probe {pid}: interrupted; the requests in flight were abandoned (never sent again)")
        else:
            failure = exc
            if failure is not None:
                say(f"probe {pid}: stopped at a step: {failure.message}")
        # what the way back (the always steps) proved counts however the walk ended
        proven = verdict or {"verified": ctx.always_outcome.get("verified", []),
                             "unverified": ctx.always_outcome.get("unverified", [])}
        got = ctx.output("probe_result")
        kept = bool(ctx.output("probe_keep"))
        back_failed = _back_failures(plan, ctx)
        verdicts = ctx.output("plan_verdicts", {})
        if back_failed:
            after = {"restored": False, "error": "; ".join(back_failed)}
        elif plan.mode == "spare":
            after = {"restored": True, "how": "spare pair stopped and removed; the revision verified untouched"}
        else:
            if plan.keep and not kept:
                say(f"probe {pid}: --keep not applied: not every request was ok (or the window was mixed); "
                    "the baseline was restored")
            way = "keep" if kept else "restore"
            after = {"restored": not kept, "kept": kept, "revision": (verdicts.get(way) or {}).get("revision"),
                     "how": "kept as a new revision" if kept else "the revision's files, as a new revision"}
        doc = {"probe": pid, "op": op, "when": now_iso(), "operator": default_operator(),
               "revision": plan.rev.number, "bundle": plan.bundle.as_dict(), "mode": plan.mode, "pair": plan.ids,
               "workload": {"input_tokens": plan.workload[0], "output_tokens": plan.workload[1]},
               "requests": plan.requests, "concurrency": plan.concurrency,
               "variables": plan.variables, "n_variables": len(plan.variables),
               "multi_variable": len(plan.variables) > 1,
               "result": (got or {}).get("result") or f"not run: {failure.message if failure else 'unknown'}",
               "outcomes": (got or {}).get("outcomes", []), "signatures": (got or {}).get("signatures", []),
               "mixed": bool((got or {}).get("mixed_reasons")) or (failure is not None and got is None),
               "mixed_reasons": (got or {}).get("mixed_reasons", []) +
               ([f"the probe stopped before its requests: {failure.message}"] if failure and got is None else []),
               "after": after, "verified": list(proven["verified"]), "unverified": list(proven["unverified"])}
        ctx.journal.step(op, "probe-result", "ok" if not back_failed else "failed", doc)
        out.update(doc=doc, back_failed=back_failed)

    try:
        run_operation(plan.plan, plan.probe_inv, plan.record, say, pool=pool, gateways=gateways, op=op,
                      basis=plan.rev.number, context={"placement": union, "old_placement": plan.baseline},
                      head=number, closing=result, finish=lambda c, v: _way_back_failed(plan, c, v))
    except (PdopsError, KeyboardInterrupt) as exc:
        if "doc" not in out:  # refused before the walk (the basis moved): nothing ran, nothing to record
            raise
        if isinstance(exc, KeyboardInterrupt) and not out["back_failed"]:
            raise
    doc = out["doc"]
    if out["back_failed"]:
        raise PdopsError(f"probe {doc['probe']} ({doc['result']}): the way back did not complete: "
                         + "; ".join(out["back_failed"]))
    return doc


def probe_verdict(doc: dict) -> tuple[str, dict]:
    """(headline, verdict) of a probe's result record (:func:`execute_probe`'s), as `inv probe` prints it:
    what was verified, with where the pair is now; the mixed windows as not verified; how to add a reading."""
    after = doc["after"]
    v = {"verified": doc["verified"] + [after.get("how", "")],
         "unverified": doc["unverified"] + [f"mixed window: {r}" for r in doc["mixed_reasons"]],
         "notes": ["a bundle that works is a candidate for this workload; `inv probe --note "
                   f"{doc['probe']} --reading \"...\"` adds your reading; `inv probe --list` shows the table"]}
    head = (f"probe {doc['probe']} of bundle {doc['bundle']['name']!r} on {', '.join(doc['pair'])}: {doc['result']}"
            + (" [multi-variable]" if doc["multi_variable"] else "") + (" [mixed]" if doc["mixed"] else ""))
    return head, v

