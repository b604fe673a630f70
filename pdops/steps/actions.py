"""What a deploy does on the hosts and the gateway, step by step: deliver with Ansible, start the
gateway, the admission layer and each instance (health-gated), register with the gateway, canary
every pair, read what runs. Called by the executors (pdops.steps.serve) and by a change's."""

from __future__ import annotations

import time
from pathlib import Path

from pdops.model import membership
from pdops.remote import ansible
from pdops.errors import DeployFailed, PdopsError, RemoteCommandFailed, Unreachable, Unverified
from pdops.facts import ports as port_facts, procs as proc_facts, q
from pdops.remote.gateway import GatewayClient, Gateways, deadline_in
from pdops.remote.hosts import HostPool, http_json
from pdops.model.inventory import GatewayNode, Inventory
from pdops.model.placement import Instance, Placement
from pdops.facts.gateway import BLOCKING, DRAINING
from pdops.model.admission import KEEPALIVED_UNIT, NONLOCAL_BIND_SYSCTL, UNIT as ADMISSION_UNIT
from pdops.model.render import GATEWAY_UNIT, RenderedFile, admission_config, config_ids
from pdops.reads.identity import record_identity
from pdops.runner import Say
from pdops.fanout import run_parallel
from pdops.model.versions import MOONCAKE_VERSION, SGLANG_VERSION, SMG_VERSION
from pdops.steps.preflight import SKIPPED
from pdops.reads.observe import with_configs


# ---------------------------------------------------------------- doing


def _ansible_files(build: Path, files: list[RenderedFile]) -> dict:
    """{host: [pdops_files entry]} from the written build (what was recorded is what is sent)."""
    out: dict[str, list] = {}
    for f in files:
        data = (build / f.host / f.path.lstrip("/")).read_bytes()
        out.setdefault(f.host, []).append(ansible.file_entry(f.path, data, f.mode))
    return out


def _units_by_host(pl: Placement, inv: Inventory) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {h: [GATEWAY_UNIT] for h in inv.gateway.hosts}
    adm = admission_config(inv)
    for h in adm.hosts if adm is not None else ():
        out.setdefault(h, []).append(ADMISSION_UNIT)
    for inst in pl.instances:
        for host, unit in inst.units:
            out.setdefault(host, []).append(unit)
    return out


def deliver(inv: Inventory, pl: Placement, files: list[RenderedFile], build: Path, remove: dict | None,
            say: Say) -> dict:
    """Ansible: prepare.yml then deploy.yml, in one ansible-playbook run. Returns evidence.

    prepare.yml's folder task is skipped: deploy.yml's one module run per host makes the same
    folders (playbooks/vars/pdops.yml) and checks the engine's python."""
    hosts = sorted({f.host for f in files} | set((remove or {}).keys()))
    extra = {"pdops_engine_python": inv.engine_python, "pdops_sglang_version": SGLANG_VERSION,
             "pdops_mooncake_version": MOONCAKE_VERSION, "pdops_smg_version": SMG_VERSION,
             "pdops_gateway_python": inv.gateway.python, "pdops_gateway_hosts": list(inv.gateway.hosts),
             "pdops_admission_hosts": list(inv.admission.hosts) if inv.admission else [],
             "pdops_admission_vip": bool(inv.admission and inv.admission.vip),
             "pdops_files": _ansible_files(build, files), "pdops_remove": remove or {},
             "pdops_units": _units_by_host(pl, inv)}
    t0 = time.monotonic()
    res = ansible.run_playbook(inv, ["prepare.yml", "deploy.yml"], extra, hosts, skip_tags=("pdops-folders",))
    secs = round(time.monotonic() - t0, 1)
    say(f"  prepare.yml + deploy.yml: {len(res.recap)} hosts ok, {res.changed} changes ({secs}s)")
    return {"playbooks": res.playbook, "changed": res.changed, "seconds": secs,
            "hosts": {h: vars(r) for h, r in res.recap.items()}}


