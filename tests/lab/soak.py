"""`make soak`: a seeded random sequence of operations and faults on a lab cluster, under a closed
loop of requests through the gateway (every other one streamed). Not part of `make test`.

Operations and faults, drawn with `random.Random(seed)`:
- drain: `inv drain --instance X` (a role's last instance is skipped), then `inv deploy` back;
- scale: `inv scale --topology 3p1d --allow-capacity-dip`, then back;
- change: the bundle's `max_running_requests` flipped, `inv deploy` (a rolling change);
- rollback: `inv rollback`; when the revision it returns to had another bundle, the soak's change
  is taken out of its inventory too (runbook bundle-change.md: fix the candidate before deploying
  it again), as an operator would; to a revision of another generation it must be refused (exit 4), and
  to a placement that moves an instance onto a slot another instance holds now (exit 4);
- maintenance: `inv drain --host H`, `inv uncordon --host H`, `inv deploy`;
- engine-kill (fault): SIGKILL of an instance's MainPID (read from systemd), `inv repair`;
- gateway-kill (fault): SIGKILL of the gateway's MainPID, systemd restarts it, `inv deploy` (it
  observes the restart and ends the prefill halves the crash cut);
- reboot (fault): every lab host powered off and booted, then runbook hosts-rebooted.md:
  `inv status` (exit 1), `inv deploy`, `inv verify`; the first boot as a real host's (what pdops
  enabled starts by itself), the next as the lab's (nothing starts), alternating;
- halted-change: a change whose new processes fail to start (no room for the KV pool) halts; the
  flag is taken out and `inv deploy` applies the inventory;
- gateway-restart: a gateway setting (`health_check_interval_secs`) flipped, `inv deploy` (the
  gateways restart one at a time; behind the admission layer none turns a request away);
- generation (front door only): the bundle's page size flipped, `inv deploy` (a fenced change of
  generation: the new pool beside the old one, the front door switched, the old pool stopped);
- gateway-host-off (fault; front door only): the host of a gateway that is not the admission
  host powered off; runbook gateway-host-lost.md: `inv status` (exit 1), the host back (the
  lab's boot), `inv deploy`, `inv verify`;
- etcd-kill (record on etcd only): SIGKILL of an etcd member's MainPID, then a drain and the
  deploy back while systemd restarts it: nothing may be lost, it is no fault window;
- host-add: lab05 (a fifth lab host, not in the soak's inventory) added to the inventory,
  `inv scale --topology 3p2d` (p03 starts there, or another instance when a drained one's slot
  was free), `inv scale --topology 2p2d`, `inv drain --host lab05` when an instance is still there
  (what pdops's refusal to lose a host that carries one names), lab05 taken out of the inventory
  again and `inv deploy` (the inventory without it recorded). Skipped on a lab of
  four hosts (`make soak` boots five; `make test`'s lab has four).

Every command must exit with its documented status (0; 1 for `inv status` of a cluster that does
not serve; 9 for the halted change's deploy), or it is counted (`unexpected_exits`).
After each one the cluster must serve with every instance ok (`inv status` exit 0 within 120 s);
if it does not, that is counted and `inv deploy` + `inv end-orphans` are run to go on. At the end
every request that did not get its whole answer must fall inside a fault's window (from the fault
to the end of the command that recovers from it) or be named by pdops as lost (a repair's lost
work, an ended orphaned half, a drain's accepted loss); no request ID may reach two prefills or
two decodes (none replayed). One line per operation, a summary, and the ledger (JSON) at
$SOAK_LEDGER (default: soak-ledger.json beside the lab's state).

Two shapes ($SOAK_SHAPE):
- one-gateway (default): one smg on lab01, the record on the state host, TP8 (one instance a host);
- front-door: smg on lab01 and lab04 behind HAProxy on lab01 (API keys; every request of the
  closed loop goes through it), the record on etcd members pdops runs on lab01-lab03 (`inv
  state.etcd-up` before the first deploy), TP4 (two slots a host, so that a fenced change of 2p2d
  has the four free slots its new pool needs). A reboot the lab's way runs the runbook's step 0
  (`inv state.etcd-up`) first: nothing else starts the members then.

    make soak                      # 100 operations, seed 1, on a lab of five hosts
    make soak SOAK_OPS=20 SOAK_SEED=7
    make soak SOAK_SHAPE=front-door
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest
import yaml

from pdops import lab as lab_api
from pdops.model.inventory import load_inventory, single_file_doc
from pdops.model.placement import Placement
from pdops.sim.testing import poll
from tests.lab.clusters import (Load, api_keys_file, derived_inventory, inv_cmd, record, stop_all,
                                two_gateways_behind_haproxy)

pytestmark = pytest.mark.lab

BASE = "2p2d"
OPS = ("drain", "scale", "change", "rollback", "maintenance", "engine-kill", "gateway-kill", "reboot", "halted-change",
       "host-add", "gateway-restart", "generation", "gateway-host-off", "etcd-kill")
SPARE = "lab05"  # the host that host-add adds: booted by `make soak` (PDOPS_LAB_HOSTS=5), never in the base inventory
FAULTS = ("engine-kill", "gateway-kill", "reboot", "gateway-host-off")
# the kinds each shape can run: a generation change is fenced only behind the admission layer with two
# gateways (one gateway: refused unless --unfenced); a gateway host off with one gateway is the whole
# cluster down; etcd-kill needs the record on etcd
SHAPES = {"one-gateway": tuple(k for k in OPS if k not in ("generation", "gateway-host-off", "etcd-kill")),
          "front-door": OPS}
FRONT_GATEWAYS = ["lab01", "lab04"]  # the first and the last host; HAProxy on the first
ETCD_MEMBERS = ["lab01", "lab02", "lab03"]
SOAK_KEY = "pdops-soak-key-" + "s" * 20
INTERVALS = (5, 6)  # the gateway's health_check_interval_secs, flipped by gateway-restart (5: the lab's)
PAGE_SIZES = (None, 32)  # the bundle's page_size, flipped by generation (None: SGLang's default)


@dataclass
class Done:
    n: int
    op: str
    detail: str
    start: float
    end: float
    ok: bool
    serving_after: bool
    named_lost: list[str] = field(default_factory=list)
    fault_window: tuple[float, float] | None = None
    commands: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)  # commands whose exit status was not the expected one


class Soak:
    def __init__(self, lab, inv_dir: Path, seed: int, say=print):
        self.lab, self.inv_dir, self.rng, self.say = lab, inv_dir, random.Random(seed), say
        self.done: list[Done] = []
        # the profile's settings the soak changes, as the inventory has them now; and as each revision recorded them
        self.bundle = {"max_running_requests": 64, "page_size": None, "health_check_interval_secs": INTERVALS[0]}
        self.bundle_at: dict[int, dict] = {}
        self.unexpected: list[str] = []
        self.reboots = 0
        self.spare = _hosts(single_file_doc(Path(lab.inventory))).get(SPARE)  # its inventory entry, or None
        inv = load_inventory(inv_dir)
        self.shape = "front-door" if inv.admission is not None else "one-gateway"
        self.gateways = list(inv.gateway.hosts)
        self.etcd = list(inv.state.etcd.members) if inv.state and inv.state.etcd else []
        # the closed loop goes through the front door where there is one, with its key
        self.url = inv.admission.url if inv.admission is not None else inv.gateway.first.url
        self.headers = {"Authorization": f"Bearer {SOAK_KEY}"} if inv.admission is not None else None

    # ---------------------------------------------------------------- plumbing
    def cli(self, cmds: list[str], *args, expect: int | None = 0):
        """Run `inv *args`; an exit status other than `expect` (None: any) is counted against the operation."""
        proc = inv_cmd(*args, "-i", str(self.inv_dir), timeout=900)
        line = f"inv {' '.join(args)} -> {proc.returncode}"
        if expect is not None and proc.returncode != expect:
            line += f" (expected {expect})"
            # the error and its fix (the last lines pdops prints), enough to tell which step it was
            self.unexpected.append(f"{line}: {(proc.stderr or proc.stdout).strip().splitlines()[-6:]}")
        cmds.append(line)
        return proc

    def topology(self) -> str:
        return record(self.inv_dir).current_revision().topology

    def placement(self) -> Placement:
        return Placement.from_dict(record(self.inv_dir).current_revision().placement)

    def ops_seen(self) -> list[str]:
        return list(record(self.inv_dir).journal().operations())

    def named_since(self, before: list[str]) -> list[str]:
        """Request IDs pdops named as lost in the operations journalled since `before`."""
        j = record(self.inv_dir).journal()
        out: list[str] = []
        for op in [o for o in j.operations() if o not in set(before)]:
            for r in j.read(op):
                ev = r.get("evidence") or {}
                out += list(ev.get("lost") or [])
                out += [x for v in (ev.get("ended") or {}).values() for x in v]
                out += [x for v in (ev.get("orphans_ended") or {}).values() for x in v]
                if r.get("status") == "accepted-loss":
                    out += list(ev.get("open_rids") or [])
        return out

    def serving(self, timeout: float = 120) -> bool:
        return poll(lambda: inv_cmd("status", "-i", str(self.inv_dir), timeout=120).returncode == 0, timeout, interval=2)

    def set_profile(self, **changes) -> None:
        """The inventory's profile (and the gateway's health check interval, in hosts.yml) edited."""
        if "health_check_interval_secs" in changes:
            h = self.inv_dir / "hosts.yml"
            doc = yaml.safe_load(h.read_text())
            doc["all"]["vars"]["pdops_gateway"]["health_check_interval_secs"] = changes.pop("health_check_interval_secs")
            h.write_text(yaml.safe_dump(doc, sort_keys=False))
        p = self.inv_dir / "profiles" / "p.yml"
        prof = yaml.safe_load(p.read_text())
        for k, v in changes.items():
            if k in ("max_running_requests", "mem_fraction_static", "page_size"):
                if v is None:
                    prof["bundle"].pop(k, None)
                else:
                    prof["bundle"][k] = v
            elif v is None:
                prof.pop(k, None)
            else:
                prof[k] = v
        p.write_text(yaml.safe_dump(prof))

    def main_pid(self, host: str, unit: str) -> int:
        """The unit's MainPID as systemd reads it now (0: none)."""
        c = self.lab.connection(host)
        try:
            return int(c.run(f"systemctl show -p MainPID --value {unit}", hide=True).stdout.strip() or 0)
        finally:
            c.close()

    def kill_main_pid(self, host: str, unit: str, *, seen: bool = False) -> int:
        """SIGKILL the unit's MainPID; `seen`: returned once systemd no longer names it as the unit's
        MainPID (counted as unexpected when it still does after 30 s)."""
        pid = self.main_pid(host, unit)
        if pid > 1:
            c = self.lab.connection(host)
            try:
                c.run(f"kill -KILL {pid}", hide=True)
            finally:
                c.close()
            if seen and not poll(lambda: self.main_pid(host, unit) != pid, 30, interval=0.2):
                self.unexpected.append(f"{host}:{unit}: systemd still names the killed MainPID {pid} after 30 s")
        return pid

    # ---------------------------------------------------------------- operations
    def op_drain(self, cmds):
        pl = self.placement()
        choices = [i for i in pl.instances if len(pl.role(i.role)) > 1]
        if not choices:
            return "skipped: every role has one instance"
        x = self.rng.choice(choices)
        self.cli(cmds, "drain", "--instance", x.id)
        self.cli(cmds, "deploy", "--topology", BASE)
        return f"{x.id} drained, then added back"

    def op_scale(self, cmds):
        self.cli(cmds, "scale", "--topology", "3p1d", "--allow-capacity-dip")
        self.cli(cmds, "scale", "--topology", BASE, "--allow-capacity-dip")
        return f"{BASE} -> 3p1d -> {BASE}"

    def op_change(self, cmds):
        self.bundle["max_running_requests"] = 32 if self.bundle["max_running_requests"] == 64 else 64
        self.set_profile(max_running_requests=self.bundle["max_running_requests"])
        self.cli(cmds, "deploy", "--topology", BASE)
        return f"max_running_requests -> {self.bundle['max_running_requests']} (rolling)"

    def op_generation(self, cmds):
        now = self.bundle["page_size"]
        self.bundle["page_size"] = PAGE_SIZES[(PAGE_SIZES.index(now) + 1) % len(PAGE_SIZES)]
        self.set_profile(page_size=self.bundle["page_size"])
        proc = self.cli(cmds, "deploy", "--topology", BASE)
        if proc.returncode == 0 and "fence" not in proc.stdout:
            self.unexpected.append("a change of generation was not fenced")
        return f"page_size {now} -> {self.bundle['page_size']} (fenced)"

    def op_gateway_restart(self, cmds):
        now = self.bundle["health_check_interval_secs"]
        new = self.bundle["health_check_interval_secs"] = INTERVALS[(INTERVALS.index(now) + 1) % len(INTERVALS)]
        self.set_profile(health_check_interval_secs=new)
        proc = self.cli(cmds, "deploy", "--topology", BASE)
        restarted = [h for h in self.gateways if f"gateway on {h} restarted in" in proc.stdout]
        if proc.returncode == 0 and restarted != self.gateways:
            self.unexpected.append(f"gateways restarted: {restarted}, not {self.gateways}")
        return f"health_check_interval_secs {now} -> {new}: {', '.join(restarted) or 'no gateway'} restarted"

    def op_rollback(self, cmds):
        prev = record(self.inv_dir).previous()
        if prev is not None and self.bundle_at.get(prev.number, self.bundle)["page_size"] != self.bundle["page_size"]:
            # returning across a change of generation is refused (runbook generation-change.md: the way back
            # is the old settings deployed, fenced); exit 4, nothing changed
            self.cli(cmds, "rollback", expect=4)
            return f"to revision {prev.number}: refused, another generation (page size)"
        proc = self.cli(cmds, "rollback", expect=None)
        if proc.returncode == 4 and "beside the one that holds its GPUs or port" in proc.stderr:
            # documented: the revision's placement moves an instance onto a slot another holds now (refused,
            # nothing changed, the holder named; seen in the front-door soak before it was refused)
            return "to the previous deployed revision: refused, it moves an instance onto a slot another holds"
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
            self.unexpected.append(f"inv rollback -> {proc.returncode}: {tail}")
            return "to the previous deployed revision: failed"
        # `inv rollback` returns to the recorded files, not the inventory (runbook bundle-change.md:
        # fix the candidate before deploying it again): the soak takes its change out of the inventory
        # too, as an operator would, or every later command would carry the candidate back in
        back_to = (record(self.inv_dir).current_revision().extra or {}).get("rollback_of")
        was = self.bundle_at.get(back_to, self.bundle)
        if was != self.bundle:
            self.bundle = dict(was)
            self.set_profile(**was)
            return f"to the previous deployed revision ({back_to}); the inventory's bundle back to {was}"
        return f"to the previous deployed revision ({back_to})"

    def op_maintenance(self, cmds):
        pl = self.placement()
        host = self.rng.choice(sorted({h for i in pl.instances for h in i.hosts}))
        self.cli(cmds, "drain", "--host", host)
        self.cli(cmds, "uncordon", "--host", host)
        self.cli(cmds, "deploy", "--topology", BASE)
        return f"{host} to maintenance and back"

    def op_engine_kill(self, cmds):
        x = self.rng.choice(self.placement().instances)
        host, unit = x.units[0]
        pid = self.kill_main_pid(host, unit)
        # until `inv status` sees the kill (exit 1), or 30 s: the repair is planned from what it sees
        poll(lambda: inv_cmd("status", "-i", str(self.inv_dir), timeout=120).returncode != 0, 30, interval=1)
        self.cli(cmds, "repair", "--instance", x.id)
        return f"SIGKILL {x.id} (MainPID {pid}), repaired"

    def op_gateway_kill(self, cmds):
        host = self.rng.choice(self.gateways)
        pid = self.kill_main_pid(host, "pdops-gateway.service", seen=True)  # the deploy meets the restart
        self.cli(cmds, "deploy", "--topology", self.topology())
        return f"SIGKILL the gateway on {host} (MainPID {pid}), one deploy"

    def op_gateway_host_off(self, cmds):
        """Runbook gateway-host-lost.md while the host comes back: the host of a gateway (not the
        admission host: that is the front door itself) powered off; `inv status` names the gateway
        down (exit 1); the host boots (the lab's way: nothing starts); one deploy; verify."""
        inv = load_inventory(self.inv_dir)
        host = self.rng.choice([h for h in self.gateways if h not in inv.admission.hosts])
        lab_api.down(hosts=[int(host.removeprefix("lab"))])
        self.cli(cmds, "status", expect=1)
        self.lab.ensure_up()
        self.cli(cmds, "deploy", "--topology", self.topology())
        self.cli(cmds, "verify")
        return f"{host} (a gateway's host) powered off and booted, one deploy"

    def op_etcd_kill(self, cmds):
        """An etcd member SIGKILLed (by its unit's MainPID), then a drain and the deploy back: the
        record's lock and writes go through the two members left while systemd restarts it."""
        host = self.rng.choice(self.etcd)
        pid = self.kill_main_pid(host, "pdops-etcd.service")
        detail = self.op_drain(cmds)

        def member_state() -> str:
            c = self.lab.connection(host)
            try:
                return c.run("systemctl is-active pdops-etcd.service", hide=True, warn=True).stdout.strip()
            finally:
                c.close()
        # systemd restarts it (Restart=on-failure, 2 s); active once ready
        states = []
        poll(lambda: states.append(member_state()) or states[-1] == "active", 60, interval=1)
        state = states[-1]
        if state != "active":
            self.unexpected.append(f"the etcd member on {host} is {state} 60 s after its SIGKILL")
        return f"SIGKILL the etcd member on {host} (MainPID {pid}); {detail}; the member {state}"

    def op_reboot(self, cmds):
        """Runbook hosts-rebooted.md, each command: status (exit 1), deploy, verify. The reboots
        alternate the two ways a host boots, the first one as a real host does: "enabled" (every
        unit pdops enabled starts by itself: engines from the files on disk, the gateway with its
        start-up list; status finds them running as processes the record does not know), then "lab"
        (nothing pdops installed starts: status finds every unit down)."""
        self.reboots += 1
        way = "enabled" if self.reboots % 2 else "lab"
        lab_api.down()
        self.lab.ensure_up(boot=way)
        if self.etcd and way == "lab":  # the runbook's step 0: nothing started the members
            st = self.cli(cmds, "status", expect=1)  # from this machine's cached copy, under its banner
            if "READ-ONLY CACHED COPY" not in st.stdout or "`inv state.etcd-up`" not in st.stdout:
                self.unexpected.append("inv status did not say the record is a cached copy and name inv state.etcd-up")
            self.cli(cmds, "state.etcd-up")
        self.cli(cmds, "status", expect=1)
        self.cli(cmds, "deploy", "--topology", self.topology())
        self.cli(cmds, "verify")
        return f"every host rebooted ({way} boot), one deploy"

    def set_spare(self, present: bool) -> None:
        p = self.inv_dir / "hosts.yml"
        doc = yaml.safe_load(p.read_text())
        if present:
            _hosts(doc)[SPARE] = self.spare
        else:
            _hosts(doc).pop(SPARE, None)
        p.write_text(yaml.safe_dump(doc, sort_keys=False))

    def op_host_add(self, cmds):
        if self.spare is None:
            return f"skipped: the lab has no {SPARE} (PDOPS_LAB_HOSTS=5)"
        self.set_spare(True)
        self.cli(cmds, "scale", "--topology", "3p2d")
        added = {i.id: i for i in self.placement().instances}.get("p03")
        where = "/".join(added.hosts) if added else "nowhere"
        self.cli(cmds, "scale", "--topology", BASE)
        # placement may have put another instance on the new host (a decode re-added there after a
        # drain or a rollback to a drained revision left its old slot free); the way to retire a host
        # that carries one is the one pdops's refusal names: drain the host first, then remove it
        moved = [i.id for i in self.placement().instances if SPARE in i.hosts]
        if moved:
            self.cli(cmds, "drain", "--host", SPARE)
        self.set_spare(False)
        self.cli(cmds, "deploy", "--topology", BASE)
        return (f"{SPARE} added, p03 started on {where}, scaled back, "
                + (f"{', '.join(moved)} moved off it, " if moved else "") + f"{SPARE} retired")

    def op_halted_change(self, cmds):
        # a bundle whose new processes exit at start (no room for the KV pool, as SGLang fails); a flag
        # SGLang rejects is refused before anything runs, by the generation's parse of the command lines
        p = self.inv_dir / "profiles" / "p.yml"
        good = yaml.safe_load(p.read_text())["bundle"].get("mem_fraction_static")
        self.set_profile(mem_fraction_static=0.05)
        self.cli(cmds, "deploy", "--topology", BASE, expect=9)  # the change stops (ScaleFailed)
        self.set_profile(mem_fraction_static=good)
        self.cli(cmds, "deploy", "--topology", BASE)
        return "a bundle that cannot start: halted; then the fixed inventory deployed"

    # ---------------------------------------------------------------- the loop
    def run(self, n_ops: int, ops: list[str] | None = None, kinds: tuple[str, ...] | None = None) -> dict:
        """`n_ops` drawn from `kinds` (default: every kind this shape runs), or exactly `ops` in that order."""
        kinds = kinds or SHAPES[self.shape]
        sequence = ops or [self.rng.choice(kinds) for _ in range(n_ops)]
        unfit = sorted(set(sequence) - set(SHAPES[self.shape]))
        if unfit:
            raise ValueError(f"the {self.shape} shape cannot run {', '.join(unfit)}")
        with Load(self.url, headers=self.headers) as load:
            for n, op in enumerate(sequence, 1):
                self.note_revisions()
                before, cmds, t0 = self.ops_seen(), [], time.time()
                self.unexpected = []
                try:
                    detail = getattr(self, "op_" + op.replace("-", "_"))(cmds)
                    ok = True
                except Exception as exc:  # noqa: BLE001 - the soak reports and goes on
                    detail, ok = f"error: {type(exc).__name__}: {exc}", False
                t1 = time.time()
                serving = self.serving()
                if not serving:  # the documented way back, counted against the operation
                    self.cli(cmds, "deploy", "--topology", BASE, expect=None)
                    self.cli(cmds, "end-orphans", expect=None)
                    self.serving()
                d = Done(n, op, detail, t0, t1, ok, serving, self.named_since(before),
                         (t0, t1 + 2.0) if op in FAULTS else None, cmds, list(self.unexpected))
                self.done.append(d)
                self.say(f"soak {n:3d}/{len(sequence)} {op:14s} {'serving' if serving else 'NOT SERVING'} "
                         f"{t1 - t0:6.1f}s  {detail}; {'; '.join(cmds)}")
        return self.judge(load.rows)

    def note_revisions(self) -> None:
        """The inventory's bundle for every revision recorded since the last note (the bundle changes
        only between operations: op_change, op_rollback)."""
        cur = record(self.inv_dir).current_revision().number
        for n in range(max(self.bundle_at, default=0) + 1, cur + 1):
            self.bundle_at[n] = dict(self.bundle)

    def judge(self, rows) -> dict:
        named = {r for d in self.done for r in d.named_lost}
        windows = [d.fault_window for d in self.done if d.fault_window]
        bad = [r for r in rows if not r.ok]  # a closed loop retries at once: thousands in a reboot's window
        in_window = {r.rid for r in bad if any(r.start <= b and (r.end or r.start) >= a for a, b in windows)}
        outside = [r for r in bad if r.rid not in in_window and r.rid not in named]
        replayed = replays(self.lab, self.placement())
        lost = {r.rid for r in outside}
        per_kind: dict[str, dict] = {}
        for d in self.done:  # each kind: how often, how long, what failed during it, what was lost outside a window
            k = per_kind.setdefault(d.op, {"operations": 0, "seconds": 0.0, "not_ok_during": 0,
                                           "lost_outside_fault_windows": 0})
            during = [r for r in bad if d.start <= (r.end or r.start) and r.start <= d.end]
            k["operations"] += 1
            k["seconds"] = round(k["seconds"] + d.end - d.start, 1)
            k["not_ok_during"] += len(during)
            k["lost_outside_fault_windows"] += sum(r.rid in lost for r in during)
        summary = {"operations": len(self.done), "requests": len(rows), "not_ok": len(bad),
                   "not_ok_in_fault_windows": len(in_window), "named_by_pdops": len(named),
                   "lost_outside_fault_windows": [r.rid for r in outside], "replayed": replayed,
                   "left_not_serving": [f"{d.n} {d.op}" for d in self.done if not d.serving_after],
                   "operation_errors": [f"{d.n} {d.op}: {d.detail}" for d in self.done if not d.ok],
                   "unexpected_exits": [f"{d.n} {d.op}: {u}" for d in self.done for u in d.unexpected],
                   "per_kind": dict(sorted(per_kind.items()))}
        return {"summary": summary, "operations": [asdict(d) for d in self.done],
                "ledger": [r.to_dict() for r in rows]}


