"""Preflight: pure evaluation on recorded facts (samples: tests/data/facts/*.source and
tests/data/preflight/preflight.source). No host is contacted."""

import dataclasses
import json
import shutil
import types
from pathlib import Path

import pytest

from pdops.steps import preflight as pf
from pdops.facts import host as hf
from pdops.steps.preflight import batch as pbatch
from pdops import facts as batch_protocol
from pdops.steps.preflight import checks as pchecks
from pdops.model.versions import MOONCAKE_VERSION
from pdops.steps.preflight import expected as pexp
from pdops.steps.preflight import pairing as ppair
from pdops.reads import check_result as checks_mod
from pdops.steps.preflight import results as presults
from pdops.errors import InvalidInput, Refused, RemoteCommandFailed, Unreachable
from pdops.facts import Skipped, nvidia, rdma
from pdops.facts import ports as port_facts
from pdops.facts import systemd as systemd_facts
from pdops.model.inventory import Nic
from pdops.model.placement import place
from pdops.model.topology import parse_topology

FACTS = Path(__file__).resolve().parents[2] / "data" / "facts"
DATA = Path(__file__).resolve().parents[2] / "data" / "preflight"


def read(name: str) -> str:
    return (DATA / name).read_text() if (DATA / name).exists() else (FACTS / name).read_text()


def two_gpu_host(fleet, **kw):
    """gpu01 of the reference fleet cut down to the 2-GPU / 4-GPU samples."""
    h = fleet.host("gpu01")
    return dataclasses.replace(h, **kw)


# ------------------------------------------------------------------ GPUs

def test_gpu_name_mismatch_pro_blackwell_vs_declared_rtx_6000d(fleet):
    host = two_gpu_host(fleet, gpu_count=2)  # declared "NVIDIA RTX 6000D", 84 GiB
    facts = {"gpus": nvidia.parse_gpus(read("nvidia_gpus.csv"))}
    [r] = pchecks.eval_gpu(fleet, host, None, facts)
    assert r.status == pf.FAIL
    assert "'NVIDIA RTX PRO 6000D Blackwell'" in r.reason and "'NVIDIA RTX 6000D'" in r.reason
    assert "pdops_gpus" in r.fix


def test_gpu_mixed_names_fail_and_exact_match_passes(fleet):
    host = two_gpu_host(fleet, gpu_count=2, gpu_model="NVIDIA RTX PRO 6000D Blackwell")
    [ok] = pchecks.eval_gpu(fleet, host, None, {"gpus": nvidia.parse_gpus(read("nvidia_gpus.csv"))})
    assert ok.status == pf.PASS and "2 x NVIDIA RTX PRO 6000D Blackwell (83.5 GiB)" in ok.reason
    [bad] = pchecks.eval_gpu(fleet, host, None, {"gpus": nvidia.parse_gpus(read("nvidia_gpus_mixed.csv"))})
    assert bad.status == pf.FAIL and "GPU(s) [1] are 'NVIDIA RTX 6000D'" in bad.reason
    assert "report no memory size" in bad.reason


def test_gpu_count_and_memory(fleet):
    host = two_gpu_host(fleet, gpu_count=8, gpu_model="NVIDIA RTX PRO 6000D Blackwell", gpu_memory_gib=96)
    [r] = pchecks.eval_gpu(fleet, host, None, {"gpus": nvidia.parse_gpus(read("nvidia_gpus.csv"))})
    assert "2 GPUs found, the inventory declares 8" in r.reason and "declared 96" in r.reason


def test_no_nvidia_smi_on_a_production_host_fails(fleet):
    [r] = pchecks.eval_gpu(fleet, fleet.host("gpu01"), None, {"gpus": Skipped("no nvidia-smi on this host")})
    assert r.status == pf.FAIL and "no nvidia-smi" in r.reason


def test_foreign_compute_process_on_a_gpu_to_be_used(fleet):
    host = two_gpu_host(fleet, gpu_count=2)
    facts = {"gpus": nvidia.parse_gpus(read("nvidia_gpus.csv")), "apps": nvidia.parse_apps(read("nvidia_apps.csv")),
             "pids": {41311: "pdops-p01.service", 41312: None}}
    [r] = pchecks.eval_gpu_free(fleet, host, None, facts)
    assert r.status == pf.FAIL
    assert "GPU 0: pid 41311 (sglang::scheduler_TP0, 79012 MiB, unit pdops-p01.service)" in r.reason
    assert "GPU 1: pid 41312" in r.reason and "never kills" in r.fix
    facts["apps"] = nvidia.parse_apps(read("nvidia_apps_none.txt"))
    assert pchecks.eval_gpu_free(fleet, host, None, facts)[0].status == pf.PASS


def test_own_instance_on_its_gpus_is_not_foreign(fleet):
    pl = place(fleet, parse_topology("1p1d"))
    p01 = pl.get("p01")
    host = fleet.host(p01.head.host)
    gpus = [nvidia.Gpu(i, "NVIDIA RTX 6000D", 86016, "580.82.07", f"GPU-{i}", None) for i in range(8)]
    apps = [nvidia.ComputeApp(500 + i, "sglang::scheduler", 70000, f"GPU-{i}") for i in range(8)]
    facts = {"gpus": gpus, "apps": apps, "pids": {500 + i: "pdops-p01.service" for i in range(8)}}
    assert pchecks.eval_gpu_free(fleet, host, pl, facts)[0].status == pf.PASS


