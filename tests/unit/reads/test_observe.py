"""Deciding from observation (pdops.reads.observe, deploy.plan_reconcile): what systemd, the gateway and
its start-up list report, against the revision; no hosts (a pool answering `systemctl show` text
and a gateway client answering /workers)."""

import json
import types

import pytest

from pdops.reads.observe import observe
from pdops.ops import deploy as dep
from pdops.steps.revisions import processes_of
from pdops.model import membership
from pdops.errors import PdopsError, Refused, Unreachable
from pdops.facts.gateway import Worker
from pdops.model.inventory import load_inventory
from pdops.model.placement import place
from pdops.model.render import GATEWAY_UNIT
from pdops.record.local import StateDir
from pdops.model.topology import parse_topology
from tests.unit.recorded import REPO, deployed


def show(unit, active="active", sub="running", pid=100, restarts=0, started_us=0):
    return (f"Id={unit}\nLoadState=loaded\nActiveState={active}\nSubState={sub}\nMainPID={pid if active == 'active' else 0}\n"
            f"NRestarts={restarts}\nResult=success\nUnitFileState=enabled\n"
            + (f"ExecMainStartTimestampMonotonic={started_us}\n" if started_us else "") + "\n")


class Pool:
    def __init__(self, units, start_list, extra=None, files=None):
        self.units, self.start_list, self.commands = units, start_list, []
        self.extra = extra or {}  # (host, unit) -> [(pid, ppid)] more processes in its cgroup
        self.files = files  # (host, path) -> sha256 on the host (None: not answered)

    def unit_states(self, host, units):
        from pdops.facts import systemd

        return systemd.parse_by_id(self.show(host, units))

    def show(self, host, units):
        return "".join(show(u, *self.units.get((host, u), ())) for u in units)

    def read_sections(self, host, commands):
        self.commands.append(commands["units"])
        units = commands["units"].split()[5:]
        out = {"units": (0, self.show(host, units)), "configs": (0, "")}
        if "files" in commands and self.files is not None:  # what pdops.facts.files.command prints
            out["files"] = (0, "".join(f"644 root {sha}  {p}\n" for (h, p), sha in self.files.items() if h == host))
        if "cgroups" in commands:  # what units_procs_command prints: each unit's cgroup, then the table
            header = '{"header": 1, "btime": 1796033638, "clk_tck": 100, "boot_id": "b"}\n'
            text, rows = "", []
            for u in units:
                pid = (self.units.get((host, u)) or ("active", "running", 100))[2:3] or (100,)
                text += f"PDOPS-UNIT {u}\nPDOPS-CGROUP present /sys/fs/cgroup/pdops.slice/{u}\n{pid[0]}\n"
                rows.append(json.dumps({"pid": pid[0], "ppid": 1, "start": 5, "comm": "python", "argv": ["python"]}))
                for extra, ppid in self.extra.get((host, u), ()):
                    text += f"{extra}\n"
                    rows.append(json.dumps({"pid": extra, "ppid": ppid, "start": 6, "comm": "x", "argv": [f"stray-{extra}"]}))
            out["cgroups"] = (0, text + "PDOPS-TREE\n" + header + "\n".join(rows) + "\n")
        return out

    def run(self, host, command, timeout=60):
        self.commands.append(command)
        return types.SimpleNamespace(stdout=json.dumps(self.start_list) + "\n", stderr="")


class Gateway:
    def __init__(self, workers, error=None):
        self.workers, self.error = workers, error

    def list_workers(self):
        if self.error:
            raise Unreachable(self.error)
        return self.workers

    def client(self, host):  # the lab inventory has one gateway: this is it
        return self


@pytest.fixture
def live(tmp_path):
    inv = load_inventory(REPO / "inventory" / "lab")
    pl = place(inv, parse_topology("1p2d"))
    state = StateDir("lab", tmp_path)
    pids = {i.id: {f"{h}:{u}": 100 + n for n, (h, u) in enumerate(i.units)} for i in pl.instances}
    deployed(inv, state, pl=pl, instances={i.id: {"url": i.url, "worker_id": f"w-{i.id}", "main_pids": pids[i.id]}
                                           for i in pl.instances})
    return inv, pl, state


