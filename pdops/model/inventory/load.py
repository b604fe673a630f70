"""`load_inventory`: read (through Ansible, or its cached reading) and validate, before any host."""

from __future__ import annotations

from pathlib import Path


from pdops.errors import InvalidInput

from pdops.model.inventory.schema import Inventory
from pdops.model.inventory.read import (cache_reading, cached_reading, inventory_files, read_with_ansible, read_yaml,
                                  sources_digest)
from pdops.model.inventory.validate import validate


def load_inventory(path: str | Path, *, profile: str | None = None) -> Inventory:
    """Read and validate an inventory; nothing is contacted. Ansible's reading of the same files
    is taken from this machine's cache (cache_dir()); pdops's own rules always run."""
    path = Path(path)
    files = inventory_files(path)
    digest = sources_digest(files)
    cached = cached_reading(digest)
    try:
        reading = cached or read_with_ansible(files)
    except InvalidInput:
        for f in files:  # a YAML syntax error: say where, with its line and column
            if f.suffix in (".yml", ".yaml"):
                doc = read_yaml(f)
                if doc is not None and not isinstance(doc, dict):
                    raise InvalidInput(str(f), f"is a YAML {type(doc).__name__}, not an inventory mapping",
                                       fix="start the file with `all:` (see inventory/lab/hosts.yml)") from None
        raise
    if cached is None:
        cache_reading(digest, reading)
    hostvars = reading.hostvars
    if not hostvars:
        raise InvalidInput(str(path), "the inventory lists no hosts", fix="add hosts under all.children.gpu_hosts.hosts")
    try:
        return validate(path, files, hostvars, profile)
    except InvalidInput as exc:
        if reading.raw is None:  # where a value came from is in Ansible's own reading
            reading = read_with_ansible(files)
        where = reading.origin(exc.field)
        if where:
            exc.message += f" (from {where})"
        raise
