"""The report page: one self-contained HTML file (inline CSS, charts as base64 PNG, no script that
runs, nothing fetched when it is opened), and the JSON of what it drew embedded in it
(`<script type="application/json" id="pdops-report-data">`), for tests and tools."""

from __future__ import annotations

import base64
import html
import json

from pdops.ops.report.timeline import Timeline, parse_ts
from pdops.ops.report.zone import Zone

DATA_ID = "pdops-report-data"

CSS = """
body{font-family:"DejaVu Sans",Arial,sans-serif;margin:24px;color:#222;max-width:1340px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #ccc}
h3{font-size:14px;margin:16px 0 4px}
.muted{color:#666;font-size:13px} .tz{background:#f4f4f4;padding:6px 10px;font-size:13px}
.badge{display:inline-block;padding:2px 10px;border-radius:10px;color:#fff;font-weight:bold}
.ok{background:#2e7d32} .failed{background:#c62828} .interrupted{background:#ef6c00} .none{background:#757575}
table{border-collapse:collapse;font-size:12px} td,th{border:1px solid #ddd;padding:3px 6px;vertical-align:top}
th{background:#f0f0f0;text-align:left} code,pre{font-size:12px} pre{white-space:pre-wrap;background:#f8f8f8;padding:6px}
.rescue{color:#8e0000;font-weight:bold} .always{color:#0d47a1;font-weight:bold}
img{max-width:100%;display:block;border:1px solid #eee}
.words{background:#fff8e1;border-left:4px solid #ffb300;padding:8px 12px;font-size:14px}
li.verified::marker{content:"\\2713  ";color:#2e7d32} li.unverified::marker{content:"\\2717  ";color:#c62828}
"""


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _badge(status: str) -> str:
    cls = status if status in ("ok", "failed", "interrupted") else "none"
    return f'<span class="badge {cls}">{_e(status)}</span>'


def _compact(v, limit: int = 300) -> str:
    s = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def _phase(p: str) -> str:
    return f'<span class="{p}">{p}</span>' if p in ("rescue", "always") else _e(p)


def header(tl: Timeline, zone: Zone, cluster: str) -> str:
    who = tl.holder
    by = f"{who.get('operator') or '?'} on {who.get('machine') or '?'}" if who else "not journalled"
    return (f"<h1>{_e(tl.operation)} {_e(tl.op)} {_badge(tl.outcome())}</h1>"
            f'<p class="muted">cluster <b>{_e(cluster)}</b> · by {_e(by)} · from {_e(zone.stamp(tl.start))} '
            f"to {_e(zone.stamp(tl.end))} ({tl.seconds:.1f} s) · {len(tl.bars)} journal records</p>"
            f'<p id="verdict-line"><b>verdict</b> {_e(verdict_line(tl))}</p>'
            f'<p class="tz" id="timezone">{_e(zone.line(tl.start))}</p>')


def verdict_line(tl: Timeline) -> str:
    """The verdict in one line, for the top of the page."""
    v = tl.verdict
    if v is None:
        return "no verdict journalled: the operation did not finish (interrupted, or still running)"
    ev = v["evidence"]
    if ev.get("error"):
        return f"{v['status']}: {str(ev['error']).splitlines()[0]}"
    return (f"{v['status']}: {len(ev.get('verified') or [])} verified, {len(ev.get('unverified') or [])} not verified"
            " (the verdict below lists them)")


def verdict(tl: Timeline, zone: Zone) -> str:
    out = ["<h2>Verdict</h2>"]
    v = tl.verdict
    if v is None:
        out.append('<p class="words">No verdict is journalled: the operation did not finish (interrupted, or '
                   "still running). Its last journalled step is "
                   + (f"<b>{_e(tl.bars[-1].step)}</b> ({_e(tl.bars[-1].status)})." if tl.bars else "none.") + "</p>")
        return "".join(out)
    ev = v["evidence"]
    out.append(f"<p>{_badge(v['status'])} journalled at {_e(_stamp(zone, v['ts']))}</p>")
    if ev.get("error"):
        out.append(f"<pre>{_e(ev['error'])}</pre>")
    for key, cls, word in (("verified", "verified", "verified"), ("unverified", "unverified", "not verified")):
        items = ev.get(key) or []
        out.append(f"<h3>{word} ({len(items)})</h3>")
        out.append("<ul>" + "".join(f'<li class="{cls}">{_e(x)}</li>' for x in items) + "</ul>" if items
                   else '<p class="muted">none</p>')
    for key, word in (("notes", "notes"), ("noops", "nothing to do")):
        items = ev.get(key) or []
        if items:
            out.append(f"<h3>{word}</h3><ul>" + "".join(f"<li>{_e(x)}</li>" for x in items) + "</ul>")
    rest = {k: v for k, v in ev.items() if k not in ("error", "verified", "unverified", "notes", "noops")}
    if rest:
        out.append("<h3>and</h3>" + _facts(rest))
    return "".join(out)


def _stamp(zone: Zone, ts) -> str:
    t = parse_ts(ts)
    return zone.stamp(t) if t else str(ts)


def _facts(d: dict) -> str:
    return "<table>" + "".join(f"<tr><th>{_e(k)}</th><td><code>{_e(_compact(v, 600))}</code></td></tr>"
                               for k, v in d.items()) + "</table>"


