"""Helpers for lab tests that deploy clusters: a derived inventory per test cluster (own
state dir, optional profile and changes), the CLI as a user runs it, a clean slate, and
`deployed`, the one recipe of a module's test cluster."""

from __future__ import annotations

import re

import contextlib
import json
import os
import resource
import urllib.parse
import urllib.request
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import yaml
from pdops.remote.hosts import http_json
from pdops.model.inventory import single_file_doc
from pdops.lab import own_record
from pdops.sim.testing import wait_until

REPO = Path(__file__).resolve().parents[2]


def api_keys_file(path: Path, key: str) -> Path:
    """The front door's API keys file, one key, mode 0600 before the key is written (as an operator keeps
    it: outside the inventory dir)."""
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(key + "\n")
    return path


def two_gateways_behind_haproxy(gateways: Sequence[str], port: int, keys: Path, *, fence_hold_s: float | None = None):
    """The lab's front-door shape, as an inventory mutation for `derived_inventory` and `deployed`: smg on
    each of `gateways`, HAProxy on the first with the API keys in `keys`, 16 requests at once and 16
    queued (60 s, then 429); `fence_hold_s`: a fenced change's hold at each shift."""
    def mutate(doc):
        v = doc["all"]["vars"]
        v["pdops_gateway"].pop("host", None)
        v["pdops_gateway"]["hosts"] = list(gateways)
        v["pdops_admission"] = {"host": gateways[0], "port": port, "cap": 16, "queue": 16, "queue_timeout_s": 60,
                                "overflow_status": 429, "api_keys_file": str(keys)}
        if fence_hold_s is not None:
            v["pdops_fence_hold_s"] = fence_hold_s
    return mutate


