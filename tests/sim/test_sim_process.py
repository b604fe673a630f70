"""The sim's processes, SIGTERM drain, PD timeouts and faults (sims only, no gateway)."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from pdops.sim.testing import free_port, http, metric, wait_until


def _titles(pid):
    return sorted(c.cmdline()[0] if c.cmdline() else c.name() for c in psutil.Process(pid).children())


def _gone(pids):
    return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


def test_children_are_named_like_sglang_and_die_with_the_main_process(sims):
    h = sims(["--tp-size", "2"])
    kids = h.state()["children"]
    assert sorted(k["title"] for k in kids) == ["sglang::detokenizer", "sglang::scheduler_TP0", "sglang::scheduler_TP1"]
    assert all(t.startswith("sglang::") for t in _titles(h.pid))
    os.kill(h.pid, signal.SIGKILL)  # no cleanup code runs: only PDEATHSIG can stop them
    wait_until(lambda: _gone([k["pid"] for k in kids]), 5, "children killed by PR_SET_PDEATHSIG")


def _generate_in_thread(h, max_new, out, stream=False):
    def run():
        out.append(http("POST", h.url + "/generate", {"text": "a b c", "stream": stream, "sampling_params": {"max_new_tokens": max_new}}, timeout=30))

    t = threading.Thread(target=run)
    t.start()
    return t


def test_sigterm_drains_accepts_new_requests_then_exits_with_its_children(sims):
    h = sims(["--tp-size", "2"])
    kids = [k["pid"] for k in h.state()["children"]]
    out = []
    t1 = _generate_in_thread(h, 300, out)  # about 1.3 s of decode
    wait_until(lambda: h.state().get("in_flight"), 5, "request in flight")
    h.terminate()
    wait_until(lambda: h.get("/health")[0] == 503, 5, "/health 503 during drain")
    assert h.get("/ready")[0] == 503
    t2 = _generate_in_thread(h, 20, out)  # new requests are still accepted
    t2.join(10)
    assert h.proc.alive()
    t1.join(15)
    assert [s for s, _ in out] == [200, 200]
    assert h.proc.wait(10) == 0
    wait_until(lambda: _gone(kids), 5, "children gone after drain")


def test_force_shutdown_skips_the_wait(sims):
    h = sims(env={"SGL_FORCE_SHUTDOWN": "1"})
    out = []
    _generate_in_thread(h, 100000, out)
    wait_until(lambda: h.state().get("in_flight"), 5, "request in flight")
    h.terminate()
    assert h.proc.wait(5) is not None


def test_ignore_sigterm_fault(sims):
    h = sims(env={"PDOPS_SIM_FAULTS": "ignore_sigterm"})
    h.terminate()
    time.sleep(1.0)  # the drain poll is 0.2 s: a clean exit would have happened by now
    assert h.proc.alive() and h.get("/health")[0] == 200


def test_crash_child_fault_takes_the_tree_down(sims):
    h = sims(["--tp-size", "2"], env={"PDOPS_SIM_FAULTS": "crash_child=0.3"})
    kids = [k["pid"] for k in h.state()["children"]]
    assert h.proc.wait(10) == 1
    wait_until(lambda: _gone(kids), 5, "children gone after crash")


def test_stray_grandchild_survives_its_parent(sims):
    h = sims(env={"PDOPS_SIM_FAULTS": "stray_grandchild"})
    stray = wait_until(lambda: h.state()["strays"], 5, "stray pid reported")[0]
    p = psutil.Process(stray)
    assert p.cmdline()[0] == "sglang::stray"
    assert p.ppid() != h.pid and stray not in [c.pid for c in psutil.Process(h.pid).children(recursive=True)]
    os.kill(h.pid, signal.SIGKILL)
    h.proc.wait(5)
    time.sleep(0.3)
    assert psutil.pid_exists(stray) and p.status() != psutil.STATUS_ZOMBIE  # left behind
    h.stop()  # kills the stray by its recorded pid
    wait_until(lambda: _gone([stray]), 5, "stray killed by stop()")


def test_multi_node_rank_joins_rank_0_and_exits_with_it(sims):
    port = free_port()
    common = ["--tp-size", "4", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}"]
    r0 = sims([*common, "--node-rank", "0"], ready=False)
    time.sleep(0.5)
    assert r0.get("/health")[0] in (0, 503)  # not up before every rank joined
    r1 = sims([*common, "--node-rank", "1", "--port", str(free_port())], ready=False)
    r0.wait_ready(10)
    titles = sorted(c.cmdline()[0] for c in psutil.Process(r1.pid).children())
    assert titles == ["sglang::scheduler_TP2", "sglang::scheduler_TP3"]
    assert http("GET", r1.url + "/health", timeout=1)[0] == 0  # rank 1 serves no HTTP
    r1.terminate()  # only logged on node rank >= 1
    time.sleep(0.5)
    assert r1.proc.alive()
    r0.stop()
    assert r1.proc.wait(10) == 0


def _pd_pair(sims, env=None):
    p = sims(["--disaggregation-mode", "prefill", "--enable-metrics"], env)
    d = sims(["--disaggregation-mode", "decode", "--enable-metrics"], env)
    return p, d


def _pd_send(p, d, room, max_new, out, text="x y z", sides="pd"):
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": p.bootstrap_port, "bootstrap_room": room}
    ts = []
    for h, tag in ((p, "p"), (d, "d")):
        if tag not in sides:
            continue

        def run(h=h, tag=tag):
            out[tag] = http("POST", h.url + "/generate", {**body, "rid": f"r{room}"}, timeout=60)
        t = threading.Thread(target=run)
        t.start()
        ts.append(t)
    return ts


def test_bootstrap_route_protocol(sims):
    p = sims(["--disaggregation-mode", "prefill", "--tp-size", "2"])
    base = f"http://127.0.0.1:{p.bootstrap_port}"
    assert http("GET", base + "/health") == (200, "OK")
    s, info = http("GET", base + "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
    assert s == 200 and info["attn_tp_size"] == 2 and info["pp_size"] == 1
    s, rank = http("GET", base + "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0")
    assert s == 200 and rank["rank_port"] == p.state()["kv_port"]
    assert http("GET", base + "/route")[0] == 400


def test_hung_room_times_out_with_500_on_both_sides(sims):
    p, d = _pd_pair(sims, {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "1.5"})
    p.post("/_sim/faults", {"hang_room": 77})
    out = {}
    t0 = time.monotonic()
    for t in _pd_send(p, d, 77, 4, out):
        t.join(20)
    assert out["d"][0] == 500 and out["p"][0] == 500, out
    assert time.monotonic() - t0 < 6
    assert metric(d, "sglang:num_transfer_failed_reqs_total") == 1
    assert metric(p, "sglang:num_transfer_failed_reqs_total") == 1


def test_prefill_bootstrap_timeout_without_decode(sims):
    p = sims(["--disaggregation-mode", "prefill", "--enable-metrics"], {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "1"})
    t0 = time.monotonic()
    s, body = p.post("/generate", {"text": "a", "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port, "bootstrap_room": 5})
    assert s == 500 and time.monotonic() - t0 < 4
    assert metric(p, "sglang:num_bootstrap_failed_reqs_total") == 1


def test_decode_fails_when_prefill_bootstrap_is_unreachable(sims):
    d = sims(["--disaggregation-mode", "decode"], {"PDOPS_SIM_ROUTE_RETRY_S": "0.1"})
    s, _ = d.post("/generate", {"text": "a", "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 9})
    assert s == 500


@pytest.mark.parametrize("how", ["abort_request", "disconnect"])
def test_decode_abort_releases_the_room_on_the_prefill(sims, how):
    p, d = _pd_pair(sims)
    p.post("/_sim/faults", {"hang_room": 11})  # holds the request in both transfer queues
    out = {}
    if how == "abort_request":
        ts = _pd_send(p, d, 11, 4, out)
    else:
        ts = _pd_send(p, d, 11, 4, {}, sides="p")  # the decode side goes through a socket we drop
        import http.client as httpc, json
        c = httpc.HTTPConnection("127.0.0.1", d.port, timeout=10)
        c.request("POST", "/generate", json.dumps({"text": "x y z", "rid": "r11", "sampling_params": {"max_new_tokens": 4},
                                                   "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port, "bootstrap_room": 11}),
                  {"Content-Type": "application/json"})
    wait_until(lambda: d.get("/v1/loads")[1]["loads"][0]["disaggregation"]["decode_transfer_queue_reqs"] == 1, 15,
               "decode waits for KV")
    wait_until(lambda: p.get("/v1/loads")[1]["loads"][0]["disaggregation"]["prefill_inflight_queue_reqs"] == 1, 5, "prefill holds the room")
    if how == "abort_request":
        assert d.post("/abort_request", {"rid": "r11"})[0] == 200
    else:
        c.sock.close()
        c.close()
    wait_until(lambda: not d.state().get("in_flight", True), 5, "decode released")
    wait_until(lambda: not p.state().get("in_flight", True), 5, "prefill released")
    for t in ts:
        t.join(10)
    if how == "abort_request":
        assert out["d"][0] == 200 and out["d"][1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_unhealthy_after_fault_turns_health_503_for_good(sims):
    h = sims(env={"PDOPS_SIM_FAULTS": "unhealthy_after=1"})  # the start-up wait took the one 200
    assert [h.get("/health")[0] for _ in range(3)] == [503, 503, 503]
    assert h.get("/ready")[0] == 503
    assert h.state()["faults"]["unhealthy_after"] == 1