def per_kind_table(per_kind: dict) -> str:
    """One line per kind of operation: how many, their mean time, requests not served whole while they ran,
    and of those the ones lost outside every fault window (the goal: 0)."""
    lines = [f"{'kind':18s} {'ops':>4s} {'mean s':>7s} {'not ok during':>14s} {'lost outside windows':>21s}"]
    for kind, k in per_kind.items():
        lines.append(f"{kind:18s} {k['operations']:4d} {k['seconds'] / k['operations']:7.1f} {k['not_ok_during']:14d} "
                     f"{k['lost_outside_fault_windows']:21d}")
    return "\n".join(lines)


def write_page(result: dict, path: Path, seed: int) -> Path:
    """Every operation of the soak on one timeline beside the requests ok and not ok each second
    (pdops.ops.report.runs), its fault windows shaded."""
    from pdops.ops.report.runs import Span, runs_page

    spans = [Span(f"{d['n']} {d['op']}", d["start"], d["end"], ok=d["ok"] and d["serving_after"] and not d["unexpected"],
                  detail=d["detail"], fault_window=tuple(d["fault_window"]) if d["fault_window"] else None)
             for d in result["operations"]]
    page, _ = runs_page(f"soak, seed {seed}", spans, result["ledger"], summary=result["summary"])
    path.write_text(page, encoding="utf-8")
    return path