def test_driver_uniform_across_hosts(fleet):
    a, b = fleet.hosts[0].name, fleet.hosts[1].name
    g1 = [nvidia.Gpu(0, "x", 1, "580.82.07", "u", None)]
    g2 = [nvidia.Gpu(0, "x", 1, "570.124.06", "u", None)]
    results = [checks_mod.ok_result(a, "gpu-driver", "driver 580.82.07"), checks_mod.ok_result(b, "gpu-driver", "driver 570.124.06")]
    out = pf.evaluate_cluster(fleet, {a: {"gpus": g1}, b: {"gpus": g2}}, results)
    ra = next(r for r in out if r.host == a)
    assert ra.status == pf.FAIL and "580.82.07 here differs" in ra.reason and f"570.124.06 on {b}" in ra.reason


# ------------------------------------------------------------------ RDMA

def test_inactive_port_and_wrong_link_layer_fail(fleet):
    host = fleet.host("gpu01")  # mlx5_0 and mlx5_1, both RoCE
    [r] = pchecks.eval_rdma(fleet, host, None, {"devinfo": rdma.parse_devinfo(read("ibv_devinfo.txt"))})
    assert r.status == pf.FAIL
    assert "mlx5_1 port 1 is PORT_DOWN, not PORT_ACTIVE" in r.reason
    assert "mlx5_0" not in r.reason  # the active RoCE port is fine
    ib = dataclasses.replace(host, nics=(Nic("mlx5_0", "ib0", "IB", 0, tuple(range(8))),))
    [r2] = pchecks.eval_rdma(fleet, ib, None, {"devinfo": rdma.parse_devinfo(read("ibv_devinfo.txt"))})
    assert "mlx5_0 link layer is Ethernet, the inventory declares IB" in r2.reason


def test_missing_rdma_device(fleet):
    host = dataclasses.replace(fleet.host("gpu01"), nics=(Nic("mlx5_4", "x", "RoCE", 3, tuple(range(8))),))
    [r] = pchecks.eval_rdma(fleet, host, None, {"devinfo": rdma.parse_devinfo(read("ibv_devinfo.txt"))})
    assert "mlx5_4 not found (ibv_devinfo lists ['mlx5_0', 'mlx5_1'])" in r.reason


def test_gid_table_only_link_local_fails_with_the_fix(fleet):
    host = dataclasses.replace(fleet.host("gpu01"), nics=(Nic("mlx5_0", "ens1f0np0", "RoCE", 1, tuple(range(8))),))
    facts = {"gids:mlx5_0": rdma.parse_gids(read("rdma_gids_linklocal_only.txt"))}
    [r] = pchecks.eval_roce_gid(fleet, host, None, facts)
    assert r.status == pf.FAIL
    assert "GID index 1 is link-local" in r.reason and "only link-local entries" in r.reason
    assert "GID is NULL" in r.reason
    assert r.fix.startswith("set gid_index to the RoCE v2 entry")
    assert "ens1f0np0" in r.fix


def test_gid_index_points_at_v1_or_link_local_suggests_the_v2_entry(fleet):
    gids = rdma.parse_gids(read("rdma_gids_roce.txt"))
    for idx, why in ((1, "link-local"), (2, "IB/RoCE v1, not RoCE v2"), (5, "is empty")):
        host = dataclasses.replace(fleet.host("gpu01"), nics=(Nic("mlx5_0", "e", "RoCE", idx, tuple(range(8))),))
        [r] = pchecks.eval_roce_gid(fleet, host, None, {"gids:mlx5_0": gids})
        assert r.status == pf.FAIL and why in r.reason
        assert r.fix == "set gid_index to the RoCE v2 entry 3 (10.0.0.5) for mlx5_0 in pdops_nics"
    host = dataclasses.replace(fleet.host("gpu01"), nics=(Nic("mlx5_0", "e", "RoCE", 3, tuple(range(8))),))
    [ok] = pchecks.eval_roce_gid(fleet, host, None, {"gids:mlx5_0": gids})
    assert ok.status == pf.PASS and "gid 3 RoCE v2 10.0.0.5" in ok.reason


def test_ib_only_host_skips_the_roce_gid_check(fleet):
    host = dataclasses.replace(fleet.host("gpu01"), nics=(Nic("mlx5_0", "ib0", "IB", 0, tuple(range(8))),))
    [r] = pchecks.eval_roce_gid(fleet, host, None, {})
    assert r.status == pf.SKIPPED


def test_nic_affinity_mismatch_from_topo(fleet):
    topo = nvidia.parse_topo(read("nvidia_topo.txt"))  # GPU0,1 near mlx5_0; GPU2,3 near mlx5_1
    wrong = dataclasses.replace(fleet.host("gpu01"), gpu_count=4, nics=(
        Nic("mlx5_0", "a", "RoCE", 3, (0, 2)), Nic("mlx5_1", "b", "RoCE", 3, (1, 3))))
    [r] = pchecks.eval_nic_affinity(fleet, wrong, None, {"topo": topo})
    assert r.status == pf.FAIL
    assert "GPU 1 is mapped to mlx5_1 (SYS) but mlx5_0 is closer (PXB)" in r.reason
    assert "GPU 2 is mapped to mlx5_0 (SYS) but mlx5_1 is closer (PIX)" in r.reason
    assert "move GPU 1 to the gpus list of mlx5_0" in r.fix
    right = dataclasses.replace(wrong, nics=(Nic("mlx5_0", "a", "RoCE", 3, (0, 1)), Nic("mlx5_1", "b", "RoCE", 3, (2, 3))))
    assert pchecks.eval_nic_affinity(fleet, right, None, {"topo": topo})[0].status == pf.PASS