def start_gateway(inv: Inventory, pool: HostPool, gateways: Gateways, node: GatewayNode, say: Say, restart: bool,
                  deadline_s: float = 60, clear_list: bool | None = None) -> dict:
    """Start (or restart) one gateway's unit and wait for its /health, bounded by `deadline_s`.
    `clear_list` (default: on a restart) empties its start-up list first."""
    verb = "restart" if restart else "start"
    if restart if clear_list is None else clear_list:
        # a fresh cluster: a list left by an earlier life of it must not register anything
        membership.update_one(pool, node.host, clear=True)
    job = ""
    try:  # a unit that hit its start limit refuses `start` until reset: this start is the operator's
        pool.run(node.host, f"systemctl reset-failed {q(GATEWAY_UNIT)} || true; systemctl {verb} {q(GATEWAY_UNIT)}")
    except RemoteCommandFailed as exc:
        # the start job failed: smg exited while its ExecStartPost ran (its port taken, say), where on
        # another run it exits just after the job: a race. Either way systemd starts it again
        # (Restart=on-failure) and the wait below decides, as for a unit that failed after its job
        said = (exc.output or "").strip().splitlines()
        job = f"; `systemctl {verb}` exited {exc.returncode}" + (f": {said[0][:160]}" if said else "")
    deadline = deadline_in(deadline_s)
    client = gateways.client(node.host)
    while True:
        try:
            client.health()
            break
        except (Unreachable, Unverified):
            st = pool.unit_states(node.host, [GATEWAY_UNIT])[GATEWAY_UNIT]
            # after a failed job only a unit systemd is starting again is waited for (not one it cannot
            # find or will not restart: that fails now)
            gone = bool(job) and st.active_state not in ("activating", "active", "reloading")
            if gone or st.active_state == "failed" or time.monotonic() > deadline:
                raise DeployFailed(f"gateway {GATEWAY_UNIT} on {node.host} did not answer {node.url}/health "
                                   f"(unit {st.load_state}/{st.active_state}/{st.sub_state}{job})",
                                   evidence=pool.journal_tail(node.host, GATEWAY_UNIT)) from None
            time.sleep(0.3)
    st = pool.unit_states(node.host, [GATEWAY_UNIT])[GATEWAY_UNIT]
    say(f"  gateway up on {node.host}: {node.url} (MainPID {st.main_pid})")
    return {"url": node.url, "main_pid": st.main_pid, "unit": GATEWAY_UNIT, "host": node.host}


def start_admission(inv: Inventory, pool: HostPool, say: Say, restart: bool, deadline_s: float = 30,
                    host: str | None = None) -> dict | None:
    """Start the admission layer (HAProxy) on one admission host after the gateways; wait until it
    answers HTTP."""
    adm = admission_config(inv)
    if adm is None:
        return None
    host = host or adm.host
    url = adm.url_of(host)
    if adm.vip:  # HAProxy binds the virtual address before keepalived holds it here: the sysctl first
        # a repair (not `restart`) starts keepalived only where it does not run: a restart there would
        # take the virtual address back to this host before its HAProxy is up
        pool.run(host, f"sysctl -q -p {q(NONLOCAL_BIND_SYSCTL)} && systemctl enable -q {KEEPALIVED_UNIT} && "
                       f"systemctl {'restart' if restart else 'start'} {KEEPALIVED_UNIT}")
    # a start limit hit by a crash loop at boot (StartLimitBurst) would refuse the operator's start
    pool.run(host, f"systemctl reset-failed {q(ADMISSION_UNIT)} 2>/dev/null || true; "
                   f"systemctl {'restart' if restart else 'start'} {q(ADMISSION_UNIT)}")
    deadline = deadline_in(deadline_s)
    while True:
        try:
            status, _ = http_json("GET", f"{url}/health", timeout=3)
            break  # any HTTP answer (401 without a key) means it serves
        except Unreachable:
            if time.monotonic() > deadline:
                raise DeployFailed(f"admission layer {ADMISSION_UNIT} on {host} did not answer {url}",
                                   evidence=pool.journal_tail(host, ADMISSION_UNIT)) from None
            time.sleep(0.3)
    say(f"  admission layer up: {url} (cap {adm.cap}, queue {adm.queue}; unauthenticated probe got {status})")
    return {"url": url, "host": host, "cap": adm.cap, "probe_status": status}


