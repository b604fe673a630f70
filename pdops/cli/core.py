"""Cluster operations: plan, render (and, as they land: deploy, status, drain, scale, rollback)."""

from __future__ import annotations

from pathlib import Path

from invoke import task

from pdops.model import build as builds
from pdops.cli import cli_errors, print_verdict, seconds
from pdops import record as rec
from pdops.errors import InvalidInput

DEFAULT_INVENTORY = "inventory/lab"


@task(help={"topology": "NpMd, e.g. 8p4d (or a YAML file)", "inventory": "inventory dir or file"})
@cli_errors
def plan(c, topology, inventory=DEFAULT_INVENTORY):
    """Print the placement table for a topology; writes nothing, contacts no host."""
    inv, pl = builds.load_and_place(inventory, topology)
    print(builds.format_placement(inv, pl))


@task(help={"topology": "NpMd, e.g. 8p4d", "inventory": "inventory dir or file",
            "out": "build folder (default build/<cluster>/<topology>)"})
@cli_errors
def render(c, topology, inventory=DEFAULT_INVENTORY, out=None):
    """Render every host's files for a topology into a build folder, with a manifest of hashes."""
    inv, pl = builds.load_and_place(inventory, topology)
    path, files = builds.render_build(inv, pl, Path(out) if out else None)
    hosts = len({f.host for f in files})
    print(f"rendered {len(files)} files for {hosts} hosts ({pl.topology}, {inv.engine}) into {path}")
    print(f"manifest: {path / 'manifest.json'}")


@task(help={"hosts": "lab hosts to boot (default 4)"})
@cli_errors
def demo(c, hosts="4"):
    """What `make demo` runs: plan the reference fleet, boot a lab, deploy 2p1d, serve, drain p02, status."""
    from pdops.lab.demo import run_demo

    from pdops.lab import validate_host_count

    run_demo(validate_host_count(hosts))


@task(help={"topology": "NpMd, e.g. 2p1d", "inventory": "inventory dir or file",
            "dry_run": "print the plan only",
            "skip_check": "a preflight check to skip (repeatable; recorded in the journal)",
            "max_unavailable": "instances per role out at once while replacing (default 1; 0: surge every one)",
            "force": "accept a plan that leaves a role with no serving instance at some step",
            "allow_capacity_dip": "accept a plan that must drain before it can add (GPUs to free first)",
            "unfenced": "roll a change of generation in waves anyway (requests pairing old and new fail)"},
      iterable=["skip_check"])
@cli_errors
def deploy(c, topology, inventory=DEFAULT_INVENTORY, dry_run=False, skip_check=None, max_unavailable=None,
           force=False, allow_capacity_dip=False, unfenced=False):
    """Deploy a topology; on a live cluster, plan any difference (topology, inventory, profile, pdops's
    templates) as a rolling change: keep, replace, add, remove; or repair what observation finds."""
    from pdops.ops import deploy as dep
    from pdops.model.inventory import load_inventory
    from pdops.model.topology import parse_topology

    topo = parse_topology(topology)
    mu = whole_cluster(max_unavailable, "--max-unavailable")
    inv = load_inventory(inventory)
    record = rec.open_record(inv)

    def make(seen):
        return dep.plan_deploy(inv, topo, record, set(skip_check or ()), max_unavailable=mu, force=force,
                               allow_capacity_dip=allow_capacity_dip, seen=seen, unfenced=unfenced)

    how, plan, v = dep.operate_deploy(inv, record, make, dry_run=dry_run)
    if v is None:
        return
    if how == "change":
        print_change_verdict(plan, v)
    elif how == "repair":
        print_verdict(f"repaired revision {plan.live.number} ({plan.placement.topology}) as revision {v['revision']}; "
                      f"repaired: {'; '.join(plan.findings)}.", v)
    else:
        print_verdict(f"deployed {plan.placement.topology} as revision {v['revision']} and made it current.", v)


def print_change_verdict(plan, verdict: dict) -> None:
    what = (f"rolled back to revision {plan.rollback_of}'s placement" if plan.rollback_of else
            "changed" if plan.replaced or plan.surge or plan.gateway_restart or
            plan.cordoned != list((plan.current.extra or {}).get("cordoned", [])) else "scaled")
    if plan.cordoned:
        what += f" (cordoned: {', '.join(plan.cordoned)})"
    print_verdict(f"{what}: {plan.current.topology} -> {plan.target.topology} as revision {verdict['revision']}, "
                  "now current.", verdict)


def whole_cluster(v, flag: str, default: int = 1) -> int:
    from pdops.errors import InvalidInput

    if v is None:
        return default
    try:
        n = int(str(v).strip())
    except ValueError:
        raise InvalidInput(flag, f"{v!r} is not a whole number", fix=f"e.g. {flag} 1") from None
    if n < 0:
        raise InvalidInput(flag, f"{n} is negative", fix=f"e.g. {flag} 1 (0: surge every replacement)")
    return n


