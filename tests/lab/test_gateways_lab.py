"""Two gateways behind the admission layer, on the lab (docs/gateway.md "Two or more gateways").

One 2p1d cluster (p01 lab01, p02 lab02, d01 lab03), smg on lab03 and lab04, HAProxy on lab03
spreading requests over both, the record on lab03. Under load through HAProxy, with a CPU hog
on one core: a planned restart of every gateway turns no request away; SIGKILL of one gateway
and its whole host going down turn away at most what was in flight on it at that moment (a
connection HAProxy tries on a dead gateway is refused and sent to the other one, so the
detection window of its health check adds nothing); nothing is replayed; `inv status` and
`inv verify` name the gateway that differs, and one `inv deploy` repairs it."""

from __future__ import annotations

import json
import shlex
import threading
import time

import pytest

from pdops.model.inventory import load_inventory
from pdops.model.placement import Placement
from pdops.model.render import GATEWAY_UNIT
from pdops.remote.gateway import Gateways
from pdops.sim.testing import wait_until
from tests.lab.clusters import (Load, REPO, api_keys_file, cli, cpu_hog, deployed, host_run, never_twice, record,
                                two_gateways_behind_haproxy, waited)

pytestmark = pytest.mark.lab

KEY = "pdops-lab-key-G-" + "g" * 16
GATEWAYS = ["lab03", "lab04"]


@pytest.fixture(scope="module")
def cluster(lab, tmp_path_factory):
    import yaml

    root = tmp_path_factory.mktemp("gateways")
    two_gateways = two_gateways_behind_haproxy(GATEWAYS, 18082, api_keys_file(root / "admission.keys", KEY))
    base_env = yaml.safe_load((REPO / "pdops" / "profiles" / "lab-sim.yml").read_text())["env"]
    with deployed(lab, root / "inv", "2p1d", mutate=two_gateways,
                  profile={"env": {**base_env, "PDOPS_SIM_DECODE_STEP_MS": "10"}}) as (inv_dir, proc):
        yield inv_dir, proc


def _main_pid(lab, host: str) -> int:
    return int(host_run(lab, host, f"systemctl show -p MainPID --value {GATEWAY_UNIT}").strip() or 0)


def _routable(inv) -> dict[str, set[str]]:
    out = {}
    for h, c in Gateways.of(inv, timeout=2).items():
        try:
            out[h] = {w.url for w in c.list_workers() if w.routable}
        except Exception:  # noqa: BLE001 - down or restarting: nothing routable there
            out[h] = set()
    return out


def _load(url: str, seconds: float, prefix: str) -> tuple[threading.Thread, list]:
    from pdops.remote.loadgen import send

    rows: list = []
    t = threading.Thread(target=lambda: rows.extend(send(
        url, duration=seconds, concurrency=6, max_new_tokens=60, stream_every=1, timeout=60, rid_prefix=prefix,
        headers={"Authorization": f"Bearer {KEY}"})))
    t.start()
    return t, rows


def _streams_running(inv_dir, at_least: int = 4) -> None:
    """Until the decode runs `at_least` streams: the load is flowing through both gateways."""
    from pdops.remote.hosts import http_json

    [d] = Placement.from_dict(record(inv_dir).current_revision().placement).role("decode")

    def running() -> int:
        try:
            return http_json("GET", f"{d.url}/v1/loads", timeout=2)[1]["loads"][0]["num_running_reqs"]
        except Exception:  # noqa: BLE001 - not answering: nothing counted
            return 0
    wait_until(lambda: running() >= at_least, 30, f"{at_least} streams running at the decode")


def _sessions(lab, inv, host: str) -> int:
    """HAProxy's current sessions on one gateway's server (`show stat`, on the admission host)."""
    from pdops.model.admission import GATEWAYS_BACKEND, stat_command

    out = host_run(lab, inv.admission.host, stat_command())
    lines = [ln for ln in out.splitlines() if ln.strip()]
    head = lines[0].lstrip("# ").split(",")
    for ln in lines[1:]:
        row = dict(zip(head, ln.split(",")))
        if row.get("pxname") == GATEWAYS_BACKEND and row.get("svname") == f"gw-{host}":
            return int(row.get("scur") or 0)
    raise AssertionError(f"no server gw-{host} in HAProxy's stats: {out[:500]}")


