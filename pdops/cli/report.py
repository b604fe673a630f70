"""`inv report --op ID`: one operation of the journal as a self-contained HTML page (pdops.ops.report)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from invoke import task

from pdops.cli import cli_errors, seconds
from pdops import record as rec

DEFAULT_INVENTORY = "inventory/lab"
MAX_MARGIN_S = 86400
OP_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def writable_dir(out) -> Path:
    """`--out` as a directory this user can write (made when missing); InvalidInput otherwise."""
    from pdops.errors import InvalidInput

    p = Path(os.path.abspath(os.path.expanduser(str(out))))
    if p.exists() and not p.is_dir():
        raise InvalidInput("--out", f"{out} is a file, not a directory", fix="name a directory (the page is <op id>.html in it)")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise InvalidInput("--out", f"{out} cannot be made: {probe} is not a directory", fix="name a writable directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise InvalidInput("--out", f"{out} is not writable ({probe} does not let {os.getuid()} write)",
                           fix="name a directory you can write, e.g. --out ./reports")
    return p


@task(help={"op": "the operation's id (`inv journal` lists them)", "inventory": "inventory dir or file",
            "out": "directory the page is written to, as <op id>.html (default: <operator dir>/reports)",
            "prometheus": "the cluster's Prometheus URL (default: the inventory's pdops_prometheus_url, else "
                          "pdops_prometheus's host on port 9090)",
            "margin": "seconds of metrics drawn before and after the operation (default 120)"})
@cli_errors
def report(c, op=None, inventory=DEFAULT_INVENTORY, out=None, prometheus=None, margin=None):
    """One operation as a self-contained HTML page: its plan, its steps on a timeline, its verdict, and
    what the cluster served meanwhile (the dashboard's panels, from the cluster's Prometheus)."""
    from pdops.errors import InvalidInput
    from pdops.model.inventory import load_inventory
    from pdops.ops import report as rep
    from pdops.record.local import local_dir

    # every operator input checked before anything is contacted
    if not op:
        raise InvalidInput("--op", "missing", fix="an operation id from `inv journal`, e.g. --op scale-20261204T101500Z-1a2b3c")
    if not OP_ID.match(str(op)):
        raise InvalidInput("--op", f"{op!r} is not an operation id", fix="copy one from `inv journal`")
    margin_s = seconds(margin, "--margin")
    margin_s = rep.DEFAULT_MARGIN_S if margin_s is None else margin_s
    if margin_s > MAX_MARGIN_S:
        raise InvalidInput("--margin", f"{margin} seconds is more than a day", fix="e.g. --margin 600")
    outdir = writable_dir(out) if out else None
    inv = load_inventory(inventory)
    src = rep.source(inv, prometheus)
    outdir = outdir or writable_dir(local_dir(inv) / "reports")
    page = rep.build_report(inv, rec.open_record(inv), str(op), src, margin_s=margin_s)
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / f"{op}.html"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page.html, encoding="utf-8")
    tmp.replace(path)
    print(f"wrote {path}")
    print(f"  {page.summary()}")
