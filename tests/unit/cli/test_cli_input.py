"""Operator mistakes in task options get one clear error (exit 2), never a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("args,needle", [
    (["drain", "-i", "inventory/lab", "--instance", "p01", "--wait", "abc"], "--wait: 'abc' is not a number of seconds"),
    (["drain", "-i", "inventory/lab", "--instance", "p01", "--interval", "-1"], "--interval: '-1' is not a non-negative"),
    (["drain", "-i", "inventory/lab"], "--instance: missing"),
    (["stop", "-i", "inventory/lab", "--kill-survivors"], "--instance: missing"),
    (["admission.keys", "-i", "inventory/lab", "--deadline", "0"], "--deadline: 0 is less than 5 seconds"),
    (["lab.up", "--hosts", "abc"], "--hosts: 'abc' is not a whole number"),
    (["lab.up", "--hosts", "65"], "--hosts: 65 is out of range"),
    (["demo", "--hosts", "0"], "--hosts: 0 is out of range"),
    (["deploy", "--topology", "0p4d", "-i", "inventory/lab"], "needs at least one prefill"),
    (["status", "-i", "inventory/lab", "--watch", "0"], "--watch: '0' is not a positive number of seconds"),
    (["status", "-i", "inventory/lab", "--watch", "soon"], "--watch: 'soon' is not a number of seconds"),
    (["status", "-i", "inventory/lab", "--prometheus", "mon01:9090"], "--prometheus: 'mon01:9090' is not an http(s) URL"),
    (["repair", "-i", "inventory/lab"], "--instance: missing"),
    (["repair", "-i", "inventory/lab", "--instance", "d01;reboot"], "is not an instance id"),
    (["repair", "-i", "inventory/lab", "--instance", "d01", "--wait", "-5"], "--wait: '-5' is not a non-negative"),
    (["probe", "-i", "inventory/lab", "--spare"], "--bundle: no bundle file given"),
    (["probe", "-i", "inventory/lab", "--spare", "--bundle", "no-such.yml"], "--bundle: no-such.yml is not a file"),
    (["probe", "-i", "inventory/lab", "--spare", "--bundle", "tests/data/probe/T2.yml", "--workload", "lots"],
     "--workload: 'lots' is not INPUT/OUTPUT tokens"),
    (["probe", "-i", "inventory/lab", "--spare", "--bundle", "tests/data/probe/T2.yml", "--requests", "x"],
     "--requests: 'x' is not a whole number"),
    (["probe", "-i", "inventory/lab", "--spare", "--bundle", "tests/data/probe/bad-flag.yml"],
     "is not a flag of SGLang 0.5.23"),
    # refused before the record is read: no lab is up here, so a later check would fail unreachable
    (["probe", "-i", "inventory/lab", "--spare", "--instances", "p01,d01", "--bundle", "tests/data/probe/T2.yml"],
     "give exactly one of --instances p01,d01 and --spare"),
    (["probe", "-i", "inventory/lab", "--spare", "--keep", "--bundle", "tests/data/probe/T2.yml"], "nothing to keep"),
    (["probe", "-i", "inventory/lab", "--instances", "p01;reboot", "--bundle", "tests/data/probe/T2.yml"],
     "is not a list of instance ids"),
    (["probe", "-i", "inventory/lab", "--spare", "--requests", "4", "--concurrency", "9", "--bundle",
      "tests/data/probe/T2.yml"], "--concurrency: 9 is not 1..4"),
    (["probe", "-i", "inventory/lab", "--note", "T1"], "--reading: the reading is empty"),
    (["probe", "-i", "inventory/lab", "--note", "x1", "--reading", "r"], "'x1' is not a probe id"),
])
def test_bad_option_values_are_refused_without_a_traceback(args, needle):
    proc = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr and "fix:" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_every_verdict_says_what_the_operation_cost_this_machine_and_when_it_was_the_bottleneck():
    """The last verdict line: CPU seconds over the command's wall time as cores busy; past 80% of the
    machine's cores it says the machine, not the fleet, held the operation back (issue #35)."""
    from pdops.cli import machine_cost

    calm = machine_cost(16.9, 45.4, 2)
    assert calm == "this machine: 16.9 CPU-s in 45.4 s, 0.37 of its 2 core(s) busy on average"
    busy = machine_cost(30.0, 18.0, 2)
    assert "1.67 of its 2 core(s)" in busy and "not the fleet, held the operation back" in busy
    assert "held" not in machine_cost(1.5, 1.0, 2)  # 0.75 of 2 cores: not past 80%
