"""`make mutate`: flip each verifier's verdict to "yes" and show that a test fails.

Each mutation names a verifier by what it is in the code, not by file and line: the
qualified name of a function or property (`StopEvidence.verified`, `canary_pair`) that is
defined exactly once anywhere under `pdops/`. A mutation either replaces that function's
whole body (`body=`: the verifier answers "yes" without looking), or flips one text that
occurs exactly once inside it (`old=`/`new=`). So a file that moves, or a function that
moves within its file, keeps its mutation applicable; only a rename needs MUTATIONS updated,
and `tests/unit/core/test_mutations.py` (part of `make test`) says so at once.

First the catching tests run once with nothing mutated: each must pass, or a "caught" below
would prove nothing. Then, for every mutation, the script writes the mutated file in place, runs the tests that exist to
catch it, restores the file, and prints a table: verifier, the tests that failed (caught the
flip). It exits 1 if any flip survives (no test failed), 2 if a mutation no longer applies,
and refuses to start while a file it mutates has uncommitted changes.

Not part of `make test`: the rows boot the lab and deploy (README: how long it takes).
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "pdops"
VERIFIERS = "tests/lab/test_verifiers.py"


@dataclass(frozen=True)
class Mutation:
    """One verifier flipped to "yes". `where`: the qualified name of the function or property
    (Class.method) defined once under pdops/. Either `body` (the new body, replacing the whole
    body) or `old`/`new` (a text found exactly once in that function's source)."""

    verifier: str
    where: str
    tests: tuple[str, ...]
    body: str = ""
    old: str = ""
    new: str = ""


MUTATIONS = (
    Mutation("stop: StopEvidence.verified always true", "StopEvidence.verified",
             (f"{VERIFIERS}::test_stop_with_an_escaped_process_holding_the_ports_is_not_verified_until_it_is_ended",
              "tests/unit/steps/test_stopping.py"),
             body="return True"),
    Mutation("undo: an undone instance's stop checks none of the ports its processes held", "held_ports",
             ("tests/unit/steps/test_stopping.py::test_an_undone_instance_that_may_never_have_listened_must_close_only_the_ports_its_own_processes_hold",),
             body="return []"),
    Mutation("canary: canary_pair sends nothing", "canary_pair",
             (f"{VERIFIERS}::test_canary_names_exactly_the_pair_whose_transfer_fails_and_registers_nothing",),
             body='return {"rid": "not sent", "completion_tokens": 1}'),
    Mutation("health gate: any /health answer counts as healthy", "await_health",
             (f"{VERIFIERS}::test_health_gate_an_instance_that_never_turns_healthy",),
             old="if status == 200:", new="if True:"),
    Mutation("start: whatever listens on the instance's port is taken for its unit", "port_owner",
             (f"{VERIFIERS}::test_start_is_not_verified_when_another_process_answers_on_the_instances_port",),
             old="if not set(owners) & mine:", new="if False:"),
    Mutation("rollback: an instance moved onto a slot another holds now is planned", "refuse_moves_onto_held_slots",
             ("tests/unit/ops/test_scale_plan.py::test_a_rollback_that_moves_an_instance_onto_the_slot_another_holds_now_is_refused",),
             body="return None"),
    Mutation("registration: the gateway's answer is not awaited", "GatewayClient.wait_worker_healthy",
             (f"{VERIFIERS}::test_registration_the_gateway_never_shows_healthy",),
             body='return type("Accepted", (), {"id": None, "url": url, "routable": True})()'),
    Mutation("empty checks: every reading is empty", "EmptyReading.empty",
             (f"{VERIFIERS}::test_empty_check_2_catches_work_that_arrived_after_check_1",
              "tests/unit/steps/test_stopping.py"),
             body="return True"),
    Mutation("verdict: what a step could not check listed as verified", "run_steps",
             (f"{VERIFIERS}::test_verdict_lists_skipped_checks_as_not_verified_never_as_verified",
              "tests/unit/core/test_runner.py"),
             old="unverified += r.unverified", new="verified += r.unverified"),
    Mutation("verify: a MainPID outside its unit's cgroup passes", "_cgroup_problems",
             ("tests/unit/reads/test_verify_host_state.py",),
             old="elif str(pid) not in procs.get(u, []):", new="elif False:"),
    Mutation("generation: a change of generation counts as none (rolled in waves)", "GenerationChange.changes",
             ("tests/unit/ops/test_fenced.py",), body="return False"),
    Mutation("sim: a prefill and a decode of two generations pair", "mismatch",
             ("tests/sim/test_sim_generation.py", "tests/unit/model/test_generation.py"), body="return None"),
    Mutation("gateways: a gateway that does not route to an instance is not seen", "InstanceObservation.gateway_problems",
             ("tests/unit/ops/test_gateways.py",), body="return {}"),
    Mutation("status: a process in a unit's cgroup outside MainPID's family is not named", "RankIdentity.strays",
             ("tests/unit/reads/test_observe.py::test_status_names_a_process_in_a_units_cgroup_that_is_not_under_its_main_pid",
              "tests/lab/test_repair.py::test_a_stray_process_in_a_decode_cgroup_is_named_and_stopped_by_the_repair"),
             body="return []"),
    Mutation("record on etcd: the lock taken without compare-and-swap", "EtcdSession.first",
             ("tests/unit/record/test_record_etcd.py::test_two_operators_racing_for_the_lock_exactly_one_holds_it",),
             old='compare = [E.cmp_created(p + "lock", 0), E.cmp_modified(p + "holder", prev.mod_revision if prev else 0)]',
             new='compare = []'),
    Mutation("record on etcd: a write under the lock does not check the lease is still held", "EtcdSession.first",
             ("tests/unit/record/test_record_etcd.py::test_a_holder_whose_lease_expired_writes_nothing_and_the_next_change_reports_it",),
             old='self.guard = [E.cmp_created(p + "lock", res.revision)]', new='self.guard = []'),
    Mutation("migration: the copy taken as equal without reading it back", "do_record_verify_copy",
             ("tests/unit/record/test_record_etcd.py::test_a_copy_that_does_not_read_back_equal_is_not_a_migration",),
             old="if want != got:", new="if False:"),
    Mutation("front door: every gateway taken as UP in HAProxy without reading it", "wait_gateways_up",
             ("tests/lab/test_gateways_lab.py::test_sigkill_of_one_gateway_turns_away_at_most_what_was_in_flight_on_it",),
             body="return {}"),
    Mutation("serving: a worker taken as routable whatever its circuit breaker", "Worker.routable",
             ("tests/unit/reads/test_breakers.py", "tests/sim/test_sim_breakers.py",
              "tests/lab/test_repair.py::test_a_decode_killed_under_load_and_repaired_leaves_no_circuit_open"),
             body='return self.is_healthy and self.status == READY'),
    Mutation("close-breakers: an open breaker left as it is", "do_close_breakers",
             ("tests/lab/test_repair.py::test_a_decode_killed_under_load_and_repaired_leaves_no_circuit_open",
              "tests/lab/test_repair.py::test_the_only_decode_killed_opens_the_prefills_circuit_and_its_repair_closes_both"),
             old="w = client.reregister(w, deadline)", new="pass"),
    Mutation("observe: a file edited on the host taken as the revision's", "file_drift",
             ("tests/unit/reads/test_observe.py::test_a_launch_script_edited_beside_the_process_that_runs_the_revisions_is_put_back_without_a_restart",
              "tests/unit/reads/test_observe.py::test_a_launch_script_edited_and_run_by_a_restart_is_replaced_from_the_revisions_files"),
             body="return None"),
    Mutation("stop: the unit's runtime directory (the engine's TMPDIR) said removed without reading it", "runtime_dir_left",
             ("tests/unit/steps/test_stopping.py::test_what_systemd_left_of_the_units_runtime_directory_is_said",),
             body='return f"{RUN_DIR}/{runtime_dir(unit)} removed by systemd"'),
)


class NotApplicable(Exception):
    """A mutation that no longer applies: its function is gone, defined twice, or its text moved."""


def _definitions(tree: ast.AST) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function in a module with its qualified name (Class.method, outer.inner)."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return out


def locate(m: Mutation, root: Path = REPO) -> tuple[Path, ast.FunctionDef]:
    """The one file and function `m.where` names; NotApplicable unless there is exactly one."""
    found = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        found += [(path, fn) for name, fn in _definitions(tree) if name == m.where]
    if len(found) != 1:
        where = ", ".join(f"{p.relative_to(root)}:{fn.lineno}" for p, fn in found) or "nowhere"
        raise NotApplicable(f"{m.verifier}: {m.where} is defined {len(found)} times under {PACKAGE}/ "
                            f"({where}), not once; update MUTATIONS in scripts/mutate.py")
    return found[0]


def mutated_text(m: Mutation, root: Path = REPO) -> tuple[Path, str, str]:
    """(file, original text, mutated text) for `m`; NotApplicable when it cannot be applied."""
    path, fn = locate(m, root)
    original = path.read_text()
    lines = original.splitlines(keepends=True)
    first, last = fn.body[0].lineno - 1, fn.end_lineno  # the body's lines (decorators and def kept)
    if m.body:
        indent = " " * fn.body[0].col_offset
        new_body = textwrap.indent(m.body.rstrip() + "\n", indent)
        text = "".join(lines[:first]) + new_body + "".join(lines[last:])
    else:
        source = "".join(lines[fn.lineno - 1:last])
        if source.count(m.old) != 1:
            raise NotApplicable(f"{m.verifier}: {m.old!r} occurs {source.count(m.old)} times in {m.where} "
                                f"({path.relative_to(root)}), not once; update MUTATIONS in scripts/mutate.py")
        text = "".join(lines[:fn.lineno - 1]) + source.replace(m.old, m.new) + "".join(lines[last:])
    if text == original:
        raise NotApplicable(f"{m.verifier}: the mutation changes nothing in {m.where}; update MUTATIONS")
    compile(text, str(path), "exec")
    return path, original, text


def _dirty(paths: list[str]) -> list[str]:
    out = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=REPO, capture_output=True, text=True)
    return [ln for ln in out.stdout.splitlines() if ln.strip()]


