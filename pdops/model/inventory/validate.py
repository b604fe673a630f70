"""Every rule of pdops on an inventory, each error naming the field and the fix."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

from pdops.model.admission import parse_admission
from pdops.errors import InvalidInput, one_of
from pdops.model.prometheus_setting import parse_prometheus
from pdops.model.sim_faults import parse_faults

from pdops.model.inventory.schema import (DEFAULT_STATE_DIR, ENGINES, ETCD_CLIENT_PORT, EtcdSetting, Gateway, GatewayNode, Host, Inventory, MOONCAKE_RPC_PORTS, Ports,
                                   Profile, StateLocation, max_slots)
from pdops.model.inventory.parse import (cluster_vars, load_profile, parse_host, port_number, required, resolve_engine_python,
                                   resolve_gateway_python)


def validate(path: Path, files: list[Path], hostvars: dict[str, dict], profile: str | None) -> "Inventory":
    """Every rule of pdops, on the variables Ansible merged for each host."""
    all_vars = cluster_vars(hostvars)
    cluster = str(all_vars.get("pdops_cluster") or path.stem)
    if not re.match(r"^[A-Za-z0-9_.-]+$", cluster):
        raise InvalidInput("pdops_cluster", f"{cluster!r} is not a valid cluster name", fix="letters, digits, '-', '_', '.'")
    engine = all_vars.get("pdops_engine", "sglang")
    if engine not in ENGINES:
        raise InvalidInput("pdops_engine", f"{engine!r} is not one of {ENGINES}", fix="use sglang (production) or sim (lab)")
    prof = load_profile(profile or required(all_vars, "pdops_profile", "all.vars", (str,), "name a profile from pdops/profiles/"),
                        path if path.is_dir() else path.parent)
    if prof.device == "cpu" and not (engine == "sglang" and all_vars.get("pdops_virtual_hardware", False)):
        raise InvalidInput("pdops_profile", f"profile {prof.name} runs SGLang on a CPU, with the lab's stand-ins for GPU kernels",
                           fix="use it only in the lab (pdops_engine: sglang, pdops_virtual_hardware: true); "
                               "GPU hosts take a cuda profile")

    hosts = tuple(parse_host(n, hv) for n, hv in hostvars.items())
    _check_unique(hosts)

    pv = required(all_vars, "pdops_ports", "all.vars", (dict,), "set pdops_ports: {http_base, bootstrap_base, dist_init_base}")
    ports = Ports(
        http_base=port_number(pv.get("http_base"), "pdops_ports.http_base"),
        bootstrap_base=port_number(pv.get("bootstrap_base"), "pdops_ports.bootstrap_base"),
        dist_init_base=port_number(pv.get("dist_init_base"), "pdops_ports.dist_init_base"),
        stride=_stride(pv.get("stride", 10)),
    )
    gv = required(all_vars, "pdops_gateway", "all.vars", (dict,), "set pdops_gateway: {host, port, prometheus_port, ...}")
    names = {h.name: h for h in hosts}
    gw_hosts = _gateway_hosts(gv, names)
    mcr = gv.get("max_concurrent_requests", -1)
    qs = gv.get("queue_size", 0)
    if not isinstance(mcr, int) or (mcr < 1 and mcr != -1):
        raise InvalidInput("pdops_gateway.max_concurrent_requests", f"{mcr!r} must be -1 (off) or at least 1",
                           fix="the real cap belongs to the admission layer; leave -1")
    if not isinstance(qs, int) or qs < 0:
        raise InvalidInput("pdops_gateway.queue_size", f"{qs!r} must be 0 or more", fix="set a non-negative queue size")
    key_file = gv.get("api_key_file")
    if key_file is not None and not str(key_file).startswith("/"):
        raise InvalidInput("pdops_gateway.api_key_file", f"{key_file!r} is not an absolute path", fix="use an absolute path")
    policies = {k: _routing_policy(gv, k) for k in ("policy", "prefill_policy", "decode_policy")}
    breaker = {}
    for k, default in (("cb_failure_threshold", 10), ("cb_success_threshold", 3), ("cb_timeout_secs", 15),
                       ("health_failure_threshold", 3), ("health_check_interval_secs", 5)):
        v = gv.get(k, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidInput(f"pdops_gateway.{k}", f"{v!r} must be a whole number, at least 1",
                               fix=f"e.g. {k}: {default} (docs/gateway.md \"Circuit breakers\")")
        breaker[k] = v
    gw_port = port_number(gv.get("port"), "pdops_gateway.port")
    gw_prom = port_number(gv.get("prometheus_port"), "pdops_gateway.prometheus_port")
    breaker["standby_port"] = port_number(gv.get("standby_port", gw_port - 1), "pdops_gateway.standby_port")
    breaker["standby_prometheus_port"] = port_number(gv.get("standby_prometheus_port", gw_prom - 1),
                                                     "pdops_gateway.standby_prometheus_port")
    gateway = Gateway(
        nodes=tuple(GatewayNode(h, names[h].data_addr, gw_port, gw_prom) for h in gw_hosts),
        port=gw_port, prometheus_port=gw_prom,
        api_key_file=key_file, max_concurrent_requests=mcr, queue_size=qs,
        **breaker,
        python=resolve_gateway_python(str(gv.get("python", "/opt/pdops/gateway-venv/bin/python"))), **policies,
    )
    _check_port_plan(hosts, ports, gateway, prof)
    state = _state_location(all_vars.get("pdops_state"), names, gw_hosts[0], cluster)

    drain = all_vars.get("pdops_drain") or {}
    budget = drain.get("budget_s", 1800)
    margin = drain.get("stop_margin_s", 120)
    for k, v in (("budget_s", budget), ("stop_margin_s", margin)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidInput(f"pdops_drain.{k}", f"{v!r} must be a positive number of seconds", fix="set whole seconds")
    for k in ("pdops_start_timeout_s", "pdops_register_timeout_s"):
        v = all_vars.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise InvalidInput(k, f"{v!r} must be a positive number of seconds", fix=f"e.g. {k}: 60")
    sim_faults = _sim_faults(all_vars.get("pdops_sim_faults"), engine)
    def digest_of(vars_: dict, hosts_: dict) -> str:
        return hashlib.sha256(json.dumps({"vars": vars_, "hosts": hosts_}, sort_keys=True, default=str)
                              .encode()).hexdigest()

    # where the record lives is not what the cluster runs: moving it (inv state.migrate, a new state
    # host) changes no revision's inventory. Records written before it could move hold the digest with it.
    def unrecorded(d: dict) -> dict:
        return {k: v for k, v in d.items() if k not in RECORD_VARS}

    def as_before(d: dict) -> dict:  # pdops_state as it could be written before: host and dir only
        out = dict(d)
        old = {k: v for k, v in (d.get("pdops_state") or {}).items() if k in ("host", "dir")} \
            if isinstance(d.get("pdops_state"), dict) else d.get("pdops_state")
        if old:
            out["pdops_state"] = old
        else:
            out.pop("pdops_state", None)
        return out

    digest = digest_of(unrecorded(all_vars), {h: unrecorded(v) for h, v in hostvars.items()})
    legacy_digest = digest_of(as_before(all_vars), {h: as_before(v) for h, v in hostvars.items()})
    inv = Inventory(
        cluster=cluster, path=path, engine=engine, profile=prof, hosts=hosts, gateway=gateway, ports=ports,
        engine_python=resolve_engine_python(str(all_vars.get("pdops_engine_python", "/opt/pdops/venv/bin/python")), engine),
        virtual_hardware=bool(all_vars.get("pdops_virtual_hardware", False)), digest=digest,
        legacy_digest=legacy_digest,
        drain_budget_s=budget, stop_timeout_s=budget + margin, files=tuple(f.resolve() for f in files),
        vars=all_vars, sim_faults=sim_faults, state=state,
    )
    return dataclasses.replace(inv, admission=parse_admission(all_vars, inv),
                               prometheus=parse_prometheus(all_vars, [h.name for h in hosts]))


def _gateway_hosts(gv: dict, names: dict) -> list[str]:
    """`pdops_gateway.host: gpu01` (one gateway, the default) or `pdops_gateway.hosts: [gpu01, gpu02]`
    (two or more, each an independent smg that pdops gives every worker)."""
    if "host" in gv and "hosts" in gv:
        raise InvalidInput("pdops_gateway", "both `host` and `hosts` are set",
                           fix="keep `host: <name>` for one gateway or `hosts: [<name>, <name>]` for several")
    if "hosts" in gv:
        val = gv["hosts"]
        if not isinstance(val, list) or not val or not all(isinstance(h, str) for h in val):
            raise InvalidInput("pdops_gateway.hosts", f"{val!r} is not a list of host names",
                               fix="e.g. hosts: [gpu01, gpu02]")
        field_name = "pdops_gateway.hosts"
    else:
        val = [required(gv, "host", "pdops_gateway", (str,), "name the inventory host that runs the gateway "
                        "(or `hosts: [a, b]` for two or more)")]
        field_name = "pdops_gateway.host"
    for h in val:
        if h not in names:
            raise InvalidInput(field_name, f"{h!r} is not a host of this inventory", fix=one_of(names, h))
    dup = sorted({h for h in val if val.count(h) > 1})
    if dup:
        raise InvalidInput(field_name, f"{', '.join(dup)} named more than once",
                           fix="one gateway per host: name each host once")
    return list(val)


def _state_location(val: Any, names: dict, gw_host: str, cluster: str) -> StateLocation:
    """`pdops_state: {backend, host, dir, etcd}`: default the SSH state host (the gateway host,
    /var/lib/pdops/state)."""
    fix = f"e.g. pdops_state: {{host: {gw_host}, dir: {DEFAULT_STATE_DIR}}}"
    if val is None:
        return StateLocation(gw_host)
    if not isinstance(val, dict):
        raise InvalidInput("pdops_state", f"{val!r} is not a mapping", fix=fix)
    unknown = sorted(set(val) - {"host", "dir", "backend", "etcd"})
    if unknown:
        raise InvalidInput("pdops_state", f"unknown key(s) {', '.join(map(str, unknown))}", fix=fix)
    host = val.get("host", gw_host)
    if not isinstance(host, str) or host not in names:
        raise InvalidInput("pdops_state.host", f"{host!r} is not a host of this inventory",
                           fix=one_of(names, host) + " (the record lives on a host of the cluster)")
    d = val.get("dir", DEFAULT_STATE_DIR)
    if not isinstance(d, str) or not d.startswith("/"):
        raise InvalidInput("pdops_state.dir", f"{d!r} is not an absolute path", fix=fix)
    if os.path.normpath(d) != d.rstrip("/") or d.rstrip("/") in ("", "/") or any(c in d for c in "\n\0"):
        raise InvalidInput("pdops_state.dir", f"{d!r} is not a plain absolute directory path",
                           fix=f"a path such as {DEFAULT_STATE_DIR}, without '..' or '//'")
    backend = val.get("backend", "host")
    if backend not in ("host", "etcd"):
        raise InvalidInput("pdops_state.backend", f"{backend!r} is neither 'host' nor 'etcd'",
                           fix="host: the record on pdops_state.host over SSH (default); etcd: on pdops_state.etcd")
    etcd = None if val.get("etcd") is None else _etcd_setting(val["etcd"], names, cluster)
    if backend == "etcd" and etcd is None:
        raise InvalidInput("pdops_state.etcd", "missing, and pdops_state.backend is etcd",
                           fix="e.g. etcd: {endpoints: [https://etcd1:2379, ...], ca: ..., cert: ..., key: ...}")
    return StateLocation(host, d.rstrip("/"), backend, etcd)


RECORD_VARS = ("pdops_state", "pdops_state_dir")  # where the record is kept: not in the inventory's digest

_ETCD_KEYS = {"endpoints", "members", "prefix", "ca", "cert", "key"}
_ETCD_FIX = "e.g. etcd: {endpoints: [https://10.0.0.5:2379, https://10.0.0.6:2379, https://10.0.0.7:2379]}"


def _etcd_setting(val: Any, names: dict, cluster: str) -> EtcdSetting:
    """`pdops_state.etcd`: `endpoints` (client URLs of an etcd cluster) or `members` (three or five
    inventory hosts pdops runs etcd on), a key prefix, and TLS files on this machine."""
    if not isinstance(val, dict):
        raise InvalidInput("pdops_state.etcd", f"{val!r} is not a mapping", fix=_ETCD_FIX)
    unknown = sorted(set(val) - _ETCD_KEYS)
    if unknown:
        raise InvalidInput("pdops_state.etcd", f"unknown key(s) {', '.join(map(str, unknown))}",
                           fix=f"known: {', '.join(sorted(_ETCD_KEYS))}")
    members = val.get("members") or []
    if not isinstance(members, list) or any(m not in names for m in members):
        bad = next((m for m in members if m not in names), members) if isinstance(members, list) else members
        raise InvalidInput("pdops_state.etcd.members", f"{bad!r} is not a host of this inventory",
                           fix=one_of(names, str(bad)) + " (pdops runs etcd on three or five of the cluster's hosts)")
    if members and (len(members) % 2 == 0 or len(set(members)) != len(members)):
        raise InvalidInput("pdops_state.etcd.members", f"{members} is not an odd number of distinct hosts",
                           fix="three members survive the loss of one, five of two")
    endpoints = val.get("endpoints")
    if endpoints is None:
        endpoints = [f"{'https' if val.get('cert') else 'http'}://{names[m].ssh_addr}:{ETCD_CLIENT_PORT}"
                     for m in members]
    if not isinstance(endpoints, list) or not endpoints:
        raise InvalidInput("pdops_state.etcd.endpoints", f"{endpoints!r}: no client URL (and no members)",
                           fix=_ETCD_FIX)
    for e in endpoints:
        u = urllib.parse.urlsplit(str(e))
        if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/") or u.query:
            raise InvalidInput("pdops_state.etcd.endpoints", f"{e!r} is not a client URL such as https://10.0.0.5:2379",
                               fix=_ETCD_FIX)
    prefix = val.get("prefix", f"/pdops/{cluster}/")
    if not isinstance(prefix, str) or not prefix.startswith("/") or any(c in prefix for c in " \n\0"):
        raise InvalidInput("pdops_state.etcd.prefix", f"{prefix!r} is not a key prefix such as /pdops/{cluster}/",
                           fix="one prefix per cluster, starting with /")
    prefix = prefix if prefix.endswith("/") else prefix + "/"
    tls = {}
    for k in ("ca", "cert", "key"):
        f = val.get(k)
        if f is None:
            continue
        if not isinstance(f, str) or not f.startswith("/"):
            raise InvalidInput(f"pdops_state.etcd.{k}", f"{f!r} is not an absolute path", fix="a file on this machine")
        tls[k] = f
    if ("cert" in tls) != ("key" in tls):
        raise InvalidInput("pdops_state.etcd", "a client certificate needs its key (cert and key, or neither)",
                           fix="set both cert: and key:")
    if tls and members:
        raise InvalidInput("pdops_state.etcd", "TLS files are set with members: pdops runs its members over plain HTTP",
                           fix="for TLS, run etcd as your site does and name its client URLs in endpoints:")
    if tls and any(str(e).startswith("http://") for e in endpoints):
        raise InvalidInput("pdops_state.etcd.endpoints", "TLS files are set but an endpoint is http://",
                           fix="use https:// client URLs with TLS")
    return EtcdSetting(tuple(str(e).rstrip("/") for e in endpoints), prefix, tuple(members),
                       tuple(names[m].ssh_addr for m in members), tls.get("ca"), tls.get("cert"), tls.get("key"))


def _sim_faults(val: Any, engine: str) -> dict[str, str]:
    """`pdops_sim_faults: {p02: fail_transfer}`: faults the sim engine starts with, per instance."""
    if val is None:
        return {}
    if engine != "sim":
        raise InvalidInput("pdops_sim_faults", f"set with engine {engine!r}; faults exist only in the sim engine",
                           fix="remove pdops_sim_faults (it is for lab tests with pdops_engine: sim)")
    if not isinstance(val, dict):
        raise InvalidInput("pdops_sim_faults", f"{val!r} is not a mapping", fix="e.g. {p02: fail_transfer}")

    out = {}
    for k, v in val.items():
        if not re.match(r"^[pd][0-9]{2,}$", str(k)):
            raise InvalidInput(f"pdops_sim_faults.{k}", "is not an instance id", fix="use ids such as p01 or d02")
        try:
            parse_faults(str(v))
        except ValueError as e:
            raise InvalidInput(f"pdops_sim_faults.{k}", str(e), fix="see docs/sim.md, Faults") from None
        out[str(k)] = str(v)
    return out


# The choices of `smg launch` (smg 1.13's parser) for each routing flag pdops supports. `manual`
# routes by a client-sent routing key, which pdops's canary, drain and bench do not send.
ROUTING_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")


PREFILL_POLICIES = ROUTING_POLICIES + ("bucket",)


def _routing_policy(gv: dict, key: str) -> str | None:
    val = gv.get(key)
    if val is None:
        return None
    allowed = PREFILL_POLICIES if key == "prefill_policy" else ROUTING_POLICIES
    if val not in allowed:
        raise InvalidInput(f"pdops_gateway.{key}", f"{val!r} is not a routing policy pdops supports",
                           fix=f"use one of: {', '.join(allowed)} (or leave it out for the gateway's default, "
                           "cache_aware)")
    return val


def _check_unique(hosts: tuple[Host, ...]) -> None:
    for attr, label in (("ssh_addr", "ansible_host"), ("data_addr", "pdops_data_addr")):
        seen: dict[str, str] = {}
        for h in hosts:
            val = getattr(h, attr)
            if val in seen:
                raise InvalidInput(f"hosts.{h.name}.{label}", f"{val} is also the {label} of {seen[val]}",
                                   fix="every host needs its own address")
            seen[val] = h.name


def _stride(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 2:
        raise InvalidInput("pdops_ports.stride", f"{v!r} is not a whole number of at least 2",
                           fix="each slot takes base + stride * slot, and a prefill slot two bootstrap ports: "
                               "use the default 10")
    return v


def _check_port_plan(hosts: tuple[Host, ...], ports: Ports, gateway: Gateway, profile: Profile) -> None:
    """Port ranges of instance slots must not overlap each other, the gateway or Mooncake's RPC range."""
    slots = max_slots(hosts, profile)
    span = ports.stride * max(slots - 1, 0) + 1
    ranges = {
        "pdops_ports.http_base": range(ports.http_base, ports.http_base + span),
        "pdops_ports.bootstrap_base": range(ports.bootstrap_base, ports.bootstrap_base + span + 1),
        # SGLang takes a few ports above the dist-init port for its own sockets.
        "pdops_ports.dist_init_base": range(ports.dist_init_base, ports.dist_init_base + span + ports.stride - 1),
    }
    singles = {"pdops_gateway.port": gateway.port, "pdops_gateway.prometheus_port": gateway.prometheus_port,
               "pdops_gateway.standby_port": gateway.standby_port,
               "pdops_gateway.standby_prometheus_port": gateway.standby_prometheus_port}
    seen_ports: dict[int, str] = {}
    for name, p in singles.items():
        if p in seen_ports:
            raise InvalidInput(name, f"port {p} is also {seen_ports[p]}", fix="give each gateway listener its own port")
        seen_ports[p] = name
    names = list(ranges)
    for i, a in enumerate(names):
        ra = ranges[a]
        if ra[-1] > 65535:
            raise InvalidInput(a, f"ports up to {ra[-1]} exceed 65535", fix="lower the base port")
        for b in names[i + 1:]:
            rb = ranges[b]
            if ra.start < rb.stop and rb.start < ra.stop:
                raise InvalidInput(b, f"ports {rb.start}-{rb.stop - 1} collide with {a} ({ra.start}-{ra.stop - 1})",
                                   fix="move one base so the ranges do not overlap")
        if ra.start < MOONCAKE_RPC_PORTS.stop and MOONCAKE_RPC_PORTS.start < ra.stop:
            raise InvalidInput(a, f"ports {ra.start}-{ra.stop - 1} collide with Mooncake's RPC range 15000-17000",
                               fix="move the base outside 15000-17000")
        for s, p in singles.items():
            if p in ra:
                raise InvalidInput(s, f"port {p} collides with {a} ({ra.start}-{ra.stop - 1})",
                                   fix="pick a gateway port outside the instance port ranges")
