"""Day-2 changes on a live lab cluster, each under load through the gateway from a client that
counts every request (none lost, none replayed): a parameter-bundle change rolled one instance per
role at a time, a template change alone (applied, not just recorded), a host added to the
inventory and scaled onto.

The lab has 4 hosts x 8 virtual GPUs and the lab-sim profile is TP8: one instance per host.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.lab.clusters import Load, REPO, deployed, derived_inventory, inv_cmd, main_pids, received_rids, record, set_bundle, stop_all

from pdops.remote.hosts import http_json
from pdops.model.inventory import load_inventory
from pdops.model.placement import Placement

pytestmark = pytest.mark.lab


def cli(inv_dir: Path, *args, timeout=900):
    return inv_cmd(*args, "-i", str(inv_dir), timeout=timeout)


def server_info(inv_dir: Path) -> dict[str, dict]:
    st = record(inv_dir)
    pl = Placement.from_dict(st.current_revision().placement)
    out = {}
    for i in pl.instances:
        status, doc = http_json("GET", f"{i.url}/server_info", timeout=10)
        assert status == 200
        out[i.id] = doc
    return out


def changed(inv_dir: Path, *args, gateway_restart: bool = False, run=None) -> tuple[str, Load]:
    """Run a change under load (`run`: how the inv command runs; default `cli`). With a gateway
    restart, requests arriving while it restarts are turned away (counted and printed); none
    already in flight may fail."""
    inv = load_inventory(inv_dir)
    with Load(inv.gateway.first.url) as load:
        proc = (run or (lambda *a: cli(inv_dir, *a)))(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ref = load.refused() if gateway_restart else []
    load.assert_clean(allow_refused=gateway_restart,
                      received=received_rids(inv_dir, {r.rid for r in ref}) if gateway_restart else None)
    if gateway_restart:
        window = (max(r.end or r.start for r in ref) - min(r.start for r in ref)) if ref else 0.0
        print(f"gateway restart under load: {len(load.rows)} requests; turned away while it restarted: {len(ref)} "
              f"(a closed loop retrying at once) within {window:.1f}s; every other one served in full")
    else:
        assert not load.refused()
    return proc.stdout, load


def out_intervals(inv_dir: Path) -> dict[str, tuple[int, int]]:
    """For the last operation: each replaced instance's (first step out of service, register) positions."""
    st = record(inv_dir)
    j = st.journal()
    op = j.operations()[-1]
    recs = [r["step"] for r in j.read(op)]
    out = {}
    for n, name in enumerate(recs):
        if name.startswith("replace ") and name.endswith(": leave-gateway"):
            out[name.split()[1].rstrip(":")] = (n, None)
        if name.startswith("register ") and name.split()[1] in out:
            out[name.split()[1]] = (out[name.split()[1]][0], n)
    return out


@pytest.fixture(scope="module")
def live(lab, tmp_path_factory):
    with deployed(lab, tmp_path_factory.mktemp("change") / "c", "2p2d", profile={}) as c:
        yield c.inv_dir


