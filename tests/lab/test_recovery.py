"""Compound failures: faults on top of a pending or halted change, then the one documented command.

Runbook "cluster down" (docs/runbooks/cluster-down.md): after a reboot of every host with a
change pending (the inventory edited, not yet applied), `inv deploy --topology <T>` with the
inventory on disk plans from what it observes: the gateway down is started first, instances that
do not run are not drained (nothing to wait for) and count for no floor, a floor already broken is
said in the plan, not refused. The cluster serves again with the pending change applied."""

from __future__ import annotations

import json

import pytest
import yaml

from pdops import lab as lab_api
from pdops.hosts import http_json
from pdops.inventory import load_inventory
from pdops.load import send
from pdops.placement import Placement
from tests.lab.clusters import derived_inventory, inv_cmd, record, stop_all

pytestmark = pytest.mark.lab


def cli(inv_dir, *args):
    return inv_cmd(*args, "-i", str(inv_dir), timeout=900)


def test_a_reboot_with_a_change_pending_is_one_deploy_back_to_serving(lab, tmp_path):
    stop_all(lab)
    inv_dir = derived_inventory(lab, tmp_path / "down", profile={})
    proc = cli(inv_dir, "deploy", "--topology", "2p2d")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    before = record(inv_dir).current()
    # the change is pending: the inventory on disk asks for another bundle
    p = inv_dir / "profiles" / "p.yml"
    prof = yaml.safe_load(p.read_text())
    prof["bundle"]["max_running_requests"] = 32
    p.write_text(yaml.safe_dump(prof))
    lab_api.down()  # every host powered off, then booted: on the lab nothing of pdops starts at boot
    lab.ensure_up()
    # runbook step 1: look
    st = cli(inv_dir, "status")
    assert st.returncode != 0 and "down" in st.stdout, st.stdout + st.stderr
    # runbook step 2: the dry run says what it observed and what it will do, and changes nothing
    dry = cli(inv_dir, "deploy", "--topology", "2p2d", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    out = dry.stdout
    assert "observed: the gateway does not answer" in out and "started first" in out, out
    for iid in ("p01", "p02", "d01", "d02"):
        assert f"observed: {iid} does not serve (units not running" in out, out
    assert "floor: no prefill serves now" in out and "floor: no decode serves now" in out, out
    assert "wait-empty" not in out  # nothing runs to wait for
    assert record(inv_dir).current() == before
    # runbook step 3: the one command
    proc = cli(inv_dir, "deploy", "--topology", "2p2d")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rev = record(inv_dir).current_revision()
    assert rev.number > before and rev.outcome == "deployed" and rev.topology == "2p2d"
    # runbook step 4: prove it
    status = cli(inv_dir, "status", "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    rows = json.loads(status.stdout)["instances"]
    assert sorted(r["instance"] for r in rows if r["healthy"]) == ["d01", "d02", "p01", "p02"], rows
    pl = Placement.from_dict(rev.placement)
    for i in pl.instances:  # the pending change is what runs now
        assert http_json("GET", f"{i.url}/server_info", timeout=10)[1]["max_running_requests"] == 32
    inv = load_inventory(inv_dir)
    rows = send(inv.gateway.url, requests=8, concurrency=4, max_new_tokens=8, rid_prefix="back")
    if not all(r.ok for r in rows):  # the gateway's view says why (e.g. a prefill listed on its old bootstrap port)
        pytest.fail(json.dumps({"failed": [r.to_dict() for r in rows if not r.ok][:2],
                                "workers": http_json("GET", f"{inv.gateway.url}/workers", timeout=10)[1]},
                               default=str)[:4000])
    verify = cli(inv_dir, "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    stop_all(lab)
