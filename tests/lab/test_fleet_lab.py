"""A fleet, not a lab (issue #35): deploy and drain on 32 lab hosts, as on 4.

Not part of `make test` (its time goal has no room for a 32-host lab): `make test-fleet` runs it with
PDOPS_LAB_HOSTS=32, and `make bench` calls that. 24p8d, one TP8 instance per host, the sim's model
load 0 s; then `inv status` and `inv verify` see every instance serve, and a drain of p01 under a
closed loop of requests through the gateway loses, refuses and replays none.
"""

from __future__ import annotations

import json

import pytest

from tests.lab.clusters import Load, cli, deployed, never_twice, record

pytestmark = [pytest.mark.lab, pytest.mark.fleet]
HOSTS = 32


@pytest.fixture(scope="module")
def fleet(lab, tmp_path_factory):
    if lab.n < HOSTS:
        pytest.skip(f"needs a lab of {HOSTS} hosts: `make test-fleet` (PDOPS_LAB_HOSTS={HOSTS}); this one has {lab.n}")
    topo = f"{HOSTS - HOSTS // 4}p{HOSTS // 4}d"
    with deployed(lab, tmp_path_factory.mktemp("fleet"), topo,
                  profile={"env": {"PDOPS_SIM_STARTUP_S": "0", "PDOPS_SIM_SHUTDOWN_POLL_S": "1"}}) as d:
        yield d.inv_dir, topo


def test_status_and_verify_see_every_instance_of_32_hosts_serve(fleet):
    inv_dir, topo = fleet
    proc = cli(inv_dir, "status", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert len(doc["instances"]) == HOSTS and all(r["state"] == "ok" for r in doc["instances"]), \
        [r for r in doc["instances"] if r["state"] != "ok"][:3]
    assert sorted({h for r in doc["instances"] for h in r["hosts"]}) == [f"lab{i:02d}" for i in range(1, HOSTS + 1)]
    proc = cli(inv_dir, "verify")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_drain_on_32_hosts_loses_no_request_and_leaves_the_rest_serving(lab, fleet):
    inv_dir, topo = fleet
    from pdops.model.inventory import load_inventory

    url = load_inventory(inv_dir).gateway.first.url
    with Load(url, prefix="fleet-drain") as load:
        proc = cli(inv_dir, "drain", "--instance", "p01")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    load.assert_clean()
    never_twice(lab, inv_dir, "fleet-drain")
    rev = record(inv_dir).current_revision()
    assert "p01" not in rev.instances and len(rev.instances) == HOSTS - 1
    proc = cli(inv_dir, "verify")
    assert proc.returncode == 0, proc.stdout + proc.stderr
