import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _loopback_only():
    """No test reaches past loopback (only 127.0.0.0/8 and ::1 may carry test traffic): a connection
    this process opens to any other address fails at once, naming it. The shipped fleet inventory's
    addresses are real hosts' (10.x): a test that plans against it and would contact its record or
    its hosts fails here instead of trying."""
    import errno
    import ipaddress
    import socket

    real = socket.socket.connect, socket.socket.connect_ex

    def refuse(sock, address):
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        host = address[0]
        try:
            addrs = [ipaddress.ip_address(host.split("%", 1)[0])]
        except ValueError:  # a name: what it resolves to
            addrs = [ipaddress.ip_address(a[4][0].split("%", 1)[0]) for a in socket.getaddrinfo(host, None)]
        if not all(a.is_loopback for a in addrs):
            raise OSError(errno.ENETUNREACH, f"tests reach loopback only, not {host} (tests/conftest.py)")

    def connect(sock, address):
        refuse(sock, address)
        return real[0](sock, address)

    def connect_ex(sock, address):
        refuse(sock, address)
        return real[1](sock, address)

    socket.socket.connect, socket.socket.connect_ex = connect, connect_ex


_loopback_only()


def pytest_configure(config):
    """Under pytest-xdist each worker gets a lab of its own: worker gwK uses lab slot K (its own
    addresses, cgroup group and lab dir: pdops.lab.slot), so labs side by side never meet."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker and "PDOPS_INV_LOG" not in os.environ:
        # the run's log of every `inv` a test runs (tests/lab/clusters.py: inv_cmd), read by the report
        # below; set before the xdist workers start, so they inherit it
        art = Path(os.environ.get("PDOPS_TEST_ARTIFACTS") or REPO / "build" / "test-artifacts")
        art.mkdir(parents=True, exist_ok=True)
        log = art / "inv-commands.jsonl"
        log.write_text("")
        os.environ["PDOPS_INV_LOG"] = str(log)
    if worker.startswith("gw") and worker[2:].isdigit() and "PDOPS_LAB_SLOT" not in os.environ:
        os.environ["PDOPS_LAB_SLOT"] = worker[2:]
        if int(worker[2:]) and os.environ.get("PDOPS_LAB_DIR"):
            os.environ["PDOPS_LAB_DIR"] = os.environ["PDOPS_LAB_DIR"].rstrip("/") + worker[2:]


# `make test` hands whole test files to its xdist workers in collection order (--dist loadfile
# --no-loadscope-reorder; xdist's own order is "most tests first", which put the one-test soak last
# and made it the run's tail). Every lab module goes longest first, by its worker-minutes in a fresh
# `make test` (its own report, 2026-12-07, a1da58c), so that the last ones handed out are the short
# ones and the workers end together; a lab module not in the table goes before them all (its length
# is unknown: early, it cannot become the tail). The many short unit files come last and fill the gaps.
LAB_MODULE_MINUTES = {
    "tests/lab/test_real_engine.py": 8.66, "tests/lab/test_change.py": 7.11, "tests/lab/test_soak_lab.py": 6.38,
    "tests/lab/test_repair.py": 5.86, "tests/lab/test_generation_lab.py": 4.36, "tests/lab/test_probe_lab.py": 3.93,
    "tests/lab/test_recovery.py": 3.02, "tests/lab/test_admission_lab.py": 2.92, "tests/lab/test_gateways_lab.py": 2.90,
    "tests/lab/test_record_etcd_lab.py": 2.76, "tests/lab/test_verifiers.py": 2.53, "tests/lab/test_scale.py": 2.25,
    "tests/lab/test_sweep_lab.py": 1.89, "tests/lab/test_gateway_lab.py": 1.71, "tests/lab/test_report_lab.py": 1.58,
    "tests/lab/test_drain.py": 1.44, "tests/lab/test_deploy.py": 1.42, "tests/lab/test_runner_lab.py": 0.96,
    "tests/lab/test_shared_record.py": 0.91, "tests/lab/test_observability_lab.py": 0.70, "tests/lab/test_lab.py": 0.57,
    "tests/lab/test_preflight_lab.py": 0.38,
}
_AREA_ORDER = {"lab": 1, "sim": 2, "integration": 3, "contract": 4, "unit": 5}


def pytest_collection_modifyitems(config, items):
    def rank(item) -> tuple[int, float]:
        path = item.nodeid.split("::", 1)[0]
        area = _area(item.nodeid)
        if area == "lab":
            return 1, -LAB_MODULE_MINUTES.get(path, float("inf"))
        return _AREA_ORDER.get(area, 6), 0.0

    items.sort(key=rank)  # stable: each file keeps its own order


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def fleet():
    from pdops.model.inventory import load_inventory

    return load_inventory(REPO / "inventory" / "rtx6000d")


@pytest.fixture
def lab_inv():
    from pdops.model.inventory import load_inventory

    return load_inventory(REPO / "inventory" / "lab")


@pytest.fixture
def local_record(tmp_path, monkeypatch):
    """`pdops.record.open_record` answering with a shared record whose state host is this machine
    (the real host script, run locally), its state dir and operator dir under tmp_path."""
    import pdops.record as rec
    from pdops.record import HostStore, LocalTransport, SharedRecord

    def open_record(inv, **kw):
        return SharedRecord(inv.cluster, tmp_path / "operator",
                            HostStore(inv.cluster, "localhost", str(tmp_path / "shared"), LocalTransport()), **kw)

    monkeypatch.setattr(rec, "open_record", open_record)
    return open_record


# ---------------------------------------------------------------- where the time goes

AREAS = ("unit", "contract", "integration", "sim", "lab")
_area_seconds: dict[str, float] = {}
_area_tests: dict[str, int] = {}
_lab_module_seconds: dict[str, float] = {}
# worker -> [module, first report, last report] in the order it ran them (seconds since the run began)
_worker_modules: dict[str, list[list]] = {}
_T0 = time.monotonic()


def _area(nodeid: str) -> str:
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def pytest_runtest_logreport(report):
    """Setup, call and teardown of every test, summed by area (a module fixture that boots a
    cluster is charged to the test that first asked for it, as pytest measures it)."""
    area = _area(report.nodeid)
    _area_seconds[area] = _area_seconds.get(area, 0.0) + report.duration
    if area == "lab":
        module = report.nodeid.split("::", 1)[0]
        _lab_module_seconds[module] = _lab_module_seconds.get(module, 0.0) + report.duration
    if report.when == "call":
        _area_tests[area] = _area_tests.get(area, 0) + 1
    node = getattr(report, "node", None)  # under xdist, the worker that ran it
    worker = getattr(getattr(node, "gateway", None), "id", None) or "main"
    module, now = report.nodeid.split("::", 1)[0], time.monotonic() - _T0
    ran = _worker_modules.setdefault(worker, [])
    if ran and ran[-1][0] == module:
        ran[-1][2] = now
    else:
        ran.append([module, max(now - report.duration, 0.0), now])


def pytest_terminal_summary(terminalreporter):
    if not _area_seconds:
        return
    tr = terminalreporter
    tr.section("time per area (setup + call + teardown, summed over the xdist workers)")
    order = [a for a in AREAS if a in _area_seconds] + sorted(set(_area_seconds) - set(AREAS))
    for area in order:
        s = _area_seconds[area]
        tr.write_line(f"{area:<12} {_area_tests.get(area, 0):>5} tests  {s:8.1f} s  ({s / 60:5.1f} min)")
    total = sum(_area_seconds.values())
    tr.write_line(f"{'all':<12} {sum(_area_tests.values()):>5} tests  {total:8.1f} s  ({total / 60:5.1f} min)")
    if _lab_module_seconds:
        tr.section("lab worker-minutes per module (setup + call + teardown; the module's cluster included)")
        for module, sec in sorted(_lab_module_seconds.items(), key=lambda kv: -kv[1]):
            tr.write_line(f"{sec / 60:6.2f} min  {module}")
    _report_inv_commands(tr)
    if len(_worker_modules) > 1:
        # where the run's tail is: each worker's lab modules, and when it finished its last test
        tr.section("each worker's lab modules (start-end, minutes into the run) and its last test")
        for worker, ran in sorted(_worker_modules.items()):
            labs = [f"{m.rsplit('/', 1)[-1].removesuffix('.py')} {a / 60:.1f}-{b / 60:.1f}"
                    for m, a, b in ran if _area(m + "::") == "lab"]
            tr.write_line(f"{worker}: done at {ran[-1][2] / 60:.1f}; " + ", ".join(labs))


def _report_inv_commands(tr) -> None:
    """The `inv` commands the tests ran as an operator would, summed by task: how many, their wall
    time and their CPU (theirs and their children's: ssh, Ansible), most wall time first."""
    import json

    path = os.environ.get("PDOPS_INV_LOG")
    lines = Path(path).read_text().splitlines() if path and Path(path).exists() else []
    if not lines:
        return
    by_task: dict[str, list[float]] = {}
    for line in lines:
        d = json.loads(line)
        t = by_task.setdefault(d["task"], [0, 0.0, 0.0])
        t[0] += 1
        t[1] += d["wall_s"]
        t[2] += d["cpu_s"]
    tr.section(f"`inv` commands run by the tests, by task (wall and CPU minutes; log: {path})")
    for task, (n, wall, cpu) in sorted(by_task.items(), key=lambda kv: -kv[1][1]):
        tr.write_line(f"{task:<22} {n:>4} runs  wall {wall / 60:6.2f} min  CPU {cpu / 60:6.2f} min")
    n, wall, cpu = (sum(t[i] for t in by_task.values()) for i in range(3))
    tr.write_line(f"{'all':<22} {n:>4} runs  wall {wall / 60:6.2f} min  CPU {cpu / 60:6.2f} min")
