"""`python tests/lab/moved_template.py TEMPLATES_DIR <inv task and args>`: run an `inv` task as a pdops
release whose templates are TEMPLATES_DIR would (the template-change lab test). Only this process
reads them: the checkout's templates/ stay as they are, for every other test running beside it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pdops.model.render  # noqa: E402

pdops.model.render.TEMPLATES = Path(sys.argv[1]).resolve()

from invoke import Program  # noqa: E402

import tasks  # noqa: E402

Program(namespace=tasks.ns).run(["inv", *sys.argv[2:]])  # exits with the task's status
