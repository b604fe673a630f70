"""What the fleet's Prometheus and Grafana need for exactly what pdops deployed: a `file_sd` target
file that follows the current revision, recording and alert rules for PD clusters, and a
dashboard. Pure builders here; the target file and the step that writes it are
pdops.steps.targets's (docs/observability.md).

Target labels: `cluster`, `instance` (p01.., `gateway`, `admission`), `role` (prefill, decode,
gateway, admission), `host`, `revision`; `job` is pdops-engine, pdops-gateway or pdops-admission.
Nothing secret is in a target file or a label: where engines or the gateway need an API key,
the scrape config (`scrape_config`) names its file (`authorization.credentials_file`).
"""

from __future__ import annotations

import yaml

from pdops.steps.targets import JOB_ADMISSION, JOB_ENGINE, JOB_GATEWAY, local_targets_path

DEFAULT_TTFT_P99_S = 5.0


def scrape_config(inv, targets_file: str | None = None) -> dict:
    """The scrape jobs for the fleet's prometheus.yml (pdops does not own that file): file_sd over
    the target file; an API key by file reference, never inline."""
    cfg = getattr(inv, "prometheus", None)
    path = targets_file or (cfg.targets_file(inv.cluster) if cfg else str(local_targets_path(inv)))
    job = {"job_name": f"pdops-{inv.cluster}", "file_sd_configs": [{"files": [path]}],
           # each target's own `job` label (pdops-engine, -gateway, -admission) wins over job_name
           "honor_labels": False}
    # pdops starts engines without a key; where the gateway has one, the scrape presents it from
    # its file (an endpoint that does not check it ignores the header)
    key_file = inv.gateway.api_key_file
    if key_file:
        job["authorization"] = {"type": "Bearer", "credentials_file": str(key_file)}
    return {"scrape_configs": [job]}


# ---------------------------------------------------------------- rules

ENGINE = f'job="{JOB_ENGINE}"'
PD_FAILURE_COUNTERS = "sglang:num_(bootstrap|transfer)_failed_reqs_total"


def first_increase(counter: str, above: int) -> str:
    """`increase(counter[5m]) > above`, and also a series that appeared within 5 minutes above it: SGLang
    creates its failure counters at their first increment, and increase() over a series that starts at
    1 sees no increase (the first failure would never alert)."""
    return (f"increase({counter}{{{ENGINE}}}[5m]) > {above} or "
            f"({counter}{{{ENGINE}}} > {above} unless {counter}{{{ENGINE}}} offset 5m)")


def ttft_threshold_s(inv) -> float:
    """The profile's `slo.ttft_p99_s`, else DEFAULT_TTFT_P99_S."""
    v = (inv.profile.slo or {}).get("ttft_p99_s")
    return float(v) if v else DEFAULT_TTFT_P99_S


