"""Lab: a cluster of real systemd + sshd test hosts on this machine (see docs/design/lab.md)."""

from __future__ import annotations

import re

from invoke import task

from pdops import lab as lab_api
from pdops.cli import cli_errors
from pdops.errors import InvalidInput
from pdops.lab.hostfiles import BOOT_MODES


@task(help={"hosts": f"how many lab hosts to boot (1..{lab_api.MAX_HOSTS}, default 4)",
            "boot": "lab (default: nothing pdops installed starts at boot) or enabled (every unit enabled in "
                    "multi-user.target.wants starts, as on a real host)"})
@cli_errors
def up(c, hosts="4", boot="lab"):  # a string: a bad value gets our error, not invoke's traceback
    """Boot lab hosts lab01..labNN on 127.0.10.1..N (only those not up) and write the inventory."""
    n = lab_api.validate_host_count(hosts)
    if boot not in BOOT_MODES:
        raise InvalidInput("--boot", f"{boot!r} is not one of {', '.join(BOOT_MODES)}")
    print(f"lab: bringing up {n} host(s) in {lab_api.resolve_lab_dir()} (boot: {boot}) ...", flush=True)
    result = lab_api.up(n, boot=boot)
    for line in lab_api.format_status(result):
        print("  " + line)
    if result.changed:
        action = f"booted {len(result.booted)}"
        if result.cleaned:
            action += f", cleaned up {len(result.cleaned)} killed abruptly"
        if result.inventory_changed:
            action += ", inventory written"
    else:
        action = "all already up, inventory current: nothing changed"
    print(lab_api.summary_line(result, action))
    print(f"inventory: {lab_api.inventory_path()}")
    print(f"ssh key:   {lab_api.ssh_key_path()}   (ssh -i <key> root@{lab_api.host_address(1)})")


@task(help={"host": "only this host (lab03 or 3); repeatable: a host that dies while the others run"},
      iterable=["host"])
@cli_errors
def down(c, host=None):
    """Power every lab host off over SSH (kill its recorded PID if it hangs), remove its cgroups."""
    only = None
    if host:
        from pdops.errors import InvalidInput

        only = []
        for h in host:
            m = re.fullmatch(r"(?:lab)?0*(\d+)", str(h))
            if not m or not 1 <= int(m.group(1)) <= 99:
                raise InvalidInput("--host", f"{h!r} is not a lab host", fix="e.g. --host lab03 (or 3)")
            only.append(int(m.group(1)))
    result = lab_api.down(hosts=only)
    if not result:
        print("lab: no lab hosts recorded or running: nothing to do")
        return
    for line in lab_api.format_status(result):
        print("  " + line)
    left = lab_api.lab_processes()
    dirs = lab_api.lab_cgroup_dirs()
    print(
        f"{len(result)} lab host(s) stopped; lab processes left: {len(left)}, "
        f"pdops-lab cgroup dirs left: {len(dirs)}"
    )


@task
@cli_errors
def status(c):
    """Show each lab host: up or down, PID, systemd state, sshd answering."""
    result = lab_api.status()
    if not result:
        print(f"lab: no lab hosts in {lab_api.resolve_lab_dir()} (inv lab.up boots them)")
        return
    for line in lab_api.format_status(result):
        print("  " + line)
    print(lab_api.summary_line(result))