def test_gpudirect_peermem_dmabuf_or_fail():
    no = hf.parse_gpudirect(read("gpudirect_proprietary_no_peermem.txt"))
    assert not no.peermem and no.open_kernel_module is False and no.kernel == (6, 1)
    [r] = pchecks.eval_gpudirect(None, types.SimpleNamespace(name="h"), None, {"gpudirect": no})
    assert r.status == pf.FAIL and "nvidia_peermem is not loaded and no DMA-BUF" in r.reason
    assert r.fix.startswith("modprobe nvidia_peermem")
    dmabuf = hf.parse_gpudirect(read("gpudirect_open_dmabuf.txt"))
    [r] = pchecks.eval_gpudirect(None, types.SimpleNamespace(name="h"), None, {"gpudirect": dmabuf})
    assert r.status == pf.PASS and "DMA-BUF" in r.reason
    peer = hf.parse_gpudirect(read("gpudirect_peermem.txt"))
    [r] = pchecks.eval_gpudirect(None, types.SimpleNamespace(name="h"), None, {"gpudirect": peer})
    assert r.status == pf.PASS and r.reason == "nvidia_peermem loaded"
    old = dataclasses.replace(dmabuf, kernel=(5, 10))
    assert pchecks.eval_gpudirect(None, types.SimpleNamespace(name="h"), None, {"gpudirect": old})[0].status == pf.FAIL


# ------------------------------------------------------------------ virtual hardware

def test_virtual_hardware_hardware_checks_are_skipped_never_pass(lab_inv):
    plans = pf.plan_preflight(lab_inv, None)
    assert [p.host for p in plans] == [h.name for h in lab_inv.hosts]
    for hp in plans:
        reasons = {r.check: r for r in hp.skipped}
        for name in ("gpu", "gpu-driver", "gpu-free", "rdma", "roce-gid", "nic-affinity", "gpudirect"):
            assert name not in hp.run
            assert reasons[name].status == pf.SKIPPED and reasons[name].reason == presults.VIRTUAL_REASON
        assert {"ports", "memlock", "time", "disk", "ver-sglang"} <= set(hp.run)
    # and no hardware command is even sent
    cmd = pf.host_command(lab_inv, plans[0], None)
    assert "nvidia-smi --query-gpu" not in cmd and "ibv_devinfo" not in cmd


def test_lab_versions_sglang_pinned_mooncake_and_nccl_skipped(lab_inv):
    v = hf.parse_versions(read("versions_lab_venv.txt"))
    host = lab_inv.hosts[0]
    facts = {"versions": v}
    assert pf.CHECKS["ver-sglang"].evaluate(lab_inv, host, None, facts)[0].status == pf.PASS
    for name in ("ver-mooncake", "ver-nccl"):
        [r] = pf.CHECKS[name].evaluate(lab_inv, host, None, facts)
        assert r.status == pf.SKIPPED and "virtual hardware" in r.reason


def test_gateway_version_read_from_the_gateways_own_environment(lab_inv):
    """smg is pinned in the gateway's environment (pdops_gateway.python), not the engine's."""
    gw = lab_inv.host(lab_inv.gateway.first.host)
    ok = {"gateway-versions": hf.parse_versions(read("gateway_versions_lab_distinfo.txt"))}
    [r] = pf.CHECKS["ver-gateway"].evaluate(lab_inv, gw, None, ok)
    assert r.status == pf.PASS and "smg 1.13.0" in r.reason
    drifted = {"gateway-versions": hf.parse_versions(read("gateway_versions_drifted.txt"))}
    [r] = pf.CHECKS["ver-gateway"].evaluate(lab_inv, gw, None, drifted)
    assert r.status == pf.FAIL and "smg 1.12.0, pdops pins 1.13.0" in r.reason
    assert lab_inv.gateway.python in r.fix
    # the engine's environment has no smg: the check never reads it
    engine_only = {"gateway-versions": hf.parse_versions(read("versions_lab_venv.txt"))}
    [r] = pf.CHECKS["ver-gateway"].evaluate(lab_inv, gw, None, engine_only)
    assert r.status == pf.FAIL and "not installed in " + lab_inv.gateway.python in r.reason


def test_time_not_synchronized_skipped_in_lab_failed_in_production(lab_inv, fleet):
    for sample in ("timedatectl_unsynced.txt", "timedatectl_no_systemd.txt"):
        t = hf.parse_time(read(sample))
        [lab] = pchecks.eval_time(lab_inv, lab_inv.hosts[0], None, {"time": t})
        assert lab.status == pf.SKIPPED and "share the machine's clock" in lab.reason
        [prod] = pchecks.eval_time(fleet, fleet.hosts[0], None, {"time": t})
        assert prod.status == pf.FAIL
    assert "timedatectl exited 1" in hf.parse_time(read("timedatectl_no_systemd.txt")).detail
    [ok] = pchecks.eval_time(fleet, fleet.hosts[0], None, {"time": hf.parse_time(read("timedatectl_synced.txt"))})
    assert ok.status == pf.PASS