def run_change(inv, record, make, dry_run: bool, *, observe: bool = True) -> None:
    """A change of the live cluster (`make(seen)` -> ScalePlan), planned and walked by pdops.ops.operate
    (`observe=False`: the record alone, a change that starts and stops nothing); its verdict printed."""
    from pdops.ops import scale as sc
    from pdops.ops.operate import operate

    plan, v = operate(inv, record, make, lambda p, conns: sc.execute_scale(p, record, **conns), dry_run=dry_run,
                      observe_first=observe)
    if v is not None:
        print_change_verdict(plan, v)


@task(help={"inventory": "inventory dir or file", "json": "machine-readable output (the same rows and state words)",
            "watch": "refresh every N seconds (default 5) until interrupted",
            "prometheus": "a Prometheus URL: add each instance's TPM and PD failure rate of the last 5 minutes"},
      optional=["watch"])
@cli_errors
def status(c, inventory=DEFAULT_INVENTORY, json=False, watch=None, prometheus=None):
    """One row per instance ending in a state word (ok, restarted, degraded, down, not registered) and
    the command to run; the gateway's too. Exit status 1 when anything is not ok (for cron or a check)."""
    import json as _json
    import time

    from invoke.exceptions import Exit

    from pdops.model.inventory import load_inventory
    from pdops.reads.status import collect_status, format_status

    every = None if watch is None else (5.0 if watch is True else seconds(watch, "--watch"))
    if every is not None and every <= 0:
        raise InvalidInput("--watch", f"{watch!r} is not a positive number of seconds", fix="e.g. --watch 5")
    if prometheus is not None and not str(prometheus).startswith(("http://", "https://")):
        raise InvalidInput("--prometheus", f"{prometheus!r} is not an http(s) URL", fix="e.g. --prometheus http://mon01:9090")
    inv = load_inventory(inventory)
    doc = collect_status(inv, rec.open_record(inv, cached_ok=True), prometheus=prometheus)
    if every is None:
        print(_json.dumps(doc, indent=2, default=str) if json else format_status(doc))
    try:
        while every is not None:
            out = _json.dumps(doc, indent=2, default=str) if json else format_status(doc)
            print(("\x1b[H\x1b[2J" if not json else "") + f"every {every:g}s, {doc.get('at', '')} (Ctrl-C ends)\n{out}",
                  flush=True)
            time.sleep(every)
            doc = collect_status(inv, rec.open_record(inv, cached_ok=True), prometheus=prometheus)
    except KeyboardInterrupt:  # the watch ends; the last look decides the exit status
        pass
    if not doc.get("ok", True):
        raise Exit(code=1)


@task(help={"inventory": "inventory dir or file"})
@cli_errors
def verify(c, inventory=DEFAULT_INVENTORY):
    """Check the current revision on every host (units, cgroups, 0600 env, ports, memlock, gateway,
    admission layer: one SSH command per host), then what runs now against it (MainPIDs, files,
    the gateway's workers)."""
    from pdops.model.inventory import load_inventory
    from pdops.reads.verify import run_verify

    inv = load_inventory(inventory)
    print(f"verify {inv.cluster}: {run_verify(inv, rec.open_record(inv))}")


def _instance_op(instance, inventory, dry_run, make_plan, execute, headline: str, *, observe: bool = False) -> None:
    """An operation on one instance, planned and walked by pdops.ops.operate: `observe` reads systemd on
    the hosts of the instance and of a few others of its role (`near`) and each gateway's /workers, so
    that an operation on one instance costs the same on 4 hosts as on 64."""
    from pdops.model.inventory import load_inventory
    from pdops.ops.operate import operate

    if not instance:
        raise InvalidInput("--instance", "missing", fix="name the instance, e.g. --instance p07 (see `inv status`)")
    inv = load_inventory(inventory)
    record = rec.open_record(inv)
    _, v = operate(inv, record, lambda seen: make_plan(inv, record, seen), lambda p, conns: execute(p, record, **conns),
                   dry_run=dry_run, observe_first=observe, units_of=lambda rev: near(rev, instance))
    if v is not None:
        print_verdict(headline, v)


# Besides its own, the units of this many others of an instance's role are read for its floor: one of
# them serving is proof enough; the rest count by the gateways' routing (pdops.reads.observe units_of).
FLOOR_UNITS_READ = 3


def near(rev, instance: str) -> frozenset[str]:
    """The instance and the first FLOOR_UNITS_READ others of its role: whose units an operation on one
    instance reads, the same count on 4 hosts as on 64."""
    from pdops.model.placement import Placement

    pl = Placement.from_dict(rev.placement)
    role = pl.get(instance).role
    return frozenset([instance] + [i.id for i in pl.role(role) if i.id != instance][:FLOOR_UNITS_READ])


def _drain_or_stop(instance, inventory, dry_run, force, wait, interval, force_after, skip_gateway):
    from pdops.ops import drain as dr

    _instance_op(instance, inventory, dry_run,
                 lambda inv, record, seen: dr.plan_drain(inv, record, instance, force=force, wait_s=wait,
                                                        interval_s=interval, force_after=force_after,
                                                        skip_gateway=skip_gateway, seen=seen),
                 dr.execute_drain, f"{instance} {'drained and stopped' if not skip_gateway else 'stopped'}.",
                 observe=True)


