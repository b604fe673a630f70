"""The report's charts, drawn with matplotlib's Agg canvas (no display, no pyplot state): the
timeline of the steps and one chart per dashboard panel, all on one time axis: the same window,
the same width and margins, so a moment is at the same place on every chart. Local time below
each chart, UTC above it."""

from __future__ import annotations

import datetime as _dt
import io
import math

from pdops.ops.report.metrics import CB_METRIC, Panel, label
from pdops.ops.report.timeline import Bar, Timeline
from pdops.ops.report.zone import UTC, Zone

WIDTH_IN, DPI = 13.0, 100
LEFT, RIGHT = 0.25, 0.80  # figure fractions: every chart's axes start and end here
STATUS_COLORS = {"ok": "#2e7d32", "noop": "#9e9e9e", "failed": "#c62828", "interrupted": "#ef6c00",
                 "note": "#1565c0"}
OTHER_COLOR = "#6a1b9a"
PHASE_HATCH = {"rescue": "////", "always": "...."}
WAVE_COLORS = ("#1f77b4", "#ff7f0e", "#9467bd", "#17becf", "#bcbd22", "#8c564b")
CB_STATES = {-1: "removed", 0: "closed", 1: "open", 2: "half-open"}


def figure(height_in: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, height_in), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def num(t: _dt.datetime) -> float:
    from matplotlib import dates as mdates

    return mdates.date2num(t)


def time_axis(ax, zone: Zone, start: _dt.datetime, end: _dt.datetime, *, xlabel: bool = True) -> None:
    """The shared axis: [start, end], local time below, UTC above."""
    from matplotlib import dates as mdates

    ax.set_xlim(num(start), num(end))
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(tz=zone.tz, minticks=5, maxticks=12))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=zone.tz))
    ax.tick_params(axis="x", labelsize=8)
    if xlabel:
        ax.set_xlabel(f"{zone.name} ({zone.abbr(start)}, {zone.offset(start)})", fontsize=8)
    top = ax.secondary_xaxis("top")
    top.xaxis.set_major_locator(mdates.AutoDateLocator(tz=UTC, minticks=5, maxticks=12))
    top.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=UTC))
    top.tick_params(axis="x", labelsize=7, colors="#666666")
    top.set_xlabel("UTC", fontsize=7, color="#666666", loc="left")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)


def _operation_marks(ax, tl: Timeline) -> None:
    """Where the operation began and ended, and each wave's span, on any chart."""
    for w in tl.waves:
        if w.start and w.end:
            ax.axvspan(num(w.start), num(w.end), color=WAVE_COLORS[(w.n - 1) % len(WAVE_COLORS)], alpha=0.08, lw=0)
    for t in (tl.start, tl.end):
        ax.axvline(num(t), color="#333333", linestyle="--", linewidth=0.8)


def _row_label(b: Bar) -> str:
    tag = {"rescue": "[rescue] ", "always": "[always] "}.get(b.phase, "")
    name = b.step if len(b.step) <= 48 else b.step[:45] + "..."
    return f"{tag}{name}"


def timeline_png(tl: Timeline, zone: Zone, start: _dt.datetime, end: _dt.datetime) -> bytes:
    """One row per journalled record, in journal order: a bar from its start to its end in its
    outcome's colour (hatched: rescue ////, always ....), a diamond for a record without a duration
    (lock, plan, verdict); each wave's span shaded and named; right of each row the instance, its
    wave and the host the step ran on."""
    from matplotlib.patches import Patch

    n = max(len(tl.bars), 1)
    height = 1.6 + 0.19 * n
    fig = figure(height)
    fig.subplots_adjust(left=LEFT, right=RIGHT, top=1 - 0.75 / height, bottom=0.75 / height)
    ax = fig.add_subplot(1, 1, 1)
    time_axis(ax, zone, start, end)
    _operation_marks(ax, tl)
    span = max((end - start).total_seconds(), 1.0) / 86400.0
    for y, b in enumerate(tl.bars):
        color = STATUS_COLORS.get(b.status, OTHER_COLOR)
        if b.point:
            ax.plot([num(b.end)], [y], marker="D", markersize=5, color=color, linestyle="none")
        else:
            width = max((b.end - b.start).total_seconds() / 86400.0, span * 0.002)
            ax.barh(y, width, left=num(b.start), height=0.7, color=color, edgecolor="#222222" if b.phase != "main"
                    else color, hatch=PHASE_HATCH.get(b.phase), linewidth=0.5)
        right = " · ".join(x for x in (b.instance, f"wave {b.wave}" if b.wave else None, b.host) if x)
        if right:
            ax.annotate(right, xy=(1.005, y), xycoords=("axes fraction", "data"), fontsize=6.5, va="center",
                        color=WAVE_COLORS[(b.wave - 1) % len(WAVE_COLORS)] if b.wave else "#444444")
    ax.set_yticks(range(len(tl.bars)))
    ax.set_yticklabels([_row_label(b) for b in tl.bars], fontsize=6.5)
    for tick, b in zip(ax.get_yticklabels(), tl.bars):
        if b.phase in ("rescue", "always"):
            tick.set_color("#8e0000" if b.phase == "rescue" else "#0d47a1")
    ax.set_ylim(len(tl.bars) - 0.5, -0.5)
    for w in tl.waves:
        if w.start and w.end:
            # staggered: the labels of short waves side by side would overlap
            ax.annotate(w.label, xy=(num(w.start), 0), xycoords=("data", "axes fraction"),
                        xytext=(2, 3 + 10 * ((w.n - 1) % 3)), textcoords="offset points", fontsize=7, va="bottom",
                        color=WAVE_COLORS[(w.n - 1) % len(WAVE_COLORS)], fontweight="bold")
    seen = sorted({b.status for b in tl.bars})
    handles = [Patch(color=STATUS_COLORS.get(s, OTHER_COLOR), label=s) for s in seen]
    handles += [Patch(facecolor="white", edgecolor="#222222", hatch=PHASE_HATCH[p], label=p)
                for p in ("rescue", "always") if any(b.phase == p for b in tl.bars)]
    if handles:
        fig.legend(handles=handles, loc="lower right", fontsize=7, frameon=False, ncol=len(handles),
                   bbox_to_anchor=(0.995, 0.0))
    return png(fig)


