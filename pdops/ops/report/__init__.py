"""`inv report --op ID`: one self-contained HTML page per operation (docs/observability.md, "One page
per operation"): the plan, each journalled step as a bar on a timeline (start, end, outcome;
rescue and always steps marked; waves and instances labelled), the verdict with what was
verified and what was not; and, where the cluster's Prometheus answers, the dashboard's own
panels (`pdops.ops.prometheus.PANELS`, the queries `inv prometheus.dashboard` ships) over the
operation's window plus a margin, on the same time axis. Where no Prometheus is configured or
none answers, the page says so in words. Times in the operator's zone, UTC beside them.

The package, by concern: ``zone`` (the operator's time zone), ``timeline`` (the journal as bars,
pure), ``metrics`` (which Prometheus, and `query_range` per panel), ``charts`` (matplotlib, Agg),
``page`` (the HTML); :func:`build_report` puts them together.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass

from pdops.errors import InvalidInput, PdopsError
from pdops.ops.report import charts, metrics, page, timeline
from pdops.ops.report.metrics import Source, source
from pdops.ops.report.page import embedded_data
from pdops.ops.report.zone import Zone, operator_zone
from pdops.model.placement import Placement

DEFAULT_MARGIN_S = 120.0

__all__ = ["DEFAULT_MARGIN_S", "Report", "Source", "Zone", "build_report", "embedded_data", "operator_zone", "source"]


@dataclass
class Report:
    html: str
    data: dict

    def summary(self) -> str:
        steps = len(self.data["steps"])
        prom = self.data["prometheus"]
        if prom["state"] != "answered":
            return f"{steps} journal records on the timeline; no chart of what the cluster served: {prom['words']}"
        with_data = sum(1 for p in self.data["panels"] if p["drawn"])
        return (f"{steps} journal records on the timeline; {with_data} of {len(self.data['panels'])} dashboard "
                f"panels with data from {prom['url']}")


def worker_names(record) -> dict[str, str]:
    """Worker URL -> instance id, from the record's revisions (the breakers' legend)."""

    out: dict[str, str] = {}
    try:
        for n in record.revision_numbers():
            rev = record.read_revision(n)
            for i in Placement.from_dict(rev.placement).instances:
                out[i.url] = i.id
    except (PdopsError, KeyError, TypeError, ValueError):
        pass
    return out


def _prometheus(src: Source, cluster: str, start, end, query) -> tuple[dict, list | None]:
    """What the page says about Prometheus, and the panels (None: nothing to draw)."""
    if src.url is None:
        return {"state": "not configured", "url": None, "why": src.why,
                "words": f"No Prometheus is configured for this cluster ({src.why}): no chart of what the cluster "
                         "served is drawn. Name one in the inventory (pdops_prometheus_url: http://mon01:9090) or "
                         "give --prometheus URL."}, None
    try:
        version = metrics.answers(src.url)
    except PdopsError as exc:
        return {"state": "no answer", "url": src.url, "why": src.why, "error": exc.message,
                "words": f"The cluster's Prometheus at {src.url} ({src.why}) did not answer ({exc.message}): no chart "
                         "of what the cluster served is drawn."}, None
    panels = metrics.fetch(src.url, cluster, start, end, query=query or metrics.query_range)
    return {"state": "answered", "url": src.url, "why": src.why, "version": version,
            "step_s": metrics.step_s(start, end),
            "words": f"From Prometheus {version} at {src.url} ({src.why}): the panels of `inv prometheus.dashboard`, "
                     f"their queries as shipped, every revision, one sample every {metrics.step_s(start, end)} s."}, panels


def build_report(inv, record, op: str, src: Source, *, margin_s: float = DEFAULT_MARGIN_S, zone: Zone | None = None,
                 now: _dt.datetime | None = None, query=None) -> Report:
    """The page of operation `op` of the cluster's journal (`record`). `query`: how a
    panel's query is asked (default: Prometheus's query_range over HTTP)."""
    records = record.journal().read(op)
    if not records:
        raise InvalidInput("--op", f"no operation {op!r} in the journal on {getattr(record, 'location', '?')}",
                           fix="see `inv journal` for operation ids")
    zone = zone or operator_zone()
    now = now or _dt.datetime.now(_dt.timezone.utc)
    tl = timeline.build(op, records)
    margin = _dt.timedelta(seconds=margin_s)
    start = tl.start - margin
    end = max(min(tl.end + margin, now), tl.end + _dt.timedelta(seconds=1))
    prom, panels = _prometheus(src, inv.cluster, start, end, query)
    tl_png = charts.timeline_png(tl, zone, start, end)
    pngs: dict[str, bytes] = {}
    panel_docs = []
    workers = worker_names(record) if panels else {}
    for p in panels or []:
        doc = {"title": p.title, "unit": p.unit, "queries": p.queries, "errors": p.errors, "points": p.points,
               "drawn": False, "series": []}
        if p.has_data:
            png, drawn = charts.panel_png(p, tl, zone, start, end, prom["step_s"], workers)
            pngs[p.title] = png
            doc.update(drawn=True, series=drawn)
        else:
            doc["words"] = p.why_empty()
        panel_docs.append(doc)
    data = {"op": op, "operation": tl.operation, "cluster": inv.cluster, "outcome": tl.outcome(),
            "timezone": {"name": zone.name, "source": zone.source, "offset": zone.offset(tl.start),
                         "abbr": zone.abbr(tl.start), "line": zone.line(tl.start)},
            "window": {"start": start.isoformat(), "end": end.isoformat(), "margin_s": margin_s,
                       "op_start": tl.start.isoformat(), "op_end": tl.end.isoformat()},
            "steps": [b.to_dict() for b in tl.bars], "waves": [w.to_dict() for w in tl.waves],
            "verdict": tl.verdict, "plan": tl.plan, "prometheus": prom, "panels": panel_docs}
    html = page.render(tl=tl, zone=zone, cluster=inv.cluster, timeline_png=tl_png, prom=prom, panels=panel_docs,
                       pngs=pngs, data=data)
    return Report(html, data)
