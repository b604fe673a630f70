"""The stop and empty-state verifiers on recorded host outputs (no host): each is shown
saying "no" for the evidence it exists for, and "yes" only when that evidence is absent."""

from __future__ import annotations

import json
from types import SimpleNamespace

from pdops.steps import stopping as dr
from pdops.facts import SKIP_MARKER
from pdops.facts import cgroup as cg
from pdops.facts import procs as proc_facts
from pdops.reads.identity import RankIdentity

UNIT = "pdops-p02.service"
CGROUP = "/system.slice/pdops-p02.service"
LAYOUT = cg.CgroupLayout("hybrid", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd")


def _proc_table(procs: list[tuple[int, int, str]]) -> str:
    lines = [json.dumps({"header": 1, "btime": 1_700_000_000, "clk_tck": 100, "boot_id": "b1"})]
    lines += [json.dumps({"pid": pid, "ppid": 1, "start": start, "comm": "python3", "argv": [cmd]})
              for pid, start, cmd in procs]
    return "\n".join(lines) + "\n"


class RecordedPool:
    """Answers each command pdops sends with a recorded output, by what the command reads."""

    def __init__(self, *, procs_now, listeners: str, cgroup_dir_gone: bool = True, runtime_dir: str = "removed\n"):
        self.procs_now = procs_now
        self.runtime_dir = runtime_dir
        self.listeners = listeners
        self.cgroup_dir_gone = cgroup_dir_gone
        self.commands: list[str] = []

    def unit_states(self, host, units):
        return {u: SimpleNamespace(result="success", is_active=False) for u in units}

    def journal_tail(self, host, unit, lines=30):
        return "Stopped pdops-p02.service."

    def run(self, host, command, timeout=60):
        self.commands.append(command)
        if command.startswith("ss "):
            out = self.listeners
        elif "PDOPS-CGROUP" in command:
            out = "".join(f"PDOPS-CGROUP {'gone' if self.cgroup_dir_gone else 'present'} {d}\n"
                          for d in LAYOUT.dirs(CGROUP))
        elif command.startswith("cat /proc/"):
            out = "1:name=systemd:/pdops-sim-escaped\n0::/pdops-sim-escaped\n"
        elif "nvidia-smi" in command:
            out = f"{SKIP_MARKER} no nvidia-smi on this host\n"
        elif command.startswith("python3 -c"):
            out = _proc_table(self.procs_now)
        elif command.startswith("if [ -e /run/pdops/"):
            out = self.runtime_dir
        else:
            raise AssertionError(f"unexpected command {command!r}")
        return SimpleNamespace(stdout=out)


def _identity() -> RankIdentity:
    """What record_identity saw before the stop: the main process and an escaped child."""
    tree = proc_facts.parse(_proc_table([(4100, 500, "python -m pdops.sim"), (4242, 900, "sglang::scheduler_escaped")]))
    return RankIdentity("lab02", UNIT, 4100, CGROUP, LAYOUT, [4100], tree)


LISTENING = ('LISTEN 0 128 127.0.10.2:30010 0.0.0.0:* users:(("python",pid=4242,fd=7))\n'
             'LISTEN 0 128 127.0.10.2:8998 0.0.0.0:* users:(("python",pid=4242,fd=9))\n')


def test_a_recorded_process_alive_outside_the_cgroup_holding_ports_is_not_a_verified_stop():
    pool = RecordedPool(procs_now=[(4242, 900, "sglang::scheduler_escaped")], listeners=LISTENING)
    ev = dr.verify_stopped(pool, _identity(), [30010, 8998], "127.0.10.2")
    assert ev.cgroup_empty  # the unit's cgroup is gone: that alone is not enough
    assert not ev.verified
    assert ev.ports_open == [30010, 8998]
    assert ev.runtime_dir == "/run/pdops/pdops-p02 removed by systemd"

    [rec] = ev.survivor_records
    assert (rec["pid"], rec["start_ticks"], rec["cgroup"], rec["ports"]) == (4242, 900, "/pdops-sim-escaped",
                                                                             [8998, 30010])
    assert "sglang::scheduler_escaped" in dr.describe_survivor(rec)


def test_what_systemd_left_of_the_units_runtime_directory_is_said():
    """The engine's TMPDIR (SGLang's IPC sockets) is under the unit's RuntimeDirectory: removed by
    systemd at the stop; a directory still there is named with what it holds, never said removed."""
    pool = RecordedPool(procs_now=[], listeners="", runtime_dir="left 7\n")
    ev = dr.verify_stopped(pool, _identity(), [30010], "127.0.10.2")
    assert ev.runtime_dir == "/run/pdops/pdops-p02 still there (7 entries)"
    assert ev.verified  # the stop itself is proved; what is left is said beside it


def test_a_reused_pid_is_not_a_survivor_and_closed_ports_verify():
    # PID 4242 now belongs to another process (other start time); nothing listens
    pool = RecordedPool(procs_now=[(4242, 7777, "bash")], listeners="")
    ev = dr.verify_stopped(pool, _identity(), [30010, 8998], "127.0.10.2")
    assert ev.verified and ev.survivors == [] and ev.ports_open == []
    assert ev.gpu.startswith("skipped: no nvidia-smi")  # said so, never "no compute process"


def test_a_port_held_by_someone_else_still_fails_the_stop():
    other = 'LISTEN 0 128 0.0.0.0:30010 0.0.0.0:* users:(("nc",pid=9999,fd=3))\n'
    pool = RecordedPool(procs_now=[], listeners=other)
    ev = dr.verify_stopped(pool, _identity(), [30010, 8998], "127.0.10.2")
    assert not ev.verified and ev.ports_open == [30010]


def test_a_non_empty_cgroup_fails_the_stop():
    class Populated(RecordedPool):
        def run(self, host, command, timeout=60):
            if "PDOPS-CGROUP" in command:
                return SimpleNamespace(stdout="".join(f"PDOPS-CGROUP present {d}\n4300\n" for d in LAYOUT.dirs(CGROUP)))
            return super().run(host, command, timeout)

    ev = dr.verify_stopped(Populated(procs_now=[], listeners=""), _identity(), [30010], "127.0.10.2")
    assert not ev.cgroup_empty and not ev.verified


def test_kill_command_names_pid_start_time_and_boot_never_a_pattern():
    cmd = dr.kill_command([{"pid": 4242, "start_ticks": 900, "boot_id": "b1"}])
    assert cmd.endswith(" 4242:900:b1")
    assert "pkill" not in cmd and "killall" not in cmd and "pidfd_open" in cmd


def test_empty_reading_is_empty_only_when_every_source_is():
    empty = dr.EmptyReading([], {}, {}, [], [])
    assert empty.empty and empty.describe() == "empty"
    for busy in (dr.EmptyReading(["rid-1"], {}, {}, [], []),
                 dr.EmptyReading([], {"prefill_inflight_queue_reqs": 1}, {}, [], []),
                 dr.EmptyReading([], {}, {"num_running_reqs": 2}, [], []),
                 dr.EmptyReading([], {}, {}, ["sglang:num_queue_reqs"], []),
                 dr.EmptyReading([], {}, {}, [], ["/metrics answered 500"])):
        assert not busy.empty, busy


def test_absent_queue_gauges_count_only_when_v1_loads_did_not_answer_every_queue():
    """Real SGLang 0.5.23 (observed in the lab): a PD decode that has run no batch since its start exports
    no queue gauges on /metrics, and keeps none while idle; its /v1/loads has every queue from the start."""
    gauges = ["sglang:num_running_reqs", "sglang:num_queue_reqs"]
    fresh = dr.EmptyReading([], {}, {}, gauges, [], loads_read=True)
    assert fresh.empty and "no batch run since its start" in fresh.describe()
    assert not dr.EmptyReading([], {}, {}, gauges, [], loads_read=False).empty
    # busy on either source is still busy, whatever the other says
    assert not dr.EmptyReading(["rid-1"], {}, {}, gauges, [], loads_read=True).empty
    assert not dr.EmptyReading([], {}, {"num_running_reqs": 1}, [], [], loads_read=True).empty


def test_a_request_open_only_in_the_log_of_an_idle_engine_still_holds_the_drain_and_is_explained():
    """Real SGLang 0.5.23 logs a request received before it validates it; one refused there (400) is
    never logged finished. pdops cannot tell it from one being tokenized, so it waits, and says why."""
    idle = dr.EmptyReading(["too-long-1"], {}, {}, [], [], loads_read=True)
    assert not idle.empty
    assert "open in its request log only" in idle.describe() and "--force-after" in idle.describe()
    # with anything queued or unread, no such word
    for busy in (dr.EmptyReading(["r"], {"num_waiting_reqs": 1}, {}, [], [], loads_read=True),
                 dr.EmptyReading(["r"], {}, {}, [], [], loads_read=False)):
        assert "request log only" not in busy.describe()


def test_an_undone_instance_that_may_never_have_listened_must_close_only_the_ports_its_own_processes_hold():
    """A halted change's instance that never registered is stopped with `check_ports: held`: its port
    may be another process's (the reason its start failed), which its stop must not wait out; a port
    its own tree (here the escaped child, still in its cgroup) listens on must be closed after."""
    from pdops.model.placement import Instance, Rank
    from pdops.steps.stopping import held_ports

    inst = Instance("p02", "prefill", (Rank(0, "lab02", "127.0.10.2", (0,)),), 0, 30010, 8998, None)
    assert inst.units[0] == ("lab02", UNIT)
    mine_and_theirs = ('LISTEN 0 128 127.0.10.2:30010 0.0.0.0:* users:(("nc",pid=9999,fd=3))\n'
                       'LISTEN 0 128 127.0.10.2:8998 0.0.0.0:* users:(("python",pid=4242,fd=9))\n')
    pool = RecordedPool(procs_now=[], listeners=mine_and_theirs)
    assert held_ports(pool, inst, {UNIT: _identity()}) == [8998]
    # a stop that leaves that port listening is not verified; the other process's port is not its matter
    still = RecordedPool(procs_now=[], listeners=mine_and_theirs)
    assert dr.verify_stopped(still, _identity(), [8998], "127.0.10.2").ports_open == [8998]
    assert held_ports(RecordedPool(procs_now=[], listeners=""), inst, {UNIT: _identity()}) == []
