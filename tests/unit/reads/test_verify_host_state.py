"""`inv verify`'s host checks (pdops.reads.verify.host_state) judged from output in the documented formats
(`systemctl show`, `ss -Hltnp`, proc(5) limits, `stat`/`sha256sum`), no host: a healthy host
passes every check, and each fault a user would care about fails the one check that owns it."""

import pytest

from pdops.model.inventory import load_inventory
from pdops.model.placement import Placement, place
from pdops.model.render import manifest as manifest_of
from pdops.model.render import render_files
from pdops.facts import batch_command
from pdops.record.local import StateDir
from pdops.model.topology import parse_topology
from pdops.reads.verify.host_state import ADMISSION_KEYS_SUFFIX, HostPlan, host_command, host_plans, judge, read_facts
from tests.unit.recorded import REPO

ADMISSION_UNIT = "/etc/systemd/system/pdops-admission.service"
ADMISSION_CFG = "/etc/pdops/pdops-admission.cfg"
KEYS_MAP = "/etc/pdops/pdops-admission-keys.map"


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    inv = load_inventory(REPO / "inventory" / "lab")
    pl = place(inv, parse_topology("1p1d"))
    manifest = manifest_of(render_files(inv, pl))
    gw_host = inv.gateway.first.host
    for path in (ADMISSION_UNIT, ADMISSION_CFG, KEYS_MAP):
        manifest[gw_host][path] = {"sha256": "a" * 64, "mode": "0o600"}
    state = StateDir("lab", tmp_path_factory.mktemp("state"))
    rev = state.write_revision(topology="1p1d", inventory_hash=inv.digest, placement=pl.to_dict(), manifest=manifest,
                               outcome="deployed", instances={}, extra={"gateway": inv.gateway.first.url})
    return {p.host: p for p in host_plans(rev)}, pl, inv


def output(plan: HostPlan, pl: Placement, *, unit=None, files=None, cgroup_pids=None, memlock=None, listen=None,
           health="200", binds=None) -> str:
    """What the host's one command prints on a healthy host, with the named parts changed."""
    unit = unit or {}
    show = "".join(
        f"Id={u}\nLoadState=loaded\nActiveState={unit.get(u, {}).get('active', 'active')}\nSubState=running\n"
        f"MainPID={100 + n}\nControlGroup=/pdops.slice/{u}\nNRestarts=0\nResult=success\n"
        f"UnitFileState={unit.get(u, {}).get('enabled', 'enabled')}\nLimitMEMLOCK=infinity\n"
        f"NeedDaemonReload={unit.get(u, {}).get('reload', 'no')}\n\n" for n, u in enumerate(plan.units))
    file_lines = "".join(f"{oct(mode)[2:]} root {sha}  {p}\n" for p, (mode, sha) in
                         {p: (0o600 if p.endswith(".env") or p.endswith(ADMISSION_KEYS_SUFFIX) else 0o644, sha)
                          for p, sha in plan.files.items()}.items()) if files is None else files
    cg = "".join(f"{u} {(cgroup_pids or {}).get(u, str(100 + n))}\n" for n, u in enumerate(plan.engine_units))
    limits = "".join(f"{u} {100 + n} Max locked memory {memlock or 'unlimited unlimited'} bytes\n"
                     for n, u in enumerate(plan.engine_units))
    if listen is None:
        socks = [(a, p) for _, a, p in plan.listeners]
        if plan.gateway_url:
            a, p = plan.gateway_url.split("//", 1)[1].rsplit(":", 1)
            socks.append((a, int(p)))
        socks += binds or []
        listen = "".join(f'LISTEN 0 128 {a}:{p} 0.0.0.0:* users:(("python",pid=4242,fd=7))\n' for a, p in socks)
    sections = {"files": file_lines, "listen": listen}
    if plan.units:
        sections.update(units=show, cgroups=cg, limits=limits)
    if plan.gateway_url:
        sections["health"] = health + "\n"
    if plan.admission_units:
        sections["binds"] = "".join(f"    bind {a}:{p}\n" for a, p in binds or [])
    # the batch protocol frames each section's text; `cat` of a here-doc prints it as a host would
    return _run_batch(sections)