def recording_rules() -> list[dict]:
    """TPM as the bench ledger defines it (60 x tokens per second; prompt tokens counted on the
    prefills, generated tokens on the decodes, so a PD request counts once), latency percentiles,
    per cluster and role and per instance."""
    r = []
    r.append({"record": "pdops:input_tpm:instance", "expr":
              f'60 * sum by (cluster, instance, role, revision) (rate(sglang:prompt_tokens_total{{{ENGINE},role="prefill"}}[1m]))'})
    r.append({"record": "pdops:output_tpm:instance", "expr":
              f'60 * sum by (cluster, instance, role, revision) (rate(sglang:generation_tokens_total{{{ENGINE},role="decode"}}[1m]))'})
    r.append({"record": "pdops:output_tpm:cluster", "expr": "sum by (cluster) (pdops:output_tpm:instance)"})
    r.append({"record": "pdops:total_tpm:cluster", "expr":
              "sum by (cluster) (pdops:input_tpm:instance) + sum by (cluster) (pdops:output_tpm:instance)"})
    for q in ("0.5", "0.99"):
        tag = q.replace("0.", "p").replace("p5", "p50")
        r.append({"record": f"pdops:ttft_seconds:{tag}", "expr":
                  f"histogram_quantile({q}, sum by (cluster, le) (rate(sglang:time_to_first_token_seconds_bucket{{{ENGINE}}}[1m])))"})
        r.append({"record": f"pdops:itl_seconds:{tag}", "expr":
                  f"histogram_quantile({q}, sum by (cluster, le) (rate(sglang:inter_token_latency_seconds_bucket{{{ENGINE}}}[1m])))"})
    # SGLang's failure counters have no series until their first increment (real engine, docs/sim.md):
    # both are summed by name (`a + b` is empty while either is absent), and every scraped engine
    # without one counts 0, so the panel says "none" rather than "no data"
    r.append({"record": "pdops:pd_failures:rate5m", "expr":
              f"sum by (cluster, instance, role) (rate({{__name__=~\"{PD_FAILURE_COUNTERS}\",{ENGINE}}}[5m])) "
              f"or 0 * sum by (cluster, instance, role) (up{{{ENGINE}}})"})
    return r


def alert_rules(inv) -> list[dict]:
    ttft = ttft_threshold_s(inv)
    # open longer than smg's breaker timeout plus a scrape: it did not half-open and close by itself
    cb_open_for = f"{inv.gateway.cb_timeout_secs + 30}s"

    def alert(name, expr, for_, severity, summary, **extra):
        return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
                "annotations": {"summary": summary, **extra}}

    return [
        alert("PdopsInstanceDown", f"up{{{ENGINE}}} == 0", "1m", "page",
              "{{ $labels.cluster }} {{ $labels.instance }} ({{ $labels.role }}) on {{ $labels.host }} is not scraped",
              runbook="docs/runbooks/instance-crashed.md", action="inv status; inv repair --instance {{ $labels.instance }}"),
        alert("PdopsBootstrapFailures", first_increase("sglang:num_bootstrap_failed_reqs_total", 0), "0m",
              "ticket", "{{ $labels.instance }}: PD bootstrap failures in the last 5 minutes (sglang#9926 on an idle pair?)",
              runbook="docs/runbooks/kv-transfer-failures.md"),
        alert("PdopsTransferFailuresRising", first_increase("sglang:num_transfer_failed_reqs_total", 3),
              "5m", "page", "{{ $labels.instance }}: KV transfer failures keep rising (dead session? sglang#13054)",
              runbook="docs/runbooks/kv-transfer-failures.md", action="inv repair --instance {{ $labels.instance }}"),
        alert("PdopsPrefillQueueGrowing",
              f'min_over_time(sglang:num_queue_reqs{{{ENGINE},role="prefill"}}[10m]) > 0 and '
              f'deriv(sglang:num_queue_reqs{{{ENGINE},role="prefill"}}[10m]) > 0', "10m", "ticket",
              "{{ $labels.instance }}: the prefill queue has grown for 10 minutes (add prefills or shed load)",
              runbook="docs/runbooks/stuck-queue.md"),
        alert("PdopsKVTransferStuck",
              f'min_over_time(sglang:num_prefill_inflight_queue_reqs{{{ENGINE}}}[5m]) > 0 and '
              f'changes(sglang:num_prefill_inflight_queue_reqs{{{ENGINE}}}[5m]) == 0', "5m", "page",
              "{{ $labels.instance }}: KV in flight has not moved for 5 minutes", runbook="docs/runbooks/stuck-queue.md"),
        alert("PdopsDecodeQueueGrowing",
              f'min_over_time((sglang:num_decode_prealloc_queue_reqs{{{ENGINE}}} + '
              f'sglang:num_decode_transfer_queue_reqs{{{ENGINE}}})[10m:1m]) > 0 and '
              f'deriv((sglang:num_decode_prealloc_queue_reqs{{{ENGINE}}} + '
              f'sglang:num_decode_transfer_queue_reqs{{{ENGINE}}})[10m:1m]) > 0', "10m", "ticket",
              "{{ $labels.instance }}: the decode prealloc/transfer queues have grown for 10 minutes",
              runbook="docs/runbooks/stuck-queue.md"),
        alert("PdopsKVCacheNearlyFull", f"sglang:token_usage{{{ENGINE}}} > 0.95", "5m", "ticket",
              "{{ $labels.instance }}: KV token usage above 95% for 5 minutes"),
        alert("PdopsTTFTHigh", f"pdops:ttft_seconds:p99 > {ttft:g}", "5m", "ticket",
              f"{{{{ $labels.cluster }}}}: TTFT p99 above {ttft:g}s (the profile's slo.ttft_p99_s) for 5 minutes"),
        alert("PdopsAdmissionQueueFull",
              f'haproxy_backend_current_queue{{job="{JOB_ADMISSION}",proxy="gateway"}} > 0 and on (cluster) '
              f'increase(haproxy_frontend_http_responses_total{{job="{JOB_ADMISSION}",proxy="admission",code="4xx"}}[5m]) > 0',
              "2m", "ticket", "{{ $labels.cluster }}: the admission queue is in use and requests are refused",
              runbook="docs/admission.md"),
        # while requests flow: smg half-opens a breaker only when it routes a request, so on a quiet gateway an
        # open breaker is harmless and stays open (the next request is its trial)
        alert("PdopsGatewayCircuitOpen", f'smg_worker_cb_state{{job="{JOB_GATEWAY}"}} == 1 and on (cluster, host) '
              f'sum by (cluster, host) (rate(smg_http_requests_total{{job="{JOB_GATEWAY}"}}[2m])) > 0', cb_open_for, "page",
              "{{ $labels.cluster }}: gateway {{ $labels.host }} keeps the circuit of {{ $labels.worker }} open longer "
              f"than its timeout ({inv.gateway.cb_timeout_secs}s): it routes nothing there",
              runbook="docs/gateway.md", action="inv status; inv deploy --topology <the current one> (registers it again)"),
        alert("PdopsNoServingRole",
              f'count by (cluster, role) (up{{{ENGINE}}}) unless on (cluster, role) '
              f'(sum by (cluster, role) (up{{{ENGINE}}}) > 0)', "1m", "page",
              "{{ $labels.cluster }}: no {{ $labels.role }} instance is up: the gateway has no healthy worker of it",
              runbook="docs/runbooks/instance-crashed.md"),
    ]


