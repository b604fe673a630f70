"""The short soak inside `make test`: every operation and fault the soak knows, in a seeded order, on
one 2p2d lab cluster of the soak's front-door shape (two gateways behind HAProxy, every request through
it with an API key, the record on etcd members pdops runs) under a closed loop of streaming requests
(tests/lab/soak.py, which `make soak` runs for 100).

Ten operations: every fault kind, the reboot twice (once each way a host boots), and the operations only
the front door has, with the rollback: engine SIGKILL + repair, a gateway SIGKILLed + deploy, a reboot of
every host + the runbook (the real way: every enabled unit starts by itself; the lab's way: nothing does,
etcd first), a change halted by a bundle whose engines cannot start, a gateway's host powered off, an
etcd member SIGKILLed during a drain, a planned restart of both gateways, a fenced change of generation,
and a rollback. The soak's other kinds (drain, scale, rolling change, host maintenance, host-add) are each
a lab test of their own (test_drain, test_scale, test_change) and in `make soak`'s sequences; they left the
make-test soak to keep it to the ten operations the suite's time allows. After each one the cluster serves with every instance ok; every request that did not
get its whole answer falls inside a fault's window or was named by pdops as lost; none reached two
prefills or two decodes.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from tests.lab.clusters import REPO, stop_all
from tests.lab.soak import SHAPES, Soak, per_kind_table, soak_cluster

pytestmark = pytest.mark.lab

# seed 37: the rollback follows the gateways' planned restart, after the change of generation, so that it
# returns to a revision of the same generation (a real rollback of HAProxy's and smg's files), not a refusal
SEED = 37
# every fault kind, and what only the front door has (module doc)
KINDS = ("engine-kill", "gateway-kill", "reboot", "halted-change", "gateway-host-off", "etcd-kill", "gateway-restart",
         "generation", "rollback")


def test_every_operation_and_fault_behind_the_front_door_with_the_record_on_etcd_loses_nothing_unnamed(
        lab, tmp_path):
    kinds = [op for op in SHAPES["front-door"] if op in KINDS]
    sequence = kinds + ["reboot"]  # both ways a host boots
    assert len(sequence) == 10
    random.Random(SEED).shuffle(sequence)
    lab.ensure_up()
    inv_dir = soak_cluster(lab, tmp_path / "soak", "front-door")
    try:
        soak = Soak(lab, inv_dir, SEED)
        result = soak.run(len(sequence), sequence)
    finally:
        stop_all(lab)
    s = result["summary"]
    print(f"\nsoak of {len(sequence)} (seed {SEED}): " + json.dumps({k: v for k, v in s.items() if k != "per_kind"}))
    print(per_kind_table(s["per_kind"]))
    assert s["operations"] == len(sequence) and {d["op"] for d in result["operations"]} == set(kinds)
    assert [d["detail"].split("(")[1].split()[0] for d in result["operations"] if d["op"] == "reboot"] == \
        ["enabled", "lab"]
    assert not s["left_not_serving"], s
    assert not s["operation_errors"], s
    assert not s["unexpected_exits"], s  # every command of every runbook it follows exits as documented
    assert not s["lost_outside_fault_windows"], s
    assert not s["replayed"], s
    assert sorted(s["per_kind"]) == sorted(kinds) and sum(k["operations"] for k in s["per_kind"].values()) == len(sequence)
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
