"""Evidence: two smg gateways kept in step by pdops (design A) or smg's own mesh (design B).

Issue #34 item 1. Runs on loopback only, no lab: one pdops.sim prefill and one sim decode (PD),
and real smg 1.13 gateways (`.venv-gateway/bin/smg launch --pd-disaggregation`, as pdops renders it)
on free ports. It observes and prints, each wait bounded (printed "not observed within N s"):

  1. mesh start: two gateways with `--enable-mesh --mesh-server-name --mesh-host --mesh-port
     --mesh-peer-urls`, each naming the other; do they start and peer?
  2. P and D registered through gateway 1 only (POST /workers): does gateway 2 list them, after how
     long, and does a /generate through gateway 2 succeed?
  3. DELETE D through gateway 1: how long until gateway 2 stops routing to it / listing it?
     3b. DELETE through gateway 2 of a worker gateway 1 registered (an import there).
  5. (run before 4, with P) POST /workers on gateway 2 of the URL gateway 1 registered: conflict?
     duplicate?
  4. SIGKILL gateway 1 (engines alive): do gateway 2's copies of its workers stay, go, still route
     (watched up to 90 s)? Then gateway 1 restarted with no registration: does it get them back from
     the mesh, does gateway 2 list them again, can the restarted gateway 1 remove them?
  6. design A: two plain smg (no mesh), POST /workers on each: time until both list both ready;
     DELETE on each: time until neither lists it.

It is an evidence script, not a test: whatever happens it prints the findings and exits 0.
Raw observations go to tests/data/facts/smg_mesh_1.13.json (--out to change, --no-save to skip).
Usage: .venv/bin/python bench/gateway_mesh.py [--wait 30] [--out PATH] [--no-save]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdops.sim.testing import Proc, free_port, http, spawn, start_sim  # noqa: E402

SMG = REPO / ".venv-gateway" / "bin" / "smg"
HOST = "127.0.0.1"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
GEN_BODY = {"text": "hello mesh", "sampling_params": {"max_new_tokens": 2}}
# Ports the lab tests use: never take one of them.
LAB_PORTS = [range(29000, 31001), range(8998, 9101), range(20000, 21001)]

FACTS: dict = {"smg_version": None, "findings": {}, "design_b_mesh": {}, "design_a_independent": {}}
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.2f}s] {msg}", flush=True)


def port() -> int:
    while True:
        p = free_port(HOST)
        if not any(p in r for r in LAB_PORTS):
            return p


def log_tail(proc: Proc, n: int = 25) -> list[str]:
    return [ANSI.sub("", line) for line in proc.log().splitlines()[-n:]]


def log_grep(proc: Proc, pattern: str, n: int = 12) -> list[str]:
    rx = re.compile(pattern)
    lines = [ANSI.sub("", line) for line in proc.log().splitlines()]
    return [line[-400:] for line in lines if rx.search(line)][-n:]


class Gateway:
    """One smg in PD mode as pdops renders it, optionally with the mesh enabled."""

    def __init__(self, name: str, *, mesh_port: int | None = None, peers: tuple[int, ...] = (),
                 http_port: int | None = None):
        self.name = name
        self.port = http_port or port()
        self.prom = port()
        self.mesh_port = mesh_port
        self.cmd = [str(SMG), "launch", "--pd-disaggregation", "--host", HOST, "--port", str(self.port),
                    "--prometheus-host", HOST, "--prometheus-port", str(self.prom), "--disable-retries",
                    "--health-check-interval-secs", "1", "--worker-startup-check-interval", "2"]
        if mesh_port is not None:
            self.cmd += ["--enable-mesh", "--mesh-server-name", name, "--mesh-host", HOST,
                         "--mesh-port", str(mesh_port)]
            if peers:
                self.cmd += ["--mesh-peer-urls", *[f"{HOST}:{p}" for p in peers]]
        self.proc: Proc | None = None
        self.started_at = 0.0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.proc = spawn(self.cmd, {"NO_COLOR": "1"}, f"mesh-{self.name}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def wait_up(self, timeout: float) -> float | None:
        def up():
            if not self.alive():
                return "exited"
            return http("GET", self.url + "/health", timeout=2)[0] in (200, 503) or None

        t, v = poll(up, timeout, 0.05)
        return None if v == "exited" else t

    def workers(self) -> list[dict] | None:
        s, r = http("GET", self.url + "/workers", timeout=3)
        if s != 200 or not isinstance(r, dict):
            return None
        return r.get("workers", [])

    def brief(self) -> list[dict]:
        return [{k: w.get(k) for k in ("id", "url", "worker_type", "status", "is_healthy")}
                for w in (self.workers() or [])]

    def entries(self, url: str) -> list[dict]:
        return [w for w in (self.workers() or []) if w.get("url") == url]

    def ready(self, url: str) -> bool:
        return any(w.get("status") == "ready" and w.get("is_healthy") for w in self.entries(url))

    def add(self, url: str, worker_type: str, bootstrap_port: int | None = None):
        body = {"url": url, "worker_type": worker_type}
        if bootstrap_port is not None:
            body["bootstrap_port"] = bootstrap_port
        return http("POST", self.url + "/workers", body, timeout=10)

    def delete(self, worker_id: str):
        return http("DELETE", f"{self.url}/workers/{worker_id}", timeout=10)

    def generate(self) -> int:
        return http("POST", self.url + "/generate", GEN_BODY, timeout=5)[0]

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill_all()

    def exit_info(self) -> dict:
        rc = None if self.proc is None else self.proc.popen.poll()
        return {"alive": self.alive(), "exit_status": rc, "log_tail": log_tail(self.proc) if self.proc else []}


def poll(pred, timeout: float, interval: float = 0.05):
    """(seconds until pred() is truthy, its value) or (None, last value) after timeout."""
    t0 = time.monotonic()
    v = None
    while True:
        v = pred()
        if v:
            return round(time.monotonic() - t0, 3), v
        if time.monotonic() - t0 > timeout:
            return None, v
        time.sleep(interval)


def poll_since(t0: float, pred, timeout: float, interval: float = 0.05):
    """Like poll, but the time is counted from ``t0`` (an earlier monotonic instant)."""
    t, v = poll(pred, timeout, interval)
    return (None if t is None else round(time.monotonic() - t0, 3)), v


def fmt(t: float | None, wait: float) -> str:
    return f"{t:.2f} s" if t is not None else f"not observed within {wait:.0f} s"


def finding(key: str, text: str) -> None:
    FACTS["findings"][key] = text
    say(f"FINDING {key}: {text}")


ABSENT = "absent"


def trace(gws, roles: dict, t0: float, done, timeout: float, gen_on=None, interval: float = 0.02) -> list:
    """Sample the gateways' /workers (and /generate through ``gen_on``) until ``done(events)`` or timeout.

    Returns the changes seen: [seconds since t0, gateway, role, state], state being the listed status
    (ABSENT when not listed) or, for role "gen", the HTTP status of a /generate.
    """
    last: dict = {}
    ev: list = []
    end = time.monotonic() + timeout
    while True:
        for g in gws:
            ws = g.workers()
            for role, url in roles.items():
                st = ABSENT if ws is not None and not any(w.get("url") == url for w in ws) else \
                    next((w.get("status") for w in (ws or []) if w.get("url") == url), "no-answer")
                if last.get((g.name, role)) != st:
                    last[(g.name, role)] = st
                    ev.append([round(time.monotonic() - t0, 3), g.name, role, st])
        if gen_on is not None:
            c = gen_on.generate()
            if last.get((gen_on.name, "gen")) != c:
                last[(gen_on.name, "gen")] = c
                ev.append([round(time.monotonic() - t0, 3), gen_on.name, "gen", c])
        if done(ev) or time.monotonic() > end:
            return ev
        time.sleep(interval)


def first(ev, gw, role, state):
    return next((t for t, g, r, s in ev if g == gw and r == role and s == state), None)


def first_listed(ev, gw, role):
    return next((t for t, g, r, s in ev if g == gw and r == role and s not in (ABSENT, "no-answer")), None)


def first_not(ev, gw, role, state):
    """First time ``gw`` shows ``role`` in a state other than ``state``."""
    return next((t for t, g, r, s in ev if g == gw and r == role and s != state), None)


def first_after(ev, gw, role, state, after):
    """First time ``gw`` shows ``state`` for ``role`` after it has shown ``after``."""
    seen = False
    for t, g, r, s in ev:
        if g == gw and r == role:
            if s == after:
                seen = True
            elif seen and s == state:
                return t
    return None


def states(ev, gw, role):
    return [s for _, g, r, s in ev if g == gw and r == role]


def worker_id(gw: Gateway, url: str) -> str | None:
    e = gw.entries(url)
    return e[0]["id"] if e else None


# --------------------------------------------------------------------------------------------
# design B: the mesh
# --------------------------------------------------------------------------------------------

def mesh_part(P, D, wait: float, started: list) -> None:
    B = FACTS["design_b_mesh"]
    m1, m2 = port(), port()
    g1 = Gateway("gw1", mesh_port=m1, peers=(m2,))
    g2 = Gateway("gw2", mesh_port=m2, peers=(m1,))
    started += [g1, g2]
    flags = ("--enable-mesh --mesh-server-name <name> --mesh-host 127.0.0.1 --mesh-port <port> "
             "--mesh-peer-urls <host:port of the other gateway(s)>")
    B["flags"] = flags
    B["cmd_gw1"] = g1.cmd[1:]
    B["cmd_gw2"] = g2.cmd[1:]

    # ---- 1. start ----------------------------------------------------------------------------
    say("1. starting two smg with the mesh enabled, each peered with the other")
    g1.start()
    g2.start()
    up1, up2 = g1.wait_up(wait), g2.wait_up(wait)

    def peered():
        a = log_grep(g1.proc, r"Successfully connected to peer gw2")
        b = log_grep(g2.proc, r"Successfully connected to peer gw1")
        return bool(a and b)

    t_peer, _ = poll(peered, wait, 0.1)
    B["start"] = {"gw1_health_s": up1, "gw2_health_s": up2, "peered_s_after_health": t_peer,
                  "gw1_mesh_log": log_grep(g1.proc, r"(?i)mesh|peer|gossip", 8),
                  "gw2_mesh_log": log_grep(g2.proc, r"(?i)mesh|peer|gossip", 8),
                  "mesh_http_status": http("GET", g1.url + "/mesh/status", timeout=3)[0]}
    if up1 is None or up2 is None:
        B["start"]["gw1"] = g1.exit_info()
        B["start"]["gw2"] = g2.exit_info()
        finding("1_start", f"mesh gateways did not start: gw1 {g1.exit_info()['exit_status']}, "
                           f"gw2 {g2.exit_info()['exit_status']}; log tails in the JSON")
        for g in (g1, g2):
            for line in log_tail(g.proc, 15):
                print(f"    {g.name}| {line}")
        return
    finding("1_start", f"both start (/health after {up1:.2f} s / {up2:.2f} s); peered (log 'Successfully "
                       f"connected to peer') {fmt(t_peer, wait)} later; flags: {flags}; no /mesh/status HTTP "
                       f"endpoint (GET answers {B['start']['mesh_http_status']})")

    # ---- 2. register on gw1 only -------------------------------------------------------------
    roles = {"P": P.url, "D": D.url}
    say("2. POST /workers of P and D on gw1 only; tracing both gateways' listings and /generate via gw2")
    t_reg = time.monotonic()
    posts = [list(g1.add(P.url, "prefill", P.bootstrap_port)), list(g1.add(D.url, "decode"))]
    ev = trace([g1, g2], roles, t_reg, lambda e: first(e, "gw2", "gen", 200) is not None, wait, gen_on=g2)
    r2 = {"note": "times from the first POST on gw1", "posts": posts, "events": ev,
          "gw1_P_ready_s": first(ev, "gw1", "P", "ready"), "gw1_D_ready_s": first(ev, "gw1", "D", "ready"),
          "gw2_P_listed_s": first_listed(ev, "gw2", "P"), "gw2_D_listed_s": first_listed(ev, "gw2", "D"),
          "gw2_P_ready_s": first(ev, "gw2", "P", "ready"), "gw2_D_ready_s": first(ev, "gw2", "D", "ready"),
          "gw2_generate_200_s": first(ev, "gw2", "gen", 200),
          "gw1_workers": g1.brief(), "gw2_workers": g2.brief()}
    r2["same_ids_on_both"] = sorted(w["id"] for w in r2["gw1_workers"]) == sorted(w["id"] for w in r2["gw2_workers"])
    B["register_gw1"] = r2
    finding("2_gossip_register",
            f"from the POSTs on gw1 (both {posts[0][0]}/{posts[1][0]}): gw1 lists P/D ready at "
            f"{fmt(r2['gw1_P_ready_s'], wait)}/{fmt(r2['gw1_D_ready_s'], wait)}; gw2 lists them at "
            f"{fmt(r2['gw2_P_listed_s'], wait)}/{fmt(r2['gw2_D_listed_s'], wait)} (ready "
            f"{fmt(r2['gw2_P_ready_s'], wait)}/{fmt(r2['gw2_D_ready_s'], wait)}); first /generate 200 via gw2 at "
            f"{fmt(r2['gw2_generate_200_s'], wait)}; same worker ids on both: {r2['same_ids_on_both']}")
    if r2["gw2_D_listed_s"] is None:
        say("gw2 never got gw1's workers: the later mesh steps are skipped")
        B["gw1_log_tail"], B["gw2_log_tail"] = log_tail(g1.proc), log_tail(g2.proc)
        return None

    # ---- 3. DELETE D on gw1, then again POST on gw1: 3 rounds ----------------------------------
    say("3. DELETE D on gw1 (3 rounds, D re-POSTed on gw1 between them); tracing both and /generate via gw2")
    rounds = []
    for i in range(3):
        d_id = worker_id(g1, D.url)
        t_del = time.monotonic()
        dres = g1.delete(d_id)
        ev = trace([g1, g2], {"D": D.url}, t_del,
                   lambda e: first(e, "gw1", "D", ABSENT) is not None and first(e, "gw2", "D", ABSENT) is not None,
                   wait, gen_on=g2)
        gen = [(t, c) for t, g, r, c in ev if r == "gen"]
        rd = {"delete": list(dres), "events": ev,
              "gw1_D_not_ready_s": first_not(ev, "gw1", "D", "ready"), "gw2_D_not_ready_s": first_not(ev, "gw2", "D", "ready"),
              "gw1_D_states": states(ev, "gw1", "D"), "gw2_D_states": states(ev, "gw2", "D"),
              "gw1_D_unlisted_s": first(ev, "gw1", "D", ABSENT), "gw2_D_unlisted_s": first(ev, "gw2", "D", ABSENT),
              "gw2_generate_first_non200_s": next((t for t, c in gen if c != 200), None)}
        t_re = time.monotonic()
        rpost = g1.add(D.url, "decode")
        ev2 = trace([g1, g2], {"D": D.url}, t_re,
                    lambda e: first(e, "gw1", "D", "ready") is not None and first(e, "gw2", "D", "ready") is not None,
                    wait)
        rd.update({"repost": list(rpost), "repost_events": ev2, "repost_gw1_ready_s": first(ev2, "gw1", "D", "ready"),
                   "repost_gw2_ready_s": first(ev2, "gw2", "D", "ready")})
        rounds.append(rd)
        say(f"   round {i + 1}: DELETE {dres[0]}; D not ready gw1 {fmt(rd['gw1_D_not_ready_s'], wait)} "
            f"{rd['gw1_D_states']}, gw2 {fmt(rd['gw2_D_not_ready_s'], wait)} {rd['gw2_D_states']}; /generate via "
            f"gw2 first non-200 {fmt(rd['gw2_generate_first_non200_s'], wait)}; unlisted gw1 "
            f"{fmt(rd['gw1_D_unlisted_s'], wait)} gw2 {fmt(rd['gw2_D_unlisted_s'], wait)}; re-POST on gw1: ready "
            f"gw1 {fmt(rd['repost_gw1_ready_s'], wait)} gw2 {fmt(rd['repost_gw2_ready_s'], wait)}")
        time.sleep(0.5)
    B["delete_gw1_rounds"] = rounds

    def rng(key):
        v = [r[key] for r in rounds if r[key] is not None]
        miss = len(rounds) - len(v)
        return (f"{min(v):.2f}-{max(v):.2f} s" if v else "never") + (f" ({miss} not observed)" if miss else "")

    finding("3_gossip_delete",
            f"3 rounds, DELETE on gw1 answered {[r['delete'][0] for r in rounds]}: gw1 stops routing (status "
            f"{rounds[0]['gw1_D_states'][:2]}) at {rng('gw1_D_not_ready_s')}; gw2 goes {rounds[0]['gw2_D_states'][:2]} "
            f"at {rng('gw2_D_not_ready_s')}, /generate via gw2 still routed to D until then (first non-200 at "
            f"{rng('gw2_generate_first_non200_s')}); unlisted gw1 {rng('gw1_D_unlisted_s')}, gw2 "
            f"{rng('gw2_D_unlisted_s')}; re-POST on gw1 to gw2 ready: {rng('repost_gw2_ready_s')}")

    # ---- 3b. DELETE on gw2 of an import ------------------------------------------------------
    say("3b. DELETE on gw2 of D, which gw1 registered (an import on gw2)")
    d_id2 = worker_id(g2, D.url)
    t_b = time.monotonic()
    r3b = g2.delete(d_id2) if d_id2 else (0, "not listed")
    long_wait = max(wait, 40.0)  # > smg's 30 s store/registry reconcile interval
    ev = trace([g1, g2], {"D": D.url}, t_b,
               lambda e: first(e, "gw2", "D", ABSENT) is not None and first_after(e, "gw2", "D", "ready", ABSENT)
               is not None, long_wait)
    r = {"id_on_gw2": d_id2, "delete_response": list(r3b), "events": ev,
         "gw2_D_unlisted_s": first(ev, "gw2", "D", ABSENT), "gw2_D_back_ready_s": first_after(ev, "gw2", "D", "ready", ABSENT),
         "gw1_D_states": states(ev, "gw1", "D"), "gw1_workers_end": g1.brief(), "gw2_workers_end": g2.brief()}
    B["delete_import_on_gw2"] = r
    finding("3b_delete_import",
            f"DELETE on gw2 of gw1's decode answered {r3b[0]} ({str(r3b[1])[:90]!r}); gw2 unlists it at "
            f"{fmt(r['gw2_D_unlisted_s'], long_wait)} while gw1 keeps it {r['gw1_D_states']}; gw2 lists it ready "
            f"again by itself at {fmt(r['gw2_D_back_ready_s'], long_wait)} (the owner's key was never tombstoned)")
    if not (g1.ready(D.url) and g2.ready(D.url)):
        if not g1.entries(D.url):
            g1.add(D.url, "decode")
        t_fix, _ = poll(lambda: g2.ready(D.url) and g1.ready(D.url), wait)
        B["delete_import_on_gw2"]["restored_both_ready_s"] = t_fix
        say(f"D restored on both: {fmt(t_fix, wait)}")

    # ---- 5. same URL registered on gw2 -------------------------------------------------------
    say("5. POST /workers on gw2 of P, already registered through gw1")
    before = {"gw1": len(g1.entries(P.url)), "gw2": len(g2.entries(P.url))}
    r5 = g2.add(P.url, "prefill", P.bootstrap_port)
    time.sleep(min(5.0, wait))
    after = {"gw1": g1.entries(P.url), "gw2": g2.entries(P.url)}
    B["same_url_on_gw2"] = {"entries_before": before, "post_response": list(r5),
                            "entries_after_5s": {k: [{x: w.get(x) for x in ("id", "status", "is_healthy")}
                                                     for w in v] for k, v in after.items()},
                            "gw2_generate_after": g2.generate()}
    finding("5_same_url",
            f"POST of P's URL on gw2 answered {r5[0]} {str(r5[1])[:160]!r}; entries for that URL after 5 s: "
            f"gw1 {len(after['gw1'])}, gw2 {len(after['gw2'])} (before: {before['gw1']}/{before['gw2']}); ids "
            f"gw1 {[w['id'][-6:] for w in after['gw1']]} gw2 {[w['id'][-6:] for w in after['gw2']]}")

    # ---- 4. SIGKILL gw1 ----------------------------------------------------------------------
    say("4. SIGKILL gw1; watching gw2's copy of D (registered through gw1 only)")
    g1.kill()
    t_kill = time.monotonic()
    down_rx = r'name: "gw1"[^}]*status: (Suspected|Down)'
    observe_s = max(wait, 90.0)  # well past smg's 30 s store/registry reconcile interval
    ev = trace([g2], {"P": P.url, "D": D.url}, t_kill,
               lambda e: first(e, "gw2", "P", ABSENT) is not None and first(e, "gw2", "D", ABSENT) is not None,
               observe_s, gen_on=g2, interval=0.25)
    m = re.search(r"(\d\d:\d\d:\d\d)", (log_grep(g2.proc, down_rx, 10**6) or [""])[0])
    gossip = log_grep(g2.proc, down_rx, 10**6)[:1]
    r = {"observed_up_to_s": observe_s, "events": ev, "gw2_P_unlisted_s": first(ev, "gw2", "P", ABSENT),
         "gw2_D_unlisted_s": first(ev, "gw2", "D", ABSENT), "gw2_D_states": states(ev, "gw2", "D"),
         "gw2_generate_codes": states(ev, "gw2", "gen"), "gw2_first_log_gw1_down": gossip,
         "kill_wallclock": time.strftime("%H:%M:%S", time.localtime(time.time() - (time.monotonic() - t_kill))),
         "gw2_workers_end": g2.brief()}
    r["gw2_generate_200_until_s"] = first_not(ev, "gw2", "gen", 200)
    B["sigkill_gw1"] = r
    finding("4_sigkill",
            f"after SIGKILL of gw1 (P and D alive), gw2 logs gw1 Down at {m.group(1) if m else '?'} (kill at "
            f"{r['kill_wallclock']}); gw2's copies of gw1's workers stay 'ready' and routed (/generate via gw2 "
            f"{r['gw2_generate_codes']}, first non-200 at {fmt(r['gw2_generate_200_until_s'], observe_s)}), then are "
            f"REMOVED although healthy: P unlisted at {fmt(r['gw2_P_unlisted_s'], observe_s)}, D at "
            f"{fmt(r['gw2_D_unlisted_s'], observe_s)} after the kill")
    FACTS["_restart_D"] = True  # the caller restarts D on the same port
    return g1, g2


def mesh_restart_part(g1_old: Gateway, g2: Gateway, D, wait: float, started: list) -> None:
    B = FACTS["design_b_mesh"]
    say("4b. restart gw1 (same name, mesh port, HTTP port), no registration: does it get the workers back?")
    g1 = Gateway("gw1", mesh_port=g1_old.mesh_port, peers=(g2.mesh_port,), http_port=g1_old.port)
    started.append(g1)
    g1.start()
    up = g1.wait_up(wait)
    if up is None:
        B["restart_gw1"] = {"started": False, **g1.exit_info()}
        finding("4b_restart", f"restarted gw1 did not start: {g1.exit_info()['exit_status']}")
        return
    long_wait = max(wait, 40.0)
    ts = g1.started_at
    t_listed, _ = poll_since(ts, lambda: g1.entries(D.url), long_wait, 0.1)
    t_ready, _ = poll_since(ts, lambda: g1.ready(D.url), long_wait, 0.1)
    t_gen, _ = poll_since(ts, lambda: g1.generate() == 200, wait, 0.1)
    B["restart_gw1"] = {"note": "times from the restarted process's start", "health_s": up, "D_listed_s": t_listed,
                        "D_ready_s": t_ready, "generate_200_s": t_gen, "gw1_workers": g1.brief(),
                        "gw2_workers": g2.brief()}
    finding("4b_restart",
            f"gw1 restarted with no registration (times from its start): /health {up:.2f} s; lists D at "
            f"{fmt(t_listed, long_wait)}, ready at {fmt(t_ready, long_wait)}; /generate via gw1 200 at "
            f"{fmt(t_gen, wait)}; gw1 lists {[(w['worker_type'], w['status']) for w in g1.brief()]}")

    say("   does gw2 list them again once gw1 is back?")
    ev = trace([g2], {"D": D.url}, ts, lambda e: first(e, "gw2", "D", "ready") is not None, long_wait, interval=0.25)
    B["restart_gw1"]["gw2_events"] = ev
    B["restart_gw1"]["gw2_D_ready_s"] = first(ev, "gw2", "D", "ready")
    finding("4b2_gw2_after_restart",
            f"gw2 lists D ready again at {fmt(B['restart_gw1']['gw2_D_ready_s'], long_wait)} from gw1's restart "
            f"(states {states(ev, 'gw2', 'D')}); gw2 lists {[(w['worker_type'], w['status']) for w in g2.brief()]}")

    # Can the restarted gw1 (same name) remove the worker its previous life registered?
    d_id = worker_id(g1, D.url)
    gw2_had = bool(g2.entries(D.url))
    if d_id:
        t_d = time.monotonic()
        r = g1.delete(d_id)
        t1, _ = poll_since(t_d, lambda: not g1.entries(D.url), 15)
        t2, _ = poll_since(t_d, lambda: not g2.entries(D.url), 15)
        B["restart_gw1"]["delete_after_restart"] = {"response": list(r), "gw1_unlisted_s": t1, "gw2_unlisted_s": t2,
                                                    "gw1_workers_end": g1.brief(), "gw2_workers_end": g2.brief()}
        finding("4d_delete_after_restart",
                f"DELETE of D on the restarted gw1 answered {r[0]} {str(r[1])[:120]!r}; gw1 unlists it "
                f"{fmt(t1, 15)}, gw2 {fmt(t2, 15) if gw2_had else 'did not list it before'}")


# --------------------------------------------------------------------------------------------
# design A: independent gateways kept in step by pdops
# --------------------------------------------------------------------------------------------

def independent_part(P, D, wait: float, started: list) -> None:
    A = FACTS["design_a_independent"]
    say("6. design A: two plain smg (no mesh), POST /workers on each")
    ga, gb = Gateway("plain1"), Gateway("plain2")
    started += [ga, gb]
    ga.start()
    gb.start()
    ua, ub = ga.wait_up(wait), gb.wait_up(wait)
    if ua is None or ub is None:
        A["start"] = {"plain1": ga.exit_info(), "plain2": gb.exit_info()}
        finding("6_independent", "plain gateways did not start (log tails in the JSON)")
        return
    roles = {"P": P.url, "D": D.url}
    both = lambda e, st: all(first(e, g.name, r, st) is not None for g in (ga, gb) for r in roles)  # noqa: E731
    t0 = time.monotonic()
    posts = {}
    for g in (ga, gb):  # one after the other, as pdops's registration step goes gateway after gateway
        posts[g.name] = [g.add(P.url, "prefill", P.bootstrap_port)[0], g.add(D.url, "decode")[0]]
    t_posts = round(time.monotonic() - t0, 3)
    ev = trace([ga, gb], roles, t0, lambda e: both(e, "ready"), wait)
    t_both = max((first(ev, g.name, r, "ready") or 1e9) for g in (ga, gb) for r in roles)
    t_both = None if t_both >= 1e9 else t_both
    gens = {g.name: g.generate() for g in (ga, gb)}
    rounds = []
    for i in range(3):
        d_ids = {g.name: worker_id(g, D.url) for g in (ga, gb)}
        t1 = time.monotonic()
        dels = {g.name: g.delete(d_ids[g.name])[0] for g in (ga, gb)}
        t_dels = round(time.monotonic() - t1, 3)
        evd = trace([ga, gb], {"D": D.url}, t1, lambda e: all(first(e, g.name, "D", ABSENT) is not None
                                                               for g in (ga, gb)), wait)
        not_ready = [first_not(evd, g.name, "D", "ready") for g in (ga, gb)]
        unlisted = [first(evd, g.name, "D", ABSENT) for g in (ga, gb)]
        t2 = time.monotonic()
        rp = {g.name: g.add(D.url, "decode")[0] for g in (ga, gb)}
        evr = trace([ga, gb], {"D": D.url}, t2, lambda e: all(first(e, g.name, "D", "ready") is not None
                                                               for g in (ga, gb)), wait)
        ready = [first(evr, g.name, "D", "ready") for g in (ga, gb)]
        rounds.append({"deletes": dels, "deletes_s": t_dels, "events": evd, "states": states(evd, ga.name, "D"),
                       "neither_routes_s": None if None in not_ready else max(not_ready),
                       "neither_lists_s": None if None in unlisted else max(unlisted),
                       "reposts": rp, "repost_events": evr, "both_ready_s": None if None in ready else max(ready)})
        time.sleep(0.5)
    A.update({"post_codes": posts, "posts_s": t_posts, "register_events": ev, "both_ready_s_from_first_post": t_both,
              "generate": gens, "delete_rounds": rounds,
              "plain1_workers_end": ga.brief(), "plain2_workers_end": gb.brief()})

    def rng(key):
        v = [r[key] for r in rounds if r[key] is not None]
        return (f"{min(v):.3f}-{max(v):.3f} s" if v else "never") + \
            (f" ({len(rounds) - len(v)} not observed)" if len(v) < len(rounds) else "")

    finding("6_independent",
            f"4 POSTs (2 per gateway) took {t_posts:.3f} s; both gateways list P and D ready {fmt(t_both, wait)} "
            f"from the first POST; /generate {gens}; 3 rounds of DELETE on both: neither routes to D at "
            f"{rng('neither_routes_s')} (states {rounds[0]['states']}), neither lists it at {rng('neither_lists_s')}; "
            f"re-POST on both to both ready: {rng('both_ready_s')}")
    for g in (ga, gb):
        g.kill()


# --------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wait", type=float, default=30.0, help="bound of every wait, seconds")
    ap.add_argument("--out", default=str(REPO / "tests" / "data" / "facts" / "smg_mesh_1.13.json"))
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    started: list[Gateway] = []
    sims = []
    env = {"PDOPS_SIM_SHUTDOWN_POLL_S": "0.2"}
    try:
        ver = spawn([str(SMG), "--version"], None, "smg-version")
        ver.wait(20)
        FACTS["smg_version"] = ANSI.sub("", ver.log()).strip()[-200:]
        ver.kill_all()
        say(f"smg: {FACTS['smg_version']}")
        P = start_sim(["--disaggregation-mode", "prefill"], env)
        sims.append(P)
        D = start_sim(["--disaggregation-mode", "decode"], env)
        sims.append(D)
        FACTS["engines"] = {"prefill": P.url, "prefill_bootstrap_port": P.bootstrap_port, "decode": D.url}
        try:
            res = mesh_part(P, D, a.wait, started)
            if res:
                g1, g2 = res
                mesh_restart_part(g1, g2, D, a.wait, started)
        except Exception:  # noqa: BLE001 - evidence script: record and go on
            FACTS["design_b_mesh"]["error"] = traceback.format_exc()[-2000:]
            say("mesh part failed:\n" + traceback.format_exc())
        for g in started:
            if g.proc is not None:
                FACTS["design_b_mesh" if g.mesh_port else "design_a_independent"].setdefault(
                    "final_log_tails", {})[g.name] = log_tail(g.proc, 12)
                g.kill()
        try:
            if not D.proc.alive():
                D = start_sim(list(D.args), env)
                sims.append(D)
            independent_part(P, D, a.wait, started)
        except Exception:  # noqa: BLE001
            FACTS["design_a_independent"]["error"] = traceback.format_exc()[-2000:]
            say("independent part failed:\n" + traceback.format_exc())
    except Exception:  # noqa: BLE001
        FACTS["error"] = traceback.format_exc()[-2000:]
        say("failed:\n" + traceback.format_exc())
    finally:
        for g in started:
            g.kill()
        for s in sims:
            s.stop()
    FACTS.pop("_restart_D", None)
    print("\n== findings ==")
    for k, v in FACTS["findings"].items():
        print(f"{k}: {v}")
    if not a.no_save:
        Path(a.out).write_text(json.dumps(FACTS, indent=1) + "\n")
        print(f"raw observations: {a.out}")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.exit(main())
