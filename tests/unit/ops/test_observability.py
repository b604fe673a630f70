"""The Prometheus side of pdops (pdops.steps.targets, pdops.ops.prometheus): target files that follow the revision, rules
checked by the real `promtool` (`check rules`, and `test rules` on series that show each alert
firing and not firing), a dashboard whose queries are the recorded ones, nothing secret anywhere."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from pdops.ops import prometheus as obs

from pdops.steps import targets as tg
from pdops.errors import InvalidInput
from pdops.model.placement import Placement, place
from pdops.model.prometheus_setting import PrometheusConfig, parse_prometheus
from pdops.model.topology import parse_topology

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None and not os.environ.get("CI"),
                                    reason="promtool not installed (Debian package prometheus: scripts/setup-system.sh)")


def test_targets_name_every_engine_and_the_gateway_with_the_revision(lab_inv):
    pl = place(lab_inv, parse_topology("2p1d"))
    doc = tg.targets(lab_inv, 7, pl)
    by = {t["labels"]["instance"]: t for t in doc}
    assert set(by) == {"p01", "p02", "d01", "gateway"}
    p01 = pl.get("p01")
    assert by["p01"]["targets"] == [f"{p01.head.data_addr}:{p01.http_port}"]
    assert by["p01"]["labels"] == {"cluster": "lab", "instance": "p01", "role": "prefill", "host": p01.head.host,
                                   "revision": "7", "job": obs.JOB_ENGINE}
    assert by["gateway"]["targets"] == [f"{lab_inv.gateway.first.addr}:{lab_inv.gateway.prometheus_port}"]
    assert by["gateway"]["labels"]["job"] == obs.JOB_GATEWAY
    # a drained instance is not in the next revision's file
    after = Placement(parse_topology("1p1d"), tuple(i for i in pl.instances if i.id != "p02"))
    assert "p02" not in {t["labels"]["instance"] for t in tg.targets(lab_inv, 8, after)}
    json.loads(tg.targets_text(doc))  # the file is JSON


def test_publish_writes_the_local_file_atomically_and_delivers_it_where_configured(lab_inv, tmp_path, monkeypatch):
    import dataclasses

    monkeypatch.setenv("PDOPS_STATE_DIR", str(tmp_path / "op"))
    pl = place(lab_inv, parse_topology("1p1d"))
    ran = []

    class Pool:
        def run(self, host, command, timeout=60):
            ran.append((host, command))

    ev = tg.publish(Pool(), lab_inv, 3, pl)
    assert json.loads((tmp_path / "op" / "prometheus" / "pdops-lab.json").read_text()) == tg.targets(lab_inv, 3, pl)
    assert not ran and "delivered" not in ev
    inv = dataclasses.replace(lab_inv, prometheus=PrometheusConfig("lab01", "/etc/prometheus/file_sd"))
    ev = tg.publish(Pool(), inv, 4, pl)
    assert ev["delivered"] == "lab01:/etc/prometheus/file_sd/pdops-lab.json"
    host, cmd = ran[0]
    assert host == "lab01" and "mv -f /etc/prometheus/file_sd/pdops-lab.json.tmp /etc/prometheus/file_sd/pdops-lab.json" in cmd


def test_the_prometheus_setting_is_validated(lab_inv):
    names = [h.name for h in lab_inv.hosts]
    assert parse_prometheus({}, names) is None
    assert parse_prometheus({"pdops_prometheus": {"host": "lab02"}}, names).targets_file("lab") == \
        "/etc/prometheus/file_sd/pdops-lab.json"
    for bad, field in (({"host": "mon9"}, "pdops_prometheus.host"),
                       ({"host": "lab01", "targets_dir": "rel/dir"}, "pdops_prometheus.targets_dir"),
                       ({"host": "lab01", "targets_dir": "/a/../etc"}, "pdops_prometheus.targets_dir"),
                       ({"host": "lab01", "port": 9090}, "pdops_prometheus.port"), ("lab01", "pdops_prometheus")):
        with pytest.raises(InvalidInput) as e:
            parse_prometheus({"pdops_prometheus": bad}, names)
        assert e.value.field == field and e.value.fix


def test_nothing_secret_in_targets_and_keys_referenced_by_file(lab_inv, tmp_path):
    import dataclasses

    key = tmp_path / "gw.key"
    key.write_text("sk-very-secret-0123456789\n")
    inv = dataclasses.replace(lab_inv, gateway=dataclasses.replace(lab_inv.gateway, api_key_file=str(key)))
    text = tg.targets_text(tg.targets(inv, 1, place(inv, parse_topology("1p1d"))))
    assert "sk-very-secret" not in text and str(key) not in text
    job = obs.scrape_config(inv)["scrape_configs"][0]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": str(key)}
    assert "sk-very-secret" not in yaml.safe_dump(obs.scrape_config(inv))


def test_the_dashboard_is_grafana_json_whose_panels_use_the_rules_and_the_variables(lab_inv):
    d = obs.dashboard(lab_inv)
    json.dumps(d)
    assert [v["name"] for v in d["templating"]["list"]] == ["datasource", "cluster", "revision"]
    recorded = {r["record"] for r in obs.recording_rules()}
    exprs = [t["expr"] for p in d["panels"] for t in p["targets"]]
    assert len(d["panels"]) == len(obs.PANELS) and all("$cluster" in e for e in exprs)
    used = {m for e in exprs for m in re.findall(r"pdops:[a-z_:0-9]+", e)}
    assert used <= recorded and {"pdops:total_tpm:cluster", "pdops:ttft_seconds:p99", "pdops:itl_seconds:p99"} <= used
    assert all("$" not in q for _, q in obs.panel_queries("lab"))


def _render(template: str, labels: dict) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), template)


def _series(name: str, values: str, **labels) -> dict:
    base = {"job": obs.JOB_ENGINE, "cluster": "lab", "revision": "3"}
    base.update(labels)
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in base.items()) + "}", "values": values}


D01 = {"instance": "d01", "role": "decode", "host": "lab02"}
D02 = {"instance": "d02", "role": "decode", "host": "lab03"}
P01 = {"instance": "p01", "role": "prefill", "host": "lab01"}
BASE = {"job": obs.JOB_ENGINE, "cluster": "lab", "revision": "3"}

_GW_TRAFFIC = {"series": f'smg_http_requests_total{{job="{obs.JOB_GATEWAY}",cluster="lab",host="lab01",path="/generate"}}',
               "values": "0+30x40"}

# alert -> (input series, eval time, labels of the firing alert or None for "does not fire")
CASES = {
    "PdopsInstanceDown": [
        ([_series("up", "1 1 0x12", **D01), _series("up", "1x14", **D02)], "3m", {**BASE, **D01}),
        ([_series("up", "1x14", **D01)], "3m", None),
    ],
    "PdopsBootstrapFailures": [
        ([_series("sglang:num_bootstrap_failed_reqs_total", "0 0 1 1 1", **D01)], "1m", {**BASE, **D01}),
        # at 4 for longer than the window: nothing new (a series newer than 5 minutes would fire)
        ([_series("sglang:num_bootstrap_failed_reqs_total", "4x40", **D01)], "6m", None),
        # the real engine's counter has no series before its first failure: it appears at 1
        ([_series("sglang:num_bootstrap_failed_reqs_total", "_ _ 1 1 1", **D01)], "1m", {**BASE, **D01}),
    ],
    "PdopsTransferFailuresRising": [
        ([_series("sglang:num_transfer_failed_reqs_total", "0+2x60", **D02)], "12m", {**BASE, **D02}),
        ([_series("sglang:num_transfer_failed_reqs_total", "0 1 1x60", **D02)], "12m", None),
        ([_series("sglang:num_transfer_failed_reqs_total", "_x4 5+2x60", **D02)], "6m", {**BASE, **D02}),
    ],
    "PdopsPrefillQueueGrowing": [
        ([_series("sglang:num_queue_reqs", "1+1x100", **P01)], "22m", {**BASE, **P01}),
        ([_series("sglang:num_queue_reqs", "5x100", **P01)], "22m", None),
    ],
    "PdopsKVTransferStuck": [
        ([_series("sglang:num_prefill_inflight_queue_reqs", "2x60", **P01)], "12m", {**BASE, **P01}),
        ([_series("sglang:num_prefill_inflight_queue_reqs", "2 3 2 3 2 3 2 3 2 3 2 3 2 3 2 3 2 3 2 3 2 3 2 3 2 3 2 3 2 3 "
                  "2 3 2 3 2 3 2 3 2 3 2 3 2 3 2 3 2 3 2 3", **P01)], "12m", None),
    ],
    "PdopsDecodeQueueGrowing": [
        ([_series("sglang:num_decode_prealloc_queue_reqs", "1+1x100", **D01),
          _series("sglang:num_decode_transfer_queue_reqs", "0x100", **D01)], "22m", {**BASE, **D01}),
        ([_series("sglang:num_decode_prealloc_queue_reqs", "0x100", **D01),
          _series("sglang:num_decode_transfer_queue_reqs", "0x100", **D01)], "22m", None),
    ],
    "PdopsKVCacheNearlyFull": [
        ([_series("sglang:token_usage", "0.97x40", **D01)], "7m", {**BASE, **D01}),
        ([_series("sglang:token_usage", "0.5x40", **D01)], "7m", None),
    ],
    "PdopsTTFTHigh": [
        ([_series("sglang:time_to_first_token_seconds_bucket", "0x60", le="5.0", **D01),
          _series("sglang:time_to_first_token_seconds_bucket", "0+10x60", le="10.0", **D01),
          _series("sglang:time_to_first_token_seconds_bucket", "0+10x60", le="+Inf", **D01)], "9m", {"cluster": "lab"}),
        ([_series("sglang:time_to_first_token_seconds_bucket", "0+10x60", le="0.5", **D01),
          _series("sglang:time_to_first_token_seconds_bucket", "0+10x60", le="+Inf", **D01)], "9m", None),
    ],
    "PdopsAdmissionQueueFull": [
        ([{"series": f'haproxy_backend_current_queue{{job="{obs.JOB_ADMISSION}",cluster="lab",proxy="gateway"}}',
           "values": "3x30"},
          {"series": f'haproxy_frontend_http_responses_total{{job="{obs.JOB_ADMISSION}",cluster="lab",proxy="admission",code="4xx"}}',
           "values": "0+5x30"}], "4m", {"job": obs.JOB_ADMISSION, "cluster": "lab", "proxy": "gateway"}),
        ([{"series": f'haproxy_backend_current_queue{{job="{obs.JOB_ADMISSION}",cluster="lab",proxy="gateway"}}',
           "values": "0x30"},
          {"series": f'haproxy_frontend_http_responses_total{{job="{obs.JOB_ADMISSION}",cluster="lab",proxy="admission",code="4xx"}}',
           "values": "0+5x30"}], "4m", None),
    ],
    "PdopsGatewayCircuitOpen": [
        ([{"series": f'smg_worker_cb_state{{job="{obs.JOB_GATEWAY}",cluster="lab",host="lab01",worker="http://127.0.10.2:30001"}}',
           "values": "0 1x40"}, _GW_TRAFFIC], "3m",
         {"job": obs.JOB_GATEWAY, "cluster": "lab", "host": "lab01", "worker": "http://127.0.10.2:30001"}),
        # open, then half-open and closed within the timeout: no page
        ([{"series": f'smg_worker_cb_state{{job="{obs.JOB_GATEWAY}",cluster="lab",host="lab01",worker="http://127.0.10.2:30001"}}',
           "values": "0 1 1 1 2 0x40"}, _GW_TRAFFIC], "3m", None),
        # open on a quiet gateway: smg half-opens it at the next request; no page
        ([{"series": f'smg_worker_cb_state{{job="{obs.JOB_GATEWAY}",cluster="lab",host="lab01",worker="http://127.0.10.2:30001"}}',
           "values": "0 1x40"},
          {"series": f'smg_http_requests_total{{job="{obs.JOB_GATEWAY}",cluster="lab",host="lab01",path="/generate"}}',
           "values": "100x40"}], "3m", None),
    ],
    "PdopsNoServingRole": [
        ([_series("up", "1 0x12", **D01), _series("up", "1 0x12", **D02), _series("up", "1x12", **P01)], "3m",
         {"cluster": "lab", "role": "decode"}),
        ([_series("up", "1 0x12", **D01), _series("up", "1x12", **D02), _series("up", "1x12", **P01)], "3m", None),
    ],
}


@needs_promtool
def test_promtool_accepts_the_rules(lab_inv, tmp_path):
    f = tmp_path / "pdops-rules.yml"
    f.write_text(obs.rules_text(lab_inv))
    proc = subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(obs.recording_rules()) + len(obs.alert_rules(lab_inv))} rules found" in proc.stdout


@needs_promtool
def test_each_alert_fires_on_its_series_and_not_on_the_others(lab_inv, tmp_path):
    """`promtool test rules`: every alert has a case where it fires (labels and annotations as
    expected) and one where it does not; a test fails if an alert is added without cases."""
    alerts = {a["alert"]: a for a in obs.alert_rules(lab_inv)}
    assert set(alerts) == set(CASES)
    rules_file = tmp_path / "pdops-rules.yml"
    rules_file.write_text(obs.rules_text(lab_inv))
    tests = []
    for name, cases in CASES.items():
        for series, at, labels in cases:
            exp = []
            if labels is not None:
                a = alerts[name]
                exp = [{"exp_labels": {**labels, **a["labels"]},
                        "exp_annotations": {k: _render(v, labels) for k, v in a["annotations"].items()}}]
            tests.append({"interval": "15s", "input_series": series,
                          "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": exp}]})
    # the recording rules as the dashboard reads them: TPM as the ledger defines it
    tests.append({"interval": "15s", "input_series": [
        _series("sglang:prompt_tokens_total", "0+1500x40", **P01),  # 100 tokens/s in
        _series("sglang:generation_tokens_total", "0+150x40", **D01),  # 10 tokens/s out
        _series("sglang:generation_tokens_total", "0+150x40", **D02),
        _series("sglang:prompt_tokens_total", "0+1500x40", **D01),  # a decode's own prompt count is not input TPM
    ], "promql_expr_test": [
        {"expr": "pdops:total_tpm:cluster", "eval_time": "5m", "exp_samples": [{"labels": 'pdops:total_tpm:cluster{cluster="lab"}', "value": 7200}]},
        {"expr": "pdops:output_tpm:cluster", "eval_time": "5m", "exp_samples": [{"labels": 'pdops:output_tpm:cluster{cluster="lab"}', "value": 1200}]},
    ]})
    # PD failures per instance: an engine with no failure counter yet (the real engine creates them at
    # their first increment) counts 0, one with only its bootstrap counter counts that counter
    tests.append({"interval": "15s", "input_series": [
        _series("up", "1x40", **D01), _series("up", "1x40", **P01),
        _series("sglang:num_bootstrap_failed_reqs_total", "0+3x40", **P01),  # 0.2 per second
    ], "promql_expr_test": [
        {"expr": "pdops:pd_failures:rate5m", "eval_time": "6m", "exp_samples": [
            {"labels": 'pdops:pd_failures:rate5m{cluster="lab",instance="d01",role="decode"}', "value": 0},
            {"labels": 'pdops:pd_failures:rate5m{cluster="lab",instance="p01",role="prefill"}', "value": 0.2}]},
    ]})
    tf = tmp_path / "pdops-rules.test.yml"
    tf.write_text(yaml.safe_dump({"rule_files": [str(rules_file)], "evaluation_interval": "15s", "tests": tests},
                                 sort_keys=False))
    proc = subprocess.run(["promtool", "test", "rules", str(tf)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
