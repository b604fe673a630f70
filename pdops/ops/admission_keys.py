"""`inv admission.keys`: rotate the admission layer's API keys on a live cluster.

Re-reads the operator's key file (`pdops_admission.api_keys_file`, validated as at
deploy: 0600, one key per line), delivers ONLY the key map (0600, root) to the admission
host with the deploy playbook, runs `systemctl reload pdops-admission.service` (the unit's
ExecReload checks the config, then USR2: new workers read the new map, old workers finish
their streams), and verifies from the operator machine: every new key gets a non-401
answer, every revoked key gets 401. Under the cluster lock, each step journalled.

Keys are secrets: only key ids (`k-` + sha256 prefix) are printed or journalled.
"""

from __future__ import annotations

import hashlib
import time

from pdops.remote import ansible
from pdops.model.admission import KEYS_MAP_PATH, UNIT, AdmissionConfig, key_id, keys_map
from pdops.errors import InvalidInput, Refused, Unreachable, Unverified
from pdops.facts import q
from pdops.remote.hosts import HostPool, http_json
from pdops.model.inventory import Inventory
from pdops.plans import Outcome, Plan, Step
from pdops.runner import RunContext, Say
from pdops.ops.operate import run_operation

PROBE_MAX = 50  # keys probed each way (a key file may hold thousands)


def parse_map(text: str) -> tuple[str, ...]:
    """The keys of a rendered key map (`<key> <key id>` per line)."""
    return tuple(line.split(" ", 1)[0] for line in text.splitlines() if line.strip())


def probe(url: str, key: str, timeout: float) -> int:
    """The HTTP status an admission host answers to GET /health with this key."""
    status, _ = http_json("GET", f"{url}/health", timeout=timeout, headers={"Authorization": f"Bearer {key}"})
    return status


def wait_keys_applied(cfg: AdmissionConfig, new: tuple[str, ...], revoked: tuple[str, ...],
                      deadline_s: float = 30.0, interval_s: float = 0.2, host: str | None = None) -> dict:
    """Poll until, in one pass, every new key gets a non-401 answer and every revoked key a 401
    (a reload takes effect when the new workers take the listener). Unverified at the deadline."""
    # A key's request goes through the cap: it may wait up to the queue timeout for a permit.
    timeout = cfg.queue_timeout_s + 5
    host = host or cfg.host
    url = cfg.url_of(host)
    deadline = time.monotonic() + deadline_s
    t0 = time.monotonic()
    while True:
        bad: list[str] = []
        seen: dict[str, int] = {}
        for k in new[:PROBE_MAX]:
            try:
                s = probe(url, k, timeout)
            except Unreachable as exc:
                bad.append(f"new key {key_id(k)}: {exc.message}")
                continue
            seen[key_id(k)] = s
            if s == 401:
                bad.append(f"new key {key_id(k)} got 401")
        for k in revoked[:PROBE_MAX]:
            try:
                s = probe(url, k, 10)
            except Unreachable as exc:
                bad.append(f"revoked key {key_id(k)}: {exc.message}")
                continue
            seen[key_id(k)] = s
            if s != 401:
                bad.append(f"revoked key {key_id(k)} got {s}, not 401")
        if not bad:
            return {"answers": seen, "applied_after_s": round(time.monotonic() - t0, 2)}
        if time.monotonic() > deadline:
            raise Unverified(f"the new keys are not in effect on {url} after {deadline_s:.0f}s",
                             fix=f"check `journalctl -u {UNIT}` on {host}; the reload may have been refused",
                             evidence="\n".join(bad[:10]))
        time.sleep(interval_s)


