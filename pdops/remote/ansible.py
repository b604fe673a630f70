"""Run the project's Ansible playbooks (idempotent host state) and read their recap."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pdops.errors import PlaybookFailed, Unreachable
from pdops.model.inventory import Inventory

PLAYBOOKS = Path(__file__).resolve().parents[2] / "playbooks"
_RECAP = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)")


@dataclass(frozen=True)
class HostRecap:
    ok: int
    changed: int
    unreachable: int
    failed: int


@dataclass(frozen=True)
class PlaybookResult:
    playbook: str
    returncode: int
    recap: dict[str, HostRecap]
    output: str

    @property
    def changed(self) -> int:
        return sum(r.changed for r in self.recap.values())




def parse_recap(output: str) -> dict[str, HostRecap]:
    """The PLAY RECAP lines of ansible-playbook's default output."""
    out = {}
    for line in output.splitlines():
        m = _RECAP.match(line.strip())
        if m:
            out[m.group(1)] = HostRecap(*(int(x) for x in m.groups()[1:]))
    return out


def file_entry(dest: str, data: bytes, mode: int) -> dict:
    """One file for deploy.yml's `pdops_files` (the pdops_files module): content travels base64."""
    return {"dest": dest, "mode": f"0{mode:o}", "content": base64.b64encode(data).decode()}


def run_playbook(inv: Inventory, playbook: str | list[str], extra_vars: dict, hosts: list[str],
                 skip_tags: tuple[str, ...] = ()) -> PlaybookResult:
    """ansible-playbook on `hosts` with one fork per host; raises on any failed or unreachable host.

    Several playbooks run in one ansible-playbook (one start, one set of SSH masters), in order;
    the recap then covers them all. `skip_tags`: tasks left out (--skip-tags)."""
    books = [playbook] if isinstance(playbook, str) else list(playbook)
    playbook = " + ".join(books)
    bindir = Path(sys.executable).parent
    env = dict(os.environ)
    env.update({"ANSIBLE_CONFIG": str(PLAYBOOKS / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
                "ANSIBLE_FORCE_COLOR": "0", "PATH": f"{bindir}:{env.get('PATH', '')}"})
    if inv.virtual_hardware:
        env["ANSIBLE_HOST_KEY_CHECKING"] = "False"  # lab hosts get new keys at every boot
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="pdops-vars-", delete=False) as f:
        json.dump(extra_vars, f)
        vars_file = f.name
    try:
        os.chmod(vars_file, 0o600)
        inventories = [a for f in inv.files for a in ("-i", str(f))]
        cmd = [str(bindir / "ansible-playbook"), *inventories, *(str(PLAYBOOKS / b) for b in books),
               "--forks", str(max(len(hosts), 1)), "--limit", ",".join(hosts), "-e", f"@{vars_file}",
               *(["--skip-tags", ",".join(skip_tags)] if skip_tags else [])]
        # Output goes to a file, not a pipe: ssh's ControlPersist master outlives ansible
        # and would hold a pipe open.
        with tempfile.TemporaryFile("w+") as out:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env,
                                timeout=1800, stdin=subprocess.DEVNULL).returncode
            out.seek(0)
            stdout = out.read()
        proc = subprocess.CompletedProcess(cmd, rc, stdout, "")
    finally:
        os.unlink(vars_file)
    output = proc.stdout + proc.stderr
    recap = parse_recap(proc.stdout)
    result = PlaybookResult(playbook, proc.returncode, recap, output)
    down = [h for h, r in recap.items() if r.unreachable]
    if down:
        raise Unreachable(f"ansible could not reach {', '.join(down)} ({playbook})",
                          fix="check the host is up and SSH answers (inv preflight)", evidence=_tail(output))
    if proc.returncode != 0 or any(r.failed for r in recap.values()) or set(hosts) - set(recap):
        failed = [h for h, r in recap.items() if r.failed] or sorted(set(hosts) - set(recap)) or hosts
        raise PlaybookFailed(f"{playbook} failed on {', '.join(failed)} (exit {proc.returncode})",
                             evidence=_tail(output))
    return result


def _tail(text: str, n: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])