def _status(inv_dir) -> dict:
    proc = cli(inv_dir, "status", "--json")
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_every_gateway_routes_to_every_worker_and_status_shows_each(cluster):
    inv_dir, proc = cluster
    inv = load_inventory(inv_dir)
    assert "gateway up on lab03" in proc.stdout and "gateway up on lab04" in proc.stdout, proc.stdout
    urls = {i.url for i in Placement.from_dict(record(inv_dir).current_revision().placement).instances}
    assert _routable(inv) == {h: urls for h in GATEWAYS}
    doc = _status(inv_dir)
    assert [(g["host"], g["state"], g["workers"]) for g in doc["gateways"]] == [("lab03", "ok", 3), ("lab04", "ok", 3)]
    assert doc["ok"] and doc["warnings"] == [], doc
    assert cli(inv_dir, "verify").returncode == 0


def test_a_planned_restart_of_every_gateway_turns_no_request_away(lab, cluster):
    """A gateway setting changes under load, a core busy: the gateways restart one at a time, each
    drained in HAProxy first (no new request) and set ready once it lists every worker; every
    request through the front door is served."""
    import yaml

    inv_dir, _ = cluster
    inv = load_inventory(inv_dir)
    before = {h: _main_pid(lab, h) for h in GATEWAYS}
    hosts = inv_dir / "hosts.yml"
    doc = yaml.safe_load(hosts.read_text())
    doc["all"]["vars"]["pdops_gateway"]["health_check_interval_secs"] = 6
    hosts.write_text(yaml.safe_dump(doc, sort_keys=False))
    with cpu_hog(), Load(inv.admission.url, headers={"Authorization": f"Bearer {KEY}"}) as load:
        proc = cli(inv_dir, "deploy", "--topology", "2p1d")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for h in GATEWAYS:
        assert f"gateway on {h} restarted in" in proc.stdout, proc.stdout
    assert proc.stdout.index("gateway-restart lab03") < proc.stdout.index("gateway-restart lab04")
    after = {h: _main_pid(lab, h) for h in GATEWAYS}
    assert all(after[h] != before[h] for h in GATEWAYS), (before, after)
    print(f"\nplanned restart of both gateways under load, one core busy: {len(load.rows)} requests, "
          f"{sum(not r.ok for r in load.rows)} failed")
    load.assert_clean(at_least=12)  # every request served whole, each request ID once
    never_twice(lab, inv_dir, "scale-load")


def _bounded_by_what_was_in_flight(rows, at: float, what: str, until: float | None = None) -> list:
    """What failed is at most what was in flight when it died, somewhere in [`at`, `until`] (the
    command that kills was sent at `at` and had seen it dead at `until`: the death lands in between):
    every failed request started before `until` and had not ended by `at`, and every request that
    started after `until` was served; returns the failed rows."""
    until = at if until is None else until
    failed = [r for r in rows if not r.ok]
    in_flight = [r for r in rows if r.start < until and (r.end or 0) > at]
    print(f"{what}: {len(rows)} requests, {len(in_flight)} in flight at that moment "
          f"(a window of {until - at:.2f}s), {len(failed)} failed")
    for r in failed:
        print(f"  failed {r.rid}: started {r.start - at:+.2f}s, ended {(r.end or at) - at:+.2f}s, "
              f"HTTP {r.http_status}, {r.status}: {str(r.error)[:160]}")
    assert all(r.start < until for r in failed), [r.to_dict() for r in failed if r.start >= until][:3]
    assert len(failed) <= len(in_flight), (len(failed), len(in_flight))
    assert [r for r in rows if r.start >= until], "no request was sent after it"
    return failed