def plan_rotate_keys(inv: Inventory, record, deadline_s: float = 30.0) -> Plan:
    """The key rotation as steps (pure apart from reading the `record`)."""
    cfg = inv.admission  # load_inventory just read and validated the operator's key file
    if cfg is None:
        raise InvalidInput("pdops_admission", "this inventory has no admission layer",
                           fix="set pdops_admission (docs/admission.md) and deploy first")
    if record.current() is None:
        raise Refused(f"{inv.cluster} has no deployed revision", fix="deploy the cluster first (`inv deploy`)")
    new_map = keys_map(cfg.keys)
    sha = hashlib.sha256(new_map.encode()).hexdigest()
    several = len(cfg.hosts) > 1
    steps = []
    for h in cfg.hosts:  # one admission host at a time: the others keep serving with their keys
        tag = f" {h}" if several else ""
        steps += [
            Step(f"check-unit{tag}", h, f"{UNIT} is active; read the key map it serves now (key ids only)", 30,
                 kind="admission-check", params={"host": h}),
            Step(f"deliver{tag}", h, f"deploy.yml puts only {KEYS_MAP_PATH} in place (0600 root, sha256 {sha[:12]}); "
                 "check mode, owner and hash on the host", 120, kind="deliver-keys",
                 params={"map": new_map, "sha": sha, "host": h}),
            Step(f"reload{tag}", h, f"systemctl reload {UNIT} (haproxy -c, then USR2: old workers finish their "
                 "streams); the master MainPID must stay", 60, kind="admission-reload", params={"host": h}),
            Step(f"verify{tag}", None, f"every new key gets a non-401 answer from {cfg.url_of(h)} and every revoked "
                 f"key a 401 (up to {PROBE_MAX} each way)", deadline_s, kind="verify-keys", params={"host": h}),
        ]
    return Plan("admission-keys", f"plan: rotate the admission keys of {inv.cluster} on {', '.join(cfg.hosts)} "
                f"({len(cfg.keys)} keys), under the cluster lock", steps,
                head={"host": cfg.host, "hosts": list(cfg.hosts), "unit": UNIT, "map": KEYS_MAP_PATH, "keys": len(cfg.keys),
                      "key_ids": list(cfg.key_ids), "map_sha256": sha})


def do_check_unit(ctx: RunContext, step: Step) -> Outcome:
    """The admission unit is active: its master's MainPID (a reload must keep it) and, for a key
    rotation, the key map it serves now against the operator's key file (key ids only). A change
    that reloads the layer for another setting (params keys=False) reads no key."""
    cfg = ctx.inv.admission
    host = step.params.get("host", cfg.host)
    st = ctx.pool.unit_states(host, [UNIT])[UNIT]
    if st.active_state != "active":
        raise Refused(f"{UNIT} on {host} is {st.active_state}/{st.sub_state}: nothing to reload",
                      fix="deploy the cluster (or start the unit) first; a deploy delivers the keys too",
                      evidence=ctx.pool.journal_tail(host, UNIT))
    if not step.params.get("keys", True):  # a change reloading the layer: its MainPID, no key read
        ctx.give(step, "admission_keys", {host: {"main_pid": st.main_pid, "added": (), "revoked": ()}})
        return Outcome(evidence={"main_pid": st.main_pid}, verified=[f"{UNIT} active (MainPID {st.main_pid})"])
    old = parse_map(ctx.pool.run(host, f"cat {q(KEYS_MAP_PATH)}").stdout)
    added = tuple(k for k in cfg.keys if k not in old)
    revoked = tuple(k for k in old if k not in cfg.keys)
    ctx.give(step, "admission_keys", {host: {"main_pid": st.main_pid, "added": added, "revoked": revoked}})
    ctx.say(f"admission keys on {host}: {len(cfg.keys)} keys "
            f"(+{len(added)} added: {', '.join(map(key_id, added)) or '-'}; "
            f"-{len(revoked)} revoked: {', '.join(map(key_id, revoked)) or '-'})")
    return Outcome(evidence={"main_pid": st.main_pid, "added": [key_id(k) for k in added],
                             "revoked": [key_id(k) for k in revoked]})


def do_deliver_keys(ctx: RunContext, step: Step) -> Outcome:
    cfg, inv = ctx.inv.admission, ctx.inv
    host = step.params.get("host", cfg.host)
    sha = step.params["sha"]
    res = ansible.run_playbook(inv, "deploy.yml", {
        "pdops_files": {host: [ansible.file_entry(KEYS_MAP_PATH, step.params["map"].encode(), 0o600)]},
        "pdops_remove": {}, "pdops_units": {}, "pdops_engine_python": inv.engine_python,
        "pdops_gateway_python": inv.gateway.python, "pdops_gateway_hosts": list(inv.gateway.hosts)}, [host])
    remote = ctx.pool.run(host, f"stat -c '%a %U:%G' {q(KEYS_MAP_PATH)} && sha256sum {q(KEYS_MAP_PATH)}")
    mode_owner, remote_sha = remote.stdout.splitlines()[0].strip(), remote.stdout.split()[-2]
    if mode_owner != "600 root:root" or remote_sha != sha:
        raise Unverified(f"{KEYS_MAP_PATH} on {host} is {mode_owner} sha256 {remote_sha[:12]}, "
                         f"expected 600 root:root sha256 {sha[:12]}")
    ctx.say(f"  delivered {KEYS_MAP_PATH} (0600 root, sha256 {sha[:12]}, {res.changed} changed)")
    return Outcome(evidence={"changed": res.changed, "mode": mode_owner, "sha256": sha},
                   verified=[f"{KEYS_MAP_PATH} on {host} is 0600 root with the new map's sha256"])