def rules(inv) -> dict:
    return {"groups": [{"name": f"pdops-{inv.cluster}-recording", "rules": recording_rules()},
                       {"name": f"pdops-{inv.cluster}-alerts", "rules": alert_rules(inv)}]}


def rules_text(inv) -> str:
    return ("# Rendered by pdops (pdops.ops.prometheus): recording and alert rules for PD clusters.\n"
            + yaml.safe_dump(rules(inv), sort_keys=False, width=200))


# ---------------------------------------------------------------- dashboard

# what a client asks the gateway to generate (smg_http_responses_total's `path`)
GENERATE_PATHS = "/generate|/v1/completions|/v1/chat/completions"
REQUESTS_PANEL = "Requests per second by outcome (gateway responses)"
BREAKERS_PANEL = "Gateway circuit breakers (0 closed, 1 open, 2 half-open, -1 removed)"

PANELS = [
    # (title, unit, [expr, ...]); $cluster and $revision are the dashboard's variables
    (REQUESTS_PANEL, "reqps",
     [f'sum by (cluster, status_code, error_code) (rate(smg_http_responses_total{{job="{JOB_GATEWAY}",'
      f'cluster="$cluster",path=~"{GENERATE_PATHS}"}}[1m]))']),
    ("Total TPM (input + output)", "short", ["pdops:total_tpm:cluster{cluster=\"$cluster\"}"]),
    ("Output TPM per decode", "short", ["pdops:output_tpm:instance{cluster=\"$cluster\"}"]),
    ("Input TPM per prefill", "short", ["pdops:input_tpm:instance{cluster=\"$cluster\"}"]),
    ("TTFT p50 / p99", "s", ["pdops:ttft_seconds:p50{cluster=\"$cluster\"}", "pdops:ttft_seconds:p99{cluster=\"$cluster\"}"]),
    ("Inter-token latency p50 / p99", "s", ["pdops:itl_seconds:p50{cluster=\"$cluster\"}",
                                            "pdops:itl_seconds:p99{cluster=\"$cluster\"}"]),
    ("Prefill queue and KV in flight", "short",
     [f'sglang:num_queue_reqs{{{ENGINE},cluster="$cluster",revision=~"$revision",role="prefill"}}',
      f'sglang:num_prefill_inflight_queue_reqs{{{ENGINE},cluster="$cluster",revision=~"$revision",role="prefill"}}']),
    ("Decode prealloc / transfer queues", "short",
     [f'sglang:num_decode_prealloc_queue_reqs{{{ENGINE},cluster="$cluster",revision=~"$revision",role="decode"}}',
      f'sglang:num_decode_transfer_queue_reqs{{{ENGINE},cluster="$cluster",revision=~"$revision",role="decode"}}']),
    ("Running requests", "short", [f'sglang:num_running_reqs{{{ENGINE},cluster="$cluster",revision=~"$revision"}}']),
    ("KV token usage", "percentunit", [f'sglang:token_usage{{{ENGINE},cluster="$cluster",revision=~"$revision"}}']),
    ("PD failures (bootstrap + transfer) per second", "short", ["pdops:pd_failures:rate5m{cluster=\"$cluster\"}"]),
    ("Instance health (1 = scraped)", "short", [f'up{{{ENGINE},cluster="$cluster",revision=~"$revision"}}']),
    (BREAKERS_PANEL, "short", [f'smg_worker_cb_state{{job="{JOB_GATEWAY}",cluster="$cluster"}}']),
]
# a panel's legend where it is not the instance
PANEL_LEGENDS = {REQUESTS_PANEL: "{{status_code}} {{error_code}}", BREAKERS_PANEL: "{{worker}} ({{host}})"}


