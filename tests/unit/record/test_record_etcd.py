"""The record on etcd (issue #36): the same record as on a state host, through the same
interface, on a real etcd (Debian's etcd-server, one member on 127.0.0.1 with ports of its own,
started here and stopped by its PID). The lab's three-member cluster: tests/lab/test_record_etcd_lab.py."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from pdops.errors import InvalidInput, Refused, Unreachable, Unverified
from pdops.model.inventory.schema import EtcdSetting
from pdops.record import HostStore, LocalTransport, SharedRecord, operations, unlock
from pdops.sim.testing import wait_until
from pdops.record.etcdstore import EtcdSession, EtcdStore
from pdops.remote import etcd as E

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_etcd(d: Path, *, tls: dict | None = None):
    """One etcd member on 127.0.0.1 (installed by scripts/setup-system.sh) with its data in `d`, until
    the block ends (stopped by its PID). `tls`: the server's files, and client certificates required."""
    assert os.path.exists(ETCD), "etcd is not installed: run scripts/setup-system.sh (make env)"
    client, peer = _free_port(), _free_port()
    url = f"{'https' if tls else 'http'}://127.0.0.1:{client}"
    extra = ["--cert-file", tls["server_cert"], "--key-file", tls["server_key"], "--client-cert-auth",
             "--trusted-ca-file", tls["ca"]] if tls else []
    log = open(d / "etcd.log", "w")
    proc = subprocess.Popen([ETCD, "--name", "unit", "--data-dir", str(d / "data"), "--listen-client-urls", url,
                             "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"unit=http://127.0.0.1:{peer}", *extra],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        probe = E.Etcd([url], timeout=1.0, **({k: tls[k] for k in ("ca", "cert", "key")} if tls else {}))

        def leader():  # ready: the member answers its status with a leader
            assert proc.poll() is None, (d / "etcd.log").read_text()[-2000:]
            try:
                return probe.status(url).get("leader")
            except Unreachable:
                return None

        wait_until(leader, 30, "etcd to elect itself leader")
        probe.close()
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        log.close()


@pytest.fixture(scope="module")
def etcd_url(tmp_path_factory):
    with running_etcd(tmp_path_factory.mktemp("etcd")) as url:
        yield url


_n = iter(range(1_000_000))


@pytest.fixture
def setting(etcd_url):
    """A fresh prefix (a cluster of its own) in the module's etcd, behind one dead endpoint."""
    return EtcdSetting(("http://127.0.0.1:9", etcd_url), f"/pdops/t{os.getpid()}-{next(_n)}/")


def rec(tmp_path: Path, who: str, setting, **kw) -> SharedRecord:
    return SharedRecord("lab", tmp_path / who, EtcdStore("lab", setting), **kw)


def deploy(r: SharedRecord, topology="1p1d", op="deploy", snapshot=None) -> int:
    with r.lock(op, say=lambda s: None) as lk:
        rev = r.write_revision(topology=topology, inventory_hash="h", placement={}, manifest={}, instances={},
                               op_id=lk.op_id, outcome="deployed", snapshot=snapshot)
        r.set_current(rev.number)
        r.journal().step(lk.op_id, "verdict", "ok", {"revision": rev.number})
    return rev.number


@pytest.fixture(params=["host", "etcd"])
def either(request, tmp_path):
    """A record maker for each store: the state host's script run locally, and etcd."""
    if request.param == "host":
        return lambda who, **kw: SharedRecord("lab", tmp_path / who, HostStore(
            "lab", "localhost", str(tmp_path / "shared"), LocalTransport()), **kw)
    s = request.getfixturevalue("setting")
    return lambda who, **kw: rec(tmp_path, who, s, **kw)


def test_both_stores_answer_the_same_record(either):
    """Revisions, current, the lock and the journal read the same from a second operator, on either store."""
    alice, bob = either("alice"), either("bob")
    assert bob.current() is None and bob.lock_holder() is None
    n1 = deploy(alice, "1p1d")
    n2 = deploy(alice, "2p1d")
    bob = either("bob")
    assert (bob.current(), bob.revision_numbers(), bob.read_revision(n2).topology) == (n2, [n1, n2], "2p1d")
    assert bob.previous().number == n1
    rows = operations(bob.journal(), last=1)
    assert len(rows) == 1 and rows[0]["verdict"] == "ok" and rows[0]["operator"]
    with alice.lock("drain", say=lambda s: None):
        with pytest.raises(Refused, match="is locked by .* running 'drain'"):
            either("carol").lock("scale", say=lambda s: None).acquire()
    assert either("carol").lock_holder() is None  # released


def test_journal_reads_only_the_operations_they_show(either):
    """`inv journal --last N`, `--op ID` and the tag reads (probe table, kill-survivors) on either store."""
    r = either("alice")
    ids = []
    for i in range(7):
        with r.lock("drain", say=lambda s: None) as lk:
            j = r.journal()
            for k in range(3 + i):
                j.step(lk.op_id, f"s{k}", "ok", {"instance": f"p0{i % 2}", "survivors": [] if k == 0 else None})
            ids.append(lk.op_id)
    j = either("bob").journal()
    last = j.last_operations(2)
    assert [r["op_id"] for r in last] == [ids[5]] * 9 + [ids[6]] * 10
    assert [s["step"] for s in j.read(ids[3])] == ["lock.held"] + [f"s{k}" for k in range(6)]
    assert [s["op_id"] for s in j.tagged("stop:p01")] == [ids[1], ids[3], ids[5]]
    assert [o["op_id"] for o in operations(j, last=3)] == ids[4:]


def test_a_16_host_snapshot_round_trips_in_parts(tmp_path, setting, monkeypatch):
    """A revision's rollback snapshot is stored in content-addressed parts, read back whole and
    checked against its digest. Rendered files of a 16-host 12p4d are 58 KiB (of 256 hosts, 782 KiB;
    docs/state.md): the parts are made 16 KiB here so that this one has four."""
    import pdops.record.etcdstore as es
    from pdops.lab import grown_fleet
    from pdops.model.build import render_build
    from pdops.model.inventory import load_inventory
    from pdops.model.placement import place
    from pdops.model.render import snapshot_of
    from pdops.model.topology import parse_topology

    inv = load_inventory(grown_fleet(tmp_path / "fleet16", 16))
    _, files = render_build(inv, place(inv, parse_topology("12p4d")), tmp_path / "build")
    snap = snapshot_of(inv, files)
    size = len(json.dumps(snap, sort_keys=True))
    monkeypatch.setattr(es, "PART_BYTES", 16 * 1024)
    n = deploy(rec(tmp_path, "alice", setting), "12p4d", snapshot=snap)
    store = EtcdStore("lab", setting)
    head = json.loads(store.etcd.range(setting.prefix + f"snap/{n:08d}").kvs[0].value)
    assert len(head["parts"]) == -(-size // es.PART_BYTES) >= 4 and head["bytes"] == size
    assert rec(tmp_path, "bob", setting).revision_snapshot(n) == json.loads(json.dumps(snap))
    # a second revision with the same files adds no part: they are shared
    before = store.etcd.range(setting.prefix + "blob/", prefix=True, count_only=True).count
    deploy(rec(tmp_path, "alice", setting), "12p4d", snapshot=snap)
    assert store.etcd.range(setting.prefix + "blob/", prefix=True, count_only=True).count == before


def test_two_operators_racing_for_the_lock_exactly_one_holds_it(tmp_path, setting):
    """Eight contenders at once, five rounds: each round exactly one acquires; the rest are refused
    naming the holder (a compare-and-swap on the lock key, not a read then a write)."""
    for round_ in range(5):
        results, barrier = [], threading.Barrier(8)

        def contend(i):
            r = rec(tmp_path, f"op{i}", setting)
            lk = r.lock(f"change{i}", say=lambda s: None)
            barrier.wait()
            try:
                lk.acquire()
                results.append(("held", lk))
            except Refused as e:
                results.append(("refused", str(e)))

        threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
        [t.start() for t in threads]
        [t.join(30) for t in threads]
        held = [x for k, x in results if k == "held"]
        assert len(results) == 8 and len(held) == 1, results
        held[0].release()


def test_a_holder_whose_lease_expired_writes_nothing_and_the_next_change_reports_it(tmp_path, setting):
    """A holder that falls silent (no keepalive) loses the lock when its lease ends; its writes are
    refused, `current` included, even to a revision it wrote itself while it held the lock; the next
    operation takes the lock and journals the interrupted one."""
    r = rec(tmp_path, "alice", setting)
    n1 = deploy(r)
    store = EtcdStore("lab", setting)
    late = [{"op": "journal", "line": json.dumps({"op_id": "drain-1", "step": "late", "status": "ok"})}]
    for i, after_expiry in enumerate(late + [{"op": "set-current"}]):
        sess = EtcdSession(store, {"operator": "alice", "op_id": f"drain-{i + 1}", "operation": "drain"}, lease_s=2)
        first = sess.first()
        assert first["ok"] and first["holder"]["lease"]
        n2 = sess.request({"op": "put-revision", "doc": {"topology": "2p1d", "outcome": "pending"}, "number": None})["number"]
        sess.request({"op": "journal", "line": json.dumps({"op_id": f"drain-{i + 1}", "step": "wait-empty",
                                                           "status": "running"})})
        # no keepalive: the lease (2 s, etcd's minimum) runs out
        wait_until(lambda: not store.etcd.range(setting.prefix + "lock").kvs, 15, "the lock's lease to run out")
        with pytest.raises(Unreachable, match="lost the cluster lock"):
            sess.request(dict(after_expiry, number=n2) if after_expiry["op"] == "set-current" else after_expiry)
    bob = rec(tmp_path, "bob", setting)
    assert bob.current() == n1 and bob.lock_holder()["holder_alive"] is False
    said = []
    with bob.lock("deploy", say=said.append) as lk:
        assert lk.interrupted["op_id"] == "drain-2"
    assert "did not finish: its last journalled step is 'wait-empty'" in said[0]
    # the late line was never written; the next holder noted that the lease ran out
    assert [s["step"] for s in bob.journal().read("drain-1")] == ["wait-empty", "lock.lease-expired"]


def test_forced_unlock_revokes_the_lease_and_the_holders_next_write_fails(tmp_path, setting):
    alice = rec(tmp_path, "alice", setting)
    lk = alice.lock("drain", say=lambda s: None).acquire()
    with pytest.raises(InvalidInput, match="--reason"):
        unlock(rec(tmp_path, "bob", setting), force=True, reason=" ")
    with pytest.raises(Refused, match="locked by"):
        unlock(rec(tmp_path, "bob", setting), force=False, reason=None)
    res = unlock(rec(tmp_path, "bob", setting), force=True, reason="alice's laptop died")
    assert "revoking its lease" in res["message"]
    with pytest.raises(Unreachable, match="lost the cluster lock"):
        alice.set_current(1)
    lk.release()
    forced = [r for r in rec(tmp_path, "carol", setting).journal().read(res["op_id"])]
    assert forced[0]["step"] == "lock.unlock-forced" and forced[0]["evidence"]["reason"] == "alice's laptop died"


def test_another_clusters_prefix_or_a_newer_format_is_refused(tmp_path, setting):
    deploy(rec(tmp_path, "alice", setting))
    other = SharedRecord("prod-a", tmp_path / "x", EtcdStore("prod-a", setting))
    with pytest.raises(InvalidInput, match="cluster 'lab'"):
        other.current()
    EtcdStore("lab", setting).etcd.txn([], [E.put(setting.prefix + "format", json.dumps({"format": 99, "cluster": "lab"}))])
    with pytest.raises(Refused, match="newer pdops"):
        rec(tmp_path, "bob", setting).current()


def test_no_member_answering_refuses_changes_and_reads_come_from_the_marked_cache(tmp_path, setting):
    deploy(rec(tmp_path, "alice", setting))
    assert rec(tmp_path, "alice", setting).current() == 1  # cached by this read
    down = EtcdSetting(("http://127.0.0.1:9", "http://127.0.0.2:9"), setting.prefix)
    with pytest.raises(Unreachable, match="no etcd member answered") as e:
        rec(tmp_path, "alice", down).lock("drain", say=lambda s: None).acquire()
    assert e.value.exit_code == 3 and e.value.fix.startswith("check the members")
    # members pdops runs (after a reboot nothing starts them on the lab): the fix names the command
    ours = EtcdSetting(down.endpoints, setting.prefix, members=("lab01", "lab02"), member_addrs=("127.0.0.1", "127.0.0.2"))
    with pytest.raises(Unreachable) as e:
        rec(tmp_path, "alice", ours).lock("drain", say=lambda s: None).acquire()
    assert e.value.fix.startswith("start the etcd members pdops runs on lab01, lab02: `inv state.etcd-up`"), e.value.fix
    with pytest.raises(Unreachable) as e:
        rec(tmp_path, "bob", ours).current()  # no cached copy here: the read alone refuses, with the same fix
    assert "`inv state.etcd-up`" in e.value.fix, e.value.fix
    cached = rec(tmp_path, "alice", down, cached_ok=True)
    assert cached.current() == 1 and "READ-ONLY CACHED COPY" in cached.cache_banner()
    assert "etcd" in cached.cache_banner()
    # `inv status` after a reboot the lab's way (every member down) reads the cached copy: its banner names the
    # store and, where pdops runs the members, the command that starts them (the hosts-rebooted runbook's step 0)
    from pdops.reads.status import record_doc, record_lines

    ours_cached = rec(tmp_path, "alice", ours, cached_ok=True)
    assert ours_cached.current() == 1
    [banner] = record_lines(record_doc(ours_cached))
    assert banner.startswith("READ-ONLY CACHED COPY of the record (fetched "), banner
    assert "etcd (2 endpoints) cannot be reached (no etcd member answered" in banner, banner
    assert banner.endswith("-> start the etcd members pdops runs on lab01, lab02: `inv state.etcd-up` (their units are "
                           "enabled; on the lab's default boot, or where one failed at boot, nothing else starts them), "
                           "then run this again"), banner


# ---------------------------------------------------------------- migration and restore

def _opener(tmp_path, setting, who="alice"):
    """`pdops.record.open_record` for an inventory whose state host is this machine and whose etcd
    is the module's: `backend` picks the store, as for `inv state.migrate`."""
    def open_record(inv, *, cached_ok=False, backend=None):
        store = EtcdStore("lab", setting) if (backend or inv.state.backend) == "etcd" else \
            HostStore("lab", "localhost", str(tmp_path / "shared"), LocalTransport())
        return SharedRecord("lab", tmp_path / who, store, cached_ok=cached_ok)
    return open_record


def _inv(tmp_path, setting, backend="host"):
    from types import SimpleNamespace

    from pdops.model.inventory.schema import StateLocation

    return SimpleNamespace(cluster="lab", state=StateLocation("localhost", str(tmp_path / "shared"), backend, setting))


def test_migration_to_etcd_and_back_copies_everything_and_marks_the_source(tmp_path, setting):
    from pdops.ops.record_store import digest, migrate, read_whole

    open_record = _opener(tmp_path, setting)
    host_inv, etcd_inv = _inv(tmp_path, setting, "host"), _inv(tmp_path, setting, "etcd")
    deploy(open_record(host_inv), "1p1d", snapshot={"files": [{"host": "lab01", "path": "/x", "content": "a" * 999}]})
    deploy(open_record(host_inv), "2p1d")
    before = digest(read_whole(open_record(host_inv)))
    said = []
    dry = migrate(host_inv, "etcd", open_record, say=said.append, dry_run=True)
    assert "would copy 2 revisions (1 snapshots), current 2" in dry["message"] and "now empty" in dry["message"]
    assert said[0].startswith("plan: move the record of lab from localhost:") and "mark-moved" in said[0]
    assert rec(tmp_path, "x", setting).revision_numbers() == []  # a dry run wrote nothing
    res = migrate(host_inv, "etcd", open_record, say=said.append)
    copied = res["copied"]
    same = ("revisions", "revisions_sha256", "snapshots", "snapshots_sha256", "current")
    assert {k: copied[k] for k in same} == {k: before[k] for k in same}
    lines = open_record(etcd_inv).journal().records()
    # the journal as read by the copy: every earlier line, then the migration's own first ones
    assert len(lines) == copied["journal_lines"] + 2 and {r["op_id"] for r in lines[before["journal_lines"]:]} == {res["op"]}
    # the source now refuses a lock and names where the record went; etcd serves it
    with pytest.raises(Refused, match="moved from localhost:.* to etcd"):
        open_record(host_inv).current()
    # a pdops that does not know the moved mark (record format 1 only) refuses the old copy as newer
    assert json.loads((tmp_path / "shared" / "format.json").read_text())["format"] == 2
    assert open_record(etcd_inv).current() == 2 and open_record(etcd_inv).revision_snapshot(1)["files"][0]["path"] == "/x"
    ops = operations(open_record(etcd_inv).journal(), last=5)
    assert ops[-1]["op_id"] == res["op"] and ops[-1]["verdict"] == "no verdict"  # its verdict is in the source
    deploy(open_record(etcd_inv), "3p1d")  # changes run on etcd now
    # and back: the state host's older copy is contained in etcd's, so it is set aside (kept), not refused
    back = migrate(etcd_inv, "host", open_record, say=said.append)
    assert back["copied"]["revisions"] == 3
    assert open_record(host_inv).current() == 3 and open_record(host_inv).history()[-1].topology == "3p1d"
    assert [p.name for p in (tmp_path / "shared").iterdir() if p.name.startswith("set-aside-")]
    assert json.loads((tmp_path / "shared" / "format.json").read_text())["format"] == 1
    fmt = EtcdStore("lab", setting).etcd.range(setting.prefix + "format").kvs[0]
    assert json.loads(fmt.value)["format"] == 2
    with pytest.raises(Refused, match="moved"):
        open_record(etcd_inv).lock("drain", say=lambda s: None).acquire()


def test_migration_is_refused_while_the_lock_is_held_and_into_a_different_record(tmp_path, setting):
    from pdops.ops.record_store import migrate

    open_record = _opener(tmp_path, setting)
    host_inv = _inv(tmp_path, setting, "host")
    deploy(open_record(host_inv))
    with open_record(host_inv).lock("drain", say=lambda s: None):
        with pytest.raises(Refused, match="is locked by"):
            migrate(host_inv, "etcd", open_record, say=lambda s: None)
    deploy(rec(tmp_path, "bob", setting), "4p4d")  # etcd holds another record already
    with pytest.raises(Refused, match="not an earlier copy"):
        migrate(host_inv, "etcd", open_record, say=lambda s: None)
    assert open_record(host_inv).current() == 1  # the source is unmarked, still the record


def test_restore_from_cache_rebuilds_the_revisions_and_says_the_journal_is_lost(tmp_path, setting):
    from pdops.ops.record_store import restore_from_cache

    shared = tmp_path / "shared"
    alice = SharedRecord("lab", tmp_path / "alice", HostStore("lab", "localhost", str(shared), LocalTransport()))
    deploy(alice, "1p1d")
    deploy(SharedRecord("lab", tmp_path / "alice", HostStore("lab", "localhost", str(shared), LocalTransport())),
           "2p1d", snapshot={"files": []})
    shutil.rmtree(shared)  # the state host's disk is gone
    new = SharedRecord("lab", tmp_path / "alice", HostStore("lab", "localhost", str(tmp_path / "new"), LocalTransport()))
    assert new.current() is None  # an empty store: the cache holding revisions is kept, not overwritten
    assert "kept" in new.cache_error
    res = restore_from_cache(SimpleInv, SharedRecord("lab", tmp_path / "alice", HostStore(
        "lab", "localhost", str(tmp_path / "new"), LocalTransport())), say=lambda s: None)
    assert any("not restored: the journal" in x for x in res["verdict"]["unverified"])
    after = SharedRecord("lab", tmp_path / "bob", HostStore("lab", "localhost", str(tmp_path / "new"), LocalTransport()))
    assert after.current() == 2 and after.revision_numbers() == [1, 2] and after.revision_snapshot(2) == {"files": []}
    assert after.revision_snapshot(1) is None
    with pytest.raises(Refused, match="holds a record already"):
        restore_from_cache(SimpleInv, SharedRecord("lab", tmp_path / "alice", HostStore(
            "lab", "localhost", str(tmp_path / "new"), LocalTransport())), say=lambda s: None)


class SimpleInv:
    cluster = "lab"


# ---------------------------------------------------------------- the inventory's pdops_state

def _lab_inv(tmp_path, state):
    import yaml

    from pdops.model.inventory import load_inventory, single_file_doc

    doc = single_file_doc(Path(__file__).resolve().parents[3] / "inventory" / "lab")
    if state is not None:
        doc["all"]["vars"]["pdops_state"] = state
    d = tmp_path / f"inv{next(_n)}"
    d.mkdir()
    (d / "hosts.yml").write_text(yaml.safe_dump(doc))
    return load_inventory(d)


def test_pdops_state_names_etcd_by_members_or_endpoints_and_bad_values_are_refused(tmp_path):
    inv = _lab_inv(tmp_path, {"backend": "etcd", "etcd": {"members": ["lab01", "lab02", "lab03"]}})
    assert inv.state.etcd.endpoints == ("http://127.0.10.1:2379", "http://127.0.10.2:2379", "http://127.0.10.3:2379")
    assert inv.state.etcd.prefix == "/pdops/lab/" and inv.state.backend == "etcd"
    for state, field, words in [
        ({"backend": "etcd"}, "pdops_state.etcd", "missing"),
        ({"backend": "zk"}, "pdops_state.backend", "neither"),
        ({"etcd": {"members": ["lab01", "lab02"]}}, "pdops_state.etcd.members", "odd number"),
        ({"etcd": {"members": ["lab01", "lab09", "lab03"]}}, "pdops_state.etcd.members", "'lab09' is not a host"),
        ({"etcd": {"endpoints": ["etcd1:2379"]}}, "pdops_state.etcd.endpoints", "not a client URL"),
        ({"etcd": {"endpoints": ["http://e:2379"], "cert": "/c.pem"}}, "pdops_state.etcd", "needs its key"),
        ({"etcd": {"endpoints": ["http://e:2379"], "cert": "/c", "key": "/k"}}, "pdops_state.etcd.endpoints", "http://"),
        ({"etcd": {"members": ["lab01", "lab02", "lab03"], "ca": "/ca"}}, "pdops_state.etcd", "plain HTTP"),
        ({"etcd": {"endpoints": ["https://e:2379"], "prefix": "pdops"}}, "pdops_state.etcd.prefix", "key prefix"),
        ({"etcd": {"endpoint": ["https://e:2379"]}}, "pdops_state.etcd", "unknown key"),
    ]:
        with pytest.raises(InvalidInput) as e:
            _lab_inv(tmp_path, state)
        assert e.value.field == field and words in str(e.value), (state, str(e.value))


def test_where_the_record_lives_is_not_part_of_the_inventorys_digest(tmp_path):
    """Moving the record (another backend, another state host) changes no revision's inventory; a
    revision recorded before, with pdops_state in its digest, still matches."""
    host = _lab_inv(tmp_path, {"host": "lab01"})
    to_etcd = _lab_inv(tmp_path, {"host": "lab01", "backend": "etcd", "etcd": {"members": ["lab01", "lab02", "lab03"]}})
    elsewhere = _lab_inv(tmp_path, {"host": "lab02"})
    assert host.digest == to_etcd.digest == elsewhere.digest
    # a revision recorded before (its digest with pdops_state) matches after the record moves to etcd;
    # after a move to another state host it does not: a recording `inv deploy` is needed (runbook)
    assert to_etcd.matches(host.legacy_digest) and not elsewhere.matches(host.legacy_digest)
    assert _lab_inv(tmp_path, {"backend": "host"}).legacy_digest == _lab_inv(tmp_path, None).legacy_digest


def test_a_copy_that_does_not_read_back_equal_is_not_a_migration(tmp_path, setting, monkeypatch):
    """The copy is proved by reading it back: one that lost a revision on the way fails the migration,
    and the source stays the record, unmarked."""
    import pdops.ops.record_store as rs

    open_record = _opener(tmp_path, setting)
    host_inv = _inv(tmp_path, setting, "host")
    deploy(open_record(host_inv))
    deploy(open_record(host_inv), "2p1d")
    real = rs.copy_into

    def lossy(session, whole, numbers=None):  # a copy that drops the newest revision
        short = dict(whole, revisions={n: d for n, d in whole["revisions"].items() if n != max(whole["revisions"])},
                     current=None)
        real(session, short, numbers)

    monkeypatch.setattr(rs, "copy_into", lossy)
    with pytest.raises(Unverified, match="differs from the source's record; the source is not marked"):
        rs.migrate(host_inv, "etcd", open_record, say=lambda s: None)
    assert open_record(host_inv).current() == 2  # not moved: still the record


def _certs(d: Path) -> dict:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    def ssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=pdops-test-ca")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN=pdops-{name}")
        ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf")
    return {k: str(d / v) for k, v in (("ca", "ca.pem"), ("cert", "client.pem"), ("key", "client.key"))}


def test_tls_with_a_client_certificate_reads_and_locks_and_refuses_without_one(tmp_path):
    """An etcd that asks for client certificates (--client-cert-auth): the record is read and locked
    with the inventory's ca/cert/key; without a client certificate, no member answers."""
    certs = _certs(tmp_path)
    server = {"server_cert": str(tmp_path / "server.pem"), "server_key": str(tmp_path / "server.key"), **certs}
    with running_etcd(tmp_path, tls=server) as url:
        s = EtcdSetting((url,), "/pdops/tls/", ca=certs["ca"], cert=certs["cert"], key=certs["key"])
        assert deploy(rec(tmp_path, "alice", s)) == 1
        assert rec(tmp_path, "bob", s).current() == 1
        no_cert = EtcdSetting((url,), "/pdops/tls/", ca=certs["ca"])
        with pytest.raises(Unreachable, match="no etcd member answered"):
            rec(tmp_path, "carol", no_cert).current()


def test_journal_lines_too_big_to_batch_or_to_copy_are_written_within_etcds_request_limit(tmp_path, setting):
    """etcd refuses a request over 1.5 MiB: 500 lines of 40 KB go in several transactions, and a line
    of 700 KiB is written once, its operation's and tag's copies referring to it."""
    r = rec(tmp_path, "alice", setting)
    with r.lock("drain", say=lambda s: None) as lk:
        lines = [json.dumps({"op_id": lk.op_id, "step": f"s{i}", "status": "ok", "evidence": {"x": "y" * 40_000}},
                            sort_keys=True) for i in range(500)]
        r._session.request({"op": "journal", "lines": lines})
        r.journal().step(lk.op_id, "big", "ok", {"instance": "p01", "survivors": [], "x": "z" * 700_000})
    j = rec(tmp_path, "bob", setting).journal()
    steps = j.read(lk.op_id)
    assert [s["step"] for s in steps] == ["lock.held"] + [f"s{i}" for i in range(500)] + ["big"]
    assert len(steps[-1]["evidence"]["x"]) == 700_000
    assert [s["step"] for s in j.tagged("stop:p01")] == ["big"]
    assert len(j.last_operations(1)) == 502


class _LostAnswers(E.Etcd):
    """A client whose next `lose` write transactions are committed by etcd, but whose answers are
    lost (as when the member dies, or stops, right after committing)."""

    lose = 0

    def txn(self, compare, success, failure=()):
        res = super().txn(compare, success, failure)
        if self.lose and any("request_put" in op for op in success):
            self.lose -= 1
            raise E.EtcdUnavailable("etcd http://x: server stopped; the outcome of this kv/txn is unknown",
                                    maybe_applied=True)
        return res


def test_a_write_whose_answer_was_lost_is_read_back_not_written_twice(tmp_path, setting):
    """A journal line, a new revision and the lock itself, each committed but its answer lost: each
    lands once (read back, then taken as done), never twice."""
    client = _LostAnswers(list(setting.endpoints))
    r = SharedRecord("lab", tmp_path / "alice", EtcdStore("lab", setting, client))
    client.lose = 1  # the lock's own transaction
    with r.lock("drain", say=lambda s: None) as lk:
        client.lose = 1
        r.journal().step(lk.op_id, "once", "ok", {})
        client.lose = 1
        rev = r.write_revision(topology="1p1d", inventory_hash="h", placement={}, manifest={}, instances={},
                               op_id=lk.op_id)
        r.set_current(rev.number)
    bob = rec(tmp_path, "bob", setting)
    assert [s["step"] for s in bob.journal().read(lk.op_id)] == ["lock.held", "once"]
    assert bob.revision_numbers() == [1] and bob.current() == 1 and bob.lock_holder() is None


def test_the_cache_is_kept_against_a_record_that_lacks_its_revisions_and_points_to_restore(tmp_path):
    """A state host whose disk was replaced: neither its empty record nor a new one begun there replaces
    this machine's cache, and a change there is refused, pointing to `inv state.restore --from-cache`."""
    def on(d, who="alice"):
        return SharedRecord("lab", tmp_path / who, HostStore("lab", "localhost", str(tmp_path / d), LocalTransport()))

    deploy(on("old"))
    deploy(on("old"), "2p1d")
    assert on("old").current() == 2
    with pytest.raises(Refused, match="holds no revision, but this machine's cache holds revisions 1..2") as e:
        on("new").lock("deploy", say=lambda s: None).acquire()
    assert "inv state.restore --from-cache" in e.value.fix
    deploy(on("new", "bob"), "4p4d")  # bob's machine has no cache: it begins a record there
    fresh = on("new")
    assert fresh.current() == 1 and "kept: it holds revisions 1..2" in fresh.cache_error
    assert json.loads(fresh.cache_file.read_text())["snapshot"]["current"] == 2


def _member_answering(answer):
    """An etcd member on 127.0.0.1 (a started HTTPServer: `.server_port`, `.shutdown()`) whose every POST is
    answered with `answer()`: (HTTP status, JSON document)."""
    import http.server

    class Member(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            code, doc = answer()
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Member)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_a_member_answering_unavailable_to_a_write_leaves_its_outcome_unknown_and_the_next_try_elsewhere():
    """A member that is stopping answers 503 "server stopped", possibly after committing: the write is
    not known to have failed (read back before sending again), and the client moves to the next member."""
    srv = _member_answering(lambda: (503, {"error": "etcdserver: server stopped",
                                           "message": "etcdserver: server stopped", "code": 14}))
    try:
        c = E.Etcd([f"http://127.0.0.1:{srv.server_port}", "http://127.0.0.1:9"])
        with pytest.raises(E.EtcdUnavailable) as e:
            c.txn([], [E.put("/k", "v")])
        assert e.value.maybe_applied and c.endpoint == "http://127.0.0.1:9"
        with pytest.raises(E.EtcdUnavailable, match="no etcd member answered"):  # a read tries every member
            c.range("/k")
    finally:
        srv.shutdown()


def test_a_hung_member_costs_one_timeout_then_every_request_goes_to_a_member_that_answers(tmp_path, setting):
    """The first endpoint accepts connections and never answers (a member whose disk stalled): the lock,
    a journal line, a revision and `current` go through, the write that timed out read back first."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)  # accepts (the kernel does), answers nothing
    try:
        eps = (f"http://127.0.0.1:{hung.getsockname()[1]}",) + setting.endpoints[1:]
        s = EtcdSetting(eps, setting.prefix)
        r = SharedRecord("lab", tmp_path / "alice", EtcdStore("lab", s, E.Etcd(list(eps), timeout=1.0)))
        t0 = time.monotonic()
        n = deploy(r)
        assert time.monotonic() - t0 < 15
        bob = rec(tmp_path, "bob", setting)
        assert bob.current() == n == 1 and [x["step"] for x in bob.journal().last_operations(1)] == ["lock.held", "verdict"]
    finally:
        hung.close()


def test_a_migration_with_no_etcd_named_is_an_input_error_either_way(tmp_path):
    from types import SimpleNamespace

    from pdops.model.inventory.schema import StateLocation
    from pdops.ops.record_store import migrate

    inv = SimpleNamespace(cluster="lab", state=StateLocation("localhost", str(tmp_path / "shared")))
    for to in ("etcd", "host"):
        with pytest.raises(InvalidInput, match="no etcd to migrate") as e:
            migrate(inv, to, _opener(tmp_path, None), say=lambda s: None)
        assert e.value.field == "pdops_state.etcd"


def test_a_read_while_the_members_elect_a_leader_is_tried_again_until_one_answers():
    """The leader SIGKILLed: the members left answer "leader changed" until they elect one. A read is
    tried again (the record is read, not refused as unreachable); a write is never sent twice."""
    answers = {"n": 0}

    def electing():
        answers["n"] += 1
        if answers["n"] <= 3:
            return 503, {"error": "etcdserver: leader changed", "message": "etcdserver: leader changed", "code": 14}
        return 200, {"header": {"revision": "7"}, "count": "0"}

    srv = _member_answering(electing)
    try:
        c = E.Etcd([f"http://127.0.0.1:{srv.server_port}", "http://127.0.0.1:9"])
        assert c.range("/k").kvs == [] and answers["n"] == 4  # three "leader changed", then the answer
        answers["n"] = 0
        with pytest.raises(E.EtcdUnavailable) as e:
            c.txn([], [E.put("/k", "v")])
        assert e.value.maybe_applied and answers["n"] == 1  # the write: sent once, its outcome unknown
    finally:
        srv.shutdown()
