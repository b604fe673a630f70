"""A real Prometheus (Debian's `prometheus`, started here on a loopback port and stopped by its PID)
scrapes a deployed lab cluster through the file_sd target file pdops writes after every change: the
dashboard's queries and the recording rules return series for every instance after traffic; a
drained instance's target is gone within one refresh; a decode killed mid-stream makes its
instance-down alert go pending."""

from __future__ import annotations

import json
import os
import math
import shutil
import time
from pathlib import Path

import pytest

from pdops.errors import Unreachable
from pdops.sim.testing import free_port, wait_until
from tests.lab.clusters import deployed, inv_cmd, prometheus_api, queue, record, running_prometheus

from pdops.ops import prometheus as obs

from pdops.steps import targets as tg
from pdops.model.inventory import load_inventory
from pdops.model.placement import Placement

pytestmark = [pytest.mark.lab,
              pytest.mark.skipif(shutil.which("prometheus") is None and not os.environ.get("CI"),
                                 reason="prometheus not installed (Debian package: scripts/setup-system.sh)")]


def cli(inv_dir: Path, *args, timeout=600):
    return inv_cmd(*args, "-i", str(inv_dir), timeout=timeout)


api = prometheus_api


@pytest.fixture(scope="module")
def cluster(lab, tmp_path_factory):
    root = tmp_path_factory.mktemp("observe")
    with deployed(lab, root / "c", "1p2d") as (inv_dir, proc):
        assert "Prometheus targets follow revision" in proc.stdout
        yield inv_dir, root


@pytest.fixture(scope="module")
def prometheus(cluster):
    inv_dir, root = cluster
    targets_file = tg.local_targets_path(load_inventory(inv_dir))
    assert targets_file.is_file()  # written by the plan's publish-targets step (an `always` step, run last)
    with running_prometheus(inv_dir, root, free_port()) as base:
        yield base, inv_dir, targets_file


def active(base: str) -> dict[str, str]:
    return {t["labels"]["instance"]: t["health"] for t in api(base, "/api/v1/targets")["activeTargets"]}


def query(base: str, expr: str) -> list[dict]:
    return api(base, "/api/v1/query", query=expr)["result"]


def test_dashboard_queries_and_recording_rules_return_series_for_every_instance(prometheus):
    from pdops.remote.loadgen import send

    base, inv_dir, _ = prometheus
    inv = load_inventory(inv_dir)
    pl = Placement.from_dict(record(inv_dir).current_revision().placement)
    want = {i.id for i in pl.instances} | {"gateway"}
    wait_until(lambda: set(active(base)) == want and all(h == "up" for h in active(base).values()), 60,
               "every target of the file up")
    from pdops.model.prompts import make_prompt

    # distinct prompts through the gateway; its policy may still send them all to one decode (seen
    # once in a run beside a soak), so every prefill x decode pair also gets generations of its own,
    # sent straight to the pair as the canary sends them
    rows = send(inv.gateway.first.url, requests=80, concurrency=8, max_new_tokens=16, stream_every=2,
                prompt_for=lambda i: make_prompt(30, i))
    assert all(r.ok for r in rows)
    from pdops.steps.canary import canary_pair

    for p in pl.role("prefill"):
        for d in pl.role("decode"):
            for _ in range(4):
                canary_pair(p, d)
    rev = str(record(inv_dir).current())

    def empty_panels() -> list[str]:
        out = []
        for title, q in obs.panel_queries(inv.cluster, rev):
            vals = [float(s["value"][1]) for s in query(base, q)]
            if not vals or all(math.isnan(v) for v in vals):
                out.append(f"{title}: {q}")
        return out
    try:
        wait_until(lambda: not empty_panels(), 60, "data for every panel")
    except Unreachable:
        raise AssertionError(f"panels without data: {empty_panels()}") from None
    prefills = {i.id for i in pl.role("prefill")}
    decodes = {i.id for i in pl.role("decode")}

    def with_tpm(rule: str) -> set[str]:
        return {s["metric"]["instance"] for s in query(base, f"{rule} > 0")}
    # each instance's rate turns positive once Prometheus has scraped it after its traffic
    wait_until(lambda: with_tpm("pdops:input_tpm:instance") == prefills, 60, "input TPM of every prefill")
    wait_until(lambda: with_tpm("pdops:output_tpm:instance") == decodes, 60, "output TPM of every decode")
    assert {s["metric"]["instance"] for s in query(base, f'sglang:num_running_reqs{{cluster="{inv.cluster}"}}')} == \
        prefills | decodes
    assert query(base, "pdops:total_tpm:cluster > 0")
    # inv status --prometheus: the last 5 minutes' TPM per instance, from this Prometheus
    doc = json.loads(cli(inv_dir, "status", "--json", "--prometheus", base).stdout)
    assert doc["gateways"][0]["prometheus_error"] is None
    assert all(r["prometheus"].get("tpm_5m", 0) > 0 for r in doc["instances"]), [r["prometheus"] for r in doc["instances"]]


def test_a_drained_instance_leaves_the_targets_within_one_refresh(prometheus):
    base, inv_dir, targets_file = prometheus
    proc = cli(inv_dir, "drain", "--instance", "d02")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    done = time.monotonic()
    doc = json.loads(targets_file.read_text())
    assert "d02" not in {t["labels"]["instance"] for t in doc}
    assert {t["labels"]["revision"] for t in doc} == {str(record(inv_dir).current())}
    wait_until(lambda: "d02" not in active(base), 10, "d02's target gone")
    print(f"d02's target gone from Prometheus {time.monotonic() - done:.1f}s after the drain's verdict")


def test_a_decode_killed_mid_stream_makes_its_instance_down_alert_go_pending(lab, prometheus):
    import threading

    from pdops.remote.loadgen import send

    base, inv_dir, _ = prometheus
    inv = load_inventory(inv_dir)
    d01 = Placement.from_dict(record(inv_dir).current_revision().placement).get("d01")
    status = json.loads(cli(inv_dir, "status", "--json").stdout)
    pid = next(r for r in status["instances"] if r["instance"] == "d01")["units"][0]["main_pid"]
    rows: list = []
    t = threading.Thread(target=lambda: rows.extend(send(inv.gateway.first.url, requests=4, concurrency=4,
                                                         max_new_tokens=2000, stream_every=1, timeout=60)))
    t.start()
    wait_until(lambda: queue(d01.url) >= 1, 30, "streams running on d01 (the only decode now)")
    c = lab.connection(d01.head.host)
    c.run(f"kill -KILL {int(pid)}", hide=True)
    c.close()

    def pending():
        return [a for a in api(base, "/api/v1/alerts")["alerts"]
                if a["labels"].get("alertname") == "PdopsInstanceDown" and a["labels"].get("instance") == "d01"
                and a["state"] in ("pending", "firing")]
    alert = wait_until(pending, 20, "PdopsInstanceDown pending for d01", interval=0.1)
    assert alert[0]["labels"]["role"] == "decode" and alert[0]["labels"]["cluster"] == inv.cluster
    t.join(90)
    assert not t.is_alive() and any(not r.ok for r in rows)  # the kill cut streams; none hung
