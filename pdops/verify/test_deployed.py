"""testinfra suite: the deployed state of the current revision, checked on every host.

Run by `inv verify` (and the lab tests) as
  pytest pdops/verify/test_deployed.py --hosts=ansible://gpu_hosts --ansible-inventory=INV
with PDOPS_VERIFY_REVISION pointing at the current revision.json.
"""

import json
import os

import pytest

REVISION = json.loads(open(os.environ["PDOPS_VERIFY_REVISION"]).read())
WILDCARD_OK = os.environ.get("PDOPS_VERIFY_ALLOW_WILDCARD") == "1"
VIRTUAL = os.environ.get("PDOPS_VERIFY_VIRTUAL") == "1"


def _units(hostname):
    """(unit, instance) pairs the current revision places on this host."""
    out = []
    for iid, inst in REVISION["instances"].items():
        for host, unit in inst["units"]:
            if host == hostname:
                out.append((unit, iid))
    return out


def _instances(hostname):
    out = []
    for inst in REVISION["placement"]["instances"]:
        for rank in inst["ranks"]:
            if rank["host"] == hostname:
                out.append((inst, rank))
    return out


@pytest.fixture
def name(host):
    return host.backend.get_hostname()


def test_units_active_enabled_and_as_rendered(host, name):
    manifest = REVISION["manifest"].get(name, {})
    for unit, _ in _units(name):
        svc = host.service(unit)
        assert svc.is_running, f"{unit} not running"
        assert svc.is_enabled, f"{unit} not enabled"
        path = f"/etc/systemd/system/{unit}"
        assert host.file(path).sha256sum == manifest[path]["sha256"], f"{path} differs from the revision"


def test_mainpid_inside_the_units_cgroup(host, name):
    for unit, _ in _units(name):
        props = dict(line.split("=", 1) for line in host.check_output(
            f"systemctl show -p MainPID -p ControlGroup {unit}").splitlines())
        pid, cg = int(props["MainPID"]), props["ControlGroup"]
        assert pid > 0, f"{unit} has no MainPID"
        candidates = [f"/sys/fs/cgroup{cg}/cgroup.procs", f"/sys/fs/cgroup/unified{cg}/cgroup.procs",
                      f"/sys/fs/cgroup/systemd{cg}/cgroup.procs"]
        procs = set()
        for c in candidates:
            f = host.file(c)
            if f.exists:
                procs |= {int(x) for x in f.content_string.split()}
        assert pid in procs, f"{unit}: MainPID {pid} not in {cg}"


def test_running_processes_use_the_revisions_files(host, name):
    """Each unit's MainPID carries the config id of the files the revision rendered for it
    (its launch script notes "<PID> <PDOPS_CONFIG>" in /run/pdops/<unit>/config before it execs):
    files changed on disk under a process that did not restart, or a process started from other
    files, fail here."""
    configs = REVISION.get("extra", {}).get("configs")
    if configs is None:
        pytest.skip("this revision was recorded before pdops recorded what each process runs")
    mine = {k.split(":", 1)[1]: v for k, v in configs.items() if k.split(":", 1)[0] == name}
    for unit, want in sorted(mine.items()):
        pid = int(host.check_output(f"systemctl show -p MainPID --value {unit}").strip() or 0)
        assert pid > 0, f"{unit} has no MainPID"
        note = host.file(f"/run/pdops/{unit.removesuffix('.service')}/config")
        parts = note.content_string.split() if note.exists else []
        got = parts[1] if len(parts) >= 2 and parts[0] == str(pid) else None
        assert got == want, (f"{unit} (MainPID {pid}) was started from files {got or 'without a config id'}, the "
                             f"revision's are {want}: the files on disk changed under a process that was not restarted")
        reload = host.check_output(f"systemctl show -p NeedDaemonReload --value {unit}").strip()
        assert reload == "no", f"{unit}: its unit file changed on disk since systemd loaded it"


def test_env_files_are_0600(host, name):
    for path, meta in REVISION["manifest"].get(name, {}).items():
        if path.endswith(".env"):
            f = host.file(path)
            assert f.exists and f.mode == 0o600, f"{path} mode {oct(f.mode) if f.exists else 'missing'}"
            assert f.sha256sum == meta["sha256"]


def test_ports_listen_on_the_data_address(host, name):
    for inst, rank in _instances(name):
        ports = [inst["http_port"]] + ([inst["bootstrap_port"]] if inst["bootstrap_port"] and rank["node_rank"] == 0 else [])
        if rank["node_rank"] != 0:
            continue  # ranks >= 1 serve no HTTP
        for port in ports:
            assert host.socket(f"tcp://{rank['data_addr']}:{port}").is_listening, f"{inst['id']}: {port} not listening"
            if not WILDCARD_OK:
                assert not host.socket(f"tcp://0.0.0.0:{port}").is_listening, f"{inst['id']}: {port} on 0.0.0.0"