def healthy_world(pl, **override):
    units = {(h, u): ("active", "running", 100 + n) for i in pl.instances for n, (h, u) in enumerate(i.units)}
    workers = [Worker(f"w-{i.id}", i.url, i.role, True, 0, i.bootstrap_port, status="ready") for i in pl.instances]
    start_list = {"workers": [membership.entry(i) for i in pl.instances]}
    return units, workers, start_list


def plan(inv, state, units, workers, start_list, gw_error=None, files=None):
    p = dep.plan_deploy(inv, parse_topology("1p2d"), state)
    assert p.live is not None and not p.steps  # same files: nothing decided before observing
    return dep.plan_reconcile(p, observe(p.inv, p.live, Pool(units, start_list, files=files),
                                         Gateway(workers, gw_error)))


def _edited(state, pl, iid: str, suffix: str):
    """Every file of the revision as rendered on its host, but `iid`'s file ending in `suffix` edited
    there; returns ({(host, path): sha256}, its host, its path)."""
    rev = state.read_revision(state.current())
    files = {(h, p): m["sha256"] for h, fs in rev.manifest.items() for p, m in fs.items()}
    (h, u), = pl.get(iid).units
    path = next(p for (hh, p) in files if hh == h and p.endswith(u.removesuffix(".service") + suffix))
    files[(h, path)] = "f" * 64
    return files, h, path


def test_a_launch_script_edited_beside_the_process_that_runs_the_revisions_is_put_back_without_a_restart(live):
    """The recorded MainPID was shown to run the revision's files: the edit has not run. The deploy puts
    the revision's file back (only that instance's files) and restarts nothing."""
    inv, pl, state = live
    units, workers, start_list = healthy_world(pl)
    files, h, path = _edited(state, pl, "d01", ".sh")
    p = plan(inv, state, units, workers, start_list, files=files)
    want = f"d01: {h}:{path} is not revision 1's: sha256 ffffffffffff"
    assert any(f.startswith(want) for f in p.findings), p.findings
    assert p.change is None and not p.noop
    names = [s.name for s in p.steps]
    assert names[:3] == ["connect", "render", "deliver"] and not [n for n in names if n.startswith(("start", "drain"))]
    deliver = p.steps[2]
    assert {(f.host, f.path) for f in deliver.params["files"]} == {(h, q) for (hh, q) in files if hh == h and "pdops-d01." in q}
    assert [i.id for i in deliver.params["placement"].instances] == ["d01"]  # no other unit is touched
    assert "nothing restarted" in dep_status_action(pl, units, workers, start_list, files, inv, state)


def test_a_launch_script_edited_and_run_by_a_restart_is_replaced_from_the_revisions_files(live):
    """systemd started the engine again (a crash, or a hand restart) from the edited script: the deploy
    replaces it, which delivers the revision's files before it starts; it serves no more, so no floor."""
    inv, pl, state = live
    units, workers, start_list = healthy_world(pl)
    files, h, path = _edited(state, pl, "d01", ".sh")
    (hd, ud), = pl.get("d01").units
    units[(hd, ud)] = ("active", "running", 555, 2)
    p = plan(inv, state, units, workers, start_list, files=files)
    assert p.change is not None, p.render()
    assert [i.id for i in p.change.replaced] == ["d01"]
    assert "its files were changed on the host" in p.render() and path in p.render()
    # as a repair: the halves the replaced decode left are ended, and `inv status`'s baseline moves past
    # the fault (the failures the edited process caused are not reported as new afterwards)
    names = [s.name for s in p.change.run]
    assert names[-2:] == ["record", "status-baseline"] and "end-orphans" in names, names
    assert "the fault this deploy observed and replaced (d01 its files were changed" in p.change.run[-1].description
    assert "then replaces it" in dep_status_action(pl, units, workers, start_list, files, inv, state)