def test_sigkill_of_one_gateway_turns_away_at_most_what_was_in_flight_on_it(lab, cluster):
    """The crash of one gateway: the streams it carried are cut (counted, never replayed); HAProxy's
    next connection to it is refused and tried on the other gateway, so nothing sent after the kill
    fails; systemd restarts it and its start-up list registers every worker again."""
    inv_dir, _ = cluster
    inv = load_inventory(inv_dir)
    urls = {i.url for i in Placement.from_dict(record(inv_dir).current_revision().placement).instances}
    with cpu_hog():
        assert _routable(inv)["lab04"] == urls
        t, rows = _load(inv.admission.url, 14, "gw-kill")
        _streams_running(inv_dir)
        # the kill lands on streams HAProxy has in flight on lab04 (the rows say which)
        wait_until(lambda: _sessions(lab, inv, "lab04") >= 1, 30, "a request in flight on gateway lab04")
        pid = _main_pid(lab, "lab04")
        [node] = [n for n in inv.gateway.nodes if n.host == "lab04"]
        c = lab.connection("lab04")
        try:
            c.open()  # the SSH handshake before the clock starts: the window is one command's round trip
            killed_at = time.time()
            # By the unit's MainPID, as a crash would. SIGKILL is asynchronous: `kill` returns before
            # the many-threaded gateway has closed its sockets (a connection accepted meanwhile is
            # reset, a CI run showed one 3 ms after `kill` returned, with a core busy). The command
            # returns once that process's listening socket is gone (`ss -p` names the process that
            # holds it): from then on a connection is refused, until systemd's restart listens again.
            c.run(f"kill -KILL {pid} && while ss -Hltnp src {shlex.quote(f'{node.addr}:{node.port}')} "
                  f"| grep -q 'pid={pid},'; do sleep 0.005; done", hide=True, timeout=30)
            kill_seen = time.time()
        finally:
            c.close()
        back_s = waited(lambda: _routable(inv)["lab04"] == urls, 60, "lab04 routing to every worker again")
        t.join(timeout=90)
    print(f"\ngateway lab04 SIGKILL -> every worker routable on it again in {back_s:.1f}s")
    _bounded_by_what_was_in_flight(rows, killed_at, "SIGKILL of gateway lab04 under load", kill_seen)
    never_twice(lab, inv_dir, "gw-kill")
    # decided from observation: verify names the restarted gateway, one deploy records it
    proc = cli(inv_dir, "verify")
    assert proc.returncode == 5 and f"gateway {GATEWAY_UNIT} on lab04 restarted" in proc.stderr, \
        proc.stdout + proc.stderr
    proc = cli(inv_dir, "deploy", "--topology", "2p1d")
    assert proc.returncode == 0 and "plan: repair revision" in proc.stdout, proc.stdout + proc.stderr
    assert cli(inv_dir, "verify").returncode == 0