# ------------------------------------------------------------------ versions

def test_versions_differ_between_hosts_fail_naming_both(fleet):
    a, b = "gpu01", "gpu02"
    facts = {a: {"versions": hf.parse_versions(read("versions_prod_gpu01.txt"))},
             b: {"versions": hf.parse_versions(read("versions_prod_gpu02_drifted.txt"))}}
    results = []
    for h in (a, b):
        for name in ("ver-sglang", "ver-mooncake", "ver-nccl"):
            results += pf.CHECKS[name].evaluate(fleet, fleet.host(h), None, facts[h])
    out = pf.evaluate_cluster(fleet, facts, results)
    get = {(r.host, r.check): r for r in out}
    assert get[(a, "ver-sglang")].status == pf.PASS  # gpu01 is on the pin, and the pin rules
    sg = get[(b, "ver-sglang")]
    assert sg.status == pf.FAIL and "sglang 0.5.22, pdops pins 0.5.23" in sg.reason
    assert "sglang 0.5.22 here differs from other hosts: 0.5.23 on gpu01" in sg.reason
    na, nb = get[(a, "ver-nccl")], get[(b, "ver-nccl")]  # no NCCL pin: compared across hosts
    assert na.status == nb.status == pf.FAIL
    assert "NCCL 2.27.3 here differs from other hosts: 2.26.2 on gpu02" in na.reason
    assert "NCCL 2.26.2 here differs from other hosts: 2.27.3 on gpu01" in nb.reason
    assert get[(a, "ver-mooncake")].status == get[(b, "ver-mooncake")].status == pf.PASS


def test_versions_fast_path_reads_dist_info_names_like_importlib():
    """The shell-only probe gives what the python probe gives, on the same venv."""
    fast = hf.parse_versions(read("versions_lab_distinfo.txt"))
    slow = hf.parse_versions(read("versions_lab_venv.txt"))
    assert fast == slow
    assert fast["sglang-router"] == "0.3.2" and fast["torch"] == "2.13.0+cpu"


def test_versions_command_on_this_venv_matches_importlib_metadata(tmp_path):
    """Run the real command (bash) against this project's venv, then against a venv that
    sees system packages, which must take the interpreter path."""
    import importlib.metadata as md
    import subprocess
    import sys

    def run(py: str, torch_nccl: bool = False) -> str:
        return subprocess.run(["bash", "-c", hf.versions_command(py, torch_nccl=torch_nccl)],
                              capture_output=True, text=True, check=True).stdout

    def want(n):
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            return None

    out = run(sys.executable)
    assert out.startswith(hf.DIST_MARK)  # no interpreter started
    assert hf.parse_versions(out) == {n: want(n) for n in hf.VERSION_PACKAGES}
    # NCCL wanted but no NCCL wheel: torch must be asked, so the interpreter runs
    assert not run(sys.executable, torch_nccl=True).startswith(hf.DIST_MARK)
    # a venv that also sees the system's packages: only the interpreter knows what it imports
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "pyvenv.cfg").write_text("include-system-site-packages = true\n")
    sp = venv / "lib" / "python3.11" / "site-packages"
    (sp / "sglang-9.9.9.dist-info").mkdir(parents=True)
    got = run(str(venv / "bin" / "python"))
    assert not got.startswith(hf.DIST_MARK) and hf.parse_versions(got)["sglang"] != "9.9.9"
    (venv / "pyvenv.cfg").write_text("include-system-site-packages = false\n")
    assert hf.parse_versions(run(str(venv / "bin" / "python")))["sglang"] == "9.9.9"


def test_two_sglang_versions_in_one_venv_fail_naming_both(fleet):
    v = hf.parse_versions(read("versions_two_sglang.txt"))
    assert v["sglang"] == "0.5.22 and 0.5.23"
    [r] = pf.CHECKS["ver-sglang"].evaluate(fleet, fleet.hosts[0], None, {"versions": v})
    assert r.status == pf.FAIL and "0.5.22 and 0.5.23" in r.reason


def test_production_host_without_mooncake_fails(fleet):
    v = hf.parse_versions(read("versions_lab_venv.txt"))
    [r] = pf.CHECKS["ver-mooncake"].evaluate(fleet, fleet.hosts[0], None, {"versions": v})
    assert r.status == pf.FAIL and "not installed" in r.reason and MOONCAKE_VERSION in r.fix


# ------------------------------------------------------------------ ports, memlock, disk

def lab_facts(name_ss, name_pids):
    return {"listen": port_facts.parse(read(name_ss)), "pids": hf.parse_pids(read(name_pids))}


def test_pids_to_units():
    units = hf.parse_pids(read("pids_lab01.txt"))
    assert units == {2210: "pdops-gateway.service", 2301: "pdops-p01.service", 2555: "pdops-test-squatter.service"}
    assert hf.parse_pids(read("pids_real.txt")) == {9250: None, 9334: None}
    assert hf.unit_of_cgroup("/user.slice/user-0.slice/session-4.scope") == "session-4.scope"