def dep_status_action(pl, units, workers, start_list, files, inv, state) -> str:
    """The fix `inv status` prints for d01 in this world."""
    from pdops.reads.status import judge

    rev = state.read_revision(state.current())
    obs = observe(inv, rev, Pool(units, start_list, files=files), Gateway(workers))
    o = next(o for o in obs.instances if o.id == "d01")
    h = judge(o, gateway_down=False, loads_error=None, failures={}, strays=[])
    assert any("is not revision 1's" in r for r in h.reasons), h.reasons
    return h.action


def test_all_as_recorded_is_no_change_naming_what_was_observed(live):
    inv, pl, state = live
    p = plan(inv, state, *healthy_world(pl))
    assert p.noop and "observed: 3 unit(s) of 3 instance(s) active with their recorded MainPIDs" in p.noop
    assert "no change" in p.render() and "repair" not in p.render()


def test_a_down_unit_a_restarted_engine_and_a_missing_worker_are_each_repaired(live):
    inv, pl, state = live
    units, workers, start_list = healthy_world(pl)
    (h, u), = pl.get("d01").units
    units[(h, u)] = ("inactive", "dead")
    (ph, pu), = pl.get("p01").units
    units[(ph, pu)] = ("active", "running", 555, 1)
    workers = [w for w in workers if w.id != "w-d02"]
    p = plan(inv, state, units, workers, start_list)
    assert not p.noop
    assert f"d01: unit {h}:{u} inactive/dead" in p.findings
    assert f"p01: {ph}:{pu} MainPID 555, recorded 100 (restarts: 1)" in p.findings
    assert "d02: not in the gateway's /workers" in p.findings
    ids = [s.name for s in p.steps]
    # d01 (a decode) was down: the halves it left on the prefill are ended before the record; p01, which
    # systemd started again, is waited for (its /health) before the canary goes through it
    assert ids == ["connect", "start d01", "healthy p01", "canary", "register d01", "register d02", "gateway-list", "end-orphans",
                   "close-breakers", "verify-running", "record"]
    canary = next(s for s in p.steps if s.name == "canary")
    assert canary.params["pairs"] == [("p01", "d01"), ("p01", "d02")]  # every pair of p01 (restarted), d01 (started)
    assert "plan: repair revision 1 (1p2d)" in p.render()


def test_a_gateway_down_is_started_and_every_worker_registered(live):
    inv, pl, state = live
    units, _, start_list = healthy_world(pl)
    units[(inv.gateway.first.host, GATEWAY_UNIT)] = ("failed", "failed")
    p = plan(inv, state, units, [], start_list, gw_error="connection refused")
    assert any(f.startswith(f"gateway {GATEWAY_UNIT}: failed/failed") for f in p.findings)
    ids = [s.name for s in p.steps]
    # the revision's gateway files put back (a no-op where they match), then the gateway started from them
    assert ids[:4] == ["connect", "render", "deliver", "gateway"] and "canary" not in ids  # no engine restarted
    assert {x for x in ids if x.startswith("register ")} == {"register p01", "register d01", "register d02"}


def test_an_unknown_worker_and_a_list_that_lacks_one_are_findings(live):
    inv, pl, state = live
    units, workers, start_list = healthy_world(pl)
    workers.append(Worker("w-x", "http://127.0.0.9:1234", "decode", True, 0, status="ready"))
    start_list["workers"] = [w for w in start_list["workers"] if w["instance"] != "d02"]
    p = plan(inv, state, units, workers, start_list)
    assert "d02: not in the gateway's start-up list" in p.findings
    assert any("http://127.0.0.9:1234" in f and "does not know" in f for f in p.findings)
    assert [s.name for s in p.steps] == ["connect", "register d02", "gateway-list d02", "close-breakers", "verify-running", "record"]


def test_a_worker_the_gateway_still_drains_after_a_drain_is_no_difference(live):
    """Right after `inv drain`, smg lists the removed worker as draining for a few seconds: no new
    request reaches it and it leaves by itself, so a look at that moment finds nothing to repair."""
    inv, pl, state = live
    units, workers, start_list = healthy_world(pl)
    workers.append(Worker("w-gone", "http://127.0.0.9:1234", "decode", False, 0, status="draining"))
    p = plan(inv, state, units, workers, start_list)
    assert p.noop and not p.findings


