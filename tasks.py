"""pdops command line: `inv --list` shows every task; `inv --help <task>` its options.

Thin by design: each task lives in pdops/cli/<area>.py, parses its arguments, calls
one pdops function and prints the result.
"""

from invoke import Collection

from pdops.cli import core, lab

ns = Collection.from_module(core)
ns.add_collection(Collection.from_module(lab), name="lab")