GATEWAY_UNIT_PATH = "/etc/systemd/system/pdops-gateway.service"
# The admission layer (HAProxy in front of the gateway, docs/design/architecture.md): any rendered unit named so.
ADMISSION_UNIT_PREFIXES = ("pdops-admission", "haproxy")


def _memlock_of(host, pid):
    """The soft and hard 'Max locked memory' of a running process (proc(5), /proc/<pid>/limits)."""
    for line in host.file(f"/proc/{pid}/limits").content_string.splitlines():
        if line.startswith("Max locked memory"):
            return line.split()[3:5]
    return None


def test_engine_units_run_with_memlock_unlimited(host, name):
    """LimitMEMLOCK=infinity in the unit as systemd loaded it, and in the running process itself."""
    for unit, _ in _units(name):
        props = dict(line.split("=", 1) for line in host.check_output(
            f"systemctl show -p LimitMEMLOCK -p MainPID {unit}").splitlines())
        assert props["LimitMEMLOCK"] == "infinity", f"{unit}: LimitMEMLOCK={props['LimitMEMLOCK']}"
        pid = int(props["MainPID"])
        assert pid > 0, f"{unit} has no MainPID"
        if _memlock_of(host, pid) != ["unlimited", "unlimited"] and VIRTUAL:
            pytest.skip(f"virtual hardware: {unit} runs with max locked memory {_memlock_of(host, pid)} "
                        "(the lab sandbox lacks CAP_SYS_RESOURCE); the unit itself asks for infinity")
        assert _memlock_of(host, pid) == ["unlimited", "unlimited"], \
            f"{unit}: MainPID {pid} runs with max locked memory {_memlock_of(host, pid)}"


def _gateway_host(hostname):
    return GATEWAY_UNIT_PATH in REVISION["manifest"].get(hostname, {})


def test_gateway_up_and_healthy(host, name):
    if not _gateway_host(name):
        return  # the gateway runs on one host only
    unit = GATEWAY_UNIT_PATH.rsplit("/", 1)[1]
    svc = host.service(unit)
    assert svc.is_running and svc.is_enabled, f"{unit} not running/enabled"
    assert host.file(GATEWAY_UNIT_PATH).sha256sum == REVISION["manifest"][name][GATEWAY_UNIT_PATH]["sha256"]
    url = REVISION.get("extra", {}).get("gateway")
    assert url, "the revision records no gateway URL"
    addr, port = url.split("//", 1)[1].rsplit(":", 1)
    assert host.socket(f"tcp://{addr}:{port}").is_listening, f"gateway not listening on {addr}:{port}"
    code = host.check_output(
        "python3 -c " + "'import sys, urllib.request; "
        "print(urllib.request.urlopen(sys.argv[1], timeout=5).status)' " + f"{url}/health")
    assert code.strip() == "200", f"{url}/health answered {code}"


def test_admission_layer_up(host, name):
    units = [p.rsplit("/", 1)[1] for p in REVISION["manifest"].get(name, {})
             if p.startswith("/etc/systemd/system/") and p.rsplit("/", 1)[1].startswith(ADMISSION_UNIT_PREFIXES)]
    if not units:
        if _gateway_host(name):
            pytest.skip("this revision renders no admission unit (pdops-admission*.service / haproxy*) on the gateway host")
        return
    manifest = REVISION["manifest"][name]
    for unit in units:
        svc = host.service(unit)
        assert svc.is_running and svc.is_enabled, f"admission layer {unit} not running/enabled"
        path = f"/etc/systemd/system/{unit}"
        assert host.file(path).sha256sum == manifest[path]["sha256"], f"{path} differs"
    # The config as rendered; the key map 0600 root (its content changes with `inv admission.keys`).
    for path, meta in manifest.items():
        if path.endswith("/pdops-admission.cfg"):
            f = host.file(path)
            assert f.exists and f.sha256sum == meta["sha256"], f"{path} differs from the revision"
            binds = [ln.split()[1] for ln in f.content_string.splitlines() if ln.strip().startswith("bind ")]
            assert binds, f"{path} has no bind line"
            for b in binds:
                addr, port = b.rsplit(":", 1)
                assert host.socket(f"tcp://{addr.strip('[]')}:{port}").is_listening, f"admission not listening on {b}"
        if path.endswith("/pdops-admission-keys.map"):
            f = host.file(path)
            assert f.exists and f.mode == 0o600 and f.user == "root", \
                f"{path}: mode {oct(f.mode) if f.exists else 'missing'}, owner {f.user if f.exists else '-'}"
