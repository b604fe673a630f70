"""`inv probe` on a live 1p1d lab cluster (runbook docs/runbooks/bundle-probe.md): three probes on a
spare pair, one that runs out of memory, one that passes, one whose window has a transfer fault
(mixed); the probe table, the failure signatures, and after each probe the baseline as recorded
(every instance of the revision still its recorded process on the revision's files, the spare
pair's units gone, `inv status` ok). Bad input is refused before any host is touched.

The sim's memory model (docs/sim.md) with the lab-sim profile's constants: 380K-token prompts, four
at once, fail as in the field report's probes T2, T6 and T5.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.lab.clusters import assert_journal_walks_the_printed_plan, REPO, cli, deployed, record

pytestmark = pytest.mark.lab

LAB_PROFILE = yaml.safe_load((REPO / "pdops" / "profiles" / "lab-sim.yml").read_text())
# 380K words a prompt: a fast prefill and a light KV payload keep each probe to seconds
PROFILE = {"env": {**LAB_PROFILE["env"], "PDOPS_SIM_PREFILL_TOKENS_PER_S": "4000000",
                   "PDOPS_SIM_KV_BYTES_PER_TOKEN": "8"}}
BUNDLES = {
    "oom": "name: T2\nflags: {chunked-prefill-size: 16384, mem-fraction-static: 0.75}\n",
    "ok": "name: T6\nflags: {chunked-prefill-size: 8192, mem-fraction-static: 0.5, context-length: 524288, "
          "max-running-requests: 4}\n",
    "mixed": "name: T5\nflags: {chunked-prefill-size: 16384, mem-fraction-static: 0.5, context-length: 524288, "
             "max-running-requests: 2}\n",
}


@pytest.fixture(scope="module")
def live(lab, tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    _write_bundles(root)
    with deployed(lab, root / "c", "1p1d", profile=PROFILE) as c:
        yield c.inv_dir, root


def _write_bundles(root: Path) -> None:
    for k, text in BUNDLES.items():
        (root / f"{k}.yml").write_text(text)


def baseline(inv_dir: Path) -> dict:
    rev = record(inv_dir).current_revision()
    return {"revision": rev.number, "main_pids": {i: d.get("main_pids") for i, d in rev.instances.items()}}


def assert_baseline(lab, inv_dir: Path, before: dict, out: str, *, verify: bool = False) -> None:
    """Observed, not read from the record alone: `inv status` ok (every unit active with its recorded
    MainPID, registered, healthy), the spare pair's unit files gone; `verify`: `inv verify` passes
    (the probe's own last step checked the revision's files on every unit)."""
    assert baseline(inv_dir) == before  # no new revision, same recorded processes
    assert "verified: revision" in out and "the spare pair's units gone" in out, out
    st = cli(inv_dir, "status", "--json")
    assert st.returncode == 0, st.stdout + st.stderr
    doc = json.loads(st.stdout)
    assert [(r["instance"], r["state"]) for r in doc["instances"]] == [("p01", "ok"), ("d01", "ok")]
    if verify:
        ver = cli(inv_dir, "verify")
        assert ver.returncode == 0, ver.stdout + ver.stderr
    m = re.search(r"p02 on (lab\d+), d02 on (lab\d+)", out)
    assert m, out
    for host, iid in ((m.group(1), "p02"), (m.group(2), "d02")):
        c = lab.connection(host)
        shown = c.run(f"systemctl show -p LoadState -p ActiveState pdops-{iid}.service; "
                      f"ls /etc/systemd/system/pdops-{iid}.service 2>&1 || true", hide=True, warn=True).stdout
        c.close()
        assert "LoadState=not-found" in shown and "ActiveState=inactive" in shown and "No such file" in shown, shown


def probe(inv_dir, root, kind, *more):
    proc = cli(inv_dir, "probe", "--bundle", str(root / f"{kind}.yml"), "--spare", "--workload", "380k/8", *more)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_bad_input_is_refused_before_any_host_is_touched(live, tmp_path):
    inv_dir, root = live
    before = baseline(inv_dir)
    ops = len(record(inv_dir).journal().operations())
    bad = {"unknown": "flags: {chunked-prefil-size: 16384}\n", "type": "flags: {mem-fraction-static: lots}\n",
           "hetero": "prefill: {chunked-prefill-size: 8192}\ndecode: {chunked-prefill-size: 4096}\n"}
    for k, text in bad.items():
        (tmp_path / f"{k}.yml").write_text(text)
        proc = cli(inv_dir, "probe", "--bundle", str(tmp_path / f"{k}.yml"), "--spare")
        assert proc.returncode == 2 and "invalid input" in proc.stderr.lower(), proc.stderr
    last = cli(inv_dir, "probe", "--bundle", str(root / "ok.yml"), "--instances", "p01,d01")
    assert last.returncode != 0 and "last serving prefill" in last.stderr and "--spare" in last.stderr
    assert len(record(inv_dir).journal().operations()) == ops and baseline(inv_dir) == before


def test_three_probes_the_table_and_the_restored_baseline(lab, live):
    inv_dir, root = live
    before = baseline(inv_dir)
    out = probe(inv_dir, root, "oom")
    assert "changes 2 variable(s)" in out and "multi-variable" in out
    assert "probe T1 of bundle 'T2' on p02, d02: 0/4 ok, 4/4 OOM [multi-variable]" in out
    assert_baseline(lab, inv_dir, before, out)
    # `inv journal` lists it as every operation: one verdict (a probe once ended with its result alone)
    from pdops.record.commands import operations

    row = operations(record(inv_dir).journal())[-1]
    assert (row["operation"], row["verdict"]) == ("probe", "ok"), row

    out = probe(inv_dir, root, "ok")
    assert_journal_walks_the_printed_plan(record(inv_dir), "probe", out, {"probe-remove"})
    assert "changes 1 variable(s)" in out and "--max-running-requests: 64 -> 4" in out
    assert "probe T2 of bundle 'T6' on p02, d02: 4/4 ok" in out and "[mixed]" not in out
    assert_baseline(lab, inv_dir, before, out)

    # a transfer fault on the spare prefill for long prompts (short canaries pass): the window is mixed
    hosts = inv_dir / "hosts.yml"
    doc = yaml.safe_load(hosts.read_text())
    doc["all"]["vars"]["pdops_sim_faults"] = {"p02": "fail_transfer_above=100000"}
    hosts.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = probe(inv_dir, root, "mixed")
    assert "probe T3 of bundle 'T5' on p02, d02: 0/4 ok, 3/4 OOM, 1/4 transfer failure [multi-variable] [mixed]" in out
    assert_baseline(lab, inv_dir, before, out, verify=True)

    note = cli(inv_dir, "probe", "--note", "T1", "--reading", "static 0.75 leaves no workspace: do not raise it further")
    assert note.returncode == 0, note.stderr
    table = cli(inv_dir, "probe", "--list", "--json")
    rows = json.loads(table.stdout)
    assert [(r["probe"], r["result"], r["mixed"], r["n_variables"]) for r in rows] == [
        ("T1", "0/4 ok, 4/4 OOM", False, 2), ("T2", "4/4 ok", False, 1),
        ("T3", "0/4 ok, 3/4 OOM, 1/4 transfer failure", True, 2)]
    oom = [s for s in rows[0]["signatures"] if s["kind"] == "exception"]
    assert len(oom) == 1 and oom[0]["exception"] == "torch.OutOfMemoryError" and oom[0]["count"] == 4
    assert oom[0]["top_frames"][0].endswith("_low_ratio_index_topk_extend") and oom[0]["alloc_gib"] > 0
    assert rows[1]["signatures"] == []
    assert any(s["kind"] == "transfer" for s in rows[2]["signatures"])
    assert "1 request(s) ended in a transfer failure" in rows[2]["mixed_reasons"][0]
    assert rows[0]["notes"][-1]["note"].startswith("static 0.75")
    text = cli(inv_dir, "probe", "--list").stdout
    assert "T1" in text and "[mixed]" in text and "static 0.75 leaves" in text
    csv_path = root / "probes.csv"
    assert cli(inv_dir, "probe", "--list", "--csv", str(csv_path)).returncode == 0
    assert csv_path.read_text().splitlines()[0].startswith("probe,when,operator")


@pytest.fixture(scope="module")
def live_2p2d(lab, live, tmp_path_factory):
    """After the spare probes: a 2p2d cluster (every slot taken), for probes on serving pairs."""
    root = tmp_path_factory.mktemp("probe2")
    _write_bundles(root)
    with deployed(lab, root / "c", "2p2d", profile=PROFILE) as c:
        yield c.inv_dir, root


def test_a_serving_pair_is_probed_out_of_the_gateway_restored_or_kept(live_2p2d):
    inv_dir, root = live_2p2d
    rev0 = record(inv_dir).current_revision()
    spare = cli(inv_dir, "probe", "--bundle", str(root / "ok.yml"), "--spare")
    assert spare.returncode != 0 and "no free GPUs for a spare" in spare.stderr
    out = cli(inv_dir, "probe", "--bundle", str(root / "oom.yml"), "--instances", "p02,d02", "--workload", "380k/8")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "probe T1 of bundle 'T2' on p02, d02: 0/4 ok, 4/4 OOM" in out.stdout
    # the way back is a recorded change: the revision's files, new processes, registered and ok
    rev1 = record(inv_dir).current_revision()
    assert rev1.number == rev0.number + 1
    from pdops.remote.hosts import http_json
    from pdops.model.inventory import load_inventory
    from pdops.model.placement import Placement
    from pdops.model.render import manifest, render_files

    inv = load_inventory(inv_dir)
    assert manifest(render_files(inv, Placement.from_dict(rev1.placement))) == rev1.manifest
    st = cli(inv_dir, "status", "--json")
    assert st.returncode == 0, st.stdout
    assert {r["instance"]: r["state"] for r in json.loads(st.stdout)["instances"]} == {
        "p01": "ok", "p02": "ok", "d01": "ok", "d02": "ok"}
    # --keep with a bundle whose every request is ok: the pair stays on it, as a new revision
    kept = cli(inv_dir, "probe", "--bundle", str(root / "ok.yml"), "--instances", "p02,d02", "--workload", "380k/8",
               "--keep")
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "4/4 ok" in kept.stdout and "kept as a new revision" in kept.stdout
    assert_journal_walks_the_printed_plan(record(inv_dir), "probe", kept.stdout, {"restore", "keep"})
    statuses = {r["step"]: r["status"] for r in record(inv_dir).journal().read(
        [o for o in record(inv_dir).journal().operations() if o.startswith("probe-")][-1])}
    assert statuses["restore"] == "noop" and statuses["keep"] == "ok"  # the condition decided, as printed
    rev2 = record(inv_dir).current_revision()
    assert rev2.number == rev1.number + 1
    pl2 = Placement.from_dict(rev2.placement)
    for iid, want in (("p02", 4), ("d02", 4), ("p01", 64), ("d01", 64)):  # what the processes report
        assert http_json("GET", pl2.get(iid).url + "/server_info", timeout=10)[1]["max_running_requests"] == want
    ver = cli(inv_dir, "verify")
    assert ver.returncode == 0, ver.stdout + ver.stderr
    plan = cli(inv_dir, "deploy", "--topology", "2p2d", "--dry-run")
    assert "replaced: p02" in plan.stdout and "replaced: d02" in plan.stdout  # the inventory still says the baseline
