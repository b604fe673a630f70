"""`inv report --op ID` of a rolling change made under load while a real Prometheus (Debian's, started
here on a loopback port, named in the inventory as `pdops_prometheus_url`, stopped by its PID)
scrapes the lab cluster: the page draws every journalled step on its timeline and every panel of
the dashboard with data from the operation's window, and headless Chromium renders it (the
screenshot is kept: under pytest's tmp dir, and copied to the path the test prints)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from pdops.sim.testing import free_port, wait_until
from tests.lab.clusters import REPO, Load, deployed, inv_cmd, prometheus_api, record, running_prometheus

from pdops.ops import prometheus as obs
from pdops.ops.report import embedded_data
from pdops.ops.report.timeline import parse_ts
from pdops.model.inventory import load_inventory

pytestmark = [pytest.mark.lab,
              pytest.mark.skipif((shutil.which("prometheus") is None or shutil.which("chromium") is None)
                                 and not os.environ.get("CI"),
                                 reason="prometheus or chromium not installed (Debian packages: scripts/setup-system.sh)")]

AFTER_S = 10  # seconds of serving after the change that the page shows
# seconds of load before the change (default none): with 60 or more, the 1-minute rates have settled
# when the change begins (the picture in docs/observability.md was made so)
WARMUP_S = float(os.environ.get("PDOPS_REPORT_LAB_WARMUP_S") or 0)
# where the screenshot is copied for a person to look at (build/ is not tracked)
ARTIFACTS = Path(os.environ.get("PDOPS_TEST_ARTIFACTS") or REPO / "build" / "test-artifacts")


api = prometheus_api


def query(base: str, expr: str) -> list[dict]:
    return api(base, "/api/v1/query", query=expr)["result"]


@pytest.fixture(scope="module")
def cluster(lab, tmp_path_factory):
    """2p2d (one instance per lab host) whose inventory names the Prometheus this module starts."""
    root = tmp_path_factory.mktemp("report")
    base = f"http://127.0.0.1:{free_port()}"

    def named(doc):
        doc["all"]["vars"]["pdops_prometheus_url"] = base
    with deployed(lab, root / "c", "2p2d", profile={}, mutate=named) as d:
        yield d.inv_dir, root, base


@pytest.fixture(scope="module")
def prometheus(cluster):
    inv_dir, root, base = cluster
    with running_prometheus(inv_dir, root, int(base.rsplit(":", 1)[1])):
        yield base, inv_dir


def set_bundle(inv_dir: Path, **bundle) -> None:
    p = inv_dir / "profiles" / "p.yml"
    prof = yaml.safe_load(p.read_text())
    prof["bundle"].update(bundle)
    p.write_text(yaml.safe_dump(prof))


def screenshot(page: Path, png: Path, width: int = 1400, height: int = 3200) -> subprocess.CompletedProcess:
    """Headless Chromium renders the page from its file (nothing else to fetch) into `png`."""
    return subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={png.parent / 'chromium-profile'}", f"--screenshot={png}",
                           f"--window-size={width},{height}", page.as_uri()],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_a_rolling_change_under_load_is_one_page_with_every_step_and_what_was_served(prometheus, tmp_path):
    from PIL import Image

    base, inv_dir = prometheus
    inv = load_inventory(inv_dir)
    want = {i for i in record(inv_dir).current_revision().instances} | {"gateway"}

    def targets() -> dict[str, str]:
        return {t["labels"]["instance"]: t["health"] for t in api(base, "/api/v1/targets")["activeTargets"]}
    wait_until(lambda: set(targets()) == want and set(targets().values()) == {"up"}, 60, "every target scraped")
    set_bundle(inv_dir, max_running_requests=32)  # every instance restarted, one per role at a time
    c = f'cluster="{inv.cluster}"'
    with Load(inv.gateway.first.url) as load:
        began = time.time()
        # the page shows the cluster serving before the change, during it, and after it
        wait_until(lambda: query(base, f'sum(rate(smg_http_responses_total{{{c},status_code="200"}}[1m])) > 0'), 60,
                   "Prometheus seeing requests served before the change")
        if WARMUP_S:
            wait_until(lambda: query(base, f"min(timestamp(up{{{c}}})) >= {began + WARMUP_S}"), WARMUP_S + 60,
                       f"{WARMUP_S:g}s of load scraped before the change")
        proc = inv_cmd("deploy", "--topology", "2p2d", "-i", str(inv_dir))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        j = record(inv_dir).journal()
        op = j.operations()[-1]
        recs = j.read(op)
        ended = parse_ts(recs[-1]["ts"]).timestamp()
        wait_until(lambda: query(base, f"min(timestamp(up{{{c}}})) >= {ended + AFTER_S}"), 60,
                   f"Prometheus scraping {AFTER_S}s past the change's end")
    load.assert_clean()
    plan = next(r["evidence"] for r in recs if r["step"] == "plan")
    assert plan["waves"] == [["p01", "d01"], ["p02", "d02"]], plan

    out = tmp_path / "pages"
    # the operator's zone is TZ's where it is set: the lab machine's own is UTC
    made = inv_cmd("report", "--op", op, "--out", str(out), "--margin", "20", "-i", str(inv_dir),
                   env={"TZ": "Europe/Berlin"})
    assert made.returncode == 0, made.stdout + made.stderr
    page = out / f"{op}.html"
    assert f"wrote {page}" in made.stdout
    text = page.read_text()
    data = embedded_data(text)
    assert data["timezone"]["name"] == "Europe/Berlin" and data["timezone"]["offset"] in ("UTC+01:00", "UTC+02:00")
    assert f'Times are in Europe/Berlin ({data["timezone"]["abbr"]}, {data["timezone"]["offset"]}), from TZ' in text

    # the Prometheus the inventory names answered, and every dashboard panel has data in the window
    assert data["prometheus"]["state"] == "answered", data["prometheus"]
    assert data["prometheus"]["url"] == base and "pdops_prometheus_url" in data["prometheus"]["why"]
    assert [p["title"] for p in data["panels"]] == [t for t, _, _ in obs.PANELS]
    assert [q for p in data["panels"] for q in p["queries"]] == [q for _, q in obs.panel_queries(inv.cluster, ".*")]
    empty = [(p["title"], p.get("words")) for p in data["panels"] if not (p["drawn"] and p["points"] > 0)]
    assert not empty, empty
    assert text.count("data:image/png;base64,") == 1 + len(obs.PANELS)
    panel = {p["title"]: p for p in data["panels"]}
    # what was served: requests answered 200 through the change; every instance's breaker drawn by its id
    served = {s["label"]: s for s in panel[obs.REQUESTS_PANEL]["series"]}
    assert "200" in served and served["200"]["max"] > 0, served
    named = {s["label"].split(" @ ")[0] for s in panel[obs.BREAKERS_PANEL]["series"]}
    assert {"p01", "p02", "d01", "d02"} <= named, named
    tpm = {s["label"].split(" (rev ")[0] for s in panel["Input TPM per prefill"]["series"] if s["max"] > 0}
    assert {"p01", "p02"} <= tpm, tpm

    # every journal record of the operation is on the timeline, in order, with its outcome
    assert [(s["step"], s["status"]) for s in data["steps"]] == [(r["step"], r["status"]) for r in recs]
    assert all(s["step"] in text for s in data["steps"])
    waves = {s["step"]: s["wave"] for s in data["steps"]}
    for n, wave in enumerate(plan["waves"], 1):
        for i in wave:
            assert waves[f"register {i}"] == n and waves[f"start {i}"] == n
    assert [w["label"] for w in data["waves"]] == ["wave 1: p01, d01", "wave 2: p02, d02"]
    always = [s["step"] for s in data["steps"] if s["phase"] == "always"]
    assert always == ["publish-targets"]
    assert data["outcome"] == "ok" and data["verdict"]["evidence"]["verified"]
    # the window: the operation plus the margin, each step inside it
    start, end = parse_ts(data["window"]["start"]), parse_ts(data["window"]["end"])
    assert all(start <= parse_ts(s["start"]) <= parse_ts(s["end"]) <= end for s in data["steps"])

    # Chromium renders it offline; the screenshot is a picture, not a blank page
    png = tmp_path / "report.png"
    shot = screenshot(page, png)
    assert shot.returncode == 0 and png.is_file(), shot.stdout + shot.stderr
    img = Image.open(png).convert("RGB")
    assert img.size == (1400, 3200)
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 200, "the screenshot is (nearly) one colour"
    white = max(colours)[0] / (img.size[0] * img.size[1])
    assert white < 0.95, f"{white:.0%} of the screenshot is its background"
    # the timeline's own colours are on it: an ok step's green
    assert any(math.dist(c, (0x2e, 0x7d, 0x32)) < 20 for _, c in colours)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(png, ARTIFACTS / "report-lab.png")
    shutil.copy(page, ARTIFACTS / "report-lab.html")
    print(f"report of {op}: {page}; screenshot {png}, copied to {ARTIFACTS / 'report-lab.png'}")
