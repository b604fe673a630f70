#!/usr/bin/python
"""Ansible module: put a host's whole set of rendered pdops files in place in one module run."""

from __future__ import annotations

DOCUMENTATION = r"""
module: pdops_files
short_description: Write a pdops revision's files (content, mode, owner) and remove stale ones, in one run
description:
  - Replaces a loop of ansible.builtin.copy (a stat, a transfer and a copy per file) with one
    module run per host; a 16-host deploy spent most of its time in those round trips.
  - A file whose content, mode and owner already match is left alone (reported unchanged),
    so a second run reports no change.
  - New content is written to a temporary file in the destination folder, created with the
    final mode (never readable more widely, even for a moment), synced, then renamed over the
    destination: a reader sees the old file or the new one, never half of one.
  - The destination folder must exist or be one of I(directories); a missing one fails.
  - prepare.yml and deploy.yml use it for pdops's folders (I(directories)) and to refuse a host
    without the engine's python (I(executables)); in deploy.yml in the same run as the files:
    one module run where several were (each module run starts a Python on the host and imports
    Ansible's module library, ~0.4 CPU-s on the lab machine).
options:
  directories:
    description: Folders to create or bring to their mode and owner (parents must exist).
    type: list
    elements: dict
    default: []
    suboptions:
      path: {type: path, required: true}
      mode: {type: str, required: true, description: octal, e.g. "0700"}
  executables:
    description: Paths that must be executable files on the host; any other is a failure naming it.
    type: list
    elements: path
    default: []
  units:
    description:
      - systemd units (names, files in I(unit_dir)) of this host. When any file was written or
        removed, they are checked with C(systemd-analyze verify) (any output or a non-zero exit
        fails, with that output) and systemd is reloaded; then every unit not enabled is
        enabled (nothing is started). What ansible.builtin.command and systemd_service did in
        three more module runs.
      - Not given (as in prepare.yml): systemd is not touched. Given, even empty (deploy.yml):
        a change of files reloads systemd.
    type: list
    elements: str
  unit_dir: {type: path, default: /etc/systemd/system}
  files:
    description: Files to write; content is base64 and hidden from logs (no_log), as env files hold secrets.
    type: list
    elements: dict
    default: []
    suboptions:
      dest: {type: path, required: true}
      content: {type: str, required: true, description: the file's bytes, base64}
      mode: {type: str, required: true, description: octal, e.g. "0600"}
  remove:
    description: Paths to remove (files of instances no longer in the revision); absent ones are fine.
    type: list
    elements: path
    default: []
  owner: {type: str, default: root}
  group: {type: str, default: root}
"""

RETURN = r"""
written: {description: paths (files or folders) created, or whose content, mode or owner changed, type: list}
removed: {description: paths that existed and were removed, type: list}
unchanged: {description: number of files already as wanted, type: int}
enabled: {description: units that were not enabled and now are, type: list}
"""

import base64
import grp
import hashlib
import os
import pwd
import tempfile

from ansible.module_utils.basic import AnsibleModule