def replays(lab, pl: Placement) -> list[str]:
    """Request IDs received twice by prefills or twice by decodes, in every engine unit's journal on
    every lab host (all invocations)."""
    import collections

    counts: collections.Counter = collections.Counter()
    for host, _ in lab.hosts:
        c = lab.connection(host)
        try:
            out = c.run("journalctl -u 'pdops-p*' -u 'pdops-d*' -o json --output-fields=MESSAGE,_SYSTEMD_UNIT "
                        "--no-pager", hide=True, warn=True).stdout
        finally:
            c.close()
        for line in out.splitlines():
            try:
                e = json.loads(line)
                msg = e.get("MESSAGE")
                if not isinstance(msg, str) or '"request.received"' not in msg:
                    continue
                doc = json.loads(msg[msg.index("{"):])
            except (ValueError, TypeError):
                continue
            role = "prefill" if str(e.get("_SYSTEMD_UNIT", "")).startswith("pdops-p") else "decode"
            if doc.get("event") == "request.received" and not str(doc.get("rid", "")).startswith("pdops-"):
                counts[(role, str(doc.get("rid")))] += 1
    return sorted(f"{role} {rid} x{n}" for (role, rid), n in counts.items() if n > 1)


def _hosts(doc: dict) -> dict:
    return doc["all"]["children"]["gpu_hosts"]["hosts"]


