"""What the cluster served during an operation, from its Prometheus: every panel of the dashboard
`inv prometheus.dashboard` ships (pdops.ops.prometheus.PANELS), each query as the dashboard has it
(`panel_queries`, every revision), over a window, with `query_range`.

Which Prometheus: `--prometheus URL`, else the inventory's `pdops_prometheus_url`, else the host of
`pdops_prometheus` on Prometheus's default port (9090); none of these: none is configured."""

from __future__ import annotations

import datetime as _dt
import math
import re
import urllib.parse
from dataclasses import dataclass, field

from pdops.errors import InvalidInput, PdopsError
from pdops.ops import prometheus as obs
from pdops.remote.hosts import http_json

URL_VAR = "pdops_prometheus_url"
DEFAULT_PORT = 9090
MAX_POINTS = 400  # per series: the step of query_range is the window over this, at least 1 s
CB_METRIC = "smg_worker_cb_state"


@dataclass(frozen=True)
class Source:
    """Where the report reads the cluster's metrics: a URL and the words that say why that one; or
    no URL and why none."""

    url: str | None
    why: str


def check_url(value, field_name: str) -> str:
    """An http(s) URL, or InvalidInput naming the field (before anything is contacted)."""
    v = str(value or "").strip()
    parsed = urllib.parse.urlparse(v)
    if parsed.scheme not in ("http", "https") or not parsed.netloc or any(c.isspace() for c in v):
        raise InvalidInput(field_name, f"{value!r} is not an http(s) URL", fix=f"e.g. {field_name} http://mon01:9090"
                           if field_name.startswith("--") else f"e.g. {field_name}: http://mon01:9090")
    return v.rstrip("/")


def source(inv, override: str | None = None) -> Source:
    """The Prometheus of the cluster (see the module's text); InvalidInput for a malformed URL."""
    if override is not None:
        return Source(check_url(override, "--prometheus"), "given with --prometheus")
    raw = (getattr(inv, "vars", None) or {}).get(URL_VAR)
    if raw is not None:
        return Source(check_url(raw, URL_VAR), f"the inventory's {URL_VAR}")
    cfg = getattr(inv, "prometheus", None)
    if cfg is not None:
        try:
            addr = inv.host(cfg.host).ssh_addr
        except (InvalidInput, AttributeError):
            addr = cfg.host
        return Source(f"http://{addr}:{DEFAULT_PORT}",
                      f"the inventory's pdops_prometheus host {cfg.host}, on Prometheus's default port "
                      f"{DEFAULT_PORT} (set {URL_VAR} to name another URL)")
    return Source(None, f"the inventory names no Prometheus (neither {URL_VAR} nor pdops_prometheus), and "
                        "no --prometheus URL was given")


@dataclass
class Series:
    query: str
    labels: dict
    points: list[tuple[float, float]]  # (unix time, value); NaN where Prometheus had no value

    @property
    def finite(self) -> int:
        return sum(1 for _, v in self.points if math.isfinite(v))


@dataclass
class Panel:
    title: str
    unit: str
    queries: list[str]
    series: list[Series] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def points(self) -> int:
        return sum(s.finite for s in self.series)

    @property
    def has_data(self) -> bool:
        return self.points > 0

    def why_empty(self) -> str:
        """Words for a panel with no data in the window."""
        if self.errors:
            return "Prometheus did not answer its query: " + "; ".join(self.errors)
        hints = []
        if any("pdops:" in q for q in self.queries):
            hints.append("it reads pdops's recording rules: is the file of `inv prometheus.rules` loaded?")
        if any("smg_" in q for q in self.queries):
            hints.append("it reads the gateway's metrics (job pdops-gateway): is the gateway scraped?")
        if any("sglang:" in q or "up{" in q for q in self.queries):
            hints.append("it reads the engines' metrics (job pdops-engine): are the engines scraped?")
        return "no data in the window" + (" (" + " ".join(hints) + ")" if hints else "")


def dashboard_panels(cluster: str) -> list[Panel]:
    """The dashboard's panels in its order, each with its queries as `inv prometheus.dashboard` ships them
    (every revision: an operation moves `current`)."""
    queries: dict[str, list[str]] = {}
    for title, q in obs.panel_queries(cluster, ".*"):
        queries.setdefault(title, []).append(q)
    return [Panel(title, unit, queries[title]) for title, unit, _ in obs.PANELS]


def step_s(start: _dt.datetime, end: _dt.datetime) -> int:
    return max(1, math.ceil((end - start).total_seconds() / MAX_POINTS))


def _get(url: str, timeout: float = 15.0) -> dict:
    status, doc = http_json("GET", url, timeout=timeout)
    if status != 200 or not isinstance(doc, dict) or doc.get("status") != "success":
        detail = doc.get("error") if isinstance(doc, dict) else str(doc)[:200]
        raise PdopsError(f"HTTP {status}: {detail}")
    return doc


def answers(url: str) -> str:
    """Prometheus's version when it answers; PdopsError (Unreachable among them) when it does not."""
    doc = _get(f"{url}/api/v1/status/buildinfo", timeout=10)
    return str((doc.get("data") or {}).get("version") or "?")


def query_range(url: str, expr: str, start: _dt.datetime, end: _dt.datetime, step: int) -> list[Series]:
    params = urllib.parse.urlencode({"query": expr, "start": f"{start.timestamp():.3f}",
                                     "end": f"{end.timestamp():.3f}", "step": str(step)})
    doc = _get(f"{url}/api/v1/query_range?{params}")
    out = []
    for s in (doc.get("data") or {}).get("result") or []:
        pts = []
        for t, v in s.get("values") or []:
            try:
                pts.append((float(t), float(v)))
            except (TypeError, ValueError):
                continue
        out.append(Series(expr, dict(s.get("metric") or {}), pts))
    return out


def fetch(url: str, cluster: str, start: _dt.datetime, end: _dt.datetime, query=query_range) -> list[Panel]:
    """Every panel over [start, end]; a query Prometheus refuses is said on its panel."""
    step = step_s(start, end)
    panels = dashboard_panels(cluster)
    for p in panels:
        for q in p.queries:
            try:
                p.series += query(url, q, start, end, step)
            except PdopsError as exc:
                p.errors.append(f"{q}: {exc.message}")
    return panels


def short_name(expr: str) -> str:
    """The metric (or recording rule) a query reads, shortened for a legend: `p99`, `num_queue_reqs`."""
    names = [n for n in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{|\[|$)", expr)
             if n not in ("by", "sum", "rate", "histogram_quantile")]
    name = names[0] if names else expr
    return name.rsplit(":", 1)[-1]


def label(series: Series, panel: Panel, workers: dict[str, str]) -> str:
    """A legend entry: the instance; for the gateway's requests, the outcome; for a breaker, the
    worker (named by its instance id where a revision knows its URL) and the gateway host."""
    m = series.labels
    if CB_METRIC in series.query:
        w = m.get("worker", "?")
        name = workers.get(w, w)
        return f"{name} @ {m['host']}" if m.get("host") else name
    if "status_code" in m:
        return " ".join(x for x in (m.get("status_code"), m.get("error_code")) if x) or "?"
    base = m.get("instance") or ""
    if len(panel.queries) > 1 or not base:
        return f"{base} {short_name(series.query)}".strip()
    return base
