"""Measurement: `bench` (load with a per-request ledger), `sweep` (P:D ratio x concurrency on a
fixed GPU budget), `capacity` (sizing arithmetic with every input and assumption shown)."""

from __future__ import annotations

import json as _json
import math
from pathlib import Path

from invoke import task

from pdops.cli import cli_errors
from pdops import record as rec
from pdops.errors import InvalidInput

DEFAULT_INVENTORY = "inventory/lab"


def _num(value, field: str, *, positive: bool = True) -> float | None:
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InvalidInput(field, f"{value!r} is not a number", fix=f"e.g. {field} 2.5") from None
    if math.isnan(v) or math.isinf(v) or (positive and v <= 0) or v < 0:
        raise InvalidInput(field, f"{value!r} must be a {'positive' if positive else 'non-negative'} number",
                           fix=f"e.g. {field} 2.5")
    return v


def _workload(profile, workload):
    from pdops.ops.bench import Workload, parse_workload

    if workload:
        return parse_workload(workload)
    wl = profile.workload or {}
    if not wl.get("input_tokens") or not wl.get("output_tokens"):
        raise InvalidInput("--workload", f"missing, and profile {profile.name} names no default workload",
                           fix="pass --workload 160k/1300")
    return Workload(int(wl["input_tokens"]), int(wl["output_tokens"]))


@task(help={"workload": "input/output tokens, e.g. 160k/1300 (default: the profile's)",
            "concurrency": "requests in flight at once (>= 1)",
            "requests": "send this many requests (or use --duration)",
            "duration": "send for this many seconds (or use --requests)",
            "ignore_eos": "generate exactly the output length (synthetic capacity track)",
            "inventory": "inventory dir or file", "out": "run folder (default <state>/bench/<run id>)",
            "timeout": "per-request timeout, seconds (a timed-out request is recorded, never retried)",
            "dry_run": "print the plan only (nothing sent, no lock taken, nothing written)"})
@cli_errors
def bench(c, concurrency, inventory=DEFAULT_INVENTORY, workload=None, requests=None, duration=None,
          ignore_eos=False, out=None, timeout=3600, dry_run=False):
    """Drive the current revision's gateway at a fixed concurrency; one ledger row per request."""
    from pdops.ops import bench as b
    from pdops.model.inventory import load_inventory

    inv = load_inventory(inventory)
    wl = _workload(inv.profile, workload)
    res = b.run_bench(inv, rec.open_record(inv), wl, concurrency, requests, duration, ignore_eos, out,
                      timeout=_num(timeout, "--timeout"), dry_run=dry_run)
    if res is None:
        return
    print(b.format_result(res))
    if not ignore_eos:
        print("note: without --ignore-eos the output length is an upper bound; the figures use reported tokens")


@task(help={"budget": "fixed GPU budget, e.g. 96", "ratios": "P:D ratios, e.g. 2:1,3:1,5:1",
            "concurrency": "concurrencies, e.g. 8,16,32,64",
            "workload": "input/output tokens, e.g. 160k/1300 (default: the profile's)",
            "repeats": "runs per cell (median and range/median spread are reported)",
            "requests": "requests per run (default 4 x concurrency)", "duration": "seconds per run instead",
            "ignore_eos": "generate exactly the output length", "allow_partial": "run ratios that cannot use the "
            "whole budget (compare them by TPM per GPU)", "inventory": "inventory dir or file",
            "out": "sweep folder (default <state>/sweeps/<id>)", "dry_run": "print the plan only",
            "render": "re-render the tables and plots of an existing sweep folder",
            "timeout": "per-request timeout, seconds (a timed-out request is recorded, never retried)",
            "min_gain": "knee threshold: the first concurrency whose next step adds less than this fraction of "
            "total TPM (default 0.02)"})