def test_not_ready_in_the_gateway_is_a_finding(live):
    inv, pl, state = live
    units, workers, start_list = healthy_world(pl)
    workers[0] = Worker(workers[0].id, workers[0].url, workers[0].worker_type, False, 0, status="not_ready")
    p = plan(inv, state, units, workers, start_list)
    assert any("in the gateway but not_ready, unhealthy" in f for f in p.findings)


def test_execute_refuses_a_live_plan_that_was_not_observed(live):
    inv, pl, state = live
    p = dep.plan_deploy(inv, parse_topology("1p2d"), state)
    with pytest.raises(Refused):
        dep.execute_deploy(p, pool=None, gateways=None)


def test_an_unreadable_start_up_list_is_named_as_such(live):
    inv, pl, state = live
    units, workers, _ = healthy_world(pl)
    pool = Pool(units, None)

    def broken(host, command, timeout=60):
        from pdops.errors import RemoteCommandFailed

        raise RemoteCommandFailed(host, "python3 -c ...", 1, "PermissionError: /etc/pdops/gateway-workers.json")

    pool.run = broken
    p = dep.plan_reconcile(p0 := dep.plan_deploy(inv, parse_topology("1p2d"), state), observe(inv, p0.live, pool, Gateway(workers)))
    assert any("start-up list /etc/pdops/gateway-workers.json unreadable" in f for f in p.findings), p.findings
    assert not any("not in the gateway's start-up list" in f for f in p.findings)


def test_what_a_change_plans_from_names_each_instance_that_does_not_serve(live):
    """pdops.reads.observation.Seen: a unit not running (nothing to drain), a worker the gateway does not
    route to; with the gateway down, an instance out of its start-up list (a gateway start will
    not bring it back)."""
    from pdops.reads.observation import Seen
    from pdops.reads.observe import observe

    inv, pl, state = live
    rev = state.current_revision()
    units, workers, start_list = healthy_world(pl)
    (h, u), = pl.get("d01").units
    units[(h, u)] = ("failed", "failed")
    workers = [w for w in workers if w.id != "w-d02"]
    seen = Seen.of(observe(inv, rev, Pool(units, start_list), Gateway(workers)))
    assert seen.not_serving == {"d01": f"units not running: {h}:{u} failed/failed",
                                "d02": "not in the gateway's /workers"}
    assert seen.down == {"d01"} and seen.gateway is None and not seen.all_serving
    units[(inv.gateway.first.host, GATEWAY_UNIT)] = ("failed", "failed")
    start_list = {"workers": [membership.entry(i) for i in pl.instances if i.id != "p01"]}
    seen = Seen.of(observe(inv, rev, Pool(units, start_list), Gateway([], "connection refused")))
    assert seen.gateway.startswith(f"{GATEWAY_UNIT} failed/failed") and not seen.gateways_active
    assert seen.not_serving == {"d01": f"units not running: {h}:{u} failed/failed",
                                "p01": "not in the gateway's start-up list"}
    assert Seen.of(observe(inv, rev, Pool(*healthy_world(pl)[::2]), Gateway(healthy_world(pl)[1]))).all_serving


def test_a_gateway_systemd_restarted_is_a_finding_and_its_cut_halves_are_ended(live):
    """SIGKILLed, the gateway came back by itself (Restart=) and registered every worker from its
    start-up list: nothing is missing, but the requests it carried left prefill halves that no decode
    holds. The recorded MainPID tells: the repair ends them and records the new MainPID."""
    inv, pl, state = live
    rev = state.current_revision()
    state.set_current(state.write_revision(
        topology=rev.topology, inventory_hash=rev.inventory_hash, placement=rev.placement, manifest=rev.manifest,
        outcome="deployed", instances=rev.instances, extra={**(rev.extra or {}), "gateway_main_pid": 700}).number)
    units, workers, start_list = healthy_world(pl)
    units[(inv.gateway.first.host, GATEWAY_UNIT)] = ("active", "running", 700)
    assert plan(inv, state, units, workers, start_list).noop  # the recorded gateway process: no change
    units[(inv.gateway.first.host, GATEWAY_UNIT)] = ("active", "running", 812, 1)
    p = plan(inv, state, units, workers, start_list)
    assert f"gateway {GATEWAY_UNIT} restarted: MainPID 812, recorded 700 (restarts by systemd: 1)" in p.findings
    assert [s.name for s in p.steps] == ["connect", "end-orphans", "verify-running", "record"]


