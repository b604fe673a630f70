"""pdops against real SGLang 0.5.23 and real Mooncake (issue 50): a 1 prefill + 1 decode cluster of the
lab's CPU profile (pdops/profiles/lab-sglang-cpu.yml: the tiny local model, Mooncake over TCP), deployed
once for the module and operated as on GPU hosts: deploy, status, verify, a decode's HTTP main process (its MainPID) SIGKILLed
mid-stream and repaired, an orphaned prefill half ended, a drain under streams, a decode edited on its host.

Each claim here is about what the real engine does, read from the lab hosts (systemd, the process tree,
SGLang's own request log), never from pdops.sim. Needs `make env-engine` (make test builds it); a machine
where the engine cannot start fails these tests with the engine's own log, it does not skip them.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pdops.sim.testing import wait_until
from tests.lab.clusters import Load, cli, deployed, host_run, received_rids, record

pytestmark = pytest.mark.lab

TOPOLOGY = "1p1d"
# a long generation: 3 prompt tokens + LONG stay within the tiny model's 4096-token context
LONG = 3500
# the longest a real engine may take to answer /health (real_engine below)
REAL_START_S = 480  # within the 600 s an `inv` command of these tests may take (clusters.inv_cmd)


def real_engine(doc: dict) -> None:
    v = doc["all"]["vars"]
    v.update({"pdops_engine": "sglang", "pdops_profile": "lab-sglang-cpu", "pdops_engine_python": "auto",
              # real SGLang answers /health after 17-64 s on an idle machine (imports, model load, warm-up);
              # beside three other lab workers and a busy loop on a machine whose two cores give about 1.6
              # cores of work, a pair still had not answered after 240 s (2026-12-07, the two engines
              # importing side by side): the start's wait is a deadline, not a delay
              "pdops_start_timeout_s": REAL_START_S})


def _shm_leftovers() -> set[Path]:
    return set(Path("/dev/shm").glob("sglang_loads_*.shm"))


def _mapped(paths: set[Path]) -> set[Path]:
    """Those of `paths` that a live process of this machine maps (lab hosts share its /dev/shm)."""
    seen = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        seen |= {p for p in paths if str(p) in text}
    return seen


@pytest.fixture(scope="module")
def real(lab, tmp_path_factory):
    before = _shm_leftovers()
    with deployed(lab, tmp_path_factory.mktemp("real"), TOPOLOGY, mutate=real_engine) as d:
        yield d
    # Every engine start leaves /dev/shm/sglang_loads_<name>_<hash>.shm behind (16 KiB; docs/lab.md):
    # pdops does not clean them yet. The files this module's engines made, now mapped by no process,
    # are removed by name so that runs do not pile them up on the machine.
    left = _shm_leftovers() - before
    for path in left - _mapped(left):
        path.unlink(missing_ok=True)


@pytest.fixture
def serving(real):
    """The module's pair as deployed, before a test that needs it. A test that failed midway may leave it
    otherwise (seen in CI: a repair halted by its canary moved `current` to 1p0d, and the tests after it
    failed on a missing d01, not on what they test). pdops repairs it from what it observes (`inv deploy`),
    and the test says so; a pair it cannot repair fails the test with pdops's own words."""
    st = cli(real.inv_dir, "status")
    if st.returncode != 0:
        print("the pair is not as deployed; `inv deploy` repairs it first:\n" + st.stdout[-1500:])
        r = cli(real.inv_dir, "deploy", "--topology", TOPOLOGY)
        assert r.returncode == 0, "the pair could not be repaired for this test:\n" + r.stdout[-4000:] + r.stderr
    return real


def _placement(inv_dir):
    from pdops.model.placement import Placement

    st = record(inv_dir)
    return Placement.from_dict(st.read_revision(st.current()).placement)


def _instance(inv_dir, iid: str):
    return next(i for i in _placement(inv_dir).instances if i.id == iid)