def _digest(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def _write(path: str, data: bytes, mode: int, uid: int, gid: int) -> None:
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".pdops-", dir=folder)
    try:
        os.fchmod(fd, mode)
        os.fchown(fd, uid, gid)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _octal(module, path: str, text: str) -> int:
    try:
        return int(str(text), 8)
    except ValueError:
        module.fail_json(msg=f"{path}: mode {text!r} is not octal")


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "files": {"type": "list", "elements": "dict", "default": [], "options": {
                "dest": {"type": "path", "required": True},
                "content": {"type": "str", "required": True, "no_log": True},
                "mode": {"type": "str", "required": True},
            }},
            "remove": {"type": "list", "elements": "path", "default": []},
            "directories": {"type": "list", "elements": "dict", "default": [], "options": {
                "path": {"type": "path", "required": True},
                "mode": {"type": "str", "required": True},
            }},
            "executables": {"type": "list", "elements": "path", "default": []},
            "units": {"type": "list", "elements": "str"},
            "unit_dir": {"type": "path", "default": "/etc/systemd/system"},
            "owner": {"type": "str", "default": "root"},
            "group": {"type": "str", "default": "root"},
        },
        supports_check_mode=True,
    )
    p = module.params
    try:
        uid, gid = pwd.getpwnam(p["owner"]).pw_uid, grp.getgrnam(p["group"]).gr_gid
    except KeyError as e:
        module.fail_json(msg=f"unknown owner or group: {e}")
    missing = [x for x in p["executables"] if not (os.path.isfile(x) and os.access(x, os.X_OK))]
    if missing:
        module.fail_json(msg=f"{', '.join(missing)} missing or not executable on this host")
    for item in p["files"]:  # everything checked before anything changes
        if not os.path.isabs(item["dest"]):
            module.fail_json(msg=f"{item['dest']}: not an absolute path")
        _octal(module, item["dest"], item["mode"])
        folder = os.path.dirname(item["dest"])
        if not os.path.isdir(folder) and folder not in {d["path"] for d in p["directories"]}:
            module.fail_json(msg=f"{folder} does not exist (prepare.yml makes pdops's folders)")
    for unit in p["units"] or []:
        if "/" in unit or not unit.endswith((".service", ".slice", ".socket", ".target", ".timer")):
            module.fail_json(msg=f"{unit!r} is not a unit name")
    written, removed, unchanged = [], [], 0
    folders: list[str] = []
    for item in p["directories"]:
        path, mode = item["path"], _octal(module, item["path"], item["mode"])
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        if st is not None and not os.path.isdir(path):
            module.fail_json(msg=f"{path} exists and is not a folder")
        if st is not None and (st.st_mode & 0o7777) == mode and st.st_uid == uid and st.st_gid == gid:
            unchanged += 1
            continue
        folders.append(path)
        if not module.check_mode:
            if st is None:
                os.mkdir(path, mode)
            os.chmod(path, mode)  # mkdir's mode is cut by the umask
            os.chown(path, uid, gid)
    for item in p["files"]:
        dest = item["dest"]
        mode = _octal(module, dest, item["mode"])
        data = base64.b64decode(item["content"])
        try:
            st = os.lstat(dest)
        except FileNotFoundError:
            st = None
        same = (st is not None and _digest(dest) == hashlib.sha256(data).hexdigest()
                and (st.st_mode & 0o7777) == mode and st.st_uid == uid and st.st_gid == gid
                and not os.path.islink(dest))
        if same:
            unchanged += 1
            continue
        written.append(dest)
        if not module.check_mode:
            _write(dest, data, mode, uid, gid)
    for path in p["remove"]:
        if os.path.lexists(path):
            removed.append(path)
            if not module.check_mode:
                os.unlink(path)
    enabled = [] if p["units"] is None else _units(module, p["units"], p["unit_dir"], bool(written or removed))
    written = folders + written
    module.exit_json(changed=bool(written or removed or enabled), written=written, removed=removed,
                     unchanged=unchanged, enabled=enabled)


def _units(module, units: list[str], unit_dir: str, files_changed: bool) -> list[str]:
    """Verify and reload when files changed; enable what is not enabled. Returns the units enabled."""
    if not units:
        if files_changed and not module.check_mode:
            _run(module, ["systemctl", "daemon-reload"])
        return []
    if files_changed and not module.check_mode:
        paths = [os.path.join(unit_dir, u) for u in units]
        rc, out, err = module.run_command(["systemd-analyze", "verify", *paths])
        if rc != 0 or (out + err).strip():
            module.fail_json(msg=f"systemd-analyze verify rejected the units (rc {rc}): {(out + err).strip()[-2000:]}")
        _run(module, ["systemctl", "daemon-reload"])
    todo = []
    for u in units:
        rc, out, _ = module.run_command(["systemctl", "is-enabled", u])
        if out.strip() != "enabled":
            todo.append(u)
    if todo and not module.check_mode:
        _run(module, ["systemctl", "enable", *todo])
    return todo


def _run(module, argv: list[str]) -> None:
    rc, out, err = module.run_command(argv)
    if rc != 0:
        module.fail_json(msg=f"{' '.join(argv)} exited {rc}: {(err or out).strip()[-2000:]}")


if __name__ == "__main__":
    main()