def test_ports_held_by_own_instance_and_gateway_pass(lab_inv):
    pl = place(lab_inv, parse_topology("1p1d"))
    [r] = pchecks.eval_ports(lab_inv, lab_inv.host("lab01"), pl, lab_facts("ss_lab01_own_and_foreign.txt", "pids_lab01.txt"))
    assert r.status == pf.PASS, r
    assert "8998 (p01 bootstrap) held by its own pdops-p01.service" in r.reason
    assert "30000 (gateway) held by its own pdops-gateway.service" in r.reason


def test_port_taken_by_a_foreign_process_fails_naming_port_and_process(lab_inv):
    pl = place(lab_inv, parse_topology("1p1d"))
    [r] = pchecks.eval_ports(lab_inv, lab_inv.host("lab01"), pl, lab_facts("ss_port_taken_real.txt", "pids_real.txt"))
    assert r.status == pf.FAIL
    assert "port 8998 (p01 bootstrap) on 127.0.10.1 is taken: 127.0.10.1:8998 by pid 9334 (python)" in r.reason
    # without a topology every slot counts: the squatter on slot 1's http port is foreign
    [r2] = pchecks.eval_ports(lab_inv, lab_inv.host("lab01"), None, lab_facts("ss_lab01_own_and_foreign.txt", "pids_lab01.txt"))
    assert r2.status == pf.PASS  # lab01 has one slot (TP8 on 8 GPUs): 30011 is no pdops port
    squat = dataclasses.replace(lab_inv, ports=dataclasses.replace(lab_inv.ports, http_base=30011))
    [r3] = pchecks.eval_ports(squat, squat.host("lab01"), None, lab_facts("ss_lab01_own_and_foreign.txt", "pids_lab01.txt"))
    assert r3.status == pf.FAIL and "pdops-test-squatter.service" in r3.reason


def test_other_lab_hosts_sockets_do_not_collide_unless_wildcard(lab_inv):
    pl = place(lab_inv, parse_topology("1p1d"))  # d01 on lab02 uses 30001 on 127.0.10.2
    facts = lab_facts("ss_lab01_own_and_foreign.txt", "pids_lab01.txt")
    [r] = pchecks.eval_ports(lab_inv, lab_inv.host("lab02"), pl, facts)
    assert r.status == pf.FAIL and "127.0.10.2:30001 by a process this host cannot see" in r.reason
    facts = lab_facts("ss_port_taken_real.txt", "pids_real.txt")  # 0.0.0.0:2024 is no pdops port
    assert pchecks.eval_ports(lab_inv, lab_inv.host("lab02"), pl, facts)[0].status == pf.PASS


def test_memlock_override_and_probe(lab_inv):
    pl = place(lab_inv, parse_topology("1p1d"))
    units = systemd_facts.parse_by_id(read("systemctl_show_memlock_override.txt"))
    ok_probe = hf.parse_memlock(read("memlock_unlimited.txt"))
    [r] = pchecks.eval_memlock(lab_inv, lab_inv.host("lab01"), pl, {"units": units, "memlock": ok_probe})
    assert r.status == pf.FAIL and "pdops-p01.service has LimitMEMLOCK=8388608" in r.reason
    [r] = pchecks.eval_memlock(lab_inv, lab_inv.host("lab01"), pl, {"units": {}, "memlock": ok_probe})
    assert r.status == pf.PASS and "unlimited" in r.reason
    real = dataclasses.replace(lab_inv, virtual_hardware=False)
    [r] = pchecks.eval_memlock(real, real.host("lab01"), pl,
                          {"units": {}, "memlock": hf.parse_memlock(read("memlock_8192.txt"))})
    assert r.status == pf.FAIL and "ulimit -l under systemd: 8192" in r.reason
    capped = hf.parse_memlock(read("memlock_lab_capped.txt"))
    [r] = pchecks.eval_memlock(real, real.host("lab01"), pl, {"units": {}, "memlock": capped})
    assert r.status == pf.FAIL and "8388608" in r.reason
    # on virtual hardware the measured cap is reported as skipped with its reason, never as a pass
    [r] = pchecks.eval_memlock(lab_inv, lab_inv.host("lab01"), pl, {"units": {}, "memlock": capped})
    assert r.status == pf.SKIPPED and "8388608" in r.reason and "CAP_SYS_RESOURCE" in r.reason
    assert "Max locked memory of a service under systemd: 8388608 bytes (8 MiB)" in r.reason


def test_disk_threshold(lab_inv):
    d = hf.parse_df(read("df_var_log.txt"))
    assert d.mount == "/" and 70 < d.available_gib < 80
    assert pchecks.eval_disk(lab_inv, lab_inv.hosts[0], None, {"disk": d})[0].status == pf.PASS
    greedy = dataclasses.replace(lab_inv, vars={**lab_inv.vars, "pdops_preflight": {"min_free_log_gib": 500}})
    [r] = pchecks.eval_disk(greedy, lab_inv.hosts[0], None, {"disk": d})
    assert r.status == pf.FAIL and "below 500 GiB" in r.reason


# ------------------------------------------------------------------ batching