def _unit_procs(lab, host: str, unit: str) -> dict[int, str]:
    """{PID: command name (15 characters, as the kernel keeps it)} of the unit's MainPID and every
    process under it, read from the host's process table."""
    main = _main_pid(lab, host, unit)
    rows = [line.split(None, 2) for line in host_run(lab, host, "ps -eo pid=,ppid=,comm=").splitlines()]
    children: dict[int, list[int]] = {}
    comm = {}
    for pid, ppid, name in (r for r in rows if len(r) == 3):
        children.setdefault(int(ppid), []).append(int(pid))
        comm[int(pid)] = name.strip()
    out, todo = {}, [main] if main in comm else []
    while todo:
        pid = todo.pop()
        out[pid] = comm[pid]
        todo += children.get(pid, [])
    return out


def _cgroup_procs(lab, host: str, unit: str) -> dict[int, str]:
    """{PID: command name} of every process whose cgroup is the unit's (from /proc/<pid>/cgroup, as
    pdops reads them: a process that left its parent's tree is still there)."""
    out = host_run(lab, host, f"for f in /proc/[0-9]*/cgroup; do grep -qs '/{unit}$' $f && "
                               "p=${f#/proc/} && p=${p%/cgroup} && echo \"$p $(cat /proc/$p/comm 2>/dev/null)\"; done")
    return {int(pid): name for pid, _, name in (line.partition(" ") for line in out.splitlines()) if pid.isdigit()}


def _main_pid(lab, host: str, unit: str) -> int:
    return int(host_run(lab, host, f"systemctl show -p MainPID --value {unit}").strip() or 0)