def await_health(pool: HostPool, inst: Instance, deadline_s: float, *, started_by: str) -> float:
    """Poll rank 0's /health until 200 (returns the seconds waited). From 2 s on, every 2 s, each
    rank's unit is read: one failed or inactive (or, for a start of pdops's own, restarted by
    systemd) stops the wait with the tail of its journal; so does the deadline. `started_by`:
    "pdops" (it just started the units) or "systemd" (it found them running: a boot of their
    enabled units, a restart after a crash: restarts are then no failure)."""
    t0 = time.monotonic()
    deadline = t0 + deadline_s
    last_check = t0  # the unit's state is read from 2 s on: most instances are healthy before
    while True:
        try:
            status, _ = http_json("GET", f"{inst.url}/health", timeout=5)
        except Unreachable:
            status = None
        if status == 200:
            return round(time.monotonic() - t0, 2)
        if time.monotonic() - last_check > 2:
            last_check = time.monotonic()
            for host, unit in inst.units:
                st = pool.unit_states(host, [unit])[unit]
                if st.active_state in ("failed", "inactive") or (started_by == "pdops" and st.n_restarts > 0):
                    raise DeployFailed(f"{inst.id}: {unit} on {host} is {st.active_state}/{st.sub_state} "
                                       f"(result {st.result}, restarts {st.n_restarts}) before becoming healthy",
                                       fix="read the journal below; fix the cause and deploy again",
                                       evidence=pool.journal_tail(host, unit))
        if time.monotonic() > deadline:
            raise DeployFailed(f"{inst.id}{', started by systemd,' if started_by == 'systemd' else ''} did not answer "
                               f"{inst.url}/health within {deadline_s:.0f}s (last: {status})",
                               evidence=pool.journal_tail(inst.head.host, inst.unit(0)),
                               fix="read the journal below; fix the cause and deploy again")
        time.sleep(0.25)


def wait_healthy(pool: HostPool, inst: Instance, deadline_s: float, say: Say) -> dict:
    """An instance systemd started (a boot of its enabled unit, or a restart after a crash): wait for
    its own /health to answer 200, without starting anything. An engine loads its model before it
    answers (real SGLang: 36-64 s on the lab's CPU, minutes on a GPU host after a reboot)."""
    waited = await_health(pool, inst, deadline_s, started_by="systemd")
    say(f"  {inst.id} healthy at {inst.url} (waited {waited}s)")
    return {"url": inst.url, "waited_s": waited}


def start_instance(inv: Inventory, pool: HostPool, inst: Instance, deadline_s: float, say: Say,
                   restart: bool) -> dict:
    """Start every rank's unit (rank 0 first), then wait for rank 0's /health with a deadline.
    A unit that fails stops the wait with the tail of its journal."""
    verb = "restart" if restart else "start"
    for host, unit in inst.units:
        # reset a start limit hit by a crash loop: this start is the operator's, and watched below
        pool.run(host, f"systemctl reset-failed {q(unit)} || true; systemctl {verb} {q(unit)}")
    ready_s = await_health(pool, inst, deadline_s, started_by="pdops")
    owner = port_owner(pool, inst)
    pids = {}
    for host, unit in inst.units:
        st = pool.unit_states(host, [unit])[unit]
        pids[f"{host}:{unit}"] = st.main_pid
    say(f"  {inst.id} healthy in {ready_s:.1f}s at {inst.url} (MainPID {', '.join(map(str, pids.values()))}; "
        f"{owner})")
    return {"url": inst.url, "main_pids": pids, "ready_s": ready_s, "port_owner": owner}


