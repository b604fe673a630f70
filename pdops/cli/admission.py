"""Operating the admission layer on a live cluster: `inv admission.keys` (key rotation)."""

from __future__ import annotations

from invoke import task

from pdops.cli import cli_errors, print_verdict, seconds
from pdops import record as rec

DEFAULT_INVENTORY = "inventory/lab"


@task(help={"inventory": "inventory dir or file",
            "deadline": "seconds to wait for the new keys to be in effect after the reload"})
@cli_errors
def keys(c, inventory=DEFAULT_INVENTORY, deadline=30):
    """Rotate API keys: re-read pdops_admission.api_keys_file (0600), deliver only the key map
    to the admission host, `systemctl reload pdops-admission.service` (in-flight streams
    continue), verify the new keys are accepted and revoked ones get 401. Journalled, locked."""
    from pdops.ops.admission_keys import rotate_keys
    from pdops.errors import InvalidInput
    from pdops.model.inventory import load_inventory

    deadline_s = seconds(deadline, "--deadline")
    if deadline_s is None or deadline_s < 5:
        raise InvalidInput("--deadline", f"{deadline!r} is less than 5 seconds",
                           fix="give the reload time to take effect, e.g. --deadline 30")
    inv = load_inventory(inventory)
    from pdops.remote.hosts import connections

    with connections(inv) as conns:
        ev = rotate_keys(inv, rec.open_record(inv), deadline_s=deadline_s, pool=conns["pool"])
    print_verdict(f"{ev['keys']} keys in effect on {ev['host']} (op {ev['op']}); added {len(ev['added'])}, "
                  f"revoked {len(ev['revoked'])}", ev["verdict"])