def _generate(url: str, rid: str, max_new_tokens: int = 8, stream: bool = False, timeout: float = 120):
    body = {"text": "pdops lab request", "rid": rid, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def _gateway_url(inv_dir) -> str:
    from pdops.model.inventory import load_inventory

    return load_inventory(inv_dir).gateway.nodes[0].url


def test_deploy_runs_real_sglang_and_each_step_is_proved_by_it(lab, real):
    out = real.proc.stdout
    # the real start: health only once the model is loaded and warmed up (503 before)
    assert re.search(r"p01 healthy in \d+\.\d+s", out) and re.search(r"d01 healthy in \d+\.\d+s", out), out
    assert "canary ok through 1 prefill x decode pair(s)" in out, out
    assert re.search(r"d01 registered with .*circuit closed", out), out
    assert "verdict: deployed 1p1d as revision 1 and made it current" in out, out
    p01, d01 = _instance(real.inv_dir, "p01"), _instance(real.inv_dir, "d01")
    # what runs is SGLang's own process tree under each unit's MainPID
    for inst in (p01, d01):
        host, unit = inst.units[0]
        names = set(_unit_procs(lab, host, unit).values())
        assert "sglang::schedul" in names and "sglang::detoken" in names, (unit, names)
    # a generation through smg, the real bootstrap and Mooncake: both halves log the request ID
    rid = f"real-deploy-{time.time_ns()}"
    status, body = _generate(_gateway_url(real.inv_dir), rid)
    assert status == 200 and json.loads(body)["meta_info"]["completion_tokens"] == 8, body
    assert received_rids(real.inv_dir, {rid}) == {rid}
    st = cli(real.inv_dir, "status")
    assert st.returncode == 0, st.stdout + st.stderr
    assert re.search(r"^p01 .* ok$", st.stdout, re.M) and re.search(r"^d01 .* ok$", st.stdout, re.M), st.stdout
    v = cli(real.inv_dir, "verify")
    assert v.returncode == 0, v.stdout + v.stderr


def test_a_decode_killed_mid_stream_takes_its_scheduler_with_it_and_the_repair_names_the_request_it_lost(lab, real, serving):
    """The decode's MainPID (SGLang's HTTP main) SIGKILLed while it generates a long stream.
    sglang#23627: a SIGKILL of the HTTP main process leaves `sglang::scheduler` holding memory when
    SGLang runs bare. Under pdops's unit (KillMode=mixed) systemd ends the whole cgroup at once: the
    scheduler never outlives its main, and nothing pdops has to find by name. `inv status` names the
    restart; `inv repair` names the request the kill cut, never sends it again, and restores.
    (One kill for both claims: each real decode start costs a minute of this machine's CPU.)"""
    d01 = _instance(real.inv_dir, "d01")
    host, unit = d01.units[0]
    before = _cgroup_procs(lab, host, unit)
    assert "sglang::schedul" in before.values(), before
    url = _gateway_url(real.inv_dir)
    rid = f"real-cut-{time.time_ns()}"
    result = {}

    def long_stream():
        try:
            # within the tiny model's context of 4096 (a longer one is refused with 400 by both halves)
            result["answer"] = _generate(url, rid, max_new_tokens=LONG, stream=True)
        except Exception as exc:  # noqa: BLE001 - the cut is the point
            result["error"] = exc

    t = threading.Thread(target=long_stream, daemon=True)
    t.start()
    # the decode is generating it (its own request log has it, not finished)
    from pdops.facts import requestlog

    wait_until(lambda: rid in requestlog.parse(host_run(lab, host, requestlog.command(unit))).open, 60,
               f"{rid} received by d01, not finished")
    main = _main_pid(lab, host, unit)
    assert main in before, (main, before)
    host_run(lab, host, f"kill -KILL {main}")
    t.join(timeout=120)
    assert "error" in result or not re.search(rf'"completion_tokens":\s*{LONG}\b', result["answer"][1]), \
        "the stream was not cut"
    # systemd restarts it (Restart=on-failure): a new MainPID, active
    wait_until(lambda: _main_pid(lab, host, unit) not in (0, main), 60, f"{unit} restarted by systemd")
    alive = set(host_run(lab, host, "ps -eo pid=").split())
    assert not set(map(str, before)) & alive, f"the old cgroup's {before} outlived its main"
    # what was left when the main died, systemd ended by the unit's cgroup (the scheduler itself may go
    # first, by the kernel: SGLang gives it a parent-death signal; its own children are then no one's)
    journal = host_run(lab, host, f"journalctl -u {unit} -o cat --no-pager")
    after_kill = journal[journal.rindex("Main process exited, code=killed, status=9/KILL"):]
    killed = {int(pid) for pid in re.findall(r"Killing process (\d+) \(\S+\) with signal SIGKILL", after_kill)}
    # systemd names each task of the cgroup it signals (the processes listed before, and their threads);
    # a process that exits by itself first (the scheduler by its parent-death signal, the resource
    # tracker when its pipe closes) is not among them: what matters is that none of them is left
    print(f"systemd ended by the cgroup after the main's SIGKILL: {sorted(killed)}; the old cgroup: {before}")
    st = cli(real.inv_dir, "status")
    assert st.returncode == 1 and "d01 restarted" in st.stdout, st.stdout
    r = cli(real.inv_dir, "repair", "--instance", "d01", "--force")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "repaired d01 (observed restarted)" in r.stdout, r.stdout
    # the request the kill cut is named, and never sent again
    assert rid in r.stdout and "failed, not replayed" in r.stdout, r.stdout
    assert cli(real.inv_dir, "verify").returncode == 0
    assert cli(real.inv_dir, "status").returncode == 0


def test_an_orphaned_prefill_half_is_named_by_status_and_ended_by_its_id(lab, real, serving):
    """The prefill half of a request whose decode never comes (what a decode killed before the KV transfer
    leaves): real SGLang's prefill holds it in its bootstrap queue; `inv status` names it, `inv end-orphans`
    aborts exactly that request ID, and the client is answered at once, not served twice."""
    import random

    from pdops.remote.hosts import http_json

    p01 = _instance(real.inv_dir, "p01")
    rid = f"real-orphan-{time.time_ns()}"
    body = {"text": f"an orphaned half {rid}", "rid": rid, "stream": False, "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": p01.head.data_addr, "bootstrap_port": p01.bootstrap_port,
            "bootstrap_room": random.getrandbits(62)}
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(answer=http_json("POST", f"{p01.url}/generate", body, timeout=200,
                                                                     headers={"x-request-id": rid})), daemon=True)
    t.start()

    def orphaned():
        st = cli(real.inv_dir, "status", "--json")
        row = next(r for r in json.loads(st.stdout)["instances"] if r["instance"] == "p01")
        return (st, row) if row["orphaned"] else None

    st, row = wait_until(orphaned, 90, "p01's orphaned half named by inv status")
    assert st.returncode == 1 and [o["rid"] for o in row["orphaned"]] == [rid], row
    ended = cli(real.inv_dir, "end-orphans")
    assert ended.returncode == 0, ended.stdout + ended.stderr
    assert f"orphaned half(s) ended and no longer open (lost work, not replayed): {rid}" in ended.stdout, ended.stdout
    t.join(timeout=60)
    assert not t.is_alive(), "the client of the ended half was not answered"
    status, doc = out["answer"]
    assert status != 200 or doc["meta_info"]["finish_reason"]["type"] == "abort", doc
    after = cli(real.inv_dir, "status")
    assert after.returncode == 0, after.stdout