def port_owner(pool: HostPool, inst: Instance) -> str:
    """Whose process listens on the instance's HTTP port, which just answered its /health: it must be a
    process of the instance's head unit (its cgroup, or MainPID's tree). Another process there (an
    instance a change has yet to stop, a stray) answers /health and canaries in its place while the
    unit itself failed to bind: DeployFailed naming it. A listener whose PID `ss` cannot attribute is
    said, not failed."""
    host, unit = inst.units[0]
    ident = record_identity(pool, host, unit)
    listeners = port_facts.parse(pool.run(host, port_facts.command()).stdout)
    owners = sorted({pid for lst in port_facts.listening_on_port(listeners, inst.http_port)
                     if lst.covers(inst.head.data_addr) for pid in lst.pids})
    mine = set(ident.cgroup_pids) | set(ident.tree)
    if not owners:
        return (f"port {inst.http_port} on {inst.head.data_addr}: NOT verified whose process holds it ("
                + ("no listener's PID read by ss" if any(lst.covers(inst.head.data_addr) for lst in
                                                         port_facts.listening_on_port(listeners, inst.http_port))
                   else "no listener seen there") + ")")
    if not set(owners) & mine:
        tree = proc_facts.parse(pool.run(host, proc_facts.command(owners)).stdout)
        who = "; ".join(f"PID {pid} ({' '.join(tree[pid].cmdline)[:120] if pid in tree else '?'})" for pid in owners)
        raise DeployFailed(f"{inst.id}: {inst.url}/health answered, but not from {unit}: port {inst.http_port} on "
                           f"{host} is held by {who}, and {unit}'s MainPID is {ident.main_pid or 'none'}",
                           fix="another process holds the instance's port (an instance not stopped yet, or a stray): "
                               "nothing was registered; stop it by its unit, then run the command again",
                           evidence=pool.journal_tail(host, unit))
    return f"port {inst.http_port} held by {unit} (PID {', '.join(map(str, owners))})"


def register(gateways: Gateways, inst: Instance, say: Say, timeout_s: float = 60) -> dict[str, str]:
    """Register the instance with every gateway and wait until each lists it healthy and ready with
    its circuit breaker closed: {gateway host: worker id}. Unverified names the gateway that did not."""
    return {h: w.id for h, w in register_workers(gateways, inst, say, timeout_s).items()}


def register_workers(gateways: Gateways, inst: Instance, say: Say, timeout_s: float = 60) -> dict:
    """:func:`register`, returning {gateway host: its routable worker (with its breaker as read)}."""
    deadline = deadline_in(timeout_s)
    out = {}
    for host, client in gateways.items():
        try:
            out[host] = register_one(client, inst, say, deadline)
        except Unverified as e:
            raise Unverified(f"gateway on {host}: {e.message}", fix=e.fix, evidence=e.evidence) from None
    return out


def register_one(client: GatewayClient, inst: Instance, say: Say, deadline: float):
    """POST the instance to one gateway and wait until its /workers lists it healthy, with its breaker
    closed where the client reads breakers; returns that worker. A worker still draining at this URL
    (the previous process at this address, drained moments ago: smg keeps it about 5 s) is waited out
    first: a POST now would answer 409 with that worker, which then goes. A worker listed at this URL
    whose breaker is not closed (its engine failed requests before a restart: smg keeps the breaker
    of a URL through it) is removed first, so that the POST gives it a new, closed breaker."""
    try:
        listed = [w for w in client.list_workers() if w.url.rstrip("/") == inst.url.rstrip("/")]
    except PdopsError:
        listed = []  # the POST below says what is wrong with the gateway
    for w in listed:
        if w.status == DRAINING:
            say(f"  {inst.id}: {client.base_url} still drains worker {w.id} at {inst.url}; waiting until it is gone")
            client.wait_worker_gone(w.id, deadline)
        elif w.breaker is not None and w.breaker.state in BLOCKING:
            say(f"  {inst.id}: {client.base_url} lists worker {w.id} with {w.breaker_problem}: removing it and "
                "adding it again (a new registration is smg's only way to close a breaker)")
            client.remove_worker(w.id)
            client.wait_worker_gone(w.id, deadline)
    for w in other_identity(client.list_workers(), inst):
        # the same URL under another bootstrap port: an earlier process of it (a registration the
        # gateway retried in the background); requests routed there would fail at the bootstrap
        say(f"  {inst.id}: {client.base_url} lists worker {w.id} at {inst.url} with bootstrap port "
            f"{w.bootstrap_port}, not {inst.bootstrap_port}: removing it first")
        client.remove_worker(w.id)
        client.wait_worker_gone(w.id, deadline)
    worker_id = client.add_worker(inst.url, inst.role, inst.bootstrap_port)
    w = client.wait_worker_healthy(inst.url, deadline)
    wrong = other_identity([w], inst)
    if wrong:
        raise Unverified(f"{inst.id}: the gateway lists worker {w.id} at {inst.url} with bootstrap port "
                         f"{w.bootstrap_port}, not {inst.bootstrap_port}: requests routed to it would fail at the "
                         "bootstrap", fix="run the operation again: it removes the stale worker first")
    cb = f", circuit {w.breaker.state}" if w.breaker is not None else ""
    say(f"  {inst.id} registered with {client.base_url}: worker {w.id or worker_id} healthy{cb}")
    return w


