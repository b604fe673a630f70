"""Audits: measure a claim on a live cluster, print the evidence, exit non-zero on fail."""

from __future__ import annotations

import json

from invoke import task

from pdops.cli import cli_errors

DEFAULT_INVENTORY = "inventory/lab"


def _decode_urls(gateway_url: str) -> list[str]:
    import urllib.request

    from pdops.errors import Unreachable
    from pdops.facts.gateway import parse

    try:
        with urllib.request.urlopen(gateway_url + "/workers", timeout=10) as r:
            workers = parse(json.loads(r.read()))
    except OSError as exc:
        raise Unreachable(f"gateway {gateway_url}/workers: {exc}") from None
    urls = [w.url for w in workers if w.worker_type == "decode"]
    if not urls:
        raise Unreachable(f"gateway {gateway_url} lists no decode worker", fix="deploy the cluster first")
    return urls


@task(help={"inventory": "inventory dir or file",
            "against_gateway": "audit the gateway's own flags instead (shows why they are not a cap)",
            "cap": "the cap to hold the target to (default: pdops_admission.cap; the gateway's "
                   "--max-concurrent-requests with --against-gateway)",
            "tokens": "max_new_tokens per stream: streams must outlast the queue phase",
            "key_file": "with --against-gateway: a file holding the gateway's API key, if it has one"})
@cli_errors
def admission(c, inventory=DEFAULT_INVENTORY, against_gateway=False, cap=None, tokens=1000, key_file=None):
    """Drive 2C long streams through the admission layer (or the gateway) and check: in-flight at
    the decodes never above C, queued served in order or refused at the queue timeout, 401
    without a key, and a client disconnect aborts the decode within a bound."""
    from pdops.ops import audit
    from pdops.errors import InvalidInput, Unverified
    from pdops.model.inventory import load_inventory

    inv = load_inventory(inventory)
    decodes = _decode_urls(inv.gateway.first.url)
    if against_gateway:
        gw = inv.gateway
        c_cap = int(cap) if cap is not None else gw.max_concurrent_requests
        if c_cap < 1:
            raise InvalidInput("--cap", "the gateway has no cap configured (-1)", fix="pass --cap N to hold it to")
        key = open(key_file).read().strip() if key_file else None
        report = audit.audit(gw.first.url, decodes, key, cap=c_cap, queue=gw.queue_size, queue_timeout_s=1,
                             overflow_status=429, tokens=int(tokens), mode="gateway", stagger_s=0.7)
    else:
        cfg = inv.admission
        if cfg is None:
            raise InvalidInput("pdops_admission", "this inventory has no admission layer",
                               fix="set pdops_admission (docs/admission.md), deploy, then audit")
        report = audit.audit(cfg.url, decodes, cfg.keys[0], cap=int(cap) if cap is not None else cfg.cap,
                             queue=cfg.queue, queue_timeout_s=cfg.queue_timeout_s,
                             overflow_status=cfg.overflow_status, tokens=int(tokens))
    print(report.format())
    if not report.passed:
        failed = ", ".join(cl.name for cl in report.claims if not cl.passed)
        raise Unverified(f"admission audit failed: {failed}", fix="see the report above")