def test_a_drain_under_streams_waits_for_each_request_by_its_id_then_stops_the_real_tree(lab, real, serving):
    d01 = _instance(real.inv_dir, "d01")
    host, unit = d01.units[0]
    procs = _unit_procs(lab, host, unit)
    # SGLang's IPC sockets are in the engine's TMPDIR, under its unit's RuntimeDirectory
    from pdops.model.commands import engine_tmpdir

    tmp = engine_tmpdir(unit)
    sockets = host_run(lab, host, f"find {tmp} -type s").split()
    assert sockets, f"no socket of SGLang in {tmp}"
    with Load(_gateway_url(real.inv_dir), prefix="real-drain", requests=4, concurrency=2,
              max_new_tokens=400) as load:
        wait_until(lambda: len(load.rows) >= 4, 120, "the first streams served")
        r = cli(real.inv_dir, "drain", "--instance", "d01", "--force")
    assert r.returncode == 0, r.stdout + r.stderr
    load.assert_clean(at_least=4, allow_refused=True)
    # SGLang's own log: every request the drained decode received, it finished
    from pdops.facts import requestlog

    log = requestlog.parse(host_run(lab, host, requestlog.command(unit)))
    assert not [rid for rid in log.open if rid.startswith("real-drain")], log.open
    assert "verified: cgroup empty" in r.stdout, r.stdout
    # what SGLang leaves at every stop (its load snapshot in /dev/shm), named and removed by exact path
    left = re.search(r"verified: left in /dev/shm by d01's processes, mapped by no process now, removed: "
                     r"(lab\d+):(/dev/shm/sglang_loads_\S+\.shm) \(\d+ bytes\)", r.stdout)
    assert left, r.stdout
    assert not Path(left.group(2)).exists()
    assert f"d01's runtime directory (its TMPDIR: the engine's IPC sockets and scratch files) {host}:" \
           f"{tmp.removesuffix('/tmp')} removed by systemd" in r.stdout, r.stdout
    assert host_run(lab, host, f"ls -d {tmp} 2>/dev/null || echo gone").strip() == "gone"
    alive = set(host_run(lab, host, "ps -eo pid=").split())
    assert not set(map(str, procs)) & alive, f"{procs} outlived the drain's stop"
    # and back: a decode added to a cluster with none is no change of generation (it was refused as
    # "decode TP unset -> 1", found here)
    back = cli(real.inv_dir, "deploy", "--topology", TOPOLOGY)
    assert back.returncode == 0, back.stdout + back.stderr
    assert "generation: unchanged" in back.stdout or "d01 healthy" in back.stdout, back.stdout


def _health(url: str) -> int | str:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError as exc:
        return type(exc).__name__