def test_the_gateway_main_pid_is_recorded_from_what_verify_running_read():
    inv = load_inventory(REPO / "inventory" / "lab")
    key = f"{inv.gateway.first.host}:{GATEWAY_UNIT}"
    running = {key: {"main_pid": 812, "config": "c1", "started_us": 5_000_000}}
    assert processes_of(running, inv) == {"gateway_main_pids": {inv.gateway.first.host: 812},
                                              "main_starts": {key: [812, 5_000_000]}}
    assert processes_of({}, inv) == {}


def test_a_process_with_the_recorded_pid_that_started_at_another_time_is_not_the_recorded_one(live):
    """PIDs are small and repeat after a reboot (a real host's, or the lab's "enabled" boot, which
    starts units in the same order each time): the MainPID alone would take the new process for the
    recorded one and call the cluster unchanged. The revision also records when each main process
    started; the same PID with another start is a restart: a finding, and the deploy's repair."""
    inv, pl, state = live
    rev = state.current_revision()
    (h, u), = pl.get("d01").units
    gw = f"{inv.gateway.first.host}:{GATEWAY_UNIT}"
    pids = {k: p for i in rev.instances.values() for k, p in (i.get("main_pids") or {}).items()}
    d01_pid = pids[f"{h}:{u}"]
    state.set_current(state.write_revision(
        topology=rev.topology, inventory_hash=rev.inventory_hash, placement=rev.placement, manifest=rev.manifest,
        outcome="deployed", instances=rev.instances,
        extra={**(rev.extra or {}), "gateway_main_pids": {inv.gateway.first.host: 700},
               "main_starts": {gw: [700, 1_000], f"{h}:{u}": [d01_pid, 2_000]}}).number)
    units, workers, start_list = healthy_world(pl)
    units[(inv.gateway.first.host, GATEWAY_UNIT)] = ("active", "running", 700, 0, 1_000)
    units[(h, u)] = ("active", "running", d01_pid, 0, 2_000)
    assert plan(inv, state, units, workers, start_list).noop  # the recorded processes: no change
    units[(inv.gateway.first.host, GATEWAY_UNIT)] = ("active", "running", 700, 0, 9_000)  # booted again
    units[(h, u)] = ("active", "running", d01_pid, 0, 9_500)
    p = plan(inv, state, units, workers, start_list)
    assert (f"gateway {GATEWAY_UNIT} restarted: MainPID 700 is the recorded PID of another process (it started at "
            "another time: a reboot, or PIDs came round)") in p.findings, p.findings
    assert any(f.startswith(f"d01: {h}:{u} MainPID {d01_pid} is the recorded PID of another process")
               for f in p.findings), p.findings
    assert "end-orphans" in [s.name for s in p.steps]


def test_an_inventory_that_renders_the_same_files_is_recorded_so_a_drain_accepts_it(live, tmp_path):
    """A host that runs nothing taken out of (or added to) the inventory: the deploy of the live
    topology records the inventory on disk (same files, same placement) instead of saying "no change"
    and leaving a drain refused for "the inventory changed"."""
    import dataclasses

    from pdops.ops import drain as dr

    inv, pl, state = live
    other = dataclasses.replace(inv, digest="f" * 64, legacy_digest="e" * 64)  # what a host list edit does
    with pytest.raises(Refused, match="the inventory changed since revision 1") as e:
        dr.plan_drain(other, state, "d02")
    assert "inv deploy --topology 1p2d" in e.value.fix
    p = plan(other, state, *healthy_world(pl))
    assert not p.noop
    assert [s.name for s in p.steps] == ["connect", "verify-running", "record"]
    assert any("renders the same files: recorded with it" in f for f in p.findings)
    assert "the inventory on disk" in p.steps[-1].description
    assert "nothing that runs differs from it, only the inventory" in p.render()
    # the record step writes the inventory on disk; then the drain accepts it
    from pdops.steps.record import do_record_repair
    from pdops.runner import RunContext

    units, _, start_list = healthy_world(pl)
    ctx = RunContext(other, state, "op-1", lambda s: None, Pool(units, start_list), None, placement=p.placement)
    do_record_repair(ctx, p.steps[-1])
    rev = state.current_revision()
    assert rev.number == 2 and rev.inventory_hash == "f" * 64 and rev.manifest == p.live.manifest
    assert dr.plan_drain(other, state, "d02").instance.id == "d02"