def test_a_gateway_host_down_turns_away_at_most_what_was_in_flight_on_it(lab, cluster):
    """The whole host of one gateway powers off under load: the other gateway serves every request
    sent after it; `inv status` names the gateway that is down; once the host is back, one deploy
    starts it and registers every worker there.

    Runbook docs/runbooks/gateway-host-lost.md, its commands in its order: `inv status` (exit 1, the
    gateway row and the line under the table), `inv verify` (exit 5, naming the gateway), `inv deploy`
    while the host is still down (refused: exit 3, nothing changed), then with the host back `inv
    deploy --dry-run` (the repair plan), `inv deploy` (starts it, registers every worker there),
    `inv verify` (exit 0), `inv status` (exit 0)."""
    from pdops import lab as lab_api

    inv_dir, _ = cluster
    inv = load_inventory(inv_dir)
    rev_before = record(inv_dir).current()
    with cpu_hog():
        t, rows = _load(inv.admission.url, 14, "gw-host")
        _streams_running(inv_dir)
        wait_until(lambda: _sessions(lab, inv, "lab04") >= 1, 30, "a request in flight on gateway lab04")
        down_at = time.time()
        lab_api.down(hosts=[4])
        gone_at = time.time()
        t.join(timeout=90)
    try:
        _bounded_by_what_was_in_flight(rows, down_at, "lab04 (a gateway's host) powered off under load", gone_at)
        # runbook 1: inv status
        st = cli(inv_dir, "status")
        print(f"\n$ inv status (lab04 down): exit {st.returncode}\n{st.stdout}{st.stderr}")
        assert st.returncode == 1, st.stdout + st.stderr
        gw4 = inv.gateway.node("lab04").url
        assert f"gateway {inv.gateway.node('lab03').url} on lab03: active/running" in st.stdout, st.stdout
        assert f"gateway {gw4} on lab04: unknown, MainPID None, 0 workers: down" in st.stdout, st.stdout
        assert "gateway lab04 down: unreadable" in st.stdout and "Unable to connect to port 22" in st.stdout
        assert "  -> its host does not answer: runbook gateway-host-lost (inv deploy --topology 2p1d once it is back" \
            in st.stdout, st.stdout
        assert "3/3 instances registered and healthy; not ok: gateway lab04" in st.stdout, st.stdout
        assert "warning:" not in st.stdout, st.stdout
        doc = _status(inv_dir)
        gws = {g["host"]: g for g in doc["gateways"]}
        assert gws["lab03"]["state"] == "ok" and gws["lab04"]["state"] in ("down", "unknown"), gws
        assert all(r["state"] == "ok" for r in doc["instances"]), doc["instances"]
        # runbook 2: inv verify fails, naming the gateway
        v = cli(inv_dir, "verify")
        assert v.returncode == 5, v.stdout + v.stderr
        assert "lab04 read: failed" in v.stderr and f"gateway {GATEWAY_UNIT} on lab04: unreadable" in v.stderr, v.stderr
        assert "fix: `inv deploy --topology <the live one>` repairs" in v.stderr, v.stderr
        # runbook 3: a deploy before the host is back cannot reach it: nothing changed
        d = cli(inv_dir, "deploy", "--topology", "2p1d")
        assert d.returncode == 3 and "unreachable: cannot reach lab04" in d.stderr, d.stdout + d.stderr
        assert "fix: check the hosts and SSH; nothing was changed" in d.stderr, d.stderr
        assert record(inv_dir).current() == rev_before
    finally:
        lab.ensure_up()
    # runbook 4: the host is back: the repair plan, then the repair
    dry = cli(inv_dir, "deploy", "--topology", "2p1d", "--dry-run")
    assert dry.returncode == 0 and "plan: repair revision" in dry.stdout, dry.stdout + dry.stderr
    assert f"gateway {GATEWAY_UNIT} on lab04: inactive/dead" in dry.stdout, dry.stdout
    assert "gateway lab04 — [lab04] start pdops-gateway.service" in dry.stdout, dry.stdout
    assert "on each of the 2 gateways (lab03, lab04)" in dry.stdout, dry.stdout
    proc = cli(inv_dir, "deploy", "--topology", "2p1d")
    assert proc.returncode == 0 and "gateway lab04" in proc.stdout, proc.stdout + proc.stderr
    assert f"gateway up on lab04: {gw4}" in proc.stdout, proc.stdout
    assert "listed healthy and ready by the /workers of each of the 2 gateways" in proc.stdout, proc.stdout
    assert "verified: the admission layer on lab03 sees lab03, lab04 UP" in proc.stdout, proc.stdout
    urls = {i.url for i in Placement.from_dict(record(inv_dir).current_revision().placement).instances}
    assert _routable(inv)["lab04"] == urls
    never_twice(lab, inv_dir, "gw-host")
    # runbook 5: verify and status
    assert cli(inv_dir, "verify").returncode == 0
    st = cli(inv_dir, "status")
    assert st.returncode == 0 and "3/3 instances registered and healthy; all ok" in st.stdout, st.stdout + st.stderr
    assert f"gateway {gw4} on lab04: active/running" in st.stdout, st.stdout


