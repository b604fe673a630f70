import json
import stat

from pdops.model.placement import place
from pdops.model.commands import engine_args, engine_env, gateway_args
from pdops.model.render import render_files, write_build
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


def _lab_doc(engine: str, profile: str, virtual: bool = True):
    from pathlib import Path

    from pdops.model.inventory import single_file_doc

    doc = single_file_doc(Path(__file__).resolve().parents[3] / "inventory" / "lab")
    doc["all"]["vars"].update({"pdops_engine": engine, "pdops_profile": profile, "pdops_virtual_hardware": virtual,
                               "pdops_engine_python": "/usr/bin/python3"})
    return doc


def _load(doc, tmp_path):
    import yaml

    from pdops.model.inventory import load_inventory

    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(doc))
    return load_inventory(tmp_path)


def test_the_cpu_profile_renders_real_sglang_with_only_its_device_differences(tmp_path):
    """The lab's real-engine profile (docs/lab.md): the same renderer, with --device cpu, each engine's own
    ports (the lab's hosts share one network namespace), the decode's cpu_tensor backup, and the lab's
    stand-ins on PYTHONPATH; the plan says so."""
    from pdops.model.build import format_placement
    from pdops.model.commands import CPU_STANDINS, cpu_engine_ports

    inv = _load(_lab_doc("sglang", "lab-sglang-cpu"), tmp_path)
    pl = place(inv, parse_topology("1p1d"))
    p, d = pl.get("p01"), pl.get("d01")
    pa, da = engine_args(inv, pl, p, p.head), engine_args(inv, pl, d, d.head)
    assert pa[pa.index("--device") + 1] == "cpu" and "--disaggregation-ib-device" not in pa
    assert pa[pa.index("--disaggregation-transfer-backend") + 1] == "mooncake_tcp"
    assert da[da.index("--disaggregation-decode-retraction-backup") + 1] == "cpu_tensor"
    assert "--disaggregation-decode-retraction-backup" not in pa
    ports = [cpu_engine_ports(inv, i, i.head) for i in (p, d)]
    # every port an engine binds on all addresses is its own
    assert len({x["nccl"] for x in ports}) == 2 and len({x["engine_info"] for x in ports}) == 2
    assert ports[0]["mc_max"] < ports[1]["mc_min"] or ports[1]["mc_max"] < ports[0]["mc_min"]
    assert all(x["mc_max"] < 32768 for x in ports)
    # two labs side by side (make test's workers: 127.0.10.N and 127.0.11.N) share one network namespace
    import dataclasses

    other = dataclasses.replace(p.head, data_addr="127.0.11.1")
    assert not set(cpu_engine_ports(inv, p, other).values()) & set(ports[0].values())
    env = engine_env(inv, d, d.head)
    assert env["PYTHONPATH"] == str(CPU_STANDINS) and env["SGLANG_USE_CPU_ENGINE"] == "1"
    # what the engine writes under HOME and TMPDIR (flashinfer's log, SGLang's IPC sockets) is in its
    # unit's RuntimeDirectory: systemd removes it at every stop
    assert env["HOME"] == env["TMPDIR"] == "/run/pdops/pdops-d01/tmp"
    unit = next(f.content for f in render_files(inv, pl) if f.path.endswith("/pdops-d01.service"))
    assert "RuntimeDirectory=pdops/pdops-d01 pdops/pdops-d01/tmp\n" in unit
    assert "engine: real SGLang on this machine's CPU" in format_placement(inv, pl)


def test_a_cpu_profile_is_refused_outside_the_lab_and_no_gpu_profile_gets_the_stand_ins(tmp_path):
    import pytest

    from pdops.errors import InvalidInput
    from pdops.model.build import format_placement

    with pytest.raises(InvalidInput) as e:
        _load(_lab_doc("sglang", "lab-sglang-cpu", virtual=False), tmp_path)
    assert "runs SGLang on a CPU" in e.value.message and "GPU hosts take a cuda profile" in e.value.fix
    (tmp_path / "sim").mkdir()
    inv = _load(_lab_doc("sim", "lab-sim"), tmp_path / "sim")
    pl = place(inv, parse_topology("1p1d"))
    for f in render_files(inv, pl):
        assert "cpu_engine" not in f.content and "SGLANG_USE_CPU_ENGINE" not in f.content, f.path
    assert "engine: real SGLang" not in format_placement(inv, pl)


def test_the_launch_script_notes_its_pid_and_config_in_the_first_of_its_runtime_directories(lab_inv, tmp_path):
    """An engine's unit has two RuntimeDirectory= entries (its own, and its TMPDIR below it); systemd
    gives the script both in $RUNTIME_DIRECTORY, joined by ':'. The note must land in the first, where
    pdops.reads.observe reads it (found when every real-engine deploy said "runs files without a config id")."""
    import subprocess

    pl = place(lab_inv, parse_topology("1p1d"))
    files = render_files(lab_inv, pl)
    script = next(f.content for f in files if f.path.endswith("/pdops-d01.sh"))
    env_text = next(f.content for f in files if f.path.endswith("/pdops-d01.env"))
    config = next(line.split("=", 1)[1] for line in env_text.splitlines() if line.startswith("PDOPS_CONFIG="))
    unit = next(f.content for f in files if f.path.endswith("/pdops-d01.service"))
    dirs = next(line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("RuntimeDirectory=")).split()
    for d in dirs:
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    head = script[:script.index("\nexec ")] + "\n"  # everything before it execs the engine
    subprocess.run(["sh", "-c", head], check=True, env={"PATH": "/usr/bin:/bin", "PDOPS_CONFIG": config,
                                                        "RUNTIME_DIRECTORY": ":".join(str(tmp_path / d) for d in dirs)})
    pid, noted = (tmp_path / dirs[0] / "config").read_text().split()
    assert noted == config and pid.isdigit()
