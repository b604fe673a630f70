"""The lab: a cluster of real systemd + sshd test hosts on this one machine (docs/design/lab.md).

Each lab host N is real systemd as PID 1 of its own PID + mount + cgroup + UTS
namespace, with a real sshd listening on 127.0.10.N. Fabric, Ansible and testinfra
reach it over real SSH; units run in real cgroups.

Safety is part of the boot, not a convention: every host gets a read-only view of the
shared root, private tmpfs /tmp, /var/tmp, /run, /var/lib/systemd, /var/log, masks for
the units that must not run against a shared kernel and filesystem, and its own cgroup
namespace. The inner boot script verifies each of these just before it execs systemd;
a host whose safety steps fail is never booted and the error names the failed step.

One concern per module, the pure ones first:

- `paths`: the slot, host names and addresses, the lab dir and the files in it
- `hostfiles`: the sshd_config, units, masks and boot scripts a host boots from (text)
- `inventory`: the Ansible inventory `up` writes, and `own_record` for a derived one
- `report`: HostStatus, UpResult and their readable lines
- `records`: a host's state.json (PIDs with start times) and whether it is alive
- `cgroups`: the hierarchy mounts, each host's cgroup dirs, the processes in them
- `machine`: what the lab needs of this machine (root, binaries), the lab dir's lock
- `ssh`: the client key, commands over SSH, sshd answering, listeners on lab addresses
- `host`: one host's boot and stop, and the clean-up of one that died
- `lifecycle`: `up`, `down`, `status` over every host
- `demo`: `make demo` (imported by the CLI only: it reaches the product's operations)

This module re-exports the names callers use (`from pdops import lab; lab.up(4)`). A test that
replaces a constant patches the module that reads it (e.g. `machine.REQUIRED_BINARIES`).
"""

from __future__ import annotations

from pdops.lab.cgroups import (CgroupMount, cgroup_indexes, cgroup_mounts, host_cgroup_pids, is_lab_cgroup,
                               lab_cgroup_dirs, lab_processes, parse_findmnt_pairs, parse_proc_cgroup)
from pdops.lab.host import BOOT_DEADLINE_S, STOP_DEADLINE_S
from pdops.lab.hostfiles import LAB_TARGET, MASKS, SSHD_UNIT, inner_script, outer_script, sshd_config_text, unit_texts
from pdops.lab.inventory import grown_fleet, inventory_doc, inventory_files, inventory_text, own_record
from pdops.lab.lifecycle import down, status, up
from pdops.lab.machine import REQUIRED_BINARIES, check_binaries
from pdops.lab.paths import (ADDRESS_PREFIX, CGROUP_GROUP, DEFAULT_LAB_DIR, LAB_DIR_ENV, MAX_HOSTS, MAX_SLOTS,
                             PRIVATE_TMPFS, SLOT_ENV, SSH_PORT, WRITABLE_BINDS, address_prefix, cgroup_group,
                             default_lab_dir, host_address, host_dir, host_name, inventory_path, needs_staging,
                             repo_root, resolve_lab_dir, slot, ssh_key_path, validate_host_count)
from pdops.lab.records import read_record, record_alive
from pdops.lab.report import HostStatus, UpResult, format_status, summary_line
from pdops.lab.ssh import SSH_OPTIONS, address_conflicts, parse_listeners

__all__ = [
    # the verbs and what they return
    "up", "down", "status", "HostStatus", "UpResult", "format_status", "summary_line",
    # where a lab lives
    "slot", "address_prefix", "cgroup_group", "default_lab_dir", "host_name", "host_address", "host_dir",
    "repo_root", "validate_host_count", "resolve_lab_dir", "inventory_path", "ssh_key_path", "needs_staging",
    "DEFAULT_LAB_DIR", "LAB_DIR_ENV", "MAX_HOSTS", "ADDRESS_PREFIX", "SSH_PORT", "CGROUP_GROUP", "SLOT_ENV",
    "MAX_SLOTS", "PRIVATE_TMPFS", "WRITABLE_BINDS",
    # what a host boots from, and its inventory
    "MASKS", "SSHD_UNIT", "LAB_TARGET", "sshd_config_text", "unit_texts", "outer_script", "inner_script",
    "inventory_doc", "inventory_text", "inventory_files", "own_record", "grown_fleet",
    # the machine, the cgroups, the records, SSH
    "REQUIRED_BINARIES", "check_binaries", "BOOT_DEADLINE_S", "STOP_DEADLINE_S", "SSH_OPTIONS",
    "CgroupMount", "cgroup_mounts", "cgroup_indexes", "parse_findmnt_pairs", "parse_proc_cgroup",
    "is_lab_cgroup", "host_cgroup_pids", "lab_processes", "lab_cgroup_dirs",
    "read_record", "record_alive", "parse_listeners", "address_conflicts",
]