def batch(sections: dict[str, str], rcs: dict[str, int] | None = None) -> str:
    rcs = rcs or {}
    return "".join(f"{batch_protocol._BEGIN} {n}\n{t}{'' if t.endswith(chr(10)) or not t else chr(10)}{batch_protocol._END} {n} {rcs.get(n, 0)}\n"
                   for n, t in sections.items())


def test_batch_command_runs_sections_in_subshells_and_splits(tmp_path):
    import subprocess

    cmd = batch_protocol.batch_command({"a": "echo one; exit 3", "b": "echo two", "c": "printf 'x\\ny\\n'"})
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True).stdout
    assert batch_protocol.split_sections(out) == {"a": (3, "one\n"), "b": (0, "two\n"), "c": (0, "x\ny\n")}


def test_unreadable_section_fails_only_the_checks_that_need_it(lab_inv):
    hp = pf.plan_preflight(lab_inv, None)[1]
    out = batch({"listen": read("ss_port_taken_real.txt"), "pids": read("pids_real.txt"),
                 "units": "", "memlock": read("memlock_unlimited.txt"), "time": read("timedatectl_synced.txt"),
                 "disk": "df: /var/log: No such file or directory\n", "versions": read("versions_lab_venv.txt")},
                rcs={"disk": 1})
    facts = pbatch.parse_sections(out, hp.sections(lab_inv))
    res = {r.check: r for r in pf.evaluate_host(lab_inv, hp, None, facts)}
    assert res["disk"].status == pf.FAIL and "cannot read disk: exited 1" in res["disk"].reason
    assert "No such file" in res["disk"].evidence
    assert res["ports"].status == res["time"].status == res["memlock"].status == pf.PASS


def test_skip_check_by_operator_and_unknown_name(lab_inv):
    with pytest.raises(InvalidInput) as e:
        pf.plan_preflight(lab_inv, None, {"bogus"})
    assert "unknown check(s) ['bogus']" in e.value.message and "pairing" in e.value.fix
    hp = pf.plan_preflight(lab_inv, None, {"ports"})[0]
    assert "ports" not in hp.run
    [r] = [r for r in hp.skipped if r.check == "ports"]
    assert r.reason == "skipped by the operator (--skip-check ports)"


def test_topology_limits_the_hosts_and_gpus(fleet):
    pl = place(fleet, parse_topology("1p1d"))
    plans = pf.plan_preflight(fleet, pl)
    assert [p.host for p in plans] == ["gpu01", "gpu02"]  # gateway is gpu01
    assert "gids:mlx5_0" in plans[0].sections(fleet) and "gids:mlx5_1" in plans[0].sections(fleet)
    ports = pexp.expected_ports(fleet, fleet.host("gpu01"), pl)
    assert [(u.port, u.purpose) for u in ports] == [(30001, "p01 http"), (8998, "p01 bootstrap"),
                                                     (30000, "gateway"), (29000, "gateway metrics")]


# ------------------------------------------------------------------ pairing matrix

def test_pairing_targets_listener_instance_or_held(lab_inv):
    pl = place(lab_inv, parse_topology("2p1d"))  # p01 lab01, p02 lab02, d01 lab03
    facts = {"lab01": lab_facts("ss_lab01_own_and_foreign.txt", "pids_lab01.txt"),
             "lab02": lab_facts("ss_port_taken_real.txt", "pids_real.txt")}
    targets = ppair.plan_targets(lab_inv, pl, facts)
    got = [(t.prefill_host, t.port, t.label, t.mode) for t in targets]
    assert got == [("lab01", 8998, "p01 bootstrap", "instance"), ("lab01", 15000, "Mooncake RPC", "listener"),
                   ("lab02", 8998, "p02 bootstrap", "listener"), ("lab02", 15000, "Mooncake RPC", "listener")]
    # the real capture: 127.0.10.1:8998 held by an unknown python: untestable, and said so
    facts["lab01"] = lab_facts("ss_port_taken_real.txt", "pids_real.txt")
    t = ppair.plan_targets(lab_inv, pl, facts)[0]
    assert t.mode == "held" and "pid 9334 (python)" in t.note


def test_matrix_cells_rendering_and_results(lab_inv):
    pl = place(lab_inv, parse_topology("2p2d"))  # p01 lab01, p02 lab02, d01 lab03, d02 lab04
    pre, dec = ppair.pairing_hosts(pl)
    assert (pre, dec) == (["lab01", "lab02"], ["lab03", "lab04"])
    targets = [ppair.Target("lab01", "127.0.10.1", 8998, "p01 bootstrap", "listener"),
               ppair.Target("lab01", "127.0.10.1", 15000, "Mooncake RPC", "listener"),
               ppair.Target("lab02", "127.0.10.2", 8998, "p02 bootstrap", "instance")]
    ok = [ppair.Probe(t.addr, t.port, True, "") for t in targets]
    blocked = [ppair.Probe("127.0.10.1", 8998, False, "timed out")] + ok[1:]
    m = ppair.evaluate_pairing(pre, dec, targets, {"lab03": ok, "lab04": blocked},
                            {"lab01": {8998: "ok", 15000: "ok"}})
    assert m.cell_ok("lab01", "lab03") and not m.cell_ok("lab01", "lab04") and m.cell_ok("lab02", "lab04")
    text = m.format()
    lines = text.splitlines()
    assert lines[1].split() == ["prefill", "\\", "decode", "lab03", "lab04"]
    assert lines[2].split() == ["lab01", "ok", "FAIL"] and lines[3].split() == ["lab02", "ok", "ok"]
    assert "lab04 -> lab01 127.0.10.1:8998 (p01 bootstrap): timed out" in text
    res = {r.host: r for r in ppair.pairing_results(lab_inv, m)}
    assert res["lab01"].status == pf.FAIL and "unreachable from lab04: 127.0.10.1:8998 (p01 bootstrap) timed out" in res["lab01"].reason
    assert "open TCP 8998 and 15000-17000 on lab01" in res["lab01"].fix
    assert res["lab04"].status == pf.FAIL and res["lab02"].status == res["lab03"].status == pf.PASS
    d = m.to_dict()
    assert [c["ok"] for c in d["cells"]] == [True, True, False, True]