def plan(tl: Timeline) -> str:
    p = tl.plan
    out = ["<h2>The plan</h2>"]
    if not p:
        return out[0] + '<p class="words">No plan is journalled for this operation.</p>'
    status = {}
    for b in tl.bars:
        status[b.step] = b.status
    head = {k: v for k, v in p.items() if k not in ("steps", "rescue", "always", "walks", "operation")}
    if head:
        out.append(_facts(head))
    rows = []
    walks = p.get("walks") or {}
    for key, pre in (("steps", ""), ("rescue", "R"), ("always", "A")):
        if key == "rescue" and p.get(key):
            rows.append('<tr><td colspan="3" class="rescue">if a step fails, then (rescue):</td></tr>')
        if key == "always" and p.get(key):
            rows.append('<tr><td colspan="3" class="always">whatever the outcome, last (always):</td></tr>')
        for n, s in enumerate(p.get(key) or [], 1):
            rows.append(f"<tr><td>{pre}{n}</td><td>{_e(s)}</td><td>{_e(status.get(s, 'not run'))}</td></tr>")
            for k, sub in enumerate(walks.get(s) or [], 1):
                rows.append(f"<tr><td>{pre}{n}.{k}</td><td>&nbsp;&nbsp;&nbsp;{_e(sub)}</td>"
                            f"<td>{_e(status.get(sub, 'not run'))}</td></tr>")
    out.append("<h3>steps, in order</h3><table><tr><th>#</th><th>step</th><th>journalled</th></tr>"
               + "".join(rows) + "</table>")
    return "".join(out)


def timeline_section(tl: Timeline, png: bytes | None) -> str:
    out = ["<h2>Steps on a timeline</h2>",
           '<p class="muted">One row per journal record, in journal order: a bar from the step\'s start to its end, '
           "coloured by outcome; rescue steps hatched ////, always steps hatched ....; a diamond for a record "
           "without a duration (lock, plan, verdict). Shaded: each wave's span. Right of each row: the instance, "
           "its wave, the host. Dashed lines: where the operation began and ended (on every chart below too).</p>"]
    if png is not None:
        out.append(_img(png, "the operation's steps on a timeline"))
    if tl.waves:
        out.append("<p>" + " · ".join(_e(w.label) for w in tl.waves) + "</p>")
    return "".join(out)


def metrics_section(prom: dict, panels: list[dict], pngs: dict[str, bytes]) -> str:
    out = ["<h2>What the cluster served meanwhile</h2>"]
    if prom["state"] != "answered":
        out.append(f'<p class="words" id="no-prometheus">{_e(prom["words"])}</p>')
        return "".join(out)
    out.append(f'<p class="muted">{_e(prom["words"])}</p>')
    for p in panels:
        out.append(f"<h3>{_e(p['title'])}</h3>")
        out.append("".join(f"<div><code>{_e(q)}</code></div>" for q in p["queries"]))
        if p["title"] in pngs:
            out.append(_img(pngs[p["title"]], p["title"]))
        else:
            out.append(f'<p class="words">{_e(p["words"])}</p>')
    return "".join(out)


def steps_table(tl: Timeline, zone: Zone) -> str:
    rows = []
    for b in tl.bars:
        rows.append(f"<tr><td>{b.n}</td><td>{_e(b.step)}</td><td>{_phase(b.phase)}</td><td>{_e(b.wave or '')}</td>"
                    f"<td>{_e(b.instance or '')}</td><td>{_e(b.host or '')}</td>"
                    f"<td>{_e(zone.stamp(b.start, date=False)) if not b.point else ''}</td>"
                    f"<td>{_e(zone.stamp(b.end, date=False))}</td>"
                    f"<td>{'' if b.point else f'{b.seconds:.2f}'}</td><td>{_e(b.status)}</td>"
                    f"<td><code>{_e(_compact(b.evidence))}</code></td></tr>")
    return ("<h2>Every journal record</h2><table><tr><th>#</th><th>step</th><th>phase</th><th>wave</th>"
            "<th>instance</th><th>host</th><th>started</th><th>ended</th><th>s</th><th>outcome</th><th>evidence</th></tr>"
            + "".join(rows) + "</table>")


def render(*, tl: Timeline, zone: Zone, cluster: str, timeline_png: bytes | None, prom: dict, panels: list[dict],
           pngs: dict[str, bytes], data: dict) -> str:
    blob = json.dumps(data, sort_keys=True, default=str).replace("<", "\\u003c")  # no "</script>" nor "<!--" in it
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>pdops {_e(tl.operation)} {_e(tl.op)}</title><style>{CSS}</style></head><body>"
            + header(tl, zone, cluster) + timeline_section(tl, timeline_png) + metrics_section(prom, panels, pngs)
            + verdict(tl, zone) + plan(tl) + steps_table(tl, zone)
            + f'<p class="muted">Made by <code>inv report --op {_e(tl.op)}</code> from the cluster\'s journal.</p>'
            + f'<script type="application/json" id="{DATA_ID}">{blob}</script></body></html>\n')


def embedded_data(page: str) -> dict:
    """The JSON a page embeds (what it drew)."""
    start = page.index(f'id="{DATA_ID}">') + len(f'id="{DATA_ID}">')
    end = page.index("</script>", start)
    return json.loads(page[start:end])