@cli_errors
def sweep(c, budget=None, ratios=None, concurrency=None, inventory=DEFAULT_INVENTORY, workload=None, repeats=1,
          requests=None, duration=None, ignore_eos=False, allow_partial=False, out=None, dry_run=False, render=None,
          timeout=3600, min_gain=None):
    """Plan and run every (ratio, concurrency) cell that fits a fixed GPU budget; write the matrix and plots."""
    from pdops.ops import sweep as sw

    if render:
        m = sw.load_matrix(render)
        res = sw.write_matrix(m, Path(render))
        print(sw.render_matrix(m))
        if res["plots_skipped"]:
            print(f"plots: {res['plots_skipped']}")
        return
    from pdops.model.inventory import load_inventory
    from pdops.record.local import new_op_id

    for name, val in (("--budget", budget), ("--ratios", ratios), ("--concurrency", concurrency)):
        if val is None:
            raise InvalidInput(name, "missing", fix="e.g. inv sweep --budget 96 --ratios 2:1,3:1,5:1 --concurrency 8,16,32")
    inv = load_inventory(inventory)
    wl = _workload(inv.profile, workload)
    # a dry run may plan from this machine's cached copy of the record when its store is unreachable
    record = rec.open_record(inv, cached_ok=bool(dry_run))
    op = new_op_id("sweep")  # the sweep's operation in the journal, and its folder's name
    folder = Path(out) if out else record.path / "sweeps" / op
    plan = sw.plan_sweep(budget, ratios, concurrency, wl, gpus_per_instance=inv.profile.gpus_per_instance, inv=inv,
                         record=record, repeats=repeats, allow_partial=allow_partial, out_dir=folder,
                         min_gain=sw.DEFAULT_MIN_GAIN if min_gain is None else min_gain, requests=requests,
                         duration=duration, ignore_eos=ignore_eos, timeout_s=_num(timeout, "--timeout"))
    print(plan.render())
    banner = getattr(record, "cache_banner", lambda: None)()
    if banner:  # the rows were planned from this machine's cached copy (a dry run only)
        print(banner)
    if dry_run:
        return
    m = sw.operate_sweep(plan, inv, record, op=op)
    print(sw.render_matrix(m))
    print(f"sweep folder: {folder} (matrix.txt, matrix.csv, matrix.json, runs/<cell>/ledger.*, plots); "
          f"journal: `inv journal --op {op}`; its page: `inv report --op {op}`")


@task(auto_shortflags=False, help={"inventory": "inventory (profile, GPUs per instance, NICs per instance); optional",
            "profile": "profile name instead of an inventory's", "workload": "input/output tokens, e.g. 80k/600",
            "arrival_rate": "requests per second to serve", "ttft_target": "TTFT target, seconds",
            "tpot_target": "TPOT target, seconds", "prefill_tps": "measured prefill tokens/s of one instance",
            "decode_step_ms": "decode step time at batch 0, ms (fit of measurements)",
            "decode_step_per_req_ms": "added decode step time per running request, ms",
            "nic_gbps": "line rate of one RDMA NIC, Gbit/s (the inventory does not record it)",
            "nic_efficiency": "usable fraction of NIC line rate (assumption, default 0.8)",
            "decode_kv_gib": "KV memory one decode instance holds, GiB (optional)", "json": "machine-readable"})
@cli_errors
def capacity(c, arrival_rate, ttft_target, tpot_target, prefill_tps, decode_step_ms, decode_step_per_req_ms,
             inventory=None, workload=None, profile=None, nic_gbps=None, nic_efficiency=None, decode_kv_gib=None,
             json=False):
    """Size P and D pools from model shape and measured per-instance rates; shows every input and assumption."""
    from pdops.model.capacity import CapacityInputs, ModelShape, nics_per_instance, plan_capacity
    from pdops.model.inventory import load_inventory, load_profile

    inv = load_inventory(inventory, profile=profile) if inventory else None
    prof = inv.profile if inv else load_profile(profile or "glm-flash-80k")
    wl = _workload(prof, workload)
    ci = CapacityInputs(
        shape=ModelShape.from_dict(prof.model_shape, f"profile {prof.name}.model_shape"),
        input_tokens=wl.input_tokens, output_tokens=wl.output_tokens,
        arrival_rate=_num(arrival_rate, "--arrival-rate"), ttft_target_s=_num(ttft_target, "--ttft-target"),
        tpot_target_s=_num(tpot_target, "--tpot-target"), prefill_tokens_per_s=_num(prefill_tps, "--prefill-tps"),
        decode_step_ms=_num(decode_step_ms, "--decode-step-ms", positive=False),
        decode_step_per_req_ms=_num(decode_step_per_req_ms, "--decode-step-per-req-ms", positive=False),
        gpus_per_instance=prof.gpus_per_instance, nic_gbps=_num(nic_gbps, "--nic-gbps"),
        nics_per_instance=nics_per_instance(inv) if inv else None,
        nic_efficiency=0.8 if nic_efficiency is None else _num(nic_efficiency, "--nic-efficiency"), decode_kv_budget_gib=_num(decode_kv_gib, "--decode-kv-gib"),
    )
    rep = plan_capacity(ci)
    print(_json.dumps(rep.to_dict(), indent=2, default=str) if json else rep.render())