def do_reload(ctx: RunContext, step: Step) -> Outcome:
    cfg = ctx.inv.admission
    host = step.params.get("host", cfg.host)
    ctx.pool.run(host, f"systemctl reload {q(UNIT)}")  # ExecReload: haproxy -c, then USR2
    # Type=notify: the unit stays "reloading" until the new workers report READY.
    deadline = ctx.deadline(step) - 5
    st2 = ctx.pool.unit_states(host, [UNIT])[UNIT]
    while st2.active_state == "reloading" and time.monotonic() < deadline:
        time.sleep(0.2)
        st2 = ctx.pool.unit_states(host, [UNIT])[UNIT]
    before = ctx.get(step, "admission_keys")[host]["main_pid"]
    if st2.active_state != "active" or st2.main_pid != before:
        raise Unverified(f"{UNIT} is {st2.active_state}/{st2.sub_state} (MainPID {before} -> "
                         f"{st2.main_pid}) after the reload: not a graceful reload",
                         evidence=ctx.pool.journal_tail(host, UNIT))
    ctx.say(f"  reloaded {UNIT}{' on ' + host if len(cfg.hosts) > 1 else ''} (master MainPID {st2.main_pid} kept: in-flight streams continue)")
    return Outcome(evidence={"unit": UNIT, "main_pid": st2.main_pid},
                   verified=[f"{UNIT} reloaded gracefully (master MainPID {st2.main_pid} kept)"])


def do_verify_keys(ctx: RunContext, step: Step) -> Outcome:
    cfg = ctx.inv.admission
    host = step.params.get("host", cfg.host)
    keys = ctx.get(step, "admission_keys")[host]
    ev = wait_keys_applied(cfg, cfg.keys, keys["revoked"], step.deadline - 5, host=host)
    ev.update(added=[key_id(k) for k in keys["added"]], revoked=[key_id(k) for k in keys["revoked"]])
    ctx.say(f"  verified after {ev['applied_after_s']}s: {min(len(cfg.keys), PROBE_MAX)} keys accepted, "
            f"{min(len(keys['revoked']), PROBE_MAX)} revoked keys get 401")
    return Outcome(evidence=ev, verified=[f"{min(len(cfg.keys), PROBE_MAX)} key(s) accepted, "
                                          f"{min(len(keys['revoked']), PROBE_MAX)} revoked key(s) refused with 401"])


def rotate_keys(inv: Inventory, record, say: Say = print, deadline_s: float = 30.0, *, pool: HostPool,
                gateways=None) -> dict:
    """Deliver the operator's key file as the new key map, reload, verify (with the runner), under
    the lock of the `record`. Returns the evidence and the verdict."""
    plan = plan_rotate_keys(inv, record, deadline_s)
    cfg = inv.admission
    got: dict = {}

    def finish(ctx: RunContext, verdict: dict) -> None:
        verdict.update(keys=len(cfg.keys), map_sha256=plan.head["map_sha256"])
        got.update(op=ctx.op, keys=ctx.output("admission_keys")[cfg.host])

    verdict = run_operation(plan, inv, record, say, pool=pool, gateways=gateways, kind="admission-keys", finish=finish)
    keys = got["keys"]
    return {"op": got["op"], "host": cfg.host, "hosts": list(cfg.hosts), "keys": len(cfg.keys),
            "added": [key_id(k) for k in keys["added"]], "revoked": [key_id(k) for k in keys["revoked"]],
            "map_sha256": plan.head["map_sha256"], "verdict": verdict}