def test_matrix_listener_that_cannot_bind_names_the_data_address(lab_inv):
    t = ppair.Target("lab01", "192.0.2.10", 8998, "p01 bootstrap", "listener")
    m = ppair.evaluate_pairing(["lab01"], ["lab02"], [t], {"lab02": [ppair.Probe("192.0.2.10", 8998, False, "[Errno 22] Invalid argument")]},
                            {"lab01": {8998: "[Errno 111] Connection refused; OSError: [Errno 99] Cannot assign requested address"}})
    [c] = m.failures()
    assert "could not listen" in c[3] and "Cannot assign requested address" in c[3]
    res = {r.host: r for r in ppair.pairing_results(lab_inv, m)}
    assert "pdops_data_addr 127.0.10.1 must be an address of lab01" in res["lab01"].fix


def test_listener_and_probe_scripts_for_real(tmp_path):
    """The listener, its readiness wait and the probe, run here as they run on a host (without systemd)."""
    import socket
    import subprocess
    import sys

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    lst = subprocess.Popen([sys.executable, "-c", ppair._LISTENER, "127.0.0.1", str(port)])
    try:
        w = subprocess.run([sys.executable, "-c", ppair._WAITER, "127.0.0.1", str(port)], capture_output=True, text=True)
        res, _ = ppair.parse_listener_start(w.stdout)
        assert res == {port: "ok"}
        cmd = ppair.probe_command(sys.executable, [("127.0.0.1", port), ("127.0.0.1", 1)], "127.0.0.1", 2)
        probes = ppair.parse_probe(subprocess.run(["sh", "-c", cmd], capture_output=True, text=True).stdout)
        assert [(p.port, p.ok) for p in probes] == [(port, True), (1, False)]
        assert "refused" in probes[1].error
    finally:
        lst.kill()
        lst.wait()


@pytest.mark.skipif(shutil.which("systemctl") is None, reason="needs systemctl to ask for the (absent) unit")
def test_waiter_names_the_listeners_error_as_soon_as_its_unit_is_gone():
    """A listener that could not bind has exited: the waiter stops at once with the bind error
    (not a 5 s timeout), which the matrix then reports as 'could not listen'."""
    import subprocess
    import sys
    import time

    t0 = time.monotonic()
    w = subprocess.run([sys.executable, "-c", ppair._WAITER, "unit=pdops-preflight-listen-gone0000.service",
                        "192.0.2.10", "8998"], capture_output=True, text=True, timeout=30)
    res, _ = ppair.parse_listener_start(w.stdout)
    assert "Cannot assign requested address" in res[8998], w
    assert time.monotonic() - t0 < 4


def test_listener_exits_with_a_clean_error_when_it_cannot_bind():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", ppair._LISTENER, "192.0.2.10", "8998"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 1
    assert r.stderr.strip() == "cannot listen on 192.0.2.10:8998: [Errno 99] Cannot assign requested address"


def test_listener_commands_name_and_stop_only_their_unit():
    start = ppair.listener_start_command("/usr/bin/python3", "pdops-preflight-listen-ab12.service", "10.0.0.1", [8998, 15000])
    assert start.startswith("systemd-run --quiet --unit=pdops-preflight-listen-ab12.service --collect -p RuntimeMaxSec=60 ")
    stop = ppair.listener_stop_command("pdops-preflight-listen-ab12.service")
    assert stop.startswith("systemctl stop pdops-preflight-listen-ab12.service")
    assert "*" not in stop and "pkill" not in stop


# ------------------------------------------------------------------ whole run on a recorded pool

class RecordedPool:
    """Answers preflight's commands from samples, per host (no SSH)."""

    def __init__(self, sections_by_host, probe_ok=True, down=()):
        self.sections_by_host = sections_by_host
        self.probe_ok = probe_ok
        self.down = set(down)
        self.commands: list[tuple[str, str]] = []

    def run(self, host, command, timeout=None):
        self.commands.append((host, command))
        if host in self.down:
            raise Unreachable(f"{host}: SSH failed: NoValidConnectionsError")
        if batch_protocol._BEGIN in command:
            return types.SimpleNamespace(stdout=batch(self.sections_by_host[host]))
        if command.startswith("systemd-run"):
            ports = [t for t in command.split(" && ")[0].split()[-3:] if t.isdigit()]
            return types.SimpleNamespace(stdout=json.dumps({p: "ok" for p in ports}) + "\n")
        if "socket.create_connection" in command and "ThreadPoolExecutor" in command:
            targets = json.loads(__import__("shlex").split(command)[3])
            return types.SimpleNamespace(stdout="".join(
                json.dumps([a, p, self.probe_ok, "" if self.probe_ok else "timed out"]) + "\n" for a, p in targets))
        if command.startswith("systemctl stop"):
            return types.SimpleNamespace(stdout="")
        raise RemoteCommandFailed(host, command, 127, "unexpected")


