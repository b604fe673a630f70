"""`inv verify`: the testinfra suite of the deployed state, run against any inventory over SSH."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pdops.errors import Refused, Unverified
from pdops.inventory import Inventory
from pdops.state import StateDir

SUITE = Path(__file__).resolve().parent / "test_deployed.py"


def run_verify(inv: Inventory, state, *, quiet: bool = True) -> str:
    """Run the suite on every host of the current revision; Unverified with the failures if any fails."""
    if len(inv.files) != 1:
        raise Refused(f"testinfra takes one inventory file; {inv.path} has {len(inv.files)}",
                      fix="keep the inventory in one hosts.yml")
    rev_n = state.current()
    if rev_n is None:
        raise Refused(f"{inv.cluster} has no current revision to verify", fix="deploy first (inv deploy)")
    bindir = Path(sys.executable).parent
    rev_file = revision_file(state, rev_n)
    env = dict(os.environ, PDOPS_VERIFY_REVISION=str(rev_file),
               PATH=f"{bindir}:{os.environ.get('PATH', '')}", ANSIBLE_CONFIG=str(
                   Path(__file__).resolve().parents[2] / "playbooks" / "ansible.cfg"))
    if inv.virtual_hardware:
        env["ANSIBLE_HOST_KEY_CHECKING"] = "False"
        env["PDOPS_VERIFY_VIRTUAL"] = "1"
    cmd = [sys.executable, "-m", "pytest", str(SUITE), "-p", "no:cacheprovider", "-q", "--no-header",
        "--rootdir", str(SUITE.parent), "-c", os.devnull,
        "--hosts=ansible://gpu_hosts", f"--ansible-inventory={inv.files[0]}"]
    with tempfile.TemporaryFile("w+") as f:  # a file: ssh masters may outlive pytest
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env, timeout=600,
                            stdin=subprocess.DEVNULL).returncode
        f.seek(0)
        out = f.read()
    proc = subprocess.CompletedProcess(cmd, rc, out, "")
    findings = observed_findings(inv, state)
    if proc.returncode != 0 or findings:
        evidence = ("\n".join(out.splitlines()[-40:]) if proc.returncode != 0 else "") + \
            ("\nobserved, against the revision:\n" + "\n".join(f"  - {f}" for f in findings) if findings else "")
        raise Unverified(f"verify of revision {rev_n} failed", evidence=evidence.strip(),
                         fix="`inv deploy --topology <the live one>` repairs what is down, restarted or missing "
                             "in the gateway" if findings else None)
    last = out.strip().splitlines()[-1] if out.strip() else "ok"
    return f"{last}; gateway: every worker of revision {rev_n} healthy and ready, none unknown"


def revision_file(state, n: int) -> Path:
    """A file holding revision `n` as recorded (the suite reads it): the local record's own file,
    or a 0600 copy of the shared record's under this machine's dir."""
    if hasattr(state, "revision_file"):
        return state.revision_file(n)
    import json
    from dataclasses import asdict

    from pdops.state import atomic_write

    d = state.path / "verify"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = d / f"revision-{int(n):04d}.json"
    atomic_write(path, json.dumps(asdict(state.read_revision(n)), indent=2, sort_keys=True) + "\n")
    os.chmod(path, 0o600)
    return path


def observed_findings(inv: Inventory, state) -> list[str]:
    """What runs now against the current revision (pdops.observe): units, MainPIDs, the gateway's
    workers (each healthy and ready, none the revision does not know) and its start-up list."""
    from pdops.hosts import connections
    from pdops.observe import observe

    with connections(inv) as conns:
        return observe(inv, state.current_revision(), conns["pool"], conns["gateway"]).findings()
