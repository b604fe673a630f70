"""One page for a run of many requests or many operations (`inv bench`, `make soak`): the spans of the
run (each operation of a soak, the bench's one run) on a timeline, beside what the clients saw each
second (requests that ended ok, and those that did not), on one time axis; the same kind of page as
`inv report --op` (self-contained HTML, charts from matplotlib's Agg canvas embedded as PNG, the
operator's time zone with UTC beside it, and a JSON block of what it drew)."""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
from collections import Counter
from dataclasses import asdict, dataclass

from pdops.ops.report import charts
from pdops.ops.report.page import CSS, DATA_ID
from pdops.ops.report.zone import UTC, Zone, operator_zone


@dataclass(frozen=True)
class Span:
    """One operation of the run: its label, start and end (epoch seconds), whether it went as
    expected, a line of detail, and the fault window its failures are counted in (None: none)."""

    label: str
    start: float
    end: float
    ok: bool = True
    detail: str = ""
    fault_window: tuple[float, float] | None = None


def per_second(rows, start: float, end: float) -> dict[str, list[int]]:
    """Requests by the second they ended in (one that never ended: the second it started), ok and not ok."""
    n = max(1, int(end - start) + 1)
    ok, bad = [0] * n, [0] * n
    for r in rows:
        t = r.get("end") or r.get("start")
        if t is None:
            continue
        i = min(max(int(t - start), 0), n - 1)
        (ok if r.get("ok", r.get("status") == "ok") else bad)[i] += 1
    return {"ok": ok, "not_ok": bad}


def _dt_of(t: float) -> _dt.datetime:
    return _dt.datetime.fromtimestamp(t, UTC)


def spans_png(spans: list[Span], zone: Zone, start: float, end: float) -> bytes:
    fig = charts.figure(max(1.6, 0.28 * len(spans) + 1.0))
    ax = fig.add_axes((charts.LEFT, 0.12, charts.RIGHT - charts.LEFT, 0.76))
    charts.time_axis(ax, zone, _dt_of(start), _dt_of(end))
    for i, s in enumerate(spans):
        y = len(spans) - 1 - i
        if s.fault_window:
            a, b = s.fault_window
            ax.axvspan(charts.num(_dt_of(a)), charts.num(_dt_of(b)), color="#ffcdd2", alpha=0.5, lw=0)
        color = charts.STATUS_COLORS["ok" if s.ok else "failed"]
        left = charts.num(_dt_of(s.start))
        ax.barh(y, max(charts.num(_dt_of(s.end)) - left, 1e-6), left=left, height=0.6, color=color)
    ax.set_yticks(range(len(spans)))
    ax.set_yticklabels([s.label for s in reversed(spans)], fontsize=7)
    ax.set_ylim(-0.7, len(spans) - 0.3)
    return charts.png(fig)


def requests_png(counts: dict[str, list[int]], zone: Zone, start: float, end: float) -> bytes:
    fig = charts.figure(2.6)
    ax = fig.add_axes((charts.LEFT, 0.2, charts.RIGHT - charts.LEFT, 0.62))
    charts.time_axis(ax, zone, _dt_of(start), _dt_of(end))
    xs = [charts.num(_dt_of(start + i + 0.5)) for i in range(len(counts["ok"]))]
    ax.plot(xs, counts["ok"], color=charts.STATUS_COLORS["ok"], lw=1, label="ok per second")
    ax.plot(xs, counts["not_ok"], color=charts.STATUS_COLORS["failed"], lw=1, label="not ok per second")
    ax.set_ylabel("requests/s", fontsize=8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    return charts.png(fig)


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def runs_page(title: str, spans: list[Span], rows: list[dict], *, summary: dict | None = None,
              zone: Zone | None = None) -> tuple[str, dict]:
    """(the HTML page, the data it drew). `rows`: the clients' ledger (dicts with start, end, ok)."""
    zone = zone or operator_zone()
    times = [s.start for s in spans] + [s.end for s in spans] + [r["start"] for r in rows if r.get("start")]
    times += [r["end"] for r in rows if r.get("end")]
    start, end = (min(times), max(times)) if times else (0.0, 1.0)
    end = max(end, start + 1)
    counts = per_second(rows, start, end)
    outcome = Counter("ok" if r.get("ok") else (r.get("status") or "not ok") for r in rows)
    data = {"title": title, "start": _dt_of(start).isoformat(), "end": _dt_of(end).isoformat(),
            "timezone": zone.line(_dt_of(start)), "spans": [asdict(s) for s in spans],
            "requests": len(rows), "outcomes": dict(outcome), "per_second": counts, "summary": summary or {}}
    rows_html = "".join(
        f"<tr><td>{html.escape(s.label)}</td><td>{html.escape(zone.stamp(_dt_of(s.start)))}</td>"
        f"<td>{s.end - s.start:.1f} s</td><td>{'ok' if s.ok else 'NOT OK'}</td><td>{html.escape(s.detail)}</td></tr>"
        for s in spans)
    blob = json.dumps(data, sort_keys=True, default=str).replace("<", "\\u003c")  # no "</script>" in it
    body = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{CSS}</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(zone.stamp(_dt_of(start)))} to {html.escape(zone.stamp(_dt_of(end)))}: {len(spans)} operation(s),
{len(rows)} request(s): {html.escape(', '.join(f'{k} {v}' for k, v in outcome.most_common()))}</p>
<p class="zone">{html.escape(zone.line(_dt_of(start)))}</p>
<h2>Operations on a timeline</h2>
<p>One row per operation, green when it went as expected, red when not; shaded: a fault's window (its
failed requests are counted there).</p>
{_img(spans_png(spans, zone, start, end), "operations on a timeline") if spans else "<p>No operation.</p>"}
<h2>What the clients saw, each second</h2>
{_img(requests_png(counts, zone, start, end), "requests per second") if rows else "<p>No request was sent.</p>"}
<h2>Summary</h2><pre>{html.escape(json.dumps(summary or {}, indent=1, default=str))}</pre>
<h2>Operations</h2><table><tr><th>operation</th><th>start</th><th>took</th><th>outcome</th><th>detail</th></tr>
{rows_html}</table>
<script type="application/json" id="{DATA_ID}">{blob}</script>
</body></html>"""
    return body, data
