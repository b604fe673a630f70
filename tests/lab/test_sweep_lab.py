"""`inv sweep` and `inv bench` end to end on the lab, through the CLI an operator runs.

The sim engines are set up to mimic a prefill-bound long-input workload (the field
report's plateau, seed report sections 4-6): 20k-token prompts, 32 output tokens, and a
prefill that computes 40,000 tokens/s, so one prefill instance serves about 2 requests/s
whatever the concurrency. On the 32-GPU budget (4 hosts x 8 virtual GPUs, TP8: four
instances) the sweep runs 3:1 (3p1d) and 1:1 (2p2d) at C1, C16 and C40: C1 leaves
prefills idle (one request at a time, and none while it decodes); at C16 every
prefill queue of 2p2d is already full, so total TPM stays flat while TTFT p99 keeps rising, and the knee
is marked. Everything asserted here is read back from the files the sweep wrote, and the
sweep's journal (the one plan, each step by its id) from the record.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from tests.lab.clusters import deployed, inv_cmd, record

from pdops.ops import bench as b

pytestmark = pytest.mark.lab

INPUT, OUTPUT = 20_000, 32
PREFILL_TPS = 40_000  # one prefill: ~2 requests/s of 20k tokens
PROFILE = {
    "workload": {"input_tokens": INPUT, "output_tokens": OUTPUT},
    "env": {
        "PDOPS_SIM_SHUTDOWN_POLL_S": "1",
        "PDOPS_SIM_PREFILL_TOKENS_PER_S": str(PREFILL_TPS),
        "PDOPS_SIM_DECODE_STEP_MS": "4",
        "PDOPS_SIM_DECODE_STEP_PER_REQ_MS": "0.02",
        # the KV payload is real bytes over loopback: keep it small on a 2-core machine
        "PDOPS_SIM_KV_BYTES_PER_TOKEN": "8",
    },
}
RATIOS = {"3:1": "3p1d", "1:1": "2p2d"}
CONCS = [1, 16, 40]
# 4 seconds of sending per run (then the requests in flight are waited out: at C40 that is another
# 7-10 s): six runs are most of this module's time, and 4 s keep every figure asserted below apart
# from its bound (6-second runs took about 12 s more for the same shape)
DURATION_S = 4
# Routing: round robin over equal requests keeps every prefill queue the same length. The
# gateway's default cache-aware policy balances by load only once queues are 64 requests
# apart, so with a few long prompts it leaves one prefill with a long queue and another
# idle at the end of a run, and a cell's figure swung by 15-25% from run to run.
ROUTING = {"policy": "round_robin"}
# A 4-second run carries its ramp and its drain in its wall clock, and the lab's 2 cores add
# noise: the knee threshold of this short run is 15%, not the 2% that runs of minutes use
# (with round robin, C16 -> C40 measured +0.03% to +2.03% over seven 6-second runs, -0.56% to
# +3.67% over four 4-second ones, and +9.6% for 3:1 in a `make test` beside a busy loop on one core,
# where C1 -> C16 gained +271%). The plateau is asserted as a shape: the second step gains under 15%
# (the knee rule) and less than the first.
MIN_GAIN = 0.15


@pytest.fixture(scope="module")
def swept(lab, tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    # nothing deployed here: the sweep deploys each ratio itself; the lab is clean again before the tests
    with deployed(lab, root / "c", None, profile=PROFILE,
                  mutate=lambda doc: doc["all"]["vars"]["pdops_gateway"].update(ROUTING)) as (inv, _):
        sweep = inv_cmd("sweep", "--budget", "32", "--ratios", ",".join(RATIOS), "--concurrency",
                        ",".join(map(str, CONCS)), "--duration", str(DURATION_S), "--timeout", "120",
                        "--min-gain", str(MIN_GAIN),
                        "-i", str(inv), "--out", str(root / "sweep"), timeout=900)
        bench = inv_cmd("bench", "--concurrency", "2", "--requests", "4", "--ignore-eos", "-i", str(inv),
                        "--out", str(root / "bench"), timeout=300)
    print(sweep.stdout)
    yield root, sweep, bench


def _matrix(root: Path) -> dict:
    return json.loads((root / "sweep" / "matrix.json").read_text())


def _cell(m: dict, ratio: str, conc: int) -> dict:
    (c,) = [c for c in m["cells"] if c["ratio"] == ratio and c["concurrency"] == conc]
    return c


def test_sweep_measures_every_planned_cell_and_writes_its_files(swept):
    root, proc, _ = swept
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = root / "sweep"
    for f in ("matrix.json", "matrix.csv", "matrix.txt", "tpm_vs_concurrency.png", "ttft_p99_vs_concurrency.png"):
        assert (out / f).stat().st_size > 0, f
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = _matrix(root)
    assert m["budget"] == 32 and m["gpus_per_instance"] == 8 and m["workload"] == "20k/32"
    assert m["topologies"] == RATIOS
    assert sorted((c["ratio"], c["concurrency"]) for c in m["cells"]) == sorted(
        (r, c) for r in RATIOS for c in CONCS)
    for c in m["cells"]:
        assert c["state"] == "measured", c
        assert len(c["runs"]) == 1 and not c["runs"][0].get("error") and not c["runs"][0]["mark"], c
    with open(out / "matrix.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(RATIOS) * len(CONCS) and {r["state"] for r in rows} == {"measured"}
    assert "measured" in (out / "matrix.txt").read_text()


def test_the_sweep_is_one_plan_in_the_journal_each_step_by_its_id(swept):
    root, proc, _ = swept
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = ["open-matrix"]
    for topo in RATIOS.values():
        ids += [f"sweep-scale {topo}"] + [f"sweep-run {topo} C{c} r1" for c in CONCS]
    for n, step in enumerate(ids, 1):  # what it printed before it ran
        assert f"{n:>2}. {step} — " in proc.stdout, step
    assert "A1. write-matrix — " in proc.stdout
    op = re.search(r"inv journal --op (sweep-\S+)`", proc.stdout).group(1)
    recs = record(root / "c").journal().read(op)
    plan = next(r for r in recs if r["step"] == "plan")["evidence"]
    assert plan["steps"] == ids and plan["always"] == ["write-matrix"]
    walked = [r for r in recs if r["step"] not in ("lock.held", "plan", "verdict")]
    assert [r["step"] for r in walked] == ids + ["write-matrix"]
    assert {r["status"] for r in walked} == {"ok"} and recs[-1]["step"] == "verdict" and recs[-1]["status"] == "ok"
    # each row's deploy or change is an operation of its own, walked under the sweep's lock
    scaled = {r["step"]: r["evidence"] for r in walked if r["step"].startswith("sweep-scale")}
    assert scaled["sweep-scale 3p1d"]["op"].startswith("deploy-") and scaled["sweep-scale 3p1d"]["revision"] == 1
    assert scaled["sweep-scale 2p2d"]["op"].startswith("scale-") and scaled["sweep-scale 2p2d"]["revision"] == 2
    # the change of the second row was printed in full before the sweep began, forecast from the revision the
    # first row was to record; planned again when its row started, it was that one: the steps its own
    # operation journalled are the ones printed
    printed = proc.stdout.split("[1/", 1)[0]
    block = printed.split("      plan: scale: lab from revision 1 (3p1d) to 2p2d\n", 1)[1].split("\n   7. ", 1)[0]
    change_ids = [m[1] for m in re.findall(r"^ {10}( \d|\d\d)\. (.+?) — ", block, re.M)]
    inner_plan = next(r for r in record(root / "c").journal().read(scaled["sweep-scale 2p2d"]["op"])
                      if r["step"] == "plan")["evidence"]
    assert change_ids == inner_plan["steps"] and "record" in change_ids, (change_ids, inner_plan["steps"])
    assert "[1:1] the change planned again from revision 1 is the one printed, step for step" in proc.stdout
    # and each cell's bench too: its plan's four steps and its verdict, by the op its sweep-run step names
    benched = [r["evidence"] for r in walked if r["step"].startswith("sweep-run")]
    assert all(ev["op"].startswith("bench-") for ev in benched), benched
    for ev in list(scaled.values()) + benched:
        inner = record(root / "c").journal().read(ev["op"])
        assert inner[-1]["step"] == "verdict" and inner[-1]["status"] == "ok", inner[-1]
    assert [r["step"] for r in inner if r["step"].startswith("bench-")] == [
        "bench-mark", "bench-load", "bench-check", "bench-write"]


def test_every_ledger_has_one_row_per_request_and_the_matrix_is_the_ledgers(swept):
    root, proc, _ = swept
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = _matrix(root)
    with open(root / "sweep" / "matrix.csv", newline="") as f:
        csv_rows = {(r["ratio"], int(r["concurrency"])): r for r in csv.DictReader(f)}
    for c in m["cells"]:
        run = c["runs"][0]
        run_dir = Path(run["run_dir"])
        rows, manifest = b.read_ledger(run_dir)
        with open(run_dir / b.LEDGER_CSV, newline="") as f:
            assert len(list(csv.DictReader(f))) == len(rows)
        # one row per request sent, each with its own id, none retried, all ended
        assert len(rows) == run["sent"] == manifest["figures"]["sent"] > 0
        assert len({r.rid for r in rows}) == len(rows)
        assert manifest["parameters"]["retries"] == 0
        assert all(r.status == "ok" and r.end is not None for r in rows), [r.to_dict() for r in rows if not r.ok][:2]
        assert all(r.prompt_tokens == INPUT and r.completion_tokens == OUTPUT for r in rows)
        assert manifest["topology"] == c["topology"] and manifest["gpus"] == 32
        assert manifest["parameters"]["concurrency"] == c["concurrency"]
        assert manifest["revision_check"]["changed"] is None
        # the matrix figures are the ledger's, recomputed with pdops.ops.bench
        wall = b.wall_clock(rows)
        tot = b.total_tpm(rows, wall)
        p99 = b.percentile(b.ttfts(rows), 99)
        assert run["total_tpm"] == pytest.approx(tot, rel=1e-12)
        assert run["output_tpm"] == pytest.approx(b.output_tpm(rows, wall), rel=1e-12)
        assert run["tpm_per_gpu"] == pytest.approx(b.tpm_per_gpu(tot, 32), rel=1e-12)
        assert run["ttft_p99"] == pytest.approx(p99, rel=1e-12)
        assert run["tpot_p99"] == pytest.approx(b.percentile(b.tpots(rows), 99), rel=1e-12)
        again = b.figures_of_run(run_dir).to_dict()
        assert {k: run[k] for k in again} == again
        row = csv_rows[(c["ratio"], c["concurrency"])]
        assert float(row["total_tpm"]) == pytest.approx(tot, rel=1e-12)
        assert float(row["ttft_p99"]) == pytest.approx(p99, rel=1e-12)
        assert int(row["sent"]) == len(rows) and int(row["ok"]) == len(rows)


def test_prefill_bound_throughput_plateaus_while_ttft_rises_and_the_knee_is_marked(swept):
    root, proc, _ = swept
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = _matrix(root)
    knees = {k["ratio"]: k for k in m["knees"]}
    for ratio in RATIOS:
        lo, mid, hi = (_cell(m, ratio, c)["runs"][0] for c in CONCS)
        # C1 keeps at most one prefill busy: C16 fills them all (2p2d at least 1.5x, 3p1d 2x)
        assert mid["total_tpm"] > 1.5 * lo["total_tpm"], (ratio, lo, mid)
        # the plateau: C16 -> C40 adds next to nothing while TTFT p99 keeps rising
        first_gain = (mid["total_tpm"] - lo["total_tpm"]) / lo["total_tpm"]
        second_gain = (hi["total_tpm"] - mid["total_tpm"]) / mid["total_tpm"]
        assert second_gain < MIN_GAIN and second_gain < first_gain, (ratio, first_gain, second_gain)
        assert hi["ttft_p99"] > 1.5 * mid["ttft_p99"], (ratio, mid, hi)
        assert knees[ratio]["concurrency"] == 16 and knees[ratio]["next_concurrency"] == 40, knees
        assert knees[ratio]["ttft_change"] > 0.5, knees
    # prefill-bound: the ratio with more prefills serves more, on the same GPUs
    best = {r: max(_cell(m, r, c)["runs"][0]["total_tpm"] for c in CONCS) for r in RATIOS}
    assert best["3:1"] > 1.2 * best["1:1"], best
    text = (root / "sweep" / "matrix.txt").read_text()
    for line in ("knee: 3p1d (3:1): knee at C16", "knee: 2p2d (1:1): knee at C16"):
        assert line in text and line in proc.stdout


def test_bench_writes_ledger_and_manifest_with_revision_topology_profile_versions(swept):
    root, _, proc = swept
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows, manifest = b.read_ledger(root / "bench")
    assert len(rows) == 4 and all(r.ok for r in rows) and len({r.rid for r in rows}) == 4
    assert (root / "bench" / b.LEDGER_CSV).stat().st_size > 0
    # the sweep left the cluster at its last topology (deploy 3p1d = revision 1, scale = 2)
    assert manifest["topology"] == "2p2d" and manifest["revision"]["number"] == 2
    assert manifest["revision"]["topology"] == "2p2d" and manifest["revision"]["inventory_hash"]
    assert manifest["profile"]["name"] == "lab-sim" and manifest["profile"]["parallel"]["tp"] == 8
    assert manifest["gpus"] == 32
    assert manifest["parameters"]["workload"] == "20k/32" and manifest["parameters"]["retries"] == 0
    v = manifest["versions"]
    assert v["pdops"] and v["engine"] == "sim" and v["sim_of_sglang"] and v["smg"]
    assert manifest["invalid"] is None and manifest["prompt_tokens_mismatch"] == 0
    assert b.figures_of_run(root / "bench").to_dict() == manifest["figures"]
    assert "verdict: all 4 requests succeeded" in proc.stdout
    # an operation as every other: its plan printed, then each step and one verdict in the journal
    assert "plan: bench " in proc.stdout and " 2. bench-load — " in proc.stdout, proc.stdout
    recs = record(root / "c").journal().read(manifest["run_id"])
    assert [r["step"] for r in recs if r["step"] != "lock.held"] == [
        "plan", "bench-mark", "bench-load", "bench-check", "bench-write", "verdict"], recs
    assert recs[-1]["status"] == "ok" and recs[-1]["evidence"]["invalid"] is None