@task(help={"instance": "instance to drain, e.g. p07", "inventory": "inventory dir or file",
            "host": "host for maintenance: move or drain every instance with a rank on it, then cordon it",
            "dry_run": "print the plan only", "force": "allow draining the last instance of a role",
            "wait": "seconds to wait for in-flight work (default: the inventory's drain budget)",
            "interval": "seconds between the two empty-state checks",
            "force_after": "at the deadline, stop anyway (the loss is recorded in the journal)"})
@cli_errors
def drain(c, inventory=DEFAULT_INVENTORY, instance=None, dry_run=False, force=False, wait=None, interval=None,
          force_after=False, host=None):
    """Take an instance out of the gateway, wait out its in-flight work, stop it by identity, prove it.
    `--host H`: every instance on H, each moved to a free slot first where there is one; H cordoned."""
    if host is not None:
        if instance is not None:
            raise InvalidInput("--host", "given with --instance", fix="drain either one instance or one host")
        from pdops.ops import scale as sc

        return _host_op(host, inventory, dry_run,
                        lambda inv, record, seen: sc.plan_drain_host(inv, record, host, force=force, seen=seen))
    _drain_or_stop(instance, inventory, dry_run, force, seconds(wait, "--wait"), seconds(interval, "--interval"),
                   force_after, False)


@task(help={"host": "a host cordoned by `inv drain --host`", "inventory": "inventory dir or file",
            "dry_run": "print the plan only"})
@cli_errors
def uncordon(c, host=None, inventory=DEFAULT_INVENTORY, dry_run=False):
    """Let placement use a host again after maintenance (nothing starts there until a change needs it)."""
    from pdops.ops import scale as sc

    _host_op(host, inventory, dry_run, lambda inv, record, seen: sc.plan_uncordon(inv, record, host), observe=False)


def _host_op(host, inventory, dry_run, make_plan, *, observe: bool = True) -> None:
    from pdops.model.inventory import load_inventory

    if not host:
        raise InvalidInput("--host", "missing", fix="name an inventory host, e.g. --host lab04")
    inv = load_inventory(inventory)
    record = rec.open_record(inv)
    run_change(inv, record, lambda seen: make_plan(inv, record, seen), dry_run, observe=observe)


@task(help={"instance": "the instance to repair, e.g. d01 (see `inv status`)", "inventory": "inventory dir or file",
            "dry_run": "print the plan only",
            "force": "restart an instance observed ok, or the last serving one of its role",
            "wait": "seconds the drain waits for in-flight work (default: the inventory's drain budget)",
            "force_after": "at the drain's deadline, stop anyway (the loss is recorded in the journal)"})
@cli_errors
def repair(c, inventory=DEFAULT_INVENTORY, instance=None, dry_run=False, force=False, force_after=False, wait=None):
    """A verified restart of one instance that `inv status` does not call ok: name its lost work, leave
    the gateway, drain, verified stop, start, health, canary its P x D pairs, register, record."""
    from pdops.model.inventory import load_inventory
    from pdops.ops.repair import check_instance_id, repair as run_repair

    iid = check_instance_id(instance)
    wait_s = seconds(wait, "--wait")
    inv = load_inventory(inventory)
    _, v = run_repair(inv, rec.open_record(inv), iid, force=force, force_after=force_after, wait_s=wait_s,
                      dry_run=dry_run)
    if v is not None:
        print_verdict(v["headline"], v)


@task(help={"inventory": "inventory dir or file", "dry_run": "print the plan only"})
@cli_errors
def end_orphans(c, inventory=DEFAULT_INVENTORY, dry_run=False):
    """End the prefill halves no decode holds (their decode process ended or restarted): each by its
    request ID with /abort_request, named in the journal as lost work, never sent again."""
    from pdops.model.inventory import load_inventory
    from pdops.ops.repair import end_orphans as run_end_orphans

    inv = load_inventory(inventory)
    v = run_end_orphans(inv, rec.open_record(inv), dry_run=dry_run)
    if v is not None:
        print_verdict("orphaned halves read on every prefill; what was found is ended and named above.", v)


@task(help={"instance": "instance to stop, e.g. p07", "inventory": "inventory dir or file",
            "dry_run": "print the plan only",
            "kill_survivors": "end the processes the last stop of the instance recorded as survivors (by PID and "
                              "start time, never by name) and verify again"})
@cli_errors
def stop(c, inventory=DEFAULT_INVENTORY, instance=None, dry_run=False, kill_survivors=False):
    """The drain's verified stop without the gateway step, for a broken instance."""
    if not kill_survivors:
        _drain_or_stop(instance, inventory, dry_run, True, None, None, False, True)
        return
    from pdops.ops import drain as dr

    _instance_op(instance, inventory, dry_run, lambda inv, record, seen: dr.plan_kill_survivors(inv, record, instance),
                 dr.execute_kill_survivors, f"the survivors of {instance}'s stop are ended; the stop is verified.")
