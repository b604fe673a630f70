import json
import stat

from pdops.model.placement import place
from pdops.model.render import engine_args, engine_env, gateway_args, render_files, write_build
from pdops.model.topology import parse_topology


def _files(inv, topo):
    pl = place(inv, parse_topology(topo))
    return pl, {(f.host, f.path): f for f in render_files(inv, pl)}


def test_engine_flags_bind_the_data_address_and_use_full_names(fleet):
    pl = place(fleet, parse_topology("8p4d"))
    p = pl.get("p01")
    args = engine_args(fleet, pl, p, p.head)
    assert args[args.index("--host") + 1] == "10.30.0.11"  # data network, never 127.0.0.1
    assert "--enable-metrics" in args and "--tp-size" in args and "--tp" not in args and "--pp" not in args
    assert args[args.index("--disaggregation-bootstrap-port") + 1] == "8998"
    ib = json.loads(args[args.index("--disaggregation-ib-device") + 1])
    assert ib == {str(g): ("mlx5_0" if g < 4 else "mlx5_1") for g in range(8)}
    d = pl.get("d01")
    assert "--disaggregation-bootstrap-port" not in engine_args(fleet, pl, d, d.head)


def test_candidate_bundle_is_rendered(fleet):
    pl = place(fleet, parse_topology("1p1d"))
    args = engine_args(fleet, pl, pl.get("d01"), pl.get("d01").head)
    for flag, val in (("--chunked-prefill-size", "8192"), ("--mem-fraction-static", "0.5"),
                      ("--context-length", "524288"), ("--max-running-requests", "4")):
        assert args[args.index(flag) + 1] == val
    assert fleet.profile.bundle["status"] == "candidate"


def test_transport_env_comes_from_the_inventory(fleet):
    pl = place(fleet, parse_topology("1p1d"))
    p = pl.get("p01")
    env = engine_env(fleet, p, p.head)
    assert env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    assert env["NCCL_SOCKET_IFNAME"] == "ens1f0np0,ens1f1np1"
    assert env["GLOO_SOCKET_IFNAME"] == "ens1f0np0"
    assert env["NCCL_IB_GID_INDEX"] == env["MC_GID_INDEX"] == "3"
    assert env["MOONCAKE_PROTOCOL"] == "rdma" and env["SGLANG_HOST_IP"] == "10.30.0.11"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"


def test_units_carry_the_stop_and_limit_settings(fleet):
    _, files = _files(fleet, "2p1d")
    unit = files[("gpu01", "/etc/systemd/system/pdops-p01.service")].content
    for line in ("KillMode=mixed", "LimitMEMLOCK=infinity", "Slice=pdops.slice", "Restart=on-failure",
                 "EnvironmentFile=/etc/pdops/pdops-p01.env", "ExecStart=/opt/pdops/bin/pdops-p01.sh",
                 f"TimeoutStopSec={fleet.stop_timeout_s}"):
        assert line in unit.splitlines()
    assert fleet.stop_timeout_s > fleet.drain_budget_s
    assert files[("gpu01", "/etc/pdops/pdops-p01.env")].mode == 0o600
    script = files[("gpu01", "/opt/pdops/bin/pdops-p01.sh")].content
    assert script.splitlines()[-1].startswith("exec /opt/pdops/venv/bin/python -m sglang.launch_server --model-path")
    assert "'{\"0\":\"mlx5_0\"" in script  # JSON map shell-quoted


def test_lab_renders_the_sim_with_the_same_arguments(lab_inv, fleet):
    _, files = _files(lab_inv, "1p1d")
    script = files[("lab01", "/opt/pdops/bin/pdops-p01.sh")].content.splitlines()[-1]
    assert " -m pdops.sim --model-path " in script
    pl = place(lab_inv, parse_topology("1p1d"))
    assert script.endswith(" ".join(engine_args(lab_inv, pl, pl.get("p01"), pl.get("p01").head)[-3:]))


def test_gateway_has_no_static_workers_and_no_retries(fleet):
    args = gateway_args(fleet, fleet.gateway.first)
    assert args[:2] == ["launch", "--pd-disaggregation"]
    assert "--disable-retries" in args
    assert "--prefill" not in args and "--decode" not in args and "--worker-urls" not in args
    assert args[args.index("--prometheus-port") + 1] == "29000"
    _, files = _files(fleet, "1p1d")
    script = files[("gpu01", "/opt/pdops/bin/pdops-gateway.sh")].content
    assert "key=$(cat /etc/pdops/gateway.key)" in script and '--api-key "$key"' in script


def test_build_folder_and_manifest(fleet, tmp_path):
    pl = place(fleet, parse_topology("12p4d"))
    files = render_files(fleet, pl)
    out = write_build(files, tmp_path / "b", {"topology": "12p4d"})
    doc = json.loads((out / "manifest.json").read_text())
    assert set(doc["files"]) == {f"gpu{n:02d}" for n in range(1, 17)}
    env = out / "gpu03" / "etc" / "pdops" / "pdops-p03.env"
    assert stat.S_IMODE(env.stat().st_mode) == 0o600
    import hashlib
    assert doc["files"]["gpu03"]["/etc/pdops/pdops-p03.env"]["sha256"] == hashlib.sha256(env.read_bytes()).hexdigest()


def test_unchanged_instances_render_identical_files(fleet):
    a = {(f.host, f.path): f.sha256 for f in render_files(fleet, place(fleet, parse_topology("8p4d")))}
    old = place(fleet, parse_topology("8p4d"))
    b = {(f.host, f.path): f.sha256 for f in render_files(fleet, place(fleet, parse_topology("10p4d"), old))}
    assert all(b[k] == v for k, v in a.items())