def _run_batch(sections: dict[str, str]) -> str:
    import subprocess

    cmd = batch_command({k: f"printf %s {_q(v)}" for k, v in sections.items()})
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=True).stdout


def _q(s: str) -> str:
    import shlex

    return shlex.quote(s)


def checks(plan, pl, virtual=False, **world):
    return {c.check: c for c in judge(plan, read_facts(output(plan, pl, **world)), virtual=virtual)}


def failed(plan, pl, **world):
    return {n: c.reason for n, c in checks(plan, pl, **world).items() if c.failed}


BIND = [("127.0.10.1", 18080)]


def test_a_healthy_host_passes_every_check(plans):
    by_host, pl, inv = plans
    gw = by_host[inv.gateway.first.host]
    assert gw.gateway_unit and gw.admission_units == ("pdops-admission.service",) and gw.engine_units
    got = checks(gw, pl, binds=BIND)
    assert {n: c.status for n, c in got.items()} == {
        "units": "pass", "cgroup": "pass", "memlock": "pass", "env-0600": "pass", "ports": "pass",
        "gateway": "pass", "admission": "pass"}, {n: c.line() for n, c in got.items()}
    other = next(p for h, p in by_host.items() if h != inv.gateway.first.host)
    assert not other.gateway_unit and not other.admission_units
    assert all(c.status == "pass" for c in checks(other, pl).values())


@pytest.mark.parametrize("world, check, says", [
    ({"unit": "inactive"}, "units", "not running (inactive/running)"),
    ({"unit": "disabled"}, "units", "not enabled (disabled)"),
    ({"unit": "reload"}, "units", "its unit file changed on disk since systemd loaded it"),
    ({"cgroup": True}, "cgroup", "not in its cgroup /pdops.slice/"),
    ({"memlock": "8388608 8388608"}, "memlock", "runs with max locked memory ['8388608', '8388608']"),
    ({"env_mode": 0o644}, "env-0600", ": mode 0o644"),
    ({"env_sha": True}, "env-0600", "differs from the revision"),
    ({"unit_sha": True}, "units", "differs from the revision"),
    ({"no_listen": True}, "ports", "not listening on"),
    ({"wildcard": True}, "ports", "listens on every address (0.0.0.0), not only"),
])
def test_each_fault_fails_the_check_that_owns_it(plans, world, check, says):
    by_host, pl, inv = plans
    plan = by_host[inv.gateway.first.host]
    unit = plan.engine_units[0]
    kw: dict = {"binds": BIND}
    if "unit" in world:
        kw["unit"] = {unit: {"inactive": {"active": "inactive"}, "disabled": {"enabled": "disabled"},
                             "reload": {"reload": "yes"}}[world["unit"]]}
    if "cgroup" in world:
        kw["cgroup_pids"] = {unit: "7 8 9"}
    if "memlock" in world:
        kw["memlock"] = world["memlock"]
    if {"env_mode", "env_sha", "unit_sha"} & set(world):
        env = next(p for p in plan.files if p.endswith(".env"))
        unit_file = f"/etc/systemd/system/{unit}"
        lines = []
        for p, sha in plan.files.items():
            mode = 0o600 if p.endswith(".env") or p.endswith(ADMISSION_KEYS_SUFFIX) else 0o644
            if p == env and "env_mode" in world:
                mode = world["env_mode"]
            if (p == env and "env_sha" in world) or (p == unit_file and "unit_sha" in world):
                sha = "0" * 64
            lines.append(f"{oct(mode)[2:]} root {sha}  {p}\n")
        kw["files"] = "".join(lines)
    if "no_listen" in world or "wildcard" in world:
        iid, addr, port = plan.listeners[0]
        socks = [(a, p) for _, a, p in plan.listeners[1:]] + BIND
        a, p = plan.gateway_url.split("//", 1)[1].rsplit(":", 1)
        socks.append((a, int(p)))
        if "wildcard" in world:
            socks += [(addr, port), ("0.0.0.0", port)]
        kw["listen"] = "".join(f'LISTEN 0 128 {a}:{p} 0.0.0.0:* users:(("python",pid=1,fd=7))\n' for a, p in socks)
    bad = failed(plan, pl, **kw)
    assert list(bad) == [check], bad
    assert says in bad[check], bad