def test_a_gateway_host_gone_for_good_is_taken_out_of_the_inventory(lab, cluster):
    """Runbook docs/runbooks/gateway-host-lost.md, "Gone for good", its commands in order: lab04
    powers off and stays off; the operator takes it out of `pdops_gateway.hosts` and out of the
    inventory; `inv deploy --dry-run` plans a change of the other gateway's files (its unit's
    RestartSec, the admission layer's server list) and names nothing on lab04; `inv deploy`, under
    load through the front door, restarts the remaining gateway (HAProxy's check paused) and reloads
    HAProxy without gw-lab04: no request fails; `inv status` warns of the single point of failure;
    `inv verify` passes. When the host comes back its gateway unit is still enabled with its old
    start-up list (pdops no longer manages it): `systemctl disable --now` it there. The module's last
    test: it leaves the cluster with one gateway."""
    import yaml

    from pdops import lab as lab_api

    inv_dir, _ = cluster
    inv = load_inventory(inv_dir)
    lab_api.down(hosts=[4])
    try:
        hosts = inv_dir / "hosts.yml"
        doc = yaml.safe_load(hosts.read_text())
        doc["all"]["vars"]["pdops_gateway"]["hosts"] = ["lab03"]
        doc["all"]["children"]["gpu_hosts"]["hosts"].pop("lab04")
        hosts.write_text(yaml.safe_dump(doc, sort_keys=False))
        dry = cli(inv_dir, "deploy", "--topology", "2p1d", "--dry-run")
        assert dry.returncode == 0, dry.stdout + dry.stderr
        assert "added:   none" in dry.stdout and "removed: none" in dry.stdout, dry.stdout
        assert ("gateway: restarted after the instances (2 of its files change: lab03:/etc/pdops/gateway.env changed; "
                "lab03:/etc/systemd/system/pdops-gateway.service changed)") in dry.stdout, dry.stdout
        assert ("admission layer: reloaded gracefully at the end (HAProxy's master stays, old workers finish their "
                "streams): lab03:/etc/pdops/pdops-admission.cfg changed") in dry.stdout, dry.stdout
        assert "kept:    p01, p02, d01" in dry.stdout, dry.stdout
        # the planner names the host taken out, and that it cannot reach it (it left the inventory too)
        assert ("gateway: lab04 leaves (no longer in pdops_gateway.hosts): its unit stopped and disabled, its files "
                "removed; the host is not in the inventory, so pdops cannot reach it") in dry.stdout, dry.stdout
        with Load(inv.admission.url, headers={"Authorization": f"Bearer {KEY}"}) as load:
            proc = cli(inv_dir, "deploy", "--topology", "2p1d")
        print(f"\ngateway host taken out of the inventory, the other gateway restarted under load: "
              f"{len(load.rows)} requests, {sum(not r.ok for r in load.rows)} failed")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "gateway restarted in" in proc.stdout and "3 worker(s) routable again" in proc.stdout, proc.stdout
        # one gateway left: its restart hands the front door to a stand-in first, which only HAProxy's new
        # config has, so HAProxy is reloaded (gracefully) before the restart
        assert "HAProxy on lab03 had no server for the gateway's stand-in" in proc.stdout, proc.stdout
        assert "verified: the admission layer on lab03 sent every request to a stand-in smg" in proc.stdout, proc.stdout
        assert "verified: pdops-admission.service reloaded gracefully" in proc.stdout, proc.stdout
        assert "not verified: lab04 is not in the inventory: its gateway unit was not disabled" in proc.stdout, \
            proc.stdout
        load.assert_clean()
        cfg = host_run(lab, "lab03", "cat /etc/pdops/pdops-admission.cfg")
        assert [ln.split()[1] for ln in cfg.splitlines() if ln.strip().startswith("server gw-")] == ["gw-lab03", "gw-lab03-standby"], cfg
        assert _main_pid(lab, "lab03") and "RestartSec=1" in host_run(lab, "lab03", f"systemctl cat {GATEWAY_UNIT}")
        st = cli(inv_dir, "status")
        assert st.returncode == 0 and "3/3 instances registered and healthy; all ok" in st.stdout, st.stdout + st.stderr
        assert "warning: single point of failure: one gateway (lab03)" in st.stdout, st.stdout
        assert "lab04" not in st.stdout, st.stdout
        v = cli(inv_dir, "verify")
        assert v.returncode == 0 and "on 3 host(s)" in v.stdout, v.stdout + v.stderr
    finally:
        lab.ensure_up()
    # the host came back: its gateway unit is still enabled (a real host would start it at boot and
    # register every worker of its old start-up list); nothing routes to it, pdops no longer reads it
    assert host_run(lab, "lab04", f"systemctl is-enabled {GATEWAY_UNIT}").strip() == "enabled"
    assert '"instance": "d01"' in host_run(lab, "lab04", "cat /etc/pdops/gateway-workers.json")
    host_run(lab, "lab04", f"systemctl disable --now {GATEWAY_UNIT}")
    assert host_run(lab, "lab04", f"systemctl is-enabled {GATEWAY_UNIT}").strip() == "disabled"
    assert cli(inv_dir, "verify").returncode == 0
