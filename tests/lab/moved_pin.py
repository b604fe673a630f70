"""`python tests/lab/moved_pin.py VERSION <inv task and args>`: run an `inv` task as the pdops release
that moves the SGLang pin to VERSION would (the SGLang-upgrade runbook's lab test). Nothing but the
pin differs: the constant in pdops.model.versions and the modules that imported it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pdops.model.versions  # noqa: E402

version = sys.argv[1]
pdops.model.versions.SGLANG_VERSION = version  # what every module imported from here on reads
for mod in [m for name, m in sys.modules.items() if name.startswith("pdops.")]:  # and any already loaded
    if hasattr(mod, "SGLANG_VERSION"):
        mod.SGLANG_VERSION = version

from invoke import Program  # noqa: E402

import tasks  # noqa: E402

Program(namespace=tasks.ns).run(["inv", *sys.argv[2:]])  # exits with the task's status