def other_identity(workers, inst: Instance) -> list:
    """Workers at the instance's URL registered with another bootstrap port (a prefill's old identity)."""
    return [w for w in workers if w.url.rstrip("/") == inst.url.rstrip("/") and inst.bootstrap_port is not None
            and w.bootstrap_port is not None and w.bootstrap_port != inst.bootstrap_port]


def undo_registrations(gateways: Gateways, pl: Placement, workers: dict, bad: list, fresh: bool,
                       say: Say) -> dict:
    """After a failed registration: remove from every gateway what this deploy could not verify (any
    worker listed for a failed instance) and, on a fresh cluster, what it registered (no revision
    will describe it). Returns what was removed and what is left."""
    removed, left = [], []
    targets = {i.url: i.id for i in bad}
    if fresh:
        targets.update({i.url: i.id for i in pl.instances if i.id in workers})
    for host, client in gateways.items():
        try:
            listed = client.list_workers()
        except PdopsError as exc:
            left.append(f"gateway on {host} unreadable: {exc.message}")
            continue
        for w in listed:
            if w.url in targets:
                try:
                    client.remove_worker(w.id)
                    client.wait_worker_gone(w.id, deadline_in(30))
                    removed.append(f"{targets[w.url]} ({host}: {w.id})")
                except PdopsError as exc:
                    left.append(f"{targets[w.url]} ({host}: {w.id}): {exc.message}")
    if removed:
        say(f"  removed from the gateways: {', '.join(removed)}")
    return {"removed": removed, "left": left}


def preflight_unverified(report, skip_checks: set[str]) -> list[str]:
    """The preflight checks that did not run, by check: skipped by the operator or for a reason
    (no nvidia-smi in the lab). Never part of what an operation calls verified."""

    out = [f"preflight {c}: skipped by the operator (--skip-check)" for c in sorted(skip_checks)]
    by_check: dict[str, dict[str, list[str]]] = {}
    for r in report.results:
        if r.status == SKIPPED and r.check not in skip_checks:
            by_check.setdefault(r.check, {}).setdefault(r.reason, []).append(r.host)
    for check, reasons in by_check.items():
        for reason, hosts in reasons.items():
            out.append(f"preflight {check}: skipped on {len(hosts)} host(s): {reason}")
    return out


def running_evidence(pool: HostPool, inv: Inventory, pl: Placement, files: list[RenderedFile]) -> dict:
    """{"host:unit": {main_pid, config}} for every unit of `pl` and the gateway, each checked against
    the config id its rendered env file carries; Unverified naming every unit that differs."""

    want = config_ids(files)
    by_host: dict[str, list[str]] = {h: [GATEWAY_UNIT] for h in inv.gateway.hosts}
    for inst in pl.instances:
        for h, u in inst.units:
            by_host.setdefault(h, []).append(u)
    res = run_parallel(list(by_host), lambda h: with_configs(pool, h, by_host[h]))
    out, bad = {}, []
    for h, units in by_host.items():
        r = res[h]
        if isinstance(r, Exception):
            bad.append(f"{h}: unreadable: {getattr(r, 'message', r)}")
            continue
        states, configs = r
        for u in units:
            k, st = f"{h}:{u}", states.get(u)
            if st is None or st.active_state != "active" or not st.main_pid:
                bad.append(f"{k} is {st.active_state + '/' + st.sub_state if st else 'not reported'}")
                continue
            out[k] = {"main_pid": st.main_pid, "config": configs.get(u), "started_us": st.exec_main_start_monotonic_us}
            if k in want and configs.get(u) != want[k]:
                bad.append(f"{k} (MainPID {st.main_pid}) runs files {configs.get(u) or 'without a config id'}, "
                           f"this revision's are {want[k]}")
    if bad:
        raise Unverified("not every process runs this revision's files: " + "; ".join(bad),
                         fix="nothing was recorded; `inv deploy` again plans a replace of what runs other files")
    return out
