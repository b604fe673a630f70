"""Reading an inventory through ansible-core (YAML and INI only), and the cache of that reading on
this operator machine, keyed by the digest of every file it depends on."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pdops.errors import InvalidInput


def read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidInput(str(path), f"cannot read: {exc.strerror}", fix="check the inventory path") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InvalidInput(str(path), f"YAML syntax error{where}: {problem}",
                           fix="fix the YAML (indentation, quoting, colons) and retry") from None


INVENTORY_SUFFIXES = (".yml", ".yaml", ".ini")


ANSIBLE_CFG = Path(__file__).resolve().parents[3] / "playbooks" / "ansible.cfg"


def inventory_files(path: Path) -> list[Path]:
    """The inventory sources: the file, or a directory's *.yml/*.yaml/*.ini and `hosts` files
    (group_vars/ and host_vars/ beside them are read by Ansible's own vars plugin)."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and (p.suffix in INVENTORY_SUFFIXES or p.name == "hosts"))
        if files:
            return files
        raise InvalidInput(str(path), "no inventory file (.yml, .yaml, .ini or hosts) in this directory",
                           fix="point -i at an inventory directory holding hosts.yml")
    raise InvalidInput(str(path), "inventory not found", fix="pass -i inventory/<name> (see inventory/)")


def _plain(value: Any) -> Any:
    """Ansible's tagged values (str, int, dict, list subclasses carrying their origin) as plain ones."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for t in (bool, int, float, str):
        if isinstance(value, t):
            return t(value)
    return value


@dataclass
class AnsibleReading:
    """Each host's variables as Ansible merges them (every layout and precedence rule it has),
    plain, and the tagged originals to say which file a value came from."""

    hostvars: dict[str, dict]
    raw: dict[str, dict] | None  # None: read from the cache (no origins)

    def origin(self, field_path: str) -> str | None:
        """`file:line` of the value at an InvalidInput field (hosts.gpu01.pdops_gpus.count,
        pdops_gateway.port, ...), where Ansible recorded it."""
        from ansible._internal._datatag._tags import Origin

        parts = [p for p in re.split(r"\.|\[(\d+)\]", field_path) if p]
        if parts and parts[0] == "hosts" and len(parts) > 1 and parts[1] in self.raw:
            node, parts = self.raw[parts[1]], parts[2:]
        elif self.raw:
            node = next(iter(self.raw.values()))
            parts = parts[2:] if parts[:2] == ["all", "vars"] else parts
        else:
            return None
        best = None
        for p in parts:
            try:
                node = node[int(p)] if isinstance(node, list) else node[p]
            except (KeyError, IndexError, ValueError, TypeError):
                break
            best = Origin.get_tag(node) or best
        if best is None or not getattr(best, "path", None):
            return None
        return f"{best.path}:{best.line_num}" if getattr(best, "line_num", None) else str(best.path)


def _ansible():
    """ansible-core's pieces, imported once, with pdops's ansible.cfg as their configuration (set
    for the import only: Ansible reads its configuration then, and no child process inherits it)."""
    prev = os.environ.get("ANSIBLE_CONFIG")
    os.environ["ANSIBLE_CONFIG"] = str(ANSIBLE_CFG)
    try:
        from ansible import constants as C
        from ansible.errors import AnsibleError
        from ansible.inventory.manager import InventoryManager
        from ansible.parsing.dataloader import DataLoader
        from ansible.vars.manager import VariableManager
    finally:
        if prev is None:
            os.environ.pop("ANSIBLE_CONFIG", None)
        else:
            os.environ["ANSIBLE_CONFIG"] = prev
    return C, AnsibleError, InventoryManager, DataLoader, VariableManager


def read_with_ansible(files: list[Path]) -> AnsibleReading:
    """ansible-core's InventoryManager and VariableManager over `files`, with pdops's
    playbooks/ansible.cfg (as ansible-playbook runs): {host: variables} exactly as
    `ansible-inventory --host` prints them (internal variables removed)."""
    C, AnsibleError, InventoryManager, DataLoader, VariableManager = _ansible()

    loader = DataLoader()
    said = io.StringIO()  # Ansible's own warnings: evidence of a failure, noise otherwise
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            inventory = InventoryManager(loader=loader, sources=[str(f) for f in files])
            vm = VariableManager(loader=loader, inventory=inventory)
            raw = {}
            for h in inventory.get_hosts():
                v = vm.get_vars(host=h, include_hostvars=False, stage="all")
                raw[str(h.name)] = {str(k): val for k, val in v.items() if k not in C.INTERNAL_STATIC_VARS}
    except AnsibleError as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        why = re.findall(r"Failed to parse inventory with '(\w+)' plugin: (.*)", said.getvalue())
        if why:  # the reason is in Ansible's warning (its error only says "Completely failed"):
            # the one from the plugin the file is written for
            want = "yaml" if any(f.suffix in (".yml", ".yaml") for f in files) else "ini"
            plugin, reason = next((w for w in why if w[0] == want), why[-1])
            first = f"{reason.strip()} ({plugin} plugin)"
        exc2 = InvalidInput(", ".join(str(f) for f in files), f"Ansible cannot read the inventory: {first}",
                            fix="fix the file Ansible names (YAML or INI inventory syntax)")
        exc2.evidence = said.getvalue().strip() or None
        raise exc2 from None
    return AnsibleReading({h: _plain(v) for h, v in raw.items()}, raw)


# Ansible's reading of an inventory, cached on this operator machine by the digest of everything it
# depends on: importing ansible-core is most of what `inv plan` costs (bench/plan_speed.py).
CACHE_FORMAT = 1


def cache_dir() -> Path:
    return Path(os.environ.get("PDOPS_CACHE_DIR") or Path.home() / ".cache" / "pdops") / "inventory"


def sources_digest(files: list[Path]) -> str:
    """sha256 over what Ansible's reading depends on: the inventory files, group_vars/ and
    host_vars/ beside them, pdops's ansible.cfg, ansible-core's release file (its version) and
    Python's (any change: a new key)."""
    import importlib.util

    h = hashlib.sha256(f"{CACHE_FORMAT}\0{sys.version_info[:2]}\0".encode())
    spec = importlib.util.find_spec("ansible")  # its release file names the version; nothing imported
    release = Path(spec.origin).parent / "release.py" if spec and spec.origin else None
    h.update(release.read_bytes() if release and release.is_file() else b"no ansible release file")
    sources = list(files)
    for d in sorted({f.parent for f in files}):
        for sub in ("group_vars", "host_vars"):
            if (d / sub).is_dir():
                sources += sorted(x for x in (d / sub).rglob("*") if x.is_file())
    for src in sources + [ANSIBLE_CFG]:
        h.update(str(src.resolve()).encode() + b"\0" + src.read_bytes() + b"\0")
    return h.hexdigest()


def cached_reading(digest: str) -> AnsibleReading | None:
    try:
        doc = json.loads((cache_dir() / f"{digest}.json").read_text())
    except (OSError, ValueError):
        return None
    return AnsibleReading(doc["hostvars"], None) if isinstance(doc, dict) and "hostvars" in doc else None


def cache_reading(digest: str, reading: AnsibleReading) -> None:
    """0600 in a 0700 dir; a value JSON cannot hold, or a dir that cannot be written: not cached."""
    try:
        text = json.dumps({"hostvars": reading.hostvars})
        if json.loads(text)["hostvars"] != reading.hostvars:  # tuples, dates...: not cached
            return
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = d / f".{digest}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, d / f"{digest}.json")
    except (OSError, TypeError, ValueError):
        return
