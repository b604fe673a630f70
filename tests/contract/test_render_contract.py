"""Rendered commands against the real parsers: SGLang 0.5.23's prepare_server_args, the
gateway package's own parse_router_args, and systemd-analyze verify for every unit."""

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

from pdops.model.contract import check_gateway_args, check_sglang_args
from pdops.errors import InvalidInput
from pdops.model.inventory import load_inventory, load_profile
from pdops.model.placement import place
from pdops.model.commands import engine_args, gateway_args
from pdops.model.render import render_files, write_build
from pdops.model.topology import Topology

pytestmark = pytest.mark.contract
REPO = Path(__file__).resolve().parents[2]
PROFILES = ["glm-flash-80k", "deepseek-flash-160k"]
# Every topology from 1p1d to 12p4d that fits the reference fleet (16 hosts x 8 GPUs, TP8).
TOPOLOGIES = [Topology(p, d) for p in range(1, 13) for d in range(1, 5) if p + d <= 16]


def _fleet(profile: str):
    inv = load_inventory(REPO / "inventory" / "rtx6000d")
    return dataclasses.replace(inv, profile=load_profile(profile))


@pytest.mark.parametrize("profile", PROFILES)
def test_every_rendered_engine_command_parses_with_sglang(profile):
    inv = _fleet(profile)
    checked: dict[tuple, object] = {}
    for topo in TOPOLOGIES:
        pl = place(inv, topo)
        for inst in pl.instances:
            for rank in inst.ranks:
                args = tuple(engine_args(inv, pl, inst, rank))
                if args not in checked:  # instances keep their slot across topologies
                    sa = check_sglang_args(list(args))
                    assert sa.disaggregation_mode == inst.role
                    assert sa.host == rank.data_addr and sa.port == inst.http_port
                    assert (sa.tp_size, sa.pp_size) == (inv.profile.tp, inv.profile.pp)
                    assert sa.enable_metrics
                    if inst.role == "prefill":
                        assert sa.disaggregation_bootstrap_port == inst.bootstrap_port
                    checked[args] = sa
    assert len(checked) >= 16


def test_multinode_instance_parses(fleet):
    inv = dataclasses.replace(fleet, profile=dataclasses.replace(fleet.profile, tp=8, pp=8))
    pl = place(inv, Topology(1, 1))
    p = pl.get("p01")
    sa = check_sglang_args(engine_args(inv, pl, p, p.ranks[3]))
    assert (sa.nnodes, sa.node_rank, sa.dist_init_addr) == (8, 3, f"10.30.0.11:{p.dist_init_port}")


@pytest.mark.parametrize("corrupt", [
    lambda a: a + ["--tp", "8", "--pp", "1"],                                 # abbreviation: ambiguous
    lambda a: a + ["--disaggregation-decode-tp", "4"],                        # not in 0.5.23
    lambda a: [x.replace("prefill", "prefil") for x in a],                    # bad choice
    lambda a: [x if x != "--tp-size" else "--tp-sizes" for x in a],           # unknown flag
    lambda a: a[2:],                                                          # no --model-path
])
def test_corrupted_flags_are_rejected_by_sglang(fleet, corrupt):
    pl = place(fleet, Topology(1, 1))
    p = pl.get("p01")
    with pytest.raises(InvalidInput, match="engine flags"):
        check_sglang_args(corrupt(engine_args(fleet, pl, p, p.head)))


def test_gateway_command_parses_with_the_gateway_parser(fleet, lab_inv):
    for inv in (fleet, lab_inv):
        ra = check_gateway_args(gateway_args(inv, inv.gateway.first))
        assert ra.pd_disaggregation and ra.disable_retries
        assert ra.prefill_urls == [] and ra.decode_urls == []
        assert ra.host == inv.gateway.first.addr and ra.port == inv.gateway.port
        assert ra.prometheus_port == inv.gateway.prometheus_port
    with pytest.raises(InvalidInput, match="gateway flags"):
        check_gateway_args(gateway_args(fleet, fleet.gateway.first) + ["--retries-off"])


