"""`make demo`: what a new user sees first. Renders the reference fleet, boots a lab, deploys
2p1d with the real gateway and sim engines, serves traffic, drains a prefill while traffic
runs (zero failed requests), and shows status. Each run gets a fresh cluster state."""

from __future__ import annotations

import threading
import time

import yaml

from pdops.record import open_record
from pdops.facts import q
from pdops.lab import lifecycle, report
from pdops.lab.inventory import own_record
from pdops.lab.paths import inventory_path, resolve_lab_dir
from pdops.model.build import REPO, format_placement, load_and_place
from pdops.model.inventory import load_inventory, single_file_doc
from pdops.model.topology import parse_topology
from pdops.ops import deploy as dep
from pdops.ops import drain as dr
from pdops.ops.bench import compute_figures, format_table
from pdops.reads.status import collect_status, format_status
from pdops.remote.hosts import HostPool, connections
from pdops.remote.loadgen import send
from pdops.runner import Say


def _section(say: Say, title: str) -> None:
    say(f"\n=== {title} " + "=" * max(0, 70 - len(title)))


def run_demo(hosts: int = 4, say: Say = print) -> None:
    _section(say, "1. plan: the reference fleet at 12p4d (16 hosts x 8 RTX 6000D), nothing contacted")
    inv_ref, pl_ref = load_and_place(REPO / "inventory" / "rtx6000d", "12p4d")
    say(format_placement(inv_ref, pl_ref))

    _section(say, f"2. lab: {hosts} real systemd + sshd hosts on 127.0.10.1..{hosts}")
    result = lifecycle.up(hosts)
    for line in report.format_status(result):
        say("  " + line)
    say(report.summary_line(result, "ready"))

    stamp = time.strftime("%Y%m%d-%H%M%S")
    where = resolve_lab_dir() / "demo" / stamp
    where.mkdir(parents=True)
    doc = single_file_doc(inventory_path())
    own_record(doc, where)  # each demo is a cluster of its own
    (where / "hosts.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    inv = load_inventory(where)
    _stop_previous(inv, say)

    _section(say, "3. deploy 2p1d: Ansible delivers, Fabric starts in order, gateway registers, canary")
    plan = dep.plan_deploy(inv, parse_topology("2p1d"), open_record(inv))
    say(plan.render())
    with connections(inv) as conns:
        v = dep.execute_deploy(plan, say, **conns)
    say(f"verdict: 2p1d live as revision {v['revision']}")
    for item in v["verified"]:
        say(f"  verified: {item}")
    for item in v["unverified"]:
        say(f"  not verified: {item}")

    _section(say, "4. traffic: 40 requests through the real gateway (half streaming), one ledger row each")
    rows = send(inv.gateway.first.url, requests=40, concurrency=8, max_new_tokens=32, stream_every=2, rid_prefix="demo")
    say(format_table([("demo 2p1d C8", compute_figures(rows, gpus=3 * inv.profile.gpus_per_instance))]))

    _section(say, "5. drain p02 while traffic runs: leave the gateway, wait per request ID, stop, prove it")
    background: list = []
    t = threading.Thread(target=lambda: background.extend(send(
        inv.gateway.first.url, requests=30, concurrency=6, max_new_tokens=64, stream_every=2, rid_prefix="demo-bg")))
    t.start()
    record = open_record(inv)
    dplan = dr.plan_drain(inv, record, "p02", interval_s=1)
    say(dplan.render())
    with connections(inv) as conns:
        verdict = dr.execute_drain(dplan, record, say, **conns)
    t.join()
    for item in verdict["verified"]:
        say(f"  verified: {item}")
    for item in verdict["unverified"]:
        say(f"  not verified: {item}")
    ok = sum(r.ok for r in background)
    say(f"traffic during the drain: {ok}/{len(background)} requests succeeded")

    _section(say, "6. status")
    say(format_status(collect_status(inv, record)))
    say(f"\nrecord and journal (on the state host): {record.location}\nthis machine's cache and builds: {record.path}\n"
        f"inventory: {where / 'hosts.yml'}\n"
        f"try: inv status -i {where}   |   inv journal -i {where}   |   inv verify -i {where}   |   "
        "inv lab.down (removes the lab)")


def _stop_previous(inv, say: Say) -> None:
    """A fresh demo: stop the units an earlier demo left on the lab hosts (by unit name)."""
    with HostPool(inv) as pool:
        for h in inv.hosts:
            out = pool.run(h.name, "systemctl list-units --plain --no-legend --state=active,activating,deactivating,failed 'pdops-*' | awk '{print $1}'").stdout
            units = " ".join(q(u) for u in out.split())
            if units:
                pool.run(h.name, f"systemctl stop {units}; systemctl reset-failed {units} 2>/dev/null; true",
                         timeout=120)
                say(f"  {h.name}: stopped {len(out.split())} unit(s) left by an earlier demo")