def _failed_tests(junit: Path) -> list[str]:
    if not junit.exists():
        return []
    failed = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}")
    return failed


def in_file_order(tests: list[str]) -> list[str]:
    """`tests` with the ids of one file in the order the file defines them (files in the order given):
    a lab module's tests share its cluster, each starting from what the one before it left, as
    `make test` runs them (given out of order, a test met a gateway an earlier one had stopped)."""
    def line(test: str) -> int:
        path, _, name = test.partition("::")
        if not name:
            return -1  # a whole file first
        for node in ast.parse((REPO / path).read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == name.split("[")[0]:
                return node.lineno
        return 1 << 30
    files = list(dict.fromkeys(t.partition("::")[0] for t in tests))
    return [t for f in files for t in sorted((t for t in tests if t.partition("::")[0] == f), key=line)]


def _pytest(python: str, tests: list[str]) -> tuple[list[str], int]:
    """Run `tests` (in file order); (the failed test ids, pytest's exit status)."""
    tests = in_file_order(tests)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                               *tests], cwd=REPO, capture_output=True, text=True)
        return _failed_tests(junit), proc.returncode


def run_one(m: Mutation, python: str) -> tuple[list[str], int]:
    path, original, text = mutated_text(m)
    restore = lambda *_: path.write_text(original)  # noqa: E731
    previous = {s: signal.signal(s, lambda n, f: (restore(), sys.exit(128 + n))) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        path.write_text(text)
        return _pytest(python, list(m.tests))
    finally:
        restore()
        for s, h in previous.items():
            signal.signal(s, h)


def main() -> int:
    python = str(REPO / ".venv" / "bin" / "python")
    try:
        paths = sorted({str(locate(m)[0].relative_to(REPO)) for m in MUTATIONS})
        for m in MUTATIONS:
            mutated_text(m)
    except NotApplicable as exc:
        print(f"mutate: {exc}", file=sys.stderr)
        return 2
    dirty = _dirty(paths)
    if dirty:
        print("mutate: refusing to edit files with uncommitted changes:\n  " + "\n  ".join(dirty), file=sys.stderr)
        return 2
    t0 = time.monotonic()
    # Baseline: a test that fails with no mutation would "catch" every flip and prove nothing.
    tests = list(dict.fromkeys(t for m in MUTATIONS for t in m.tests))
    print(f"== baseline: the {len(tests)} catching test files/ids, nothing mutated", flush=True)
    failed, rc = _pytest(python, tests)
    if rc != 0:
        print(f"mutate: these fail with no mutation (fix them first): {', '.join(failed) or f'pytest exit {rc}'}",
              file=sys.stderr)
        return 1
    print(f"   all pass ({time.monotonic() - t0:.0f} s)", flush=True)
    rows = []
    for m in MUTATIONS:
        print(f"== {m.verifier} ({m.where})", flush=True)
        caught, rc = run_one(m, python)
        rows.append((m.verifier, caught, rc))
        print(f"   {'caught by ' + ', '.join(caught) if caught else 'SURVIVED'} (pytest exit {rc})", flush=True)
    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'verifier flipped to yes'.ljust(width)}  tests that caught the flip")
    print(f"{'-' * width}  {'-' * 26}")
    for verifier, caught, _ in rows:
        print(f"{verifier.ljust(width)}  {', '.join(caught) if caught else 'NONE: the flip survived'}")
    survived = [r[0] for r in rows if not r[1]]
    print(f"\n{len(rows) - len(survived)} of {len(rows)} flips caught in {time.monotonic() - t0:.0f} s")
    return 1 if survived else 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
