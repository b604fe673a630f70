"""The short soak inside `make test`: ten operations and faults in a seeded order on one 2p2d lab
cluster under a closed loop of streaming requests (tests/lab/soak.py, which `make soak` runs for 100).

The ten are every kind the soak knows but host-add (it needs a fifth lab host; tests/lab/test_change.py adds
one), once, and a second drain: drain, scale (there and back),
rolling change, rollback, host maintenance (drain --host, uncordon, deploy), engine SIGKILL +
repair, gateway SIGKILL + deploy, a reboot of every host + deploy, a change halted by a bundle whose
engines cannot start. After each one the cluster serves with every instance ok; every request that did not get
its whole answer falls inside a fault's window or was named by pdops as lost; none reached two
prefills or two decodes.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from tests.lab.clusters import REPO, stop_all
from tests.lab.soak import OPS, Soak, soak_cluster

pytestmark = pytest.mark.lab

SEED = 11


def test_ten_operations_and_faults_in_a_seeded_order_leave_the_cluster_serving_and_lose_nothing_unnamed(
        lab, tmp_path):
    sequence = [op for op in OPS if op != "host-add"] + ["drain"]  # host-add needs a fifth lab host
    random.Random(SEED).shuffle(sequence)
    lab.ensure_up()
    inv_dir = soak_cluster(lab, tmp_path / "soak")
    try:
        soak = Soak(lab, inv_dir, SEED)
        result = soak.run(len(sequence), sequence)
    finally:
        stop_all(lab)
    s = result["summary"]
    print(f"\nsoak of {len(sequence)} (seed {SEED}): " + json.dumps(s))
    assert s["operations"] == 10 and {d["op"] for d in result["operations"]} == set(OPS) - {"host-add"}
    assert not s["left_not_serving"], s
    assert not s["operation_errors"], s
    assert not s["unexpected_exits"], s  # every command of every runbook it follows exits as documented
    assert not s["lost_outside_fault_windows"], s
    assert not s["replayed"], s
    assert s["requests"] > 100, "the closed loop hardly ran"
    # the soak's page: every operation on one timeline beside the requests ok and not ok each second
    from pdops.ops.report import embedded_data
    from tests.lab.soak import write_page

    page = write_page(result, tmp_path / "soak.html", SEED)
    data = embedded_data(page.read_text())
    assert [x["label"] for x in data["spans"]] == [f"{d['n']} {d['op']}" for d in result["operations"]]
    assert sum(data["per_second"]["ok"]) + sum(data["per_second"]["not_ok"]) == s["requests"]
    assert sum(data["per_second"]["not_ok"]) == s["not_ok"]
    assert [x["fault_window"] is not None for x in data["spans"]] == [d["fault_window"] is not None
                                                                      for d in result["operations"]]
    art = Path(os.environ.get("PDOPS_TEST_ARTIFACTS") or REPO / "build" / "test-artifacts")
    art.mkdir(parents=True, exist_ok=True)
    (art / "soak-lab.html").write_text(page.read_text())
    print(f"soak page: {art / 'soak-lab.html'}")