def lab_sections():
    return {"units": "", "memlock": read("memlock_unlimited.txt"), "listen": "", "pids": "",
            "time": read("timedatectl_unsynced.txt"), "disk": read("df_var_log.txt"),
            "versions": read("versions_lab_venv.txt"),
            "gateway-versions": read("gateway_versions_lab_distinfo.txt")}


def test_run_preflight_clean_lab_passes_or_skips(lab_inv):
    pool = RecordedPool({h.name: lab_sections() for h in lab_inv.hosts})
    rep = pf.run_preflight(lab_inv, parse_topology("1p1d"), pool, set())
    assert rep.ok, rep.format_table()
    assert rep.hosts == ["lab01", "lab02"] and rep.not_checked == ["lab03", "lab04"]
    assert all(r.status != pf.PASS for r in rep.results if r.check in ("gpu", "rdma", "gpudirect", "time"))
    assert rep.result("lab01", "pairing").status == pf.PASS
    table = rep.format_table()
    assert table.splitlines()[1].split()[:3] == ["host", "gpu", "gpu-driver"]
    assert "lab host has no nvidia-smi/RDMA (virtual hardware)" in table
    assert "preflight ok: 2 host(s)" in table
    doc = json.loads(rep.to_json())
    assert doc["ok"] and doc["pairing"]["cells"][0]["ok"] and doc["failed_hosts"] == []
    # one batched round trip per host, then listener start, probe, listener stop
    kinds = [(h, c.split()[0]) for h, c in pool.commands]
    assert sum(batch_protocol._BEGIN in c for _, c in pool.commands) == 2
    assert ("lab01", "systemd-run") in kinds and ("lab01", "systemctl") in kinds
    unit = next(c for h, c in pool.commands if c.startswith("systemd-run")).split("--unit=")[1].split()[0]
    assert unit.startswith(presults.LISTEN_UNIT_PREFIX)
    assert any(c.startswith(f"systemctl stop {unit}") for _, c in pool.commands)


def test_gate_refuses_naming_hosts_checks_and_fix_and_journals(lab_inv, tmp_path):
    sections = {h.name: lab_sections() for h in lab_inv.hosts}
    sections["lab01"]["listen"] = read("ss_port_taken_real.txt")
    sections["lab01"]["pids"] = read("pids_real.txt")
    pool = RecordedPool(sections, probe_ok=False)
    said = []
    with pytest.raises(Refused) as e:
        pf.preflight_gate(lab_inv, parse_topology("1p1d"), pool, {"disk"}, said.append)
    err = e.value
    assert "preflight failed on lab01, lab02" in err.message
    assert "lab01 ports: port 8998 (p01 bootstrap) on 127.0.10.1 is taken" in err.evidence
    assert "--skip-check pairing --skip-check ports" in err.fix
    ev = err.journal_evidence  # what the runner journals with the failed preflight step
    assert ev["skipped_by_operator"]["checks"] == ["disk"]
    assert ev["failed_hosts"] == ["lab01", "lab02"]
    assert any("pairing" in line for line in said)


def test_unreachable_host_is_reported_and_others_still_checked(lab_inv):
    pool = RecordedPool({h.name: lab_sections() for h in lab_inv.hosts}, down={"lab02"})
    rep = pf.run_preflight(lab_inv, parse_topology("1p1d"), pool, set())
    assert rep.failed_hosts == ["lab01", "lab02"]
    assert rep.result("lab02", "ssh").status == pf.FAIL and "NoValidConnectionsError" in rep.result("lab02", "ssh").reason
    assert rep.result("lab01", "ports").status == pf.PASS
    assert "lab02 unreachable over SSH" in rep.result("lab01", "pairing").reason


def test_pairing_fix_names_every_cause_and_verdict_counts(lab_inv):
    held = ppair.Target("lab01", "127.0.10.1", 8998, "p01 bootstrap", "held", "held by a foreign process: x")
    lst = ppair.Target("lab01", "127.0.10.1", 15000, "Mooncake RPC", "listener")
    m = ppair.evaluate_pairing(["lab01"], ["lab02"], [held, lst],
                            {"lab02": [ppair.Probe("127.0.10.1", 15000, False, "timed out")]},
                            {"lab01": {15000: "[Errno 99] Cannot assign requested address"}})
    res = {r.host: r for r in ppair.pairing_results(lab_inv, m)}
    assert "free the port on the prefill host" in res["lab01"].fix
    assert "pdops_data_addr 127.0.10.1 must be an address of lab01" in res["lab01"].fix
    rep = pf.PreflightReport("lab", "1p1d", ["lab01", "lab02"], list(res.values()), m)
    assert rep.verdict() == ("preflight FAILED on 2 of 2 host(s): lab01 (pairing); lab02 (pairing) "
                             "(0 passed, 2 failed, 0 skipped; pairing 1 P x 1 D: 1 cell(s) FAIL)")