def _unit_axis(ax, unit: str) -> None:
    from matplotlib.ticker import PercentFormatter

    if unit == "percentunit":
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    elif unit == "s":
        ax.set_ylabel("seconds", fontsize=8)
    elif unit == "reqps":
        ax.set_ylabel("requests/s", fontsize=8)


def _with_gaps(points: list[tuple[float, float]], step: float) -> tuple[list[_dt.datetime], list[float]]:
    """Times and values, a NaN put where Prometheus had no sample for more than 1.5 steps (a gap is
    drawn as a gap, never a line across it)."""
    xs, ys = [], []
    last = None
    for t, v in points:
        if last is not None and t - last > 1.5 * step:
            xs.append(_dt.datetime.fromtimestamp((t + last) / 2, UTC))
            ys.append(math.nan)
        xs.append(_dt.datetime.fromtimestamp(t, UTC))
        ys.append(v if math.isfinite(v) else math.nan)
        last = t
    return xs, ys


def _rev(s) -> int:
    r = str(s.labels.get("revision", ""))
    return int(r) if r.isdigit() else -1


def panel_png(panel: Panel, tl: Timeline, zone: Zone, start: _dt.datetime, end: _dt.datetime, step: float,
              workers: dict[str, str]) -> tuple[bytes, list[dict]]:
    """One dashboard panel on the shared axis; returns the PNG and what it drew (legend, points)."""
    import matplotlib

    height = 2.9
    fig = figure(height)
    fig.subplots_adjust(left=LEFT, right=RIGHT, top=1 - 0.7 / height, bottom=0.55 / height)
    ax = fig.add_subplot(1, 1, 1)
    time_axis(ax, zone, start, end)
    _operation_marks(ax, tl)
    drawn = []
    breaker = any(CB_METRIC in q for q in panel.queries)
    shown = [s for s in panel.series if s.finite]
    names = [label(s, panel, workers) for s in shown]
    colours: dict[str, str] = {}
    palette = [c["color"] for c in matplotlib.rcParams["axes.prop_cycle"]]
    newest = {n: max(_rev(s) for s, m in zip(shown, names) if m == n) for n in names}
    for s, name in sorted(zip(shown, names), key=lambda x: (x[1], _rev(x[0]))):
        colour = colours.setdefault(name, palette[len(colours) % len(palette)])
        older = _rev(s) < newest[name]
        if names.count(name) > 1 and s.labels.get("revision"):
            # an operation that records a revision starts new series (the targets' revision label): one
            # colour per instance, the older revision dotted
            name = f"{name} (rev {s.labels['revision']})"
        xs, ys = _with_gaps(s.points, step)
        ax.plot([num(x) for x in xs], ys, linewidth=1.2, label=name, color=colour, linestyle=":" if older else "-",
                drawstyle="steps-post" if breaker else "default")
        fin = [v for _, v in s.points if math.isfinite(v)]
        drawn.append({"label": name, "query": s.query, "points": len(fin), "min": min(fin), "max": max(fin),
                      "last": fin[-1]})
    if breaker:
        ax.set_yticks(sorted(CB_STATES))
        ax.set_yticklabels([CB_STATES[k] for k in sorted(CB_STATES)], fontsize=7)
        ax.set_ylim(-1.3, 2.3)
    else:
        ax.tick_params(axis="y", labelsize=7)
        _unit_axis(ax, panel.unit)
    ax.set_title(panel.title, fontsize=9, loc="left", pad=20)
    if drawn:
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=6.5, frameon=False,
                  ncol=1 if len(drawn) <= 10 else 2)
    return png(fig), drawn
