"""The gateway's start-up worker list: which workers a (re)started gateway registers by itself.

smg keeps `POST /workers` registrations in memory only. pdops keeps, on the gateway host,
``/etc/pdops/gateway-workers.json``: an instance is added once the gateway lists it healthy and
removed *before* pdops asks the gateway to drop it. The gateway unit runs the same host script
after every start (``ExecStartPost``), which queues each listed worker again; smg then probes a
queued worker until it is healthy (``--worker-startup-check-interval``). So a crash, a
``systemctl restart`` or a reboot brings back exactly the workers pdops last put in service.

Why a list beside the gateway and not its start-up flags (``--prefill URL PORT --decode URL``):
the list changes with every drain, and flags change only with a restart; the gateway's
command line stays the revision's, and what the running gateway serves is read from ``/workers``.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdops.errors import PdopsError, Unverified
from pdops.facts import q
from pdops.model.inventory import GatewayNode, Inventory
from pdops.model.placement import Instance

# under pdops.model.render's ENV_DIR and BIN_DIR (render imports this module for the gateway unit)
PATH = "/etc/pdops/gateway-workers.json"
SCRIPT_PATH = "/opt/pdops/bin/pdops-gateway-workers.py"
SCRIPT = (Path(__file__).resolve().parents[1] / "hostscripts" / "gateway_workers.py").read_text()


def entry(inst: Instance) -> dict:
    """One worker of the list, as the gateway's `POST /workers` takes it (plus the instance id)."""
    e = {"instance": inst.id, "url": inst.url, "worker_type": inst.role}
    if inst.bootstrap_port is not None:
        e["bootstrap_port"] = inst.bootstrap_port
    return e


def _run(pool, host: str, args: list[str]) -> dict | None:
    # as pdops's other host scripts travel: `python3 -c <quoted script> <quoted args>`
    res = pool.run(host, f"python3 -c {q(SCRIPT)} " + " ".join(q(a) for a in args))
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise Unverified(f"the gateway's worker list {PATH} on {host} could not be read",
                         evidence=(res.stdout + res.stderr)[-1000:]) from None


def update(pool, inv: Inventory, *, add: list[Instance] = (), remove: list[str] = (),
           revision: int | None = None, clear: bool = False, hosts=None) -> dict:
    """Add and/or remove instances in the list of every gateway (atomic on each host, under a lock
    there); `clear`: start from an empty list. Returns the first gateway's list; Unverified names
    every gateway whose list could not be changed (the others were)."""
    docs, failed = {}, []
    hosts = [h for h in inv.gateway.hosts if hosts is None or h in set(hosts)]
    for host in hosts:
        try:
            docs[host] = update_one(pool, host, add=add, remove=remove, revision=revision, clear=clear)
        except PdopsError as e:  # unreadable list or unreachable host: named, the others still changed
            failed.append(f"{host}: {e.message}")
    if failed:
        raise Unverified(f"the start-up worker list of {len(failed)} of {len(hosts)} gateway(s) "
                         "could not be changed", evidence="\n".join(failed)[-1500:],
                         fix="a gateway host that does not answer: runbook gateway-host-lost (take it out of "
                             "pdops_gateway.hosts, or bring it back), then run the operation again")
    return docs[hosts[0]]


def update_one(pool, host: str, *, add: list[Instance] = (), remove: list[str] = (),
               revision: int | None = None, clear: bool = False) -> dict:
    """The list on one gateway host (see `update`)."""
    args = ["update", "--file", PATH] + (["--clear"] if clear else [])
    if add:
        args += ["--add", json.dumps([entry(i) for i in add])]
    if remove:
        args += ["--remove", *remove]
    if revision is not None:
        args += ["--revision", str(revision)]
    return _run(pool, host, args) or {}


def read(pool, host: str) -> dict | None:
    """The list as one gateway host holds it; None when there is none yet."""
    return _run(pool, host, ["show", "--file", PATH])


def listed_ids(doc: dict | None) -> list[str]:
    return [w["instance"] for w in (doc or {}).get("workers", [])]


def exec_start_post(inv: Inventory, node: GatewayNode) -> str:
    """A gateway unit's ExecStartPost: register the listed workers with that gateway (failure
    logged, not fatal)."""
    gw = inv.gateway
    args = [gw.python, SCRIPT_PATH, "register", "--file", PATH, "--gateway", node.url, "--wait-s", "45"]
    if gw.api_key_file:
        args += ["--key-file", gw.api_key_file]
    return "-" + " ".join(args)