def test_lowered_memlock_on_virtual_hardware_is_skipped_with_its_reason(plans):
    by_host, pl, inv = plans
    plan = by_host[inv.gateway.first.host]
    got = checks(plan, pl, virtual=True, binds=BIND, memlock="8388608 8388608")["memlock"]
    assert got.status == "skipped" and "virtual hardware" in got.reason and "CAP_SYS_RESOURCE" in got.reason


def test_the_gateway_and_admission_checks(plans):
    by_host, pl, inv = plans
    plan = by_host[inv.gateway.first.host]
    assert failed(plan, pl, binds=BIND, health="503") == {"gateway": f"{inv.gateway.first.url}/health answered 503"}
    # the key map: mode and owner, not content (`inv admission.keys` changes it)
    lines = "".join(f"{'644' if p == KEYS_MAP else ('600' if p.endswith('.env') else '644')} root "
                    f"{'f' * 64 if p == KEYS_MAP else sha}  {p}\n" for p, sha in plan.files.items())
    assert failed(plan, pl, binds=BIND, files=lines) == {"admission": f"{KEYS_MAP}: mode 0o644"}
    lines = "".join(f"{'600' if p == KEYS_MAP or p.endswith('.env') else '644'} root "
                    f"{'f' * 64 if p == KEYS_MAP else sha}  {p}\n" for p, sha in plan.files.items())
    assert failed(plan, pl, binds=BIND, files=lines) == {}
    # its bind address not listening (every other socket there): the admission check alone fails
    socks = [(a, p) for _, a, p in plan.listeners] + [tuple(plan.gateway_url.split("//", 1)[1].rsplit(":", 1))]
    listen = "".join(f'LISTEN 0 128 {a}:{p} 0.0.0.0:* users:(("python",pid=1,fd=7))\n' for a, p in socks)
    bad = failed(plan, pl, binds=BIND, listen=listen)
    assert bad == {"admission": "admission bind 127.0.10.1:18080: 18080 not listening on 127.0.10.1"}, bad


@pytest.mark.parametrize("shown", ["*", "[::]", "0.0.0.0"])
def test_an_admission_layer_bound_to_every_address_is_listening(plans, shown):
    """`bind [::]:18080` (dual-stack) is printed by ss as `*:18080`: it serves the bind, so it passes."""
    by_host, pl, inv = plans
    plan = by_host[inv.gateway.first.host]
    addr = "::" if shown != "0.0.0.0" else "0.0.0.0"
    socks = [(a, p) for _, a, p in plan.listeners] + [tuple(plan.gateway_url.split("//", 1)[1].rsplit(":", 1))]
    listen = "".join(f'LISTEN 0 128 {a}:{p} 0.0.0.0:* users:(("python",pid=1,fd=7))\n' for a, p in socks)
    listen += f'LISTEN 0 128 {shown}:18080 *:* users:(("haproxy",pid=2,fd=7))\n'
    assert failed(plan, pl, binds=[(addr, 18080)], listen=listen) == {}


def test_one_command_per_host_quotes_every_path(plans):
    by_host, _, inv = plans
    plan = by_host[inv.gateway.first.host]
    cmd = host_command(plan)
    for section in ("files", "listen", "units", "cgroups", "limits", "health", "binds"):
        assert f"@@PDOPS-SECTION-BEGIN {section}" in cmd
    odd = HostPlan("h", ("u.service",), {"/etc/it's here.env": "a" * 64}, (), None)
    assert "'/etc/it'\"'\"'s here.env'" in host_command(odd)


def test_an_unreadable_section_fails_its_checks_with_the_reason(plans):
    by_host, pl, inv = plans
    plan = by_host[inv.gateway.first.host]
    out = output(plan, pl, binds=BIND).replace("@@PDOPS-SECTION-END units 0", "@@PDOPS-SECTION-END units 1")
    got = {c.check: c for c in judge(plan, read_facts(out), virtual=False)}
    assert got["units"].failed and "units unreadable: exited 1" in got["units"].reason