def soak_cluster(lab, where: Path, shape: str = "one-gateway") -> Path:
    """2p2d on lab01-lab04 (a fifth host, if booted, stays out of the inventory for host-add), in
    one of SHAPES (the module's docstring)."""
    if shape not in SHAPES:
        raise ValueError(f"SOAK_SHAPE {shape!r} is not one of {', '.join(SHAPES)}")
    stop_all(lab)
    where.mkdir(parents=True, exist_ok=True)
    keys = api_keys_file(where.parent / f"{where.name}.keys", SOAK_KEY)
    # the fenced change's hold before the old pool stops: 2 s, as in tests/lab/test_generation_lab.py
    front_door = two_gateways_behind_haproxy(FRONT_GATEWAYS, 18085, keys, fence_hold_s=2)

    def shaped(doc):
        _hosts(doc).pop(SPARE, None)
        if shape == "front-door":
            front_door(doc)
            v = doc["all"]["vars"]
            state = v["pdops_state"]  # a prefix of this cluster's own in the members' keyspace
            state.update({"backend": "etcd", "etcd": {"members": list(ETCD_MEMBERS),
                                                      "prefix": "/pdops/" + state["dir"].rsplit("/", 1)[1] + "/"}})
    profile = {} if shape == "one-gateway" else {"parallel": {"tp": 4, "ep": 4, "pp": 1}}
    inv_dir = derived_inventory(lab, where, profile=profile, mutate=shaped)
    if shape == "front-door":
        proc = inv_cmd("state.etcd-up", "-i", str(inv_dir), timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = inv_cmd("deploy", "--topology", BASE, "-i", str(inv_dir), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return inv_dir


def test_soak(lab, tmp_path):
    """`make soak`: $SOAK_OPS operations (default 100) drawn with $SOAK_SEED (default 1) from
    $SOAK_KINDS (default every kind of the shape; e.g. SOAK_KINDS=host-add,drain) on a cluster of
    $SOAK_SHAPE (one-gateway, the default, or front-door)."""
    n, seed = int(os.environ.get("SOAK_OPS", 100)), int(os.environ.get("SOAK_SEED", 1))
    shape = os.environ.get("SOAK_SHAPE") or "one-gateway"
    if shape not in SHAPES:
        pytest.fail(f"SOAK_SHAPE: {shape!r} is not one of {', '.join(SHAPES)}")
    kinds = tuple(k.strip() for k in (os.environ.get("SOAK_KINDS") or ",".join(SHAPES[shape])).split(",") if k.strip())
    unknown = sorted(set(kinds) - set(SHAPES[shape]))
    if unknown or not kinds:
        pytest.fail(f"SOAK_KINDS: {', '.join(unknown) or 'empty'} not among the {shape} shape's "
                    f"{', '.join(SHAPES[shape])}")
    inv_dir = soak_cluster(lab, tmp_path / "soak", shape)
    result = Soak(lab, inv_dir, seed).run(n, kinds=kinds)
    ledger = Path(os.environ.get("SOAK_LEDGER") or lab.lab_dir / "soak-ledger.json")
    ledger.write_text(json.dumps(result, indent=1, default=str))
    s = result["summary"]
    page = write_page(result, ledger.with_suffix(".html"), seed)
    print(f"soak summary (seed {seed}, {shape}): " + json.dumps({k: v for k, v in s.items() if k != "per_kind"}))
    print(per_kind_table(s["per_kind"]) + f"\nledger: {ledger}\npage: {page}")
    stop_all(lab)
    assert not s["lost_outside_fault_windows"] and not s["replayed"] and not s["left_not_serving"], s
    assert not s["operation_errors"] and not s["unexpected_exits"], s