def derived_inventory(lab, where: Path, *, mutate=None, profile: dict | None = None) -> Path:
    """A copy of the lab's inventory with its own record (a state dir of its own on the gateway
    host, and an operator dir of its own here), and an optional change.
    `profile` updates the lab-sim profile (e.g. {"env": {"PDOPS_SIM_DECODE_STEP_MS": "50"}})."""
    doc = single_file_doc(Path(lab.inventory))
    where.mkdir(parents=True, exist_ok=True)
    own_record(doc, where)
    if profile is not None:
        base = yaml.safe_load((REPO / "pdops" / "profiles" / "lab-sim.yml").read_text())
        base.update(profile)
        (where / "profiles").mkdir(exist_ok=True)
        (where / "profiles" / "p.yml").write_text(yaml.safe_dump(base))
        doc["all"]["vars"]["pdops_profile"] = "profiles/p.yml"
    if mutate:
        mutate(doc)
    (where / "hosts.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return where


class _Fresh:
    """The shared record, read afresh from the state host at every use (a SharedRecord keeps one
    snapshot per process, as one pdops command needs; a test reads before and after commands)."""

    def __init__(self, inv_dir: Path):
        self.inv_dir = inv_dir

    def __getattr__(self, name):
        from pdops.record import open_record
        from pdops.model.inventory import load_inventory

        return getattr(open_record(load_inventory(self.inv_dir)), name)


def record(inv_dir: Path):
    """The cluster's shared record as pdops reads it (over SSH, from the state host)."""
    return _Fresh(inv_dir)


def sshd(lab, host: str, verb: str) -> None:
    """Stop or start a lab host's sshd from outside it (nsenter into the host's systemd).
    Stopping also ends the live sessions (children of that sshd, by PID): the SSH connections
    to the host drop as they would when its network goes away."""
    import psutil

    from pdops import lab as lab_api

    outer = psutil.Process({s.name: s.pid for s in lab_api.status()}[host])
    init = next(p for p in [outer, *outer.children(recursive=True)]
                if p.name() == "systemd" and "--system" in p.cmdline())
    sessions = []
    if verb == "stop":
        listener = next(p for p in init.children(recursive=True)
                        if p.name() == "sshd" and "listener" in " ".join(p.cmdline()))
        sessions = listener.children(recursive=True)
    subprocess.run(["nsenter", "-t", str(init.pid), "-m", "-p", "-r", "-w", "--", "systemctl", verb,
                    lab_api.SSHD_UNIT], check=True, capture_output=True, timeout=30)
    for p in sessions:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    if verb == "start":
        _wait_ssh_banner(lab.address(host), 30)


def _wait_ssh_banner(addr: str, timeout: float) -> None:
    """Until sshd on `addr` answers with its banner: `systemctl start` can return before a
    simple-type sshd listens, and the next command would find the port closed."""
    import socket

    def banner() -> bool:
        try:
            with socket.create_connection((addr, 22), timeout=2) as s:
                return s.recv(64).startswith(b"SSH-")
        except OSError:
            return False

    wait_until(banner, timeout, f"sshd on {addr} to answer after its start")


def inv_cmd(*args, timeout=600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `inv <args>` from the repository, as an operator would (`env`: added to the environment).
    Its wall and CPU time (its own and its children's: ssh, Ansible) go to the run's command log,
    which the end-of-run report sums by task (tests/conftest.py)."""
    t0, cpu0 = time.monotonic(), _children_cpu()
    try:
        return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    finally:
        log_command(args, time.monotonic() - t0, _children_cpu() - cpu0)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def log_command(args: Sequence[str], wall_s: float, cpu_s: float) -> None:
    """One line in the run's command log ($PDOPS_INV_LOG, set by tests/conftest.py; none: not logged):
    the task (its first word that is not an option), its wall and CPU seconds, and the test."""
    path = os.environ.get("PDOPS_INV_LOG")
    if not path:
        return
    task = next((a for a in args if not a.startswith("-")), "?")
    line = {"task": task, "wall_s": round(wall_s, 2), "cpu_s": round(cpu_s, 2),
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}
    with open(path, "a") as f:  # one short write per line: the workers' lines do not interleave
        f.write(json.dumps(line) + "\n")


def cli(inv_dir: Path, *args, timeout=600) -> subprocess.CompletedProcess:
    """`inv <args> -i <inv_dir>`, as an operator runs it against one test cluster."""
    return inv_cmd(*args, "-i", str(inv_dir), timeout=timeout)


def host_run(lab, host: str, cmd: str) -> str:
    """`cmd` on lab host `host` as root; its stdout (a failure is not raised: the caller reads the output)."""
    c = lab.connection(host)
    try:
        return c.run(cmd, hide=True, warn=True).stdout
    finally:
        c.close()


def stop_all(lab) -> None:
    """A clean slate between test clusters: stop and disable every pdops unit on every lab host, by
    unit name. Disabled too: an earlier cluster's unit left enabled would start by itself at the next
    boot the real way (`lab.up --boot enabled`), a ghost on the ports of the cluster under test."""
    for name, _ in lab.hosts:
        c = lab.connection(name)
        units = c.run("{ systemctl list-units --all --plain --no-legend 'pdops-*'; "
                      "systemctl list-unit-files --plain --no-legend 'pdops-*'; } | awk '{print $1}' | sort -u",
                      hide=True, warn=True).stdout.split()
        if units:
            names = " ".join(units)
            c.run(f"systemctl disable --now {names} 2>/dev/null; systemctl stop {names}; "
                  f"systemctl reset-failed {names} 2>/dev/null", hide=True, warn=True)
        c.close()


class Deployed(NamedTuple):
    inv_dir: Path
    proc: subprocess.CompletedProcess | None  # the deploy's (None when nothing was deployed)


@contextlib.contextmanager
def deployed(lab, where: Path, topology: str | None, *, profile: dict | None = None, mutate=None,
             args: Sequence[str] = (), env: dict | None = None) -> Iterator[Deployed]:
    """One test cluster on a clean slate, for a module fixture: every lab host up, every pdops unit
    stopped, an inventory derived at `where` (`profile`, `mutate`: as `derived_inventory`), then
    `inv deploy --topology <topology> <args>` as an operator runs it (`env`: added to its
    environment), which must exit 0 (else the failure shows its stdout and stderr).
    Yields `Deployed(inv_dir, proc)`; `topology` None derives the inventory only (proc None), for
    tests that deploy themselves. On leaving, even by a failure, every pdops unit is stopped."""
    lab.ensure_up()
    stop_all(lab)
    try:
        inv_dir = derived_inventory(lab, where, mutate=mutate, profile=profile)
        proc = None
        if topology is not None:
            proc = inv_cmd("deploy", "--topology", topology, *args, "-i", str(inv_dir), env=env)
            assert proc.returncode == 0, proc.stdout + proc.stderr
        yield Deployed(inv_dir, proc)
    finally:
        stop_all(lab)


@contextlib.contextmanager
def running_prometheus(inv_dir: Path, root: Path, port: int) -> Iterator[str]:
    """Debian's Prometheus on 127.0.0.1:`port`, scraping the cluster of `inv_dir` every second from the
    file_sd targets pdops wrote (its publish-targets step) with pdops's rules loaded; yields its URL once
    /-/ready answers 200, and stops it by its PID on leaving."""
    from pdops.model.inventory import load_inventory
    from pdops.ops import prometheus as obs
    from pdops.steps import targets as tg

    inv = load_inventory(inv_dir)
    targets_file = tg.local_targets_path(inv)
    (root / "rules.yml").write_text(obs.rules_text(inv))
    job = obs.scrape_config(inv, str(targets_file))["scrape_configs"][0]
    job["file_sd_configs"][0]["refresh_interval"] = "1s"
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
           "rule_files": [str(root / "rules.yml")], "scrape_configs": [job]}
    (root / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    base = f"http://127.0.0.1:{port}"
    log = open(root / "prometheus.log", "w")
    proc = subprocess.Popen(["prometheus", f"--config.file={root / 'prometheus.yml'}",
                             f"--storage.tsdb.path={root / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_until(ready, 60, "prometheus ready")
        yield base
    finally:
        proc.terminate()  # by its PID: the process this helper started
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def prometheus_api(base: str, path: str, **params):
    """One Prometheus HTTP API call; its `data` (the call must have succeeded)."""
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        doc = json.loads(r.read())
    assert doc["status"] == "success", doc
    return doc["data"]


# The busy loop of cpu_hog: in slices of 0.25 s, it spins on its core while the rest of the machine leaves
# more than half a core idle, and sleeps while the rest keeps it busy already (`make test`'s other
# workers: a busy loop then only takes CPU from the suite, it adds no contention the test lacks).
HOG = """
import os, time
n, SLICE = os.cpu_count() or 1, 0.25
def busy_total():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)
b0, t0, me0, spin = *busy_total(), time.process_time(), True
while True:
    end = time.monotonic() + SLICE
    if spin:
        while time.monotonic() < end:
            pass
    else:
        time.sleep(SLICE)
    b1, t1 = busy_total()
    me1 = time.process_time()
    if t1 > t0:
        others = n * (b1 - b0) / (t1 - t0) - (me1 - me0) / SLICE  # cores the rest of the machine kept busy
        spin = others < n - 0.5
    b0, t0, me0 = b1, t1, me1
"""


@contextlib.contextmanager
def cpu_hog():
    """A busy loop on one core for the test's length, while the rest of the machine does not keep its CPUs
    busy already (HOG); it ends itself after 10 minutes at most."""
    p = subprocess.Popen(["timeout", "600", "taskset", "-c", "0", sys.executable, "-c", HOG])
    try:
        yield p
    finally:
        p.terminate()
        p.wait(timeout=10)


class Load:
    """Requests through the gateway (every other one streamed) in small batches until stopped; every
    request is counted in its ledger row. Three in flight at every moment, 64 tokens each: on the sim
    about 10 requests a second (8 tokens each made ~64 a second for a third of a core, 32 ~20 for a
    fifth, of a suite that keeps both cores busy: the loop's cost is per request), and each request
    spans more of an operation, so a drain or a restart meets requests in flight more often."""

    def __init__(self, url: str, headers: dict | None = None, *, prefix: str = "scale-load", requests: int = 6,
                 concurrency: int = 3, max_new_tokens: int = 64, distinct_prompts: bool = False,
                 stream_every: int = 2):
        self.url = url
        # distinct prompts: a cache-aware policy spreads them over the workers instead of keeping one
        self.prompt_for = None
        if distinct_prompts:
            from pdops.model.prompts import make_prompt

            self.prompt_for = lambda i: make_prompt(20, i + 1000 * len(self.rows))
        self.headers = headers
        self.prefix, self.batch = prefix, {"requests": requests, "concurrency": concurrency,
                                           "max_new_tokens": max_new_tokens, "stream_every": stream_every}
        self.rows = []
        self._stop = threading.Event()
        self._error = None
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        from pdops.remote.loadgen import send

        n = 0
        try:
            while not self._stop.is_set():
                rows = send(self.url, **self.batch, rid_prefix=f"{self.prefix}-{n}", timeout=60,
                            headers=self.headers, prompt_for=self.prompt_for)
                self.rows += rows
                n += 1
                if not any(r.ok or r.first_token is not None for r in rows):
                    # nothing answered at all (a gateway or host down): a closed loop would resend at once,
                    # a thousand requests a second that only burn the CPU the recovery needs; 0.2 s apart
                    self._stop.wait(0.2)
        except Exception as exc:  # noqa: BLE001 - reported by stop()
            self._error = exc

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(timeout=120)

    def refused(self) -> list:
        """Requests turned away before anything was served: the connection refused, or an HTTP 503
        with no token (the gateway restarting, or not yet routing to its workers)."""
        # a gateway exiting for its restart may also reset a connection it had just accepted
        # (ECONNRESET, nothing sent back): turned away too, as long as no engine received the request
        turned_away = ("connect call failed", "cannot connect", "can not write request body", "refused",
                       "server disconnected", "connection reset by peer")
        return [r for r in self.rows if not r.ok and r.first_token is None and
                (r.http_status == 503 or (r.http_status is None and
                                          any(t in str(r.error or "").lower() for t in turned_away)))]

    def assert_clean(self, at_least: int = 6, *, allow_refused: bool = False, received: set[str] | None = None):
        """Every request sent got its whole answer (none lost), each request ID once (none replayed).
        `allow_refused`: requests turned away before anything was served are counted, not failures;
        `received` (the request IDs the engines' logs show): one of those is not "turned away"."""
        assert self._error is None, self._error
        refused = {r.rid for r in self.refused()} if allow_refused else set()
        if received is not None:
            reached = refused & received
            assert not reached, f"cut after an engine received them: {sorted(reached)}"
        bad = [r.to_dict() for r in self.rows if not r.ok and r.rid not in refused]
        assert not bad, bad[:3]
        assert len(self.rows) >= at_least
        rids = [r.rid for r in self.rows]
        assert len(rids) == len(set(rids))


def main_pids(inv_dir: Path) -> dict[str, int]:
    """Each instance's MainPID, as `inv status --json` reads it (the status must be 0)."""
    proc = cli(inv_dir, "status", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {r["instance"]: r["units"][0]["main_pid"] for r in json.loads(proc.stdout)["instances"]}


def set_bundle(inv_dir: Path, **bundle) -> None:
    """The bundle of the test cluster's profile (profiles/p.yml) updated with `bundle`."""
    p = inv_dir / "profiles" / "p.yml"
    prof = yaml.safe_load(p.read_text())
    prof["bundle"].update(bundle)
    p.write_text(yaml.safe_dump(prof))


def waited(pred, timeout: float, what: str) -> float:
    """wait_until `pred`; the seconds it took (how long a recovery lasted, say)."""
    t0 = time.monotonic()
    wait_until(pred, timeout, what)
    return time.monotonic() - t0


def queue(url: str, name: str = "running") -> int:
    """One queue of an engine, summed over its ranks, as `inv status` reads it (0 when it does not answer)."""
    from pdops.facts import engine as engine_facts

    try:
        s, doc = http_json("GET", f"{url}{engine_facts.LOADS_PATH}", timeout=5)
    except Exception:  # noqa: BLE001 - restarting
        return 0
    return int(engine_facts.parse_loads(doc).total(name) or 0) if s == 200 else 0


def received_rids(inv_dir: Path, rids: set[str]) -> set[str]:
    """Which of `rids` an engine of the cluster received, by its request log in the journal (every
    invocation of every instance unit any revision names)."""
    from pdops.facts import requestlog
    from pdops.remote.hosts import HostPool
    from pdops.model.inventory import load_inventory
    from pdops.model.placement import Placement

    if not rids:
        return set()
    inv = load_inventory(inv_dir)
    st = record(inv_dir)
    units = set()
    for n in st.revision_numbers():
        rev = st.read_revision(n)
        units |= {(h, u) for i in Placement.from_dict(rev.placement).instances for h, u in i.units}
    seen: set[str] = set()
    with HostPool(inv) as pool:
        for h, u in sorted(units):
            seen |= set(requestlog.parse(pool.run(h, requestlog.command(u), timeout=60).stdout).received)
    return seen & rids


_NUMBERED = re.compile(r"^\s+(?:[RA])?\d+\. (.+?) — ")


def assert_journal_walks_the_printed_plan(state, kind: str, out: str, walk_plans: set[str] = frozenset()) -> list[str]:
    """What an operation printed before it ran (its steps, rescue and always steps, and every plan
    a walk-plan step walks, printed under it) is what its journal shows: the journalled step ids
    of its newest operation of `kind`, in order, are among those printed, in that order; each
    walk-plan step (`walk_plans`) is journalled, and the plan record lists the ids it walks.
    Returns the journalled ids."""
    printed = [m.group(1) for m in map(_NUMBERED.match, out.splitlines()) if m]
    j = state.journal()
    op = [o for o in j.operations() if o.startswith(kind + "-")][-1]
    recs = [r for r in j.read(op) if not r["step"].startswith("lock.")]
    assert recs[0]["step"] == "plan", recs[0]
    if walk_plans:
        assert set(recs[0]["evidence"]["walks"]) == set(walk_plans), recs[0]
    journalled = [r["step"] for r in recs[1:] if r["step"] not in ("probe-result", "verdict")]
    assert set(walk_plans) <= set(journalled), journalled
    i = 0
    for sid in (s for s in journalled if s not in walk_plans):
        while i < len(printed) and printed[i] != sid:
            i += 1
        assert i < len(printed), (sid, journalled, printed)  # journalled, but not printed in this order
        i += 1
    return journalled


def never_twice(lab, inv_dir: Path, prefix: str) -> None:
    """Each request ID starting with `prefix` reached each engine any revision names at most once
    (its request log in the journal, every invocation): none replayed."""
    import json
    from collections import Counter

    from pdops.model.placement import Placement

    st = record(inv_dir)
    units = {(h, u) for n in st.revision_numbers()
             for i in Placement.from_dict(st.read_revision(n).placement).instances for h, u in i.units[:1]}
    for host, unit in sorted(units):
        c = lab.connection(host)
        try:
            out = c.run(f"journalctl -u {unit} -o cat --no-pager", hide=True, warn=True).stdout
        finally:
            c.close()
        n: Counter = Counter()
        for line in out.splitlines():
            if '"request.received"' in line:
                n[json.loads(line[line.find("{"):])["rid"]] += 1
        twice = {rid: k for rid, k in n.items() if rid.startswith(prefix) and k > 1}
        assert not twice, f"{host}:{unit} received these request IDs more than once: {twice}"