def test_every_routing_policy_pdops_accepts_is_one_the_gateway_accepts(fleet):
    import dataclasses

    from pdops.model.inventory import PREFILL_POLICIES, ROUTING_POLICIES

    assert fleet.gateway.policy is None  # not set: the gateway's own default
    assert check_gateway_args(gateway_args(fleet, fleet.gateway.first)).policy == "cache_aware"
    for key, flag_dest, choices in (("policy", "policy", ROUTING_POLICIES),
                                    ("prefill_policy", "prefill_policy", PREFILL_POLICIES),
                                    ("decode_policy", "decode_policy", ROUTING_POLICIES)):
        for choice in choices:
            gw = dataclasses.replace(fleet.gateway, **{key: choice})
            ra = check_gateway_args(gateway_args(dataclasses.replace(fleet, gateway=gw), gw.first))
            assert getattr(ra, flag_dest) == choice, (key, choice)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("inv_name,topo", [("rtx6000d", Topology(12, 4)), ("lab", Topology(2, 1))])
def test_every_unit_passes_systemd_analyze_verify(tmp_path, inv_name, topo):
    """Units are verified with the paths they reference present: the build folder's copies."""
    inv = load_inventory(REPO / "inventory" / inv_name)
    out = write_build(render_files(inv, place(inv, topo)), tmp_path / "b")
    units = sorted(out.glob("*/etc/systemd/system/*.service"))
    assert len(units) == topo.prefill + topo.decode + 1
    for unit in units:
        root = unit.parents[3]
        text = unit.read_text().replace("/opt/pdops/", f"{root}/opt/pdops/").replace("/etc/pdops/", f"{root}/etc/pdops/")
        check = tmp_path / "verify" / unit.name
        check.parent.mkdir(exist_ok=True)
        check.write_text(text)
        proc = subprocess.run(["systemd-analyze", "verify", str(check)], capture_output=True, text=True,
                              env={"SYSTEMD_UNIT_PATH": f"{unit.parent}:", "PATH": "/usr/bin:/bin"})
        # systemd-analyze only warns (exit 0) on unknown values: any output is a failure.
        assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), f"{unit}: {proc.stdout}{proc.stderr}"


def test_systemd_analyze_catches_a_bad_value(tmp_path, fleet):
    """The check above can fail: a corrupted unit produces output."""
    out = write_build(render_files(fleet, place(fleet, Topology(1, 1))), tmp_path / "b")
    unit = out / "gpu01" / "etc/systemd/system/pdops-p01.service"
    root = unit.parents[3]
    bad = tmp_path / "pdops-p01.service"
    bad.write_text(unit.read_text().replace("KillMode=mixed", "KillMode=bogus").replace("/opt/pdops/", f"{root}/opt/pdops/")
                   .replace("/etc/pdops/", f"{root}/etc/pdops/"))
    proc = subprocess.run(["systemd-analyze", "verify", str(bad)], capture_output=True, text=True,
                          env={"SYSTEMD_UNIT_PATH": f"{unit.parent}:", "PATH": "/usr/bin:/bin"})
    assert "bogus" in proc.stdout + proc.stderr


def test_the_reports_probe_bundles_parse_with_sglang_as_pdops_renders_them(fleet, tmp_path):
    """`inv probe` checks a bundle against the flag table extracted from SGLang; here SGLang's own
    parser takes the command lines the probed instances get (the report's T1..T6 bundles)."""
    from pdops.ops.probe import load_bundle

    bundles = ["{chunked-prefill-size: 16384}", "{chunked-prefill-size: 16384, mem-fraction-static: 0.75}",
               "{chunked-prefill-size: 16384, mem-fraction-static: 0.5, context-length: 524288, max-running-requests: 2}",
               "{chunked-prefill-size: 8192, max-prefill-tokens: 8192, enable-mixed-chunk: true}"]
    pl = place(fleet, Topology(1, 1))
    for n, flags in enumerate(bundles):
        (tmp_path / f"b{n}.yml").write_text(f"flags: {flags}\n")
        b = load_bundle(tmp_path / f"b{n}.yml")
        inv = dataclasses.replace(fleet, engine_overrides={"p01": b.flags, "d01": b.flags})
        for iid in ("p01", "d01"):
            inst = pl.get(iid)
            sa = check_sglang_args(engine_args(inv, pl, inst, inst.ranks[0]))
            assert sa.chunked_prefill_size == int(dict(b.flags)["--chunked-prefill-size"])
            if "--mem-fraction-static" in dict(b.flags):
                assert sa.mem_fraction_static == float(dict(b.flags)["--mem-fraction-static"])