def test_a_bundle_change_restarts_every_instance_one_per_role_at_a_time(live):
    before_pids = main_pids(live)
    assert {d["max_running_requests"] for d in server_info(live).values()} == {64}
    rev_before = record(live).current_revision()
    set_bundle(live, max_running_requests=32)
    dry = cli(live, "deploy", "--topology", "2p2d", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "rolling: 2 wave(s), at most 1 per role out at once: p01, d01; p02, d02" in dry.stdout
    assert record(live).current() == rev_before.number  # the dry run changed nothing
    out, load = changed(live, "deploy", "--topology", "2p2d")
    # every instance restarted from the new files, its flag seen by the engine itself
    info = server_info(live)
    assert {i: d["max_running_requests"] for i, d in info.items()} == {"p01": 32, "p02": 32, "d01": 32, "d02": 32}
    after = main_pids(live)
    assert all(after[i] != before_pids[i] for i in before_pids), (before_pids, after)
    # one per role at a time: the out-of-service intervals of two instances of one role never overlap
    iv = out_intervals(live)
    assert set(iv) == {"p01", "p02", "d01", "d02"} and all(b is not None for _, b in iv.values())
    for a, b in (("p01", "p02"), ("d01", "d02")):
        assert iv[a][1] < iv[b][0], iv
    # each replaced prefill came back on the bootstrap port its predecessor did not use
    old = Placement.from_dict(rev_before.placement)
    new = Placement.from_dict(record(live).current_revision().placement)
    for i in new.role("prefill"):
        assert i.bootstrap_port != old.get(i.id).bootstrap_port and i.http_port == old.get(i.id).http_port
    verify = cli(live, "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert len(load.rows) >= 6


def test_a_process_running_other_files_fails_verify_and_deploy_replaces_it(live, lab):
    """Files changed on disk under a process that did not restart: verify fails on that host; the
    next deploy replaces just that instance (drain, start from the files, register)."""
    rev = record(live).current_revision()
    pl = Placement.from_dict(rev.placement)
    d02 = pl.get("d02")
    host, unit = d02.units[0]
    c = lab.connection(host)
    stem = unit.removesuffix(".service")
    c.run(f"sed -i 's/^\\([0-9]*\\) .*/\\1 0000000000000000/' /run/pdops/{stem}/config", hide=True)
    c.close()
    verify = cli(live, "verify")
    assert verify.returncode != 0
    assert f"{host}:{unit} runs files 0000000000000000" in verify.stdout + verify.stderr
    out, _ = changed(live, "deploy", "--topology", "2p2d")
    assert "replaced: d02" in out and "replaced: p01" not in out
    verify = cli(live, "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_an_sglang_upgrade_is_a_change_of_generation_refused_where_it_cannot_be_fenced(live):
    """Runbook docs/runbooks/sglang-upgrade.md: the pdops release that moves the SGLang pin (here
    tests/lab/moved_pin.py, the pin alone moved) changes the generation of every instance (the
    bootstrap protocol and KV layout are SGLang's): rolled in waves, an upgraded prefill would
    pair with a decode of the old pin. This cluster has one gateway and no admission layer, so it
    cannot be fenced: refused before anything runs, naming the pin and the ways out; nothing
    changed. (The fenced rollout itself: tests/lab/test_generation_lab.py.)"""
    import subprocess
    import sys

    new = "0.5.24"

    def pinned(*args):
        return subprocess.run([sys.executable, "tests/lab/moved_pin.py", new, *args, "-i", str(live)], cwd=REPO,
                              capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)

    before, rev = main_pids(live), record(live).current()
    for args in (("--dry-run",), ()):
        proc = pinned("deploy", "--topology", "2p2d", *args)
        assert proc.returncode == 4, proc.stdout + proc.stderr  # refused
        assert "alters the generation (SGLang version 0.5.23 -> 0.5.24)" in proc.stderr, proc.stderr
        assert "pdops_gateway.hosts" in proc.stderr and "--unfenced" in proc.stderr, proc.stderr
    assert main_pids(live) == before and record(live).current() == rev


def test_a_template_change_alone_is_applied_not_just_recorded(live, tmp_path):
    """A pdops release that changes a template (env.j2 gains a line), run by its own process
    (tests/lab/moved_template.py): the checkout's templates stay as they are for the tests that
    run beside this one."""
    import shutil
    import subprocess
    import sys

    released = tmp_path / "templates"
    shutil.copytree(REPO / "templates", released)
    (released / "env.j2").write_text((REPO / "templates" / "env.j2").read_text() + "PDOPS_TEMPLATE_PROBE=1\n")

    def release(*args):
        return subprocess.run([sys.executable, "tests/lab/moved_template.py", str(released), *args, "-i", str(live)],
                              cwd=REPO, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)

    before = main_pids(live)
    out, _ = changed(live, "deploy", "--topology", "2p2d", gateway_restart=True, run=release)
    assert "replaced: p01" in out and "pdops-p01.env" in out and "gateway: restarted" in out
    after = main_pids(live)
    assert all(after[i] != before[i] for i in before)  # restarted, not just delivered
    # the running engines carry the new variable (read from the process, not the file)
    rev = record(live).current_revision()
    pl = Placement.from_dict(rev.placement)
    from pdops.remote.hosts import HostPool

    with HostPool(load_inventory(live)) as pool:
        for i in pl.instances:
            env = pool.run(i.head.host, f"tr '\\0' '\\n' < /proc/{after[i.id]}/environ").stdout
            assert "PDOPS_TEMPLATE_PROBE=1" in env.splitlines(), i.id
    verify = cli(live, "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # the template back as it was is a change again (the dry run says so; the module's last test)
    back = cli(live, "deploy", "--topology", "2p2d", "--dry-run")
    assert back.returncode == 0 and "replaced: p01" in back.stdout and "gateway: restarted" in back.stdout


def test_a_host_added_then_taken_to_maintenance_and_back(lab, tmp_path):
    """lab04 added to a 3-host inventory and scaled onto, the rest untouched; then `inv drain --host
    lab02` (no free slot: p02 drained, its role shrinks) cordons lab02, placement avoids it, and
    `inv uncordon` lets a scale put p02 back there. (Moving an instance off a host into a free slot
    first: tests/unit/ops/test_scale_plan.py.)"""
    stop_all(lab)
    where = tmp_path / "grow"

    def three(doc):
        doc["all"]["children"]["gpu_hosts"]["hosts"].pop("lab04")
    inv_dir = derived_inventory(lab, where, mutate=three)
    proc = cli(inv_dir, "deploy", "--topology", "2p1d")  # p01 lab01, p02 lab02, d01 lab03
    assert proc.returncode == 0, proc.stdout + proc.stderr
    before = main_pids(inv_dir)
    full = cli(inv_dir, "scale", "--topology", "3p1d", "--dry-run")
    assert full.returncode == 2 and "room for 3" in full.stderr  # lab04 is not in this inventory yet
    derived_inventory(lab, where)  # lab04 added (same record)
    out, _ = changed(inv_dir, "scale", "--topology", "3p1d")
    pl = Placement.from_dict(record(inv_dir).current_revision().placement)
    assert pl.get("p03").hosts == ("lab04",)
    after = main_pids(inv_dir)
    assert {i: after[i] for i in before} == before  # p01, p02, d01 untouched
    # maintenance of lab02: no free slot, so p02 is drained and the prefills shrink to two
    out, _ = changed(inv_dir, "drain", "--host", "lab02")
    assert "removed: p02" in out and "cordoned: lab02" in out
    rev = record(inv_dir).current_revision()
    assert rev.extra["cordoned"] == ["lab02"] and sorted(rev.instances) == ["d01", "p01", "p03"]
    c = lab.connection("lab02")
    active = c.run("systemctl list-units --state=active --plain --no-legend 'pdops-p*' | awk '{print $1}'",
                   hide=True, warn=True).stdout.split()
    c.close()
    assert active == []  # nothing of pdops serves on the host in maintenance
    st = cli(inv_dir, "status")
    assert "cordoned (placement avoids them" in st.stdout and "lab02" in st.stdout
    refused = cli(inv_dir, "scale", "--topology", "3p1d")
    assert refused.returncode == 2 and "lab02 cordoned" in refused.stderr  # placement avoids it
    un = cli(inv_dir, "uncordon", "--host", "lab02")
    assert un.returncode == 0, un.stdout + un.stderr
    assert record(inv_dir).current_revision().extra["cordoned"] == []
    out, _ = changed(inv_dir, "scale", "--topology", "3p1d")
    pl = Placement.from_dict(record(inv_dir).current_revision().placement)
    assert pl.get("p02").hosts == ("lab02",)  # the lowest free id, on the host back from maintenance
    stop_all(lab)


def test_a_bundle_that_fails_to_start_halts_and_rollback_restores_the_recorded_files(lab, tmp_path):
    """The first wave's new processes fail (a bundle whose --mem-fraction-static leaves no room for the
    KV pool: the engine exits at start, as SGLang does; a flag SGLang rejects is refused at planning
    now, before anything runs, by the generation's parse of every rendered command line): the rollout halts, the instances
    not yet replaced keep serving the old revision (same MainPIDs), the journal and a `partial`
    revision name what changed; `inv rollback` returns to the previous revision's recorded files even
    though the inventory on disk still names the bad bundle."""
    stop_all(lab)
    inv_dir = derived_inventory(lab, tmp_path / "halt", profile={})
    proc = cli(inv_dir, "deploy", "--topology", "2p2d")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = record(inv_dir).current()
    before = main_pids(inv_dir)
    p = inv_dir / "profiles" / "p.yml"
    prof = yaml.safe_load(p.read_text())
    prof["bundle"]["mem_fraction_static"] = 0.05
    p.write_text(yaml.safe_dump(prof))
    inv = load_inventory(inv_dir)
    with Load(inv.gateway.first.url) as load:
        bad = cli(inv_dir, "deploy", "--topology", "2p2d")
    assert bad.returncode != 0
    assert "the rollout halted" in bad.stderr and "still serving revision" in bad.stderr
    load.assert_clean()
    st = record(inv_dir)
    rev = st.current_revision()
    assert rev.outcome == "partial" and sorted(rev.instances) == ["d02", "p02"]
    after = main_pids(inv_dir)
    assert after == {"p02": before["p02"], "d02": before["d02"]}  # never touched
    last = st.journal().read(st.journal().operations()[-1])
    assert any(r["step"] == "start p01" and r["status"] == "failed" for r in last)
    with Load(inv.gateway.first.url) as load:
        back = cli(inv_dir, "rollback")
    assert back.returncode == 0, back.stdout + back.stderr
    load.assert_clean()
    assert {d["max_running_requests"] for d in server_info(inv_dir).values()} == {64}
    now = record(inv_dir).current_revision()
    assert sorted(now.instances) == ["d01", "d02", "p01", "p02"] and now.extra.get("rollback_of") == first
    verify = cli(inv_dir, "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # the inventory still asks for the bad bundle: the next deploy plans that change again
    again = cli(inv_dir, "deploy", "--topology", "2p2d", "--dry-run")
    assert again.returncode == 0 and "replaced: p01" in again.stdout
    stop_all(lab)


def test_an_added_instance_serves_while_the_lone_old_one_is_replaced(lab, tmp_path):
    """1p2d, a bundle change, and `inv scale --topology 2p2d` on the 4-host lab: no free host is
    left for a surge, but p02 is added first on the free one and counts, so p01 is replaced in place
    after p02 is registered; under load, a prefill serves at every step and no request is lost."""
    stop_all(lab)
    inv_dir = derived_inventory(lab, tmp_path / "addfirst", profile={})
    proc = cli(inv_dir, "deploy", "--topology", "1p2d")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    set_bundle(inv_dir, max_running_requests=32)
    out, load = changed(inv_dir, "scale", "--topology", "2p2d")
    assert "added:   p02" in out and "replaced: p01" in out, out
    assert {i: d["max_running_requests"] for i, d in server_info(inv_dir).items()} == \
        {"p01": 32, "p02": 32, "d01": 32, "d02": 32}
    st = record(inv_dir)
    steps = [r["step"] for r in st.journal().read(st.journal().operations()[-1])]
    assert steps.index("register p02") < steps.index("replace p01: leave-gateway"), steps
    assert len(load.rows) >= 6
    stop_all(lab)
