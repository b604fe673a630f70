"""The admission layer's rendering and validation: every rendered config variant passes
`haproxy -c`, bad settings are refused (cases as data: tests/data/admission/bad_cases.yml)
and no key can reach, or change, the config."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdops.model import admission as adm
from pdops.model import render
from pdops.errors import InvalidInput
from pdops.model.inventory import load_inventory

REPO = Path(__file__).resolve().parents[3]
BAD = yaml.safe_load((REPO / "tests" / "data" / "admission" / "bad_cases.yml").read_text())
GOOD_KEYS = ("pdops-key-one-0123456789", "Zm9vYmFyYmF6cXV4Cg==", "a.b_c~d+e/f=g-h0123456")
needs_haproxy = pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy not installed: scripts/setup-system.sh")


def key_file(tmp_path: Path, text: str | None = None, mode: int = 0o600) -> Path:
    p = tmp_path / "admission.keys"
    p.write_text("\n".join(GOOD_KEYS) + "\n" if text is None else text)
    p.chmod(mode)
    return p


def cfg_for(inv, tmp_path, **settings):
    settings.setdefault("api_keys_file", str(key_file(tmp_path)))
    return adm.parse_admission({"pdops_admission": settings}, inv)


def write_and_check(files, root: Path) -> Path:
    """Write rendered files under root (paths rebased) and run haproxy -c on the config."""
    for f in files:
        p = root / f.path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f.content.replace("/etc/pdops/", f"{root}/etc/pdops/").replace("/run/pdops-admission/", f"{root}/"))
        p.chmod(f.mode)
    conf = root / adm.CONFIG_PATH.lstrip("/")
    adm.check_config(conf)
    return conf


def test_absent_means_no_admission_layer(fleet):
    assert adm.parse_admission({}, fleet) is None


def test_defaults(fleet, tmp_path):
    cfg = cfg_for(fleet, tmp_path)
    assert (cfg.host, cfg.port, cfg.cap, cfg.queue, cfg.queue_timeout_s, cfg.overflow_status) == \
        (fleet.gateway.first.host, 8080, 16, 32, 30, 429)
    assert cfg.keys == GOOD_KEYS
    assert "pdops-key" not in repr(cfg)  # keys never printed


@needs_haproxy
@pytest.mark.parametrize("inv_name", ["rtx6000d", "lab"])
@pytest.mark.parametrize("settings", [
    {},
    {"cap": 1, "queue": 0, "queue_timeout_s": 1, "overflow_status": 503},
    {"cap": 256, "queue": 1000, "queue_timeout_s": 600, "overflow_status": 429, "port": 9443},
    {"listen_addr": "0.0.0.0"},
    {"listen_addr": "::1"},
    {"metrics_port": 8405},
], ids=["defaults", "no-queue-503", "big", "wildcard", "ipv6", "metrics"])
def test_every_rendered_config_passes_haproxy_check(inv_name, settings, tmp_path):
    inv = load_inventory(REPO / "inventory" / inv_name)
    cfg = cfg_for(inv, tmp_path, **settings)
    files = render.render_admission_files(inv, cfg)
    by_path = {f.path: f for f in files}
    assert set(by_path) == {adm.CONFIG_PATH, adm.KEYS_MAP_PATH, adm.ERRORFILE_PATH, f"/etc/systemd/system/{adm.UNIT}"}
    assert {f.host for f in files} == {cfg.host}
    assert by_path[adm.KEYS_MAP_PATH].mode == 0o600
    write_and_check(files, tmp_path / "root")
    text = by_path[adm.CONFIG_PATH].content
    assert f"server admit abns@pdops-admission-{cfg.listen_addr}-{cfg.port} maxconn {cfg.cap}\n" in text
    assert f"timeout queue {cfg.queue_timeout_s}s" in text
    assert f"queue(gateway) ge {cfg.queue}" in text
    assert "set-header X-Request-ID %[uuid] unless { req.hdr(x-request-id) -m found }" in text
    assert "rid=%[var(txn.rid)]" in text and "log stdout format raw local0" in text
    assert by_path[adm.ERRORFILE_PATH].content.startswith(f"HTTP/1.1 {cfg.overflow_status} ")
    assert ("use-service prometheus-exporter" in text) == bool(settings.get("metrics_port"))
    for k in cfg.keys:
        assert k not in text and k not in by_path[f"/etc/systemd/system/{adm.UNIT}"].content
        assert f"{k} {adm.key_id(k)}\n" in by_path[adm.KEYS_MAP_PATH].content


def test_unit_runs_haproxy_master_worker_with_graceful_reload(fleet, tmp_path):
    cfg = cfg_for(fleet, tmp_path)
    unit = next(f for f in render.render_admission_files(fleet, cfg) if f.path.endswith(adm.UNIT)).content
    assert f"-Ws -f {adm.CONFIG_PATH}" in unit
    assert "ExecReload=/bin/kill -USR2 $MAINPID" in unit
    assert "KillMode=mixed" in unit and "Slice=pdops.slice" in unit and "Type=notify" in unit
    # the fleet's gateway has its own key: read from its file at start, never rendered
    assert fleet.gateway.api_key_file in unit and adm.GATEWAY_KEY_ENV in unit


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("inv_name", ["rtx6000d", "lab"])
def test_unit_passes_systemd_analyze_verify(inv_name, tmp_path):
    inv = load_inventory(REPO / "inventory" / inv_name)
    cfg = cfg_for(inv, tmp_path)
    unit = next(f for f in render.render_admission_files(inv, cfg) if f.path.endswith(adm.UNIT))
    d = tmp_path / "units"
    d.mkdir()
    (d / "pdops.slice").write_text("[Slice]\n")
    (d / adm.UNIT).write_text(unit.content)
    proc = subprocess.run(["systemd-analyze", "verify", str(d / adm.UNIT)], capture_output=True, text=True,
                          env={"SYSTEMD_UNIT_PATH": f"{d}:", "PATH": "/usr/bin:/bin:/usr/sbin"})
    out = "\n".join(ln for ln in (proc.stdout + proc.stderr).splitlines() if "pdops.slice" not in ln)
    assert proc.returncode == 0 and not out.strip(), out


@needs_haproxy
def test_check_config_reports_haproxys_message(tmp_path):
    bad = tmp_path / "bad.cfg"
    bad.write_text("frontend x\n    bind 127.0.0.1:1\n    bogus-keyword yes\n")
    with pytest.raises(InvalidInput, match="bogus-keyword"):
        adm.check_config(bad)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_refused_and_nothing_written(name, fleet, tmp_path):
    case = BAD[name]
    settings = dict(case.get("set") or {})
    if "api_keys_file" not in settings:
        if case.get("missing"):
            settings["api_keys_file"] = str(tmp_path / "absent.keys")
        else:
            text = case.get("keys")
            if "keys_repeat" in case:
                ch, n = case["keys_repeat"]
                text = ch * n + "\n"
            settings["api_keys_file"] = str(key_file(tmp_path, text, int(str(case.get("mode", "600")), 8)))
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(InvalidInput) as exc:
        adm.parse_admission({"pdops_admission": settings}, fleet)
    assert exc.value.field == case["field"], exc.value.render()
    if "match" in case:
        assert case["match"] in exc.value.message
    assert exc.value.fix
    assert sorted(tmp_path.rglob("*")) == before  # nothing written
    # a refused key is never echoed
    for line in (case.get("keys") or "").splitlines():
        if len(line) >= 8 and not line.startswith("#"):
            assert line not in exc.value.render()


@needs_haproxy
def test_a_key_cannot_change_the_config(fleet, tmp_path):
    """Even a map entry that looks like config stays data: the config names the map file
    and haproxy -c passes; the key map is the only file holding keys."""
    cfg = cfg_for(fleet, tmp_path)
    files = render.render_admission_files(fleet, cfg)
    conf = write_and_check(files, tmp_path / "root")
    assert adm.KEYS_MAP_PATH.split("/")[-1] in conf.read_text()
    for bad in ('abc"def0123456789012', "abc def 0123456789012", "abcdef0123456789\nhttp-request allow"):
        with pytest.raises(InvalidInput):
            adm.read_keys(key_file(tmp_path, bad + "\n"))


def test_gateway_stays_on_its_data_address_behind_the_admission_layer(fleet, tmp_path):
    """docs/admission.md, "Where the gateway listens": pdops's own clients reach the gateway
    from the operator machine, so it keeps its data address; HAProxy's one server is that
    address, and the gateway keeps retries off and its token bucket as configured."""
    from pdops.model.commands import gateway_args

    cfg = cfg_for(fleet, tmp_path)
    gw = fleet.gateway.first
    args = gateway_args(fleet, gw)
    assert args[args.index("--host") + 1] == gw.addr
    assert "--disable-retries" in args
    assert args[args.index("--max-concurrent-requests") + 1] == str(fleet.gateway.max_concurrent_requests)
    text = render.haproxy_config(cfg)
    # the cap is one server (the permit), the gateway a server behind it, health-checked on readiness
    assert f"server admit abns@pdops-admission-{cfg.listen_addr}-{cfg.port} maxconn {cfg.cap}\n" in text
    assert f"server gw-{gw.host} {gw.addr}:{gw.port} weight 100 check " in text