def test_a_deploy_of_another_topology_is_one_deploy_plan_whose_change_rolls(live):
    """plan_deploy returns one type: on a live cluster, a different topology is a DeployPlan whose
    `change` is the rolling change; it prints and walks as that change."""
    from pdops.ops.scale import ScalePlan

    inv, pl, state = live
    p = dep.plan_deploy(inv, parse_topology("1p1d"), state)
    assert isinstance(p, dep.DeployPlan) and isinstance(p.change, ScalePlan)
    assert [i.id for i in p.change.removed] == ["d02"] and p.plan is not None
    assert p.render() == p.change.render() and p.plan.step_ids() == p.change.plan.step_ids()


def test_execute_deploy_refuses_a_deploy_that_is_a_rolling_change(live):
    """A deploy whose plan is a rolling change is walked by the change's executor (as `inv deploy`
    does); handed to execute_deploy it is refused before anything runs, not walked as a deploy."""
    inv, pl, state = live
    p = dep.plan_deploy(inv, parse_topology("1p1d"), state)
    assert p.change is not None
    with pytest.raises(PdopsError, match="rolling change"):
        dep.execute_deploy(p, pool=None, gateways=None)


def test_status_names_a_process_in_a_units_cgroup_that_is_not_under_its_main_pid():
    """The cgroup read of `inv status` (one round trip per host): MainPID 140 and its child 141 are the
    engine; 150, in the same cgroup with another parent (a double fork), is a stray, named with its
    command line; a unit with no strays names none."""
    from pdops.facts import procs, systemd
    from pdops.reads.identity import RankIdentity

    header = '{"header": 1, "btime": 1796033638, "clk_tck": 100, "boot_id": "b"}\n'
    rows = [(140, 1, ["python", "-m", "sglang.launch_server"]), (141, 140, ["sglang::scheduler"]),
            (150, 1, ["sglang::stray"])]
    tree = procs.parse(header + "".join(json.dumps({"pid": p, "ppid": pp, "start": 5, "comm": a[0][:15], "argv": a}) + "\n"
                                        for p, pp, a in rows))
    st = systemd.parse_by_id(show("pdops-d01.service", pid=140))["pdops-d01.service"]
    ident = RankIdentity.of("lab02", st, [140, 141, 150], tree)
    assert ident.strays == ["PID 150 (sglang::stray)"]
    assert RankIdentity.of("lab02", st, [140, 141], tree).strays == []


def test_status_reads_strays_with_the_observation_and_names_them_per_instance(live):
    """observe(cgroups=True) carries each running unit's identity by "host:unit" (one round trip per
    host); status names, per instance, the processes in its cgroup that are not under its MainPID: a
    child of MainPID is family, a process whose parent is outside is a stray."""
    from pdops.reads.status import _instance_strays

    inv, pl, state = live
    units, workers, start_list = healthy_world(pl)
    (h, u), = pl.get("d01").units
    pid = units[(h, u)][2]
    pool = Pool(units, start_list, extra={(h, u): [(pid + 50, pid), (pid + 60, 1)]})
    obs = observe(inv, state.current_revision(), pool, Gateway(workers), cgroups=True)
    assert set(obs.identities) >= {f"{hh}:{uu}" for i in pl.instances for hh, uu in i.units}
    by_id = {o.id: o for o in obs.instances}
    assert _instance_strays(by_id["d01"], obs) == [f"{h}:{u} PID {pid + 60} (stray-{pid + 60})"]
    assert _instance_strays(by_id["p01"], obs) == []
    obs.identity_errors[h] = "the cgroup reader exited 1"
    assert _instance_strays(by_id["d01"], obs) == "the cgroup reader exited 1"