def dashboard(inv) -> dict:
    """A Grafana dashboard (importable JSON; datasource chosen at import), one panel per signal."""
    panels = []
    for n, (title, unit, exprs) in enumerate(PANELS):
        panels.append({
            "id": n + 1, "type": "timeseries", "title": title,
            "gridPos": {"h": 8, "w": 12, "x": (n % 2) * 12, "y": (n // 2) * 8},
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + k), "expr": e, "legendFormat": PANEL_LEGENDS.get(title, "{{instance}}")}
                        for k, e in enumerate(exprs)],
        })
    var = lambda name, query: {  # noqa: E731
        "name": name, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": name}, "definition": query, "refresh": 2, "includeAll": name == "revision",
        "multi": False, "allValue": ".*" if name == "revision" else None, "current": {}}
    return {
        "title": "pdops PD cluster", "uid": "pdops-pd", "schemaVersion": 39, "version": 1, "editable": True,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "tags": ["pdops", "sglang", "pd"],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "current": {}},
            var("cluster", f'label_values(up{{{ENGINE}}}, cluster)'),
            var("revision", f'label_values(up{{{ENGINE},cluster="$cluster"}}, revision)'),
        ]},
        "panels": panels,
    }


def panel_queries(cluster: str, revision: str = ".*") -> list[tuple[str, str]]:
    """(panel title, expr with the variables filled in) for every panel: what the lab test evaluates."""
    out = []
    for title, _, exprs in PANELS:
        for e in exprs:
            out.append((title, e.replace("$cluster", cluster).replace("$revision", revision)))
    return out


