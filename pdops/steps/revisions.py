"""What a revision records: of a deploy, its placement and files, each instance with the worker id
and MainPIDs it runs with; of every revision, the processes verify-running read (configs_of,
processes_of). Written to the record given: the real one by the `record-deploy` step
(pdops.steps.record), a forecast (pdops.record.forecast) by a sweep's plan, which prints the rows
after it from what this writes (no ids, no PIDs: None)."""

from __future__ import annotations

from pdops.model.inventory import Inventory
from pdops.model.placement import Placement, last_bootstrap_ports
from pdops.model.render import GATEWAY_UNIT, manifest, snapshot_of


def record_deploy(record, inv, pl: Placement, files, op: str | None, *, workers: dict, build, running: dict,
                  main_pids: dict):
    """A deploy's revision of `pl` and `files`, written to `record` and made current: each instance
    with the worker id and MainPIDs it runs with, the processes verify-running read. (A forecast
    record, pdops.record.forecast, takes what a deploy not yet walked will write: no ids, no PIDs.)"""
    instances = {i.id: {"role": i.role, "hosts": list(i.hosts), "units": [list(u) for u in i.units],
                        "worker_id": workers[i.id], "url": i.url,
                        "main_pids": main_pids.get(i.id)} for i in pl.instances}
    rev = record.write_revision(topology=str(pl.topology), inventory_hash=inv.digest,
                                placement=pl.to_dict(), manifest=manifest(files), instances=instances,
                                outcome="deployed", op_id=op,
                                extra={"gateways": inv.gateway.urls, "build": str(build),
                                       "configs": configs_of(running), **processes_of(running, inv),
                                       "last_bootstrap": last_bootstrap_ports({}, pl)},
                                snapshot=snapshot_of(inv, files))
    record.set_current(rev.number)
    return rev


def configs_of(running: dict) -> dict[str, str]:
    return {k: v["config"] for k, v in sorted(running.items()) if v.get("config")}


def processes_of(running: dict, inv: Inventory) -> dict:
    """What a revision records of the processes verify-running read: {"gateway_main_pids": {host: N}}
    (a gateway MainPID that differs later means systemd, or someone, restarted it) and
    {"main_starts": {"host:unit": [MainPID, start]}}: when each unit's main process started (systemd's
    ExecMainStartTimestampMonotonic, µs), so that a process started again with the same PID (PIDs are
    small and repeat after a reboot) is not taken for the recorded one (pdops.reads.observe)."""
    pids = {h: (running.get(f"{h}:{GATEWAY_UNIT}") or {}).get("main_pid") for h in inv.gateway.hosts}
    pids = {h: p for h, p in pids.items() if p}
    starts = {k: [v["main_pid"], v["started_us"]] for k, v in sorted(running.items()) if v.get("started_us")}
    return {**({"gateway_main_pids": pids} if pids else {}), **({"main_starts": starts} if starts else {})}