def test_an_observation_of_one_instances_units_counts_the_others_by_the_gateway_and_says_so(live):
    """units_of: systemd is read for d01 only (its unit down: it does not serve); p01 and d02, unread,
    serve where the gateway routes to them, d02 not listed there does not; the basis is stated."""
    from pdops.reads.observation import Seen

    inv, pl, state = live
    units, workers, start_list = healthy_world(pl)
    (h, u), = pl.get("d01").units
    units[(h, u)] = ("inactive", "dead")
    workers = [w for w in workers if w.id != "w-d02"]
    pool = Pool(units, start_list)
    seen = Seen.of(observe(inv, state.current_revision(), pool, Gateway(workers), units_of=frozenset({"d01"})))
    assert set(seen.not_serving) == {"d01", "d02"} and seen.down == {"d01"}
    assert seen.basis.startswith("systemd read for d01; each other instance counted as serving where a gateway")
    read = [c for c in pool.commands if c.startswith("systemctl show")]
    assert any("pdops-d01" in c for c in read) and not any("pdops-p01" in c or "pdops-d02" in c for c in read)


def test_with_another_instance_down_the_edited_files_go_back_before_anything_starts(live):
    """d01 edited and down, p01 down too (a reboot): the deploy starts both, but only after d01's files
    are the revision's again; d02, systemd's restart of an edited file, is restarted in place from them."""
    inv, pl, state = live
    units, workers, start_list = healthy_world(pl)
    files, h, path = _edited(state, pl, "d01", ".sh")
    rev = state.read_revision(state.current())
    (h2, u2), = pl.get("d02").units
    env2 = next(p for (hh, p) in files if hh == h2 and p.endswith("pdops-d02.env"))
    files[(h2, env2)] = "e" * 64
    for iid in ("d01", "p01"):
        (hh, uu), = pl.get(iid).units
        units[(hh, uu)] = ("failed", "failed")
    units[(h2, u2)] = ("active", "running", 777, 1)
    p = plan(inv, state, units, workers, start_list, files=files)
    assert p.change is None
    names = [s.name for s in p.steps]
    assert names.index("deliver") < min(names.index("start d01"), names.index("start p01"), names.index("start d02"))
    deliver = p.steps[names.index("deliver")]
    assert {f.path for f in deliver.params["files"]} >= {path, env2}
    restart = p.steps[names.index("start d02")]
    assert restart.params["restart"] is True and "healthy d02" not in names
    assert rev.number == 1


def test_an_edit_replaced_by_a_deploy_counts_only_what_serves_for_the_floor(live):
    """d02 runs an edited file (systemd restarted it); d01 runs but the gateway does not route to it. As
    in any change planned from what serves now, d01 counts for no floor and is started again first
    (not refused for leaving no decode), then d02 is replaced from the revision's files."""
    inv, pl, state = live
    units, workers, start_list = healthy_world(pl)
    files, h, path = _edited(state, pl, "d02", ".env")
    (hd, ud), = pl.get("d02").units
    units[(hd, ud)] = ("active", "running", 555, 1)
    workers = [w for w in workers if w.id != "w-d01"]
    p = plan(inv, state, units, workers, start_list, files=files)
    assert p.change is not None
    assert [w for w in p.change.waves] == [["d01"], ["d02"]], p.render()
    assert "observed not serving" in p.change.why["d01"] and "changed on the host" in p.change.why["d02"]


def test_an_instance_missing_from_the_start_up_list_is_degraded_naming_what_a_gateway_restart_would_do():
    """The observation's finding and `inv status`'s reason are one wording; status adds the consequence."""
    from pdops.model.placement import place
    from pdops.model.topology import parse_topology
    from tests.unit.observed import obs, word

    d01 = place(load_inventory(REPO / "inventory" / "lab"), parse_topology("1p1d")).get("d01")
    o = obs(d01, in_list=False)
    assert o.findings() == ["not in the gateway's start-up list"]
    h = word(o)
    assert h.state == "degraded" and "not in the gateway's start-up list (a gateway restart would drop it)" in h.reasons
    assert word(obs(d01)).state == "ok" and obs(d01).list_problem() is None
