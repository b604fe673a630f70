"""Compound failures: faults on top of a pending or halted change, then the one documented command.

Runbook "cluster down" (docs/runbooks/cluster-down.md): after a reboot of every host with a
change pending (the inventory edited, not yet applied), `inv deploy --topology <T>` with the
inventory on disk plans from what it observes: the gateway down is started first, instances that
do not run are not drained (nothing to wait for) and count for no floor, a floor already broken is
said in the plan, not refused. The cluster serves again with the pending change applied.

Also: a change halted at a drain puts back what it took out (the plan's rescue steps); orphaned
halves on a prefill are named by `inv status` and ended by `inv end-orphans` and by a drain."""

from __future__ import annotations

import re

import json

import pytest
import yaml

from pdops import lab as lab_api
from pdops.remote.hosts import http_json
from pdops.model.inventory import load_inventory
from pdops.remote.loadgen import send
from pdops.model.placement import Placement
from pdops.sim.testing import wait_until
from tests.lab.clusters import Load, derived_inventory, inv_cmd, main_pids, queue, record, set_bundle, stop_all

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
    own = [ln for ln in out.splitlines() if re.match(r"^ {1,5}\d+\. ", ln)]  # the plan's own steps
    assert own and not any("wait-empty" in ln for ln in own), out  # nothing runs to wait for
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
    rows = send(inv.gateway.first.url, requests=8, concurrency=4, max_new_tokens=8, rid_prefix="back")
    if not all(r.ok for r in rows):  # the gateway's view says why (e.g. a prefill listed on its old bootstrap port)
        pytest.fail(json.dumps({"failed": [r.to_dict() for r in rows if not r.ok][:2],
                                "workers": http_json("GET", f"{inv.gateway.first.url}/workers", timeout=10)[1]},
                               default=str)[:4000])
    verify = cli(inv_dir, "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    stop_all(lab)


def _half_on(prefill, rid: str, out: dict):
    """The prefill half of a request whose decode side never comes: what a decode SIGKILLed (or a
    request it failed) leaves on a prefill. Sent straight to the prefill, as the gateway sends it."""
    import random
    import threading

    body = {"text": f"an orphaned half {rid}", "rid": rid, "stream": False,
            "sampling_params": {"max_new_tokens": 4}, "bootstrap_host": prefill.head.data_addr,
            "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": random.getrandbits(62)}
    t = threading.Thread(target=lambda: out.update(answer=http_json("POST", f"{prefill.url}/generate", body,
                                                                     timeout=200, headers={"x-request-id": rid})))
    t.start()
    return t


def test_orphaned_halves_are_named_by_status_and_ended_by_end_orphans_and_by_a_drain(lab, tmp_path):
    """A prefill holds halves no decode holds: `inv status` names them per prefill (degraded, with
    the time the engine's timeout would end them); `inv end-orphans` ends them by rid (the client's
    request returns at once, nothing is sent again); a drain that finds only such halves left ends
    them and completes instead of stopping at its budget."""
    import uuid

    stop_all(lab)
    inv_dir = derived_inventory(lab, tmp_path / "orphans", profile={},
                                mutate=lambda d: d["all"]["vars"]["pdops_drain"].update(budget_s=20))
    proc = cli(inv_dir, "deploy", "--topology", "2p1d")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pl = Placement.from_dict(record(inv_dir).current_revision().placement)
    p01 = pl.get("p01")
    rid = f"orphan-{uuid.uuid4().hex[:8]}"
    out: dict = {}
    t = _half_on(p01, rid, out)

    def orphaned():
        st = cli(inv_dir, "status", "--json")
        row = next(r for r in json.loads(st.stdout)["instances"] if r["instance"] == "p01")
        return (st, row) if row["orphaned"] else None

    st, row = wait_until(orphaned, 60, "p01's orphaned half named by inv status")
    assert st.returncode == 1 and row["state"] == "degraded" and [o["rid"] for o in row["orphaned"]] == [rid]
    text = cli(inv_dir, "status").stdout
    assert f"waiting for a decode side that is gone (restarted, ended or failed them): {rid}; they end by timeout at" \
        in text and "-> inv end-orphans" in text, text
    ended = cli(inv_dir, "end-orphans")
    assert ended.returncode == 0, ended.stdout + ended.stderr
    assert f"orphaned half(s) ended and no longer open (lost work, not replayed): {rid}" in ended.stdout, ended.stdout
    t.join(timeout=30)
    status, doc = out["answer"]  # ended, not served: the client is told at once (SGLang: 200, finish_reason abort)
    assert not t.is_alive() and (status != 200 or doc["meta_info"]["finish_reason"]["type"] == "abort"), doc
    assert cli(inv_dir, "status").returncode == 0
    # a drain of p01 with nothing but an orphaned half on it ends the half and completes
    rid2 = f"orphan-{uuid.uuid4().hex[:8]}"
    out2: dict = {}
    t2 = _half_on(p01, rid2, out2)
    wait_until(orphaned, 60, "the second orphaned half named")
    drain = cli(inv_dir, "drain", "--instance", "p01", "--interval", "1")
    assert drain.returncode == 0, drain.stdout + drain.stderr
    assert f"ended 1 orphaned half(s) whose decode side is gone, the only work it still held (lost, not " \
           f"replayed): {rid2}" in drain.stdout, drain.stdout
    t2.join(timeout=30)
    assert not t2.is_alive()
    inv = load_inventory(inv_dir)
    assert all(r.ok for r in send(inv.gateway.first.url, requests=6, concurrency=3, max_new_tokens=8, rid_prefix="after"))
    stop_all(lab)


def test_a_change_halted_at_a_drain_puts_back_what_it_took_out(lab, tmp_path):
    """A rolling change whose first wave's drain meets its budget (a long generation sent straight
    to p01 x d01, not through the gateway): the plan's rescue steps, printed by the dry run, put
    p01 and d01 back in the gateway (canary, register, start-up list); nothing was stopped, so the
    revision stays current. Under load: no request lost; afterwards as many instances serve as
    before, `inv status` is ok, and the long generation finished untouched."""
    import threading
    import uuid

    from pdops.steps.canary import both_sides  # the canary's own way of reaching exactly one pair

    stop_all(lab)
    inv_dir = derived_inventory(lab, tmp_path / "halted", profile={"env": {"PDOPS_SIM_DECODE_STEP_MS": "20"}},
                                mutate=lambda d: d["all"]["vars"]["pdops_drain"].update(budget_s=3))
    proc = cli(inv_dir, "deploy", "--topology", "2p2d")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rev_before = record(inv_dir).current()
    pids_before = main_pids(inv_dir)
    set_bundle(inv_dir, max_running_requests=32)
    dry = cli(inv_dir, "deploy", "--topology", "2p2d", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "if a step fails, then (rescue)" in dry.stdout and "restore-check — " in dry.stdout, dry.stdout
    pl = Placement.from_dict(record(inv_dir).current_revision().placement)
    p01, d01 = pl.get("p01"), pl.get("d01")
    rid = f"halt-long-{uuid.uuid4().hex[:8]}"
    body = {"text": "a long generation the drain must wait for", "rid": rid, "stream": False,
            "sampling_params": {"max_new_tokens": 1500, "temperature": 0},  # ~30 s at 20 ms a token
            "bootstrap_host": p01.head.data_addr, "bootstrap_port": p01.bootstrap_port, "bootstrap_room": 424242}
    long_result: dict = {}
    t = threading.Thread(target=lambda: long_result.update(both_sides(p01, d01, body, rid, 120)))
    t.start()
    wait_until(lambda: queue(d01.url) > 0, 30, "the long generation running on d01")
    inv = load_inventory(inv_dir)
    with Load(inv.gateway.first.url) as load:
        bad = cli(inv_dir, "deploy", "--topology", "2p2d")
    t.join(timeout=120)
    assert bad.returncode != 0, bad.stdout + bad.stderr
    assert "still has work" in bad.stderr, bad.stderr
    assert "back in service (were out of the gateway, never stopped): d01, p01" in bad.stderr, bad.stderr
    load.assert_clean()
    # the long generation was never cut
    assert long_result["decode"][0] == 200 and long_result["decode"][1]["meta_info"]["completion_tokens"] == 1500
    st = record(inv_dir)
    assert st.current() == rev_before  # nothing was stopped: the revision still describes what runs
    assert main_pids(inv_dir) == pids_before
    steps = {r["step"]: r["status"] for r in st.journal().read(st.journal().operations()[-1])}
    # the restore, one decision a step: both running, canaried, each registered again, listed
    assert all(steps[s] == "ok" for s in ("restore-check", "restore-canary", "restore register p01",
                                          "restore register d01", "restore gateway-list")), steps
    assert steps["record-halt"] == "noop", steps
    status = cli(inv_dir, "status", "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    doc = json.loads(status.stdout)
    assert sorted(r["instance"] for r in doc["instances"] if r["healthy"]) == ["d01", "d02", "p01", "p02"]
    from pdops.remote.loadgen import send

    after = send(inv.gateway.first.url, requests=8, concurrency=4, max_new_tokens=4, stream_every=2, rid_prefix="after-halt")
    assert all(r.ok for r in after), [r.to_dict() for r in after if not r.ok]
    stop_all(lab)
