"""Prometheus targets that follow the record: the `file_sd` document of a revision (each engine's
metrics endpoint, each gateway's, the admission layer's exporter), written on this machine and on
the Prometheus host, and the `publish-targets` step every plan ends with. Target labels:
`cluster`, `instance` (p01.., `gateway`, `admission`), `role`, `host`, `revision`; `job` is
pdops-engine, pdops-gateway or pdops-admission. The rules and the dashboard over these jobs are
pdops.ops.prometheus's."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from pdops.model.placement import Placement
from pdops.plans import Outcome, Step
from pdops.record.local import local_dir
from pdops.runner import RunContext

JOB_ENGINE, JOB_GATEWAY, JOB_ADMISSION = "pdops-engine", "pdops-gateway", "pdops-admission"


def targets(inv, revision: int, placement: Placement) -> list[dict]:
    """The file_sd document of one revision: each engine's metrics endpoint (rank 0 serves HTTP),
    the gateway's Prometheus port and, where configured, the admission layer's exporter."""
    base = {"cluster": inv.cluster, "revision": str(revision)}
    out = []
    for i in placement.instances:
        out.append({"targets": [f"{i.head.data_addr}:{i.http_port}"],
                    "labels": {**base, "job": JOB_ENGINE, "instance": i.id, "role": i.role, "host": i.head.host}})
    for node in inv.gateway.nodes:
        name = "gateway" if len(inv.gateway.nodes) == 1 else f"gateway-{node.host}"
        out.append({"targets": [f"{node.addr}:{node.prometheus_port}"],
                    "labels": {**base, "job": JOB_GATEWAY, "instance": name, "role": "gateway", "host": node.host}})
    adm = inv.admission
    if adm is not None and getattr(adm, "metrics_port", None):
        for h in adm.hosts:
            name = "admission" if len(adm.hosts) == 1 else f"admission-{h}"
            out.append({"targets": [f"{adm.metrics_addr_of(h)}:{adm.metrics_port}"],
                        "labels": {**base, "job": JOB_ADMISSION, "instance": name, "role": "admission", "host": h}})
    return out


def targets_text(doc: list[dict]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def local_targets_path(inv) -> Path:
    return local_dir(inv) / "prometheus" / f"pdops-{inv.cluster}.json"


def publish(pool, inv, revision: int, placement: Placement) -> dict:
    """Write the target file of `revision`: this machine's copy always, and the Prometheus host's
    (`pdops_prometheus`) over SSH, atomically (temp file + rename: Prometheus never reads half a
    file). Returns the evidence for the record step."""
    text = targets_text(targets(inv, revision, placement))
    local = local_targets_path(inv)
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(local)
    ev: dict[str, Any] = {"targets_file": str(local), "targets": len(json.loads(text))}
    cfg = getattr(inv, "prometheus", None)
    if cfg is not None:
        path = cfg.targets_file(inv.cluster)
        q = shlex.quote
        pool.run(cfg.host, f"mkdir -p {q(cfg.targets_dir)} && umask 022 && cat > {q(path + '.tmp')} <<'PDOPS_EOF'\n"
                           f"{text}PDOPS_EOF\nmv -f {q(path + '.tmp')} {q(path)}", timeout=30)
        ev["delivered"] = f"{cfg.host}:{path}"
    return ev


def do_publish_targets(ctx: RunContext, step: Step) -> Outcome:
    rev = ctx.record.current_revision()
    if rev is None:
        return Outcome.noop("nothing is deployed: no revision to describe")
    ev, ok, no = targets_after_record(ctx.pool, ctx.inv, rev)
    return Outcome(evidence={"revision": rev.number, **ev}, verified=ok, unverified=no)


def targets_after_record(pool, inv, rev) -> tuple[dict, list[str], list[str]]:
    """Right after `current` moved: (evidence, verified, unverified). A target file that cannot be
    written does not undo the revision: it is said, with the command that writes it."""
    try:
        ev = publish(pool, inv, rev.number, Placement.from_dict(rev.placement))
    except Exception as exc:  # noqa: BLE001 - reported in the verdict, never fatal after the record
        msg = getattr(exc, "message", None) or str(exc)
        return ({"targets_error": msg}, [],
                [f"Prometheus target file of revision {rev.number} not written ({msg}); `inv prometheus.targets` writes it"])
    where = ev.get("delivered") or ev["targets_file"]
    return ({"prometheus_targets": ev},
            [f"Prometheus targets follow revision {rev.number}: {ev['targets']} target(s) in {where}"], [])
