"""The admission layer (HAProxy in front of the gateway) deployed from the inventory on the lab:
a real systemd unit on the gateway host, keys map 0600, the request id in the journal, the
verify suite's admission check, `inv audit.admission` (through it and straight at the
gateway), and `inv admission.keys` rotating keys while 10 streams are open.

One 1p1d cluster, cap C=2, queue 8, sims at 10 ms per token so a stream lasts seconds."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from pathlib import Path

import aiohttp
import pytest
import yaml

from pdops.sim.testing import wait_until
from tests.lab.clusters import REPO, deployed, inv_cmd

from pdops.model.admission import KEYS_MAP_PATH, UNIT, key_id, parse_admission
from pdops.record import open_record
from pdops.remote.hosts import http_json
from pdops.model.inventory import load_inventory

pytestmark = pytest.mark.lab

KEY_A = "pdops-lab-key-A-" + "a" * 16
KEY_B = "pdops-lab-key-B-" + "b" * 16
KEY_C = "pdops-lab-key-C-" + "c" * 16
CAP, QUEUE = 2, 8
STEP_MS = "10"


def write_keys(path: Path, *keys: str) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.touch(mode=0o600)
    tmp.chmod(0o600)
    tmp.write_text("# lab keys\n" + "".join(k + "\n" for k in keys))
    tmp.replace(path)


@pytest.fixture(scope="module")
def cluster(lab, tmp_path_factory):
    root = tmp_path_factory.mktemp("admission")
    keys = root / "admission.keys"
    write_keys(keys, KEY_A)

    def add_admission(doc):
        doc["all"]["vars"]["pdops_admission"] = {"port": 18080, "cap": CAP, "queue": QUEUE, "queue_timeout_s": 60,
                                                 "overflow_status": 429, "api_keys_file": str(keys)}
    base_env = yaml.safe_load((REPO / "pdops" / "profiles" / "lab-sim.yml").read_text())["env"]

    def cli(*args, timeout=600):
        return inv_cmd(*args, timeout=timeout)

    with deployed(lab, root / "inv", "1p1d", mutate=add_admission,
                  profile={"env": {**base_env, "PDOPS_SIM_DECODE_STEP_MS": STEP_MS}}) as (inv_dir, proc):
        yield inv_dir, load_inventory(inv_dir), keys, cli, proc


def test_admission_runs_under_systemd_with_a_0600_key_map_and_the_request_id_in_the_journal(lab, cluster):
    inv_dir, inv, _, _, deploy = cluster
    cfg = parse_admission(inv.vars, inv)
    assert f"admission layer up: http://{lab.address('lab01')}:18080 (cap 2, queue 8" in deploy.stdout
    c = lab.connection(cfg.host)
    try:
        show = dict(ln.split("=", 1) for ln in c.run(
            f"systemctl show -p ActiveState -p SubState -p MainPID -p ControlGroup -p UnitFileState -p Type {UNIT}",
            hide=True).stdout.splitlines())
        assert show["ActiveState"] == "active" and show["SubState"] == "running", show
        assert show["Type"] == "notify" and show["UnitFileState"] == "enabled", show
        assert show["ControlGroup"].startswith("/pdops.slice/") and int(show["MainPID"]) > 0, show
        # the master runs /usr/sbin/haproxy in the unit's cgroup
        exe = c.run(f"readlink /proc/{show['MainPID']}/exe", hide=True).stdout.strip()
        assert exe.endswith("/haproxy"), exe
        assert c.run(f"stat -c '%a %U:%G' {KEYS_MAP_PATH}", hide=True).stdout.strip() == "600 root:root"

        # reachable at its address; unauthenticated gets 401, key A a generation
        assert http_json("GET", cfg.url + "/health", timeout=5)[0] == 401
        rid = f"lab-rid-{uuid.uuid4().hex[:10]}"
        status, doc = http_json("POST", cfg.url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}},
                                timeout=30, headers={"Authorization": f"Bearer {KEY_A}", "X-Request-ID": rid})
        assert status == 200 and doc["meta_info"]["completion_tokens"] == 4, doc

        def logged():
            out = c.run(f"journalctl -u {UNIT} --no-pager -o cat", hide=True).stdout
            return out if f"rid={rid}" in out else None
        journal = wait_until(logged, 15, f"rid={rid} in the journal of {UNIT}")
        line = next(ln for ln in journal.splitlines() if f"rid={rid}" in ln)
        assert f"key={key_id(KEY_A)}" in line and " 200 " in line, line
        assert KEY_A not in journal
    finally:
        c.close()


def test_gateway_keeps_retries_and_its_token_bucket_off(lab, cluster):
    _, inv, _, _, _ = cluster
    c = lab.connection(inv.gateway.first.host)
    try:
        script = c.run("cat /opt/pdops/bin/pdops-gateway.sh", hide=True).stdout
    finally:
        c.close()
    assert "--disable-retries" in script
    assert "--max-concurrent-requests -1" in script and "--queue-size 0" in script


def _admission_checks(inv):
    """What `inv verify` judges of the admission layer, read on its host (one round trip)."""
    from pdops.remote.hosts import HostPool
    from pdops.reads.verify.host_state import host_command, host_plans, judge, read_facts

    plan = next(p for p in host_plans(open_record(inv).current_revision()) if p.admission_units)
    with HostPool(inv) as pool:
        facts = read_facts(pool.run(plan.host, host_command(plan)).stdout)
    return [c for c in judge(plan, facts, virtual=True) if c.check == "admission"]


def test_verify_checks_the_admission_layer(lab, cluster):
    inv_dir, inv, _, _, _ = cluster
    proc = inv_cmd("verify", "-i", str(inv_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [(c.host, c.status) for c in _admission_checks(inv)] == [("lab01", "pass")]
    # the check has teeth: a key map readable by others fails it, and `inv verify` with it
    c = lab.connection("lab01")
    try:
        c.run(f"chmod 0644 {KEYS_MAP_PATH}", hide=True)
        bad = inv_cmd("verify", "-i", str(inv_dir))
    finally:
        c.run(f"chmod 0600 {KEYS_MAP_PATH}", hide=True)
        c.close()
    assert bad.returncode != 0, bad.stdout + bad.stderr
    assert f"lab01 admission: failed: {KEYS_MAP_PATH}: mode 0o644" in bad.stderr, bad.stdout + bad.stderr


def test_audit_admission_passes_through_the_admission_layer(cluster):
    inv_dir, _, _, cli, _ = cluster
    proc = cli("audit.admission", "-i", str(inv_dir), "--tokens", "300")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "through the admission layer, cap C=2" in out and "result: PASS" in out, out
    assert re.search(r"\[PASS\] auth: 2 requests without a valid key: \['401'\], 0 reached a decode", out), out
    assert re.search(r"\[PASS\] cap: peak in-flight at the decodes 2 \(cap 2\)", out), out
    assert "[PASS] queue: 2 within the cap, 2 queued and served, 0 refused with 429" in out, out
    assert re.search(r"\[PASS\] cancel: 1 streams cut: running 2->1, aborted \+1", out), out


def test_audit_against_an_uncapped_gateway_fails_cap_and_auth(cluster):
    """The CLI path of --against-gateway on the lab's smg, whose own limiter is off (-1) as pdops
    renders it behind the admission layer; smg's limiter with a cap set is measured in
    tests/integration/test_admission_local.py (docs/admission.md)."""
    inv_dir, _, _, cli, _ = cluster
    proc = cli("audit.admission", "-i", str(inv_dir), "--against-gateway", "--cap", "2", "--tokens", "400")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 5, out  # Unverified: not a pass
    assert "straight at the gateway (its own flags), cap C=2" in out and "result: FAIL" in out, out
    m = re.search(r"\[FAIL\] cap: peak in-flight at the decodes (\d+) \(cap 2\)", out)
    assert m and int(m.group(1)) > 2, out
    assert "[FAIL] auth" in out, out  # no key at the gateway: requests reach the decode
    assert "admission audit failed: " in out and "cap" in out.split("admission audit failed: ", 1)[1], out


def test_key_rotation_during_10_open_streams_drops_none(cluster):
    inv_dir, inv, keys, cli, _ = cluster
    cfg = parse_admission(inv.vars, inv)
    tokens = 400  # 4 s per stream, 2 at a time (cap 2): the 10 streams span ~20 s

    async def stream(session, i, rec):
        body = {"text": f"rotate {i}", "stream": True, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
        async with session.post(cfg.url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY_A}"},
                                timeout=aiohttp.ClientTimeout(total=180)) as r:
            rec["status"] = r.status
            chunks = []
            async for ln in r.content:
                if ln.startswith(b"data:"):
                    chunks.append(ln.strip())
                    rec.setdefault("first", time.monotonic())
        rec["end"] = time.monotonic()
        return chunks

    async def run():
        recs = [{} for _ in range(10)]
        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(stream(session, i, recs[i])) for i in range(10)]
            # all 10 sent and the first C streaming before the rotation starts
            await asyncio.to_thread(wait_until, lambda: sum("first" in r for r in recs) >= CAP, 30, "C streams started")
            write_keys(keys, KEY_B)
            t0 = time.monotonic()
            assert not any("end" in r for r in recs)  # all 10 open when the rotation starts
            proc = await asyncio.to_thread(cli, "admission.keys", "-i", str(inv_dir))
            t1 = time.monotonic()
            results = await asyncio.gather(*tasks)
        return recs, results, proc, t0, t1

    recs, results, proc, t0, t1 = asyncio.run(run())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"revoked: {key_id(KEY_A)}" in out and f"added: {key_id(KEY_B)}" in out, out
    assert "verdict: 1 keys in effect on lab01" in out, out
    # the rotation happened while streams were open: some ended only after it finished
    assert sum(r["end"] > t1 for r in recs) >= 1, [(r.get("first", 0) - t0, r["end"] - t0) for r in recs]
    # queued in the old workers at the reload, they were still served with the old key
    assert sum(r["first"] > t1 for r in recs) >= 1, [(r["first"] - t0, r["end"] - t0) for r in recs]
    assert [r["status"] for r in recs] == [200] * 10
    assert [len(c) for c in results] == [tokens + 1] * 10  # every token chunk + [DONE]
    assert all(c[-1] == b"data: [DONE]" for c in results)
    # after: B works, A is refused
    status, doc = http_json("POST", cfg.url + "/generate", {"text": "b", "sampling_params": {"max_new_tokens": 2}},
                            timeout=30, headers={"Authorization": f"Bearer {KEY_B}"})
    assert status == 200 and doc["meta_info"]["completion_tokens"] == 2
    assert http_json("GET", cfg.url + "/health", timeout=5, headers={"Authorization": f"Bearer {KEY_A}"})[0] == 401
    # journalled under its own op, every step ok, only key ids
    recs_j = open_record(inv).journal().records()
    op = [r for r in recs_j if r["op_id"].startswith("admission-keys")]
    assert [r["step"] for r in op] == ["lock.held", "plan", "check-unit", "deliver", "reload", "verify",
                                       "verdict"], op
    assert all(r["status"] == "ok" for r in op)
    assert KEY_A not in str(op) and KEY_B not in str(op)


def test_a_gateway_restart_behind_the_admission_layer_turns_no_request_away(cluster):
    """Straight at the gateway, requests that arrive while smg restarts are refused (test_change).
    Behind the admission layer the only gateway restarts make before break: a stand-in smg from the
    new files is admitted in HAProxy once its /readiness is 200 and it routes to every worker, the
    gateway is drained to 0 sessions, restarted, admitted again, and the stand-in drained and stopped;
    no health check is paused. A gateway setting changes under load through the admission layer, a
    CPU hog on one core: every request is served, none turned away. The same deploy adds a key, so it
    also reloads HAProxy at its end (a new worker, the old one soft-stops): that handover turns none
    away either (docs/admission.md)."""
    from tests.lab.clusters import Load, cpu_hog

    inv_dir, inv, keys, _, _ = cluster
    cfg = parse_admission(inv.vars, inv)
    key = next(ln.strip() for ln in keys.read_text().splitlines() if ln.strip() and not ln.startswith("#"))
    hosts = inv_dir / "hosts.yml"
    doc = yaml.safe_load(hosts.read_text())
    doc["all"]["vars"]["pdops_gateway"]["health_check_interval_secs"] = 6
    hosts.write_text(yaml.safe_dump(doc, sort_keys=False))
    write_keys(keys, key, KEY_C)  # the load's key stays; the new one makes the deploy reload HAProxy
    with cpu_hog(), Load(cfg.url, headers={"Authorization": f"Bearer {key}"}) as load:
        proc = inv_cmd("deploy", "--topology", "1p1d", "-i", str(inv_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reloaded pdops-admission.service (master MainPID" in proc.stdout, proc.stdout
    assert "gateway: restarted" in proc.stdout and "gateway restarted in" in proc.stdout, proc.stdout
    sb = inv.gateway.standby(inv.gateway.hosts[0])
    assert f"stand-in gateway {sb.url} routes to 2 worker(s), ready, UP in HAProxy" in proc.stdout, proc.stdout
    assert f"stand-in {sb.url} drained, out of HAProxy, stopped" in proc.stdout, proc.stdout
    assert f"the admission layer on {cfg.host} sent every request to a stand-in smg" in proc.stdout, proc.stdout
    refused = load.refused()
    print(f"gateway restart behind the admission layer: {len(load.rows)} requests, {len(refused)} turned away")
    assert not refused, [r.to_dict() for r in refused[:3]]
    load.assert_clean()


def test_a_rollback_records_every_file_it_runs_and_a_gateway_killed_after_it_is_repaired_by_one_deploy(
        lab, cluster):
    """The front-door issue's fault 2: a rollback once recorded a manifest without HAProxy's files, and a
    gateway SIGKILLed after it was never repaired (`inv deploy` said `no change`, `inv verify` kept exiting 5).
    `inv rollback` returns to the revision before the gateway restart's (health check interval 5), and the
    inventory is put back too (runbook bundle-change.md); the rollback's revision records every file the
    revision before it recorded, the admission layer's included. The gateway is SIGKILLed and systemd starts it
    again: `inv verify` names it restarted (5), the runbook's `inv deploy` repairs it (`plan: repair
    revision`), `inv verify` 0. (Before the reboots at the end of this file.)"""
    from tests.lab.clusters import host_run, record

    inv_dir, inv, _, _, _ = cluster
    before = record(inv_dir).current_revision()
    back = inv_cmd("rollback", "-i", str(inv_dir))
    assert back.returncode == 0, back.stdout + back.stderr
    hosts = inv_dir / "hosts.yml"
    doc = yaml.safe_load(hosts.read_text())
    doc["all"]["vars"]["pdops_gateway"]["health_check_interval_secs"] = 5
    hosts.write_text(yaml.safe_dump(doc, sort_keys=False))
    rolled = record(inv_dir).current_revision()
    assert rolled.extra.get("rollback_of") and rolled.number > before.number, rolled
    def files(rev) -> set[str]:  # the manifest: host -> {path: sha256}
        return {f"{h}:{path}" for h, paths in rev.manifest.items() for path in paths}

    missing = sorted(files(before) - files(rolled))
    assert not missing, f"the rollback's revision lacks files the revision before it recorded: {missing}"
    assert any(path.endswith("pdops-admission.cfg") for path in files(rolled)), sorted(files(rolled))

    gw = inv.gateway.first.host
    unit = "pdops-gateway.service"

    def main_pid() -> int:
        return int(host_run(lab, gw, f"systemctl show -p MainPID --value {unit}").strip() or 0)

    killed = main_pid()
    host_run(lab, gw, f"kill -KILL {killed}")
    wait_until(lambda: main_pid() not in (0, killed), 60, "systemd to start the gateway again")
    v = inv_cmd("verify", "-i", str(inv_dir))
    assert v.returncode == 5 and f"gateway {unit} restarted: MainPID" in v.stderr, v.stdout + v.stderr
    d = inv_cmd("deploy", "--topology", "1p1d", "-i", str(inv_dir))
    assert d.returncode == 0 and "plan: repair revision" in d.stdout, d.stdout + d.stderr
    v = inv_cmd("verify", "-i", str(inv_dir))
    assert v.returncode == 0, v.stdout + v.stderr


def test_after_a_reboot_of_every_host_one_deploy_opens_the_front_door_again(lab, cluster):
    """Runbook "hosts rebooted" behind the admission layer (the front-door issue, fault 1): on the lab
    nothing pdops installed starts at boot, HAProxy included. `inv status` names the closed front door
    and the one command; the runbook's `inv deploy --topology <live>` starts the gateway, the engines
    and HAProxy, and waits until HAProxy sees the gateway UP: `inv verify` 0, requests through the
    front door served. (Near the end of this file: it reboots the module's cluster.)"""
    from pdops import lab as lab_api
    from pdops.remote.loadgen import send

    inv_dir, inv, keys, _, _ = cluster
    cfg = parse_admission(inv.vars, inv)
    key = next(ln.strip() for ln in keys.read_text().splitlines() if ln.strip() and not ln.startswith("#"))
    lab_api.down(lab.lab_dir)
    lab.ensure_up()
    st = inv_cmd("status", "-i", str(inv_dir))
    assert st.returncode == 1, st.stdout + st.stderr
    assert f"front door closed: the admission layer on {cfg.host} is not running ({UNIT} inactive/dead)" in st.stdout, \
        st.stdout
    assert "-> inv deploy --topology 1p1d (starts it)" in st.stdout, st.stdout
    proc = inv_cmd("deploy", "--topology", "1p1d", "-i", str(inv_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"start {UNIT} in front of the gateways (observed {UNIT} inactive/dead)" in proc.stdout, proc.stdout
    v = inv_cmd("verify", "-i", str(inv_dir))
    assert v.returncode == 0, v.stdout + v.stderr
    rows = send(cfg.url, requests=6, concurrency=3, max_new_tokens=8, rid_prefix="after-reboot",
                headers={"Authorization": f"Bearer {key}"})
    assert all(r.ok for r in rows), [r.to_dict() for r in rows if not r.ok][:2]


def test_after_a_reboot_the_real_way_the_enabled_units_serve_again_and_one_deploy_records_them(lab, cluster):
    """The same reboot the way a real host boots (`lab.up --boot enabled`): HAProxy, the gateway and
    the engines start by themselves from the files on disk, and the gateway re-registers its start-up
    list. `inv status` finds them running as processes the record does not know (exit 1); the
    runbook's deploy waits for each engine's /health, canaries, records the processes it proved:
    `inv status` and `inv verify` 0, requests through the front door served."""
    from pdops import lab as lab_api
    from pdops.remote.loadgen import send

    inv_dir, inv, keys, _, _ = cluster
    cfg = parse_admission(inv.vars, inv)
    key = next(ln.strip() for ln in keys.read_text().splitlines() if ln.strip() and not ln.startswith("#"))
    lab_api.down(lab.lab_dir)
    lab.ensure_up(boot="enabled")  # until the next boot (the next module's clusters disable these units)
    st = inv_cmd("status", "-i", str(inv_dir))
    assert st.returncode == 1 and "restarted" in st.stdout, st.stdout + st.stderr
    assert "front door closed" not in st.stdout, st.stdout  # HAProxy started by itself
    proc = inv_cmd("deploy", "--topology", "1p1d", "-i", str(inv_dir))
    assert proc.returncode == 0 and "repair revision" in proc.stdout, proc.stdout + proc.stderr
    assert "healthy p01" in proc.stdout and "healthy d01" in proc.stdout, proc.stdout
    for cmd in ("status", "verify"):
        r = inv_cmd(cmd, "-i", str(inv_dir))
        assert r.returncode == 0, r.stdout + r.stderr
    rows = send(cfg.url, requests=6, concurrency=3, max_new_tokens=8, rid_prefix="after-real-boot",
                headers={"Authorization": f"Bearer {key}"})
    assert all(r.ok for r in rows), [r.to_dict() for r in rows if not r.ok][:2]
