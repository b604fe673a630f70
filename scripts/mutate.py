"""`make mutate`: flip each verifier's verdict to "yes" and show that a test fails.

For every verifier below, the script changes one line of the source in place (the same
kind of change mutmut makes), runs the tests that exist to catch it, restores the file,
and prints a table: verifier, the tests that failed (caught the flip). It exits 1 if any
flip survives (no test failed), 2 if a mutation no longer applies (the code moved: update
MUTATIONS), and refuses to start while a file it mutates has uncommitted changes.

Not part of `make test`: each row boots the lab and deploys (about 10-15 minutes in all).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERIFIERS = "tests/lab/test_verifiers.py"


@dataclass(frozen=True)
class Mutation:
    verifier: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation("stop: StopEvidence.verified always true", "pdops/drain.py",
             "        return self.cgroup_empty and not self.survivors and not self.ports_open\n",
             "        return True\n",
             (f"{VERIFIERS}::test_stop_with_an_escaped_process_holding_the_ports_is_not_verified_until_it_is_ended",
              "tests/unit/test_drain_verifiers.py")),
    Mutation("canary: canary_pair sends nothing", "pdops/deploy.py",
             '    rid = f"pdops-canary-{p.id}-{d.id}-{uuid.uuid4().hex[:8]}"\n',
             '    return {"rid": "not sent", "completion_tokens": 1}\n',
             (f"{VERIFIERS}::test_canary_names_exactly_the_pair_whose_transfer_fails_and_registers_nothing",)),
    Mutation("health gate: any /health answer counts as healthy", "pdops/deploy.py",
             "        if status == 200:\n            break\n",
             "        if True:\n            break\n",
             (f"{VERIFIERS}::test_health_gate_an_instance_that_never_turns_healthy",)),
    Mutation("registration: the gateway's answer is not awaited", "pdops/deploy.py",
             "    w = client.wait_worker_healthy(inst.url, deadline_in(timeout_s))\n",
             "    w = type('Accepted', (), {'id': worker_id})()\n",
             (f"{VERIFIERS}::test_registration_the_gateway_never_shows_healthy",)),
    Mutation("empty checks: every reading is empty", "pdops/drain.py",
             "        return not (self.open_rids or self.loads_busy or self.metrics_busy or self.metrics_missing"
             " or self.errors)\n",
             "        return True\n",
             (f"{VERIFIERS}::test_empty_check_2_catches_work_that_arrived_after_check_1",
              "tests/unit/test_drain_verifiers.py")),
    Mutation("verdict: what a step could not check listed as verified", "pdops/runner.py",
             "            unverified += r.unverified\n",
             "            verified += r.unverified\n",
             (f"{VERIFIERS}::test_verdict_lists_skipped_checks_as_not_verified_never_as_verified",
              "tests/unit/test_runner.py")),
)


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


def run_one(m: Mutation, python: str) -> tuple[list[str], int]:
    path = REPO / m.path
    original = path.read_text()
    if original.count(m.old) != 1:
        raise SystemExit(f"mutate: {m.verifier}: the line to flip is not found exactly once in {m.path}; "
                         "update MUTATIONS in scripts/mutate.py")
    restore = lambda *_: path.write_text(original)  # noqa: E731
    previous = {s: signal.signal(s, lambda n, f: (restore(), sys.exit(128 + n))) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        path.write_text(original.replace(m.old, m.new))
        with tempfile.TemporaryDirectory() as tmp:
            junit = Path(tmp) / "junit.xml"
            proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                                   *m.tests], cwd=REPO, capture_output=True, text=True)
            return _failed_tests(junit), proc.returncode
    finally:
        restore()
        for s, h in previous.items():
            signal.signal(s, h)


def main() -> int:
    python = str(REPO / ".venv" / "bin" / "python")
    dirty = _dirty(sorted({m.path for m in MUTATIONS}))
    if dirty:
        print("mutate: refusing to edit files with uncommitted changes:\n  " + "\n  ".join(dirty), file=sys.stderr)
        return 2
    rows = []
    for m in MUTATIONS:
        print(f"== {m.verifier} ({m.path})", flush=True)
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
    print(f"\n{len(rows) - len(survived)} of {len(rows)} flips caught")
    return 1 if survived else 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