def test_a_decode_edited_on_its_host_to_another_page_size_exits_on_its_first_pair_and_one_deploy_restores_it(
        lab, real, serving):
    """A generation mismatch made by hand: d01's launch script edited on its host to `--page-size 16`
    (the prefill keeps SGLang's default, 1) and the unit restarted. Real SGLang does not fail the
    request cleanly: the first request that pairs them makes the decode's scheduler raise
    `Page size mismatch` and the whole decode process exits (systemd starts it again, into the same
    crash, after RestartSec). pdops names the edited file before and after the restart; the on-call stops the crash loop,
    and one `inv deploy` puts the revision's files back before it starts the decode again."""
    from pdops.model.render import BIN_DIR

    p01, d01 = _instance(real.inv_dir, "p01"), _instance(real.inv_dir, "d01")
    host, unit = d01.units[0]
    script = f"{BIN_DIR}/{unit.removesuffix('.service')}.sh"
    p_host, p_unit = p01.units[0]
    p_main = _main_pid(lab, p_host, p_unit)
    host_run(lab, host, f"sed -i '$ s/$/ --page-size 16/' {script}")
    # the edit is seen before anything runs it: the process is the recorded one, started from the
    # revision's files, so the way back puts the file back and restarts nothing
    st = cli(real.inv_dir, "status")
    assert st.returncode == 1 and f"{host}:{script} is not revision" in st.stdout, st.stdout
    assert "nothing restarted" in st.stdout, st.stdout
    host_run(lab, host, f"systemctl restart {unit}")
    main = wait_until(lambda: _health(d01.url) == 200 and _main_pid(lab, host, unit), REAL_START_S,
                      "the edited decode's start")
    # smg took it out while it restarted (its health check): until it routes to it again a request is
    # answered 503 "no available decode workers" and never reaches the pair
    from pdops.model.inventory import load_inventory
    from pdops.remote.gateway import Gateways

    gateways = Gateways.of(load_inventory(real.inv_dir), timeout=3)
    wait_until(lambda: any(w.url.rstrip("/") == d01.url.rstrip("/") and w.routable
                         for _, c in gateways.items() for w in c.list_workers()), 120,
               "the gateway routing to the edited decode")
    rid = f"real-pagesize-{time.time_ns()}"
    try:
        status, body = _generate(_gateway_url(real.inv_dir), rid, timeout=120)
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read().decode(errors="replace")
    assert status != 200, f"a prefill of page size 1 and a decode of 16 served {rid}: {body}"
    # what real SGLang does (docs/changes.md): the decode process exits with the mismatch, the prefill lives
    print(f"{rid}: HTTP {status} {body[:300]}")
    try:
        # the exit: no MainPID while systemd waits RestartSec before its next start
        wait_until(lambda: _main_pid(lab, host, unit) != main, 120, "the decode's exit")
    finally:
        # the crash loop stopped, as an on-call would first (and before the next start, a minute of CPU)
        host_run(lab, host, f"systemctl stop {unit}")
        journal = host_run(lab, host, f"journalctl -u {unit} -o cat --no-pager")
        print("d01's journal, last lines:\n" + "\n".join(journal.splitlines()[-40:]))
    assert "Page size mismatch: prefill server has page_size=1, but decode server has page_size=16" in journal
    assert _main_pid(lab, p_host, p_unit) == p_main, "the prefill exited too"
    st = cli(real.inv_dir, "status")
    assert st.returncode == 1 and f"{host}:{script} is not revision" in st.stdout, st.stdout
    assert "then replaces it" in st.stdout, st.stdout
    r = cli(real.inv_dir, "deploy", "--topology", TOPOLOGY)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "its files were changed on the host" in r.stdout, r.stdout
    assert "--page-size" not in host_run(lab, host, f"cat {script}")
    status, body = _generate(_gateway_url(real.inv_dir), f"real-pagesize-after-{time.time_ns()}")
    assert status == 200, body
    after = cli(real.inv_dir, "status")
    assert after.returncode == 0, after.stdout
    assert cli(real.inv_dir, "verify").returncode == 0
