"""Bounded admission in front of the gateway: HAProxy with API keys, a concurrency cap
held for each request's whole life, and a bounded queue (rule 2, docs/design/sglang.md).

The gateway's own `--max-concurrent-requests` (smg 1.13) holds a cap, but cannot rotate keys
without a restart, answers a queue timeout with 503 whatever is asked, and has no key unless
one is set at start (docs/admission.md, measured), so the cap lives here: one backend whose only server is the gateway, `maxconn C` (a permit is held
until the response, stream included, ends), `maxqueue Q` and `timeout queue T`. The
overflow status (HAProxy's queue 503, or 429) is an errorfile. API keys are never in
the config: they sit in a 0600 map file the config names, so adding or revoking a key
is a graceful reload (`systemctl reload`: USR2 to the master, old workers finish their
streams) that changes no config byte.

Validated here with the rest of the inventory (`load_inventory` calls `parse_admission`
once and keeps the result as `Inventory.admission`); the config texts are made here and
rendered into files by `pdops.model.render`; `check_config` runs `haproxy -c`. Nothing touches a host.
This module imports nothing of pdops but its errors: the inventory is passed in.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import shlex
import shutil
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from pdops.errors import InvalidInput, one_of

VAR = "pdops_admission"
# In /etc/pdops (root, 0700, made by prepare.yml): deploy.yml creates no directory. HAProxy's
# master reads all three as root (at start and at every reload); workers need none of them.
HAPROXY_DIR = "/etc/pdops"
CONFIG_PATH = f"{HAPROXY_DIR}/pdops-admission.cfg"
KEYS_MAP_PATH = f"{HAPROXY_DIR}/pdops-admission-keys.map"
ERRORFILE_PATH = f"{HAPROXY_DIR}/pdops-admission-overflow.http"
UNIT = "pdops-admission.service"
# HAProxy's runtime API (admin level, root only). The cap's backend has one server, the permit
# (`ADMIT_SERVER`), which hands a request to the internal frontend in front of the gateways'
# backend (`GATEWAYS_BACKEND`, one server per gateway: `gateway_server`).
STATS_SOCKET = "/run/pdops-admission/admin.sock"
ADMIT_SERVER = "gateway/admit"
GATEWAYS_BACKEND = "gateways"


def gateway_server(host: str) -> str:
    """A gateway's server in HAProxy's runtime API (host names are [A-Za-z0-9.-])."""
    return f"{GATEWAYS_BACKEND}/gw-{host}"
# A connection the gateway refused carried nothing, so HAProxy tries it again, min(timeout
# connect, 1 s) apart, on another gateway when there is one (a gateway that died, before its
# health check marks it DOWN).
CONN_RETRIES = 10
# The health check of each gateway (smg's /readiness): every 2 s; 3 failures mark it DOWN, 2
# successes UP again. A gateway that dies is marked DOWN within inter x fall = 6 s (plus one
# check's timeout); until then the connections HAProxy tries on it are refused and redispatched
# (retries), so what it turns away is what was in flight on it (docs/gateway.md).
CHECK_INTER_MS, CHECK_FALL, CHECK_RISE = 2000, 3, 2
# The weight every gateway's server has in the rendered config: a front door "as deployed".
FULL_WEIGHT = 100


def admit_address(addr: str, port: int) -> str:
    """Where the permit hands requests to the gateways' frontend: an abstract unix socket, named by
    the admission bind (unique on a host; lab hosts share one network namespace)."""
    return f"abns@pdops-admission-{addr}-{port}"
# Sent to the runtime API by the host's python3 (a package file, like pdops's other host scripts).
_RUNTIME_SCRIPT = (Path(__file__).resolve().parents[1] / "hostscripts" / "haproxy_runtime.py").read_text()


def runtime_command(command: str, socket_path: str = STATS_SOCKET) -> str:
    """The shell command that sends one command to HAProxy's runtime API on the admission host."""
    return " ".join(shlex.quote(a) for a in ("python3", "-c", _RUNTIME_SCRIPT, socket_path, command))


def standby_server(host: str) -> str:
    """The name a lone gateway's stand-in has among the gateways' servers, as `show stat` keys it."""
    return f"{host}-standby"


def server_state_command(host: str, state: str, socket_path: str = STATS_SOCKET) -> str:
    """Set one gateway's server state: `drain` (no new request; those on it go on) before its planned
    restart, `ready` once it lists every worker again."""
    if state not in ("ready", "drain", "maint"):
        raise InvalidInput("server state", f"{state!r} is not ready, drain or maint")
    return runtime_command(f"set server {gateway_server(host)} state {state}", socket_path)


def server_weight_command(host: str, weight: int, socket_path: str = STATS_SOCKET) -> str:
    """Set one gateway's share of new requests (0..256, relative to the others)."""
    if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= 256:
        raise InvalidInput("weight", f"{weight!r} is not 0..256")
    return runtime_command(f"set weight {gateway_server(host)} {weight}", socket_path)


def stat_command(socket_path: str = STATS_SOCKET) -> str:
    """`show stat` of every proxy (CSV), to read each gateway server's state and sessions."""
    return runtime_command("show stat", socket_path)


@dataclass(frozen=True)
class ServerStat:
    """One gateway's server as HAProxy reports it (`show stat`)."""

    status: str  # UP, DOWN, DRAIN, MAINT, "UP 1/2" (rising), ...
    sessions: int  # requests in flight on it now (scur)
    weight: int

    @property
    def up(self) -> bool:
        return self.status == "UP"


def parse_gateway_stats(text: str) -> dict[str, ServerStat]:
    """{gateway host: its server's ServerStat} from `show stat` output; InvalidInput when it is not
    HAProxy's CSV (the runtime API answered something else)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines or not lines[0].startswith("# pxname"):
        raise InvalidInput("show stat", f"not HAProxy's stats CSV: {text[:200]!r}")
    head = lines[0].lstrip("# ").split(",")
    out = {}
    for ln in lines[1:]:
        row = dict(zip(head, ln.split(",")))
        if row.get("pxname") == GATEWAYS_BACKEND and row.get("svname", "").startswith("gw-"):
            out[row["svname"][3:]] = ServerStat(row.get("status", "?"), int(row.get("scur") or 0),
                                                int(row.get("weight") or 0))
    return out
HAPROXY_BIN = "/usr/sbin/haproxy"
GATEWAY_KEY_ENV = "PDOPS_GATEWAY_KEY"

DEFAULTS = {"port": 8080, "cap": 16, "queue": 32, "queue_timeout_s": 30, "overflow_status": 429,
            "api_keys_file": "/etc/pdops/admission.keys"}
KNOWN = set(DEFAULTS) | {"host", "hosts", "listen_addr", "metrics_port", "vip", "vrrp_interface", "vrrp_router_id"}
# The front door's own pair (docs/gateway.md "The front door itself"): keepalived holds the virtual
# address on one admission host at a time; pdops renders its config and a sysctl that lets HAProxy
# bind the address on the host that does not hold it yet.
KEEPALIVED_CONFIG = "/etc/keepalived/keepalived.conf"
KEEPALIVED_UNIT = "keepalived.service"
NONLOCAL_BIND_SYSCTL = "/etc/sysctl.d/90-pdops-admission.conf"
IFACE_RE = re.compile(r"[A-Za-z0-9_.:-]{1,15}")
OVERFLOW_STATUSES = (429, 503)
# Keys: a charset that can never close a quote, start a comment or split a map line.
KEY_RE = re.compile(r"[A-Za-z0-9._~+/=-]{16,256}")
KEY_CHARSET = "A-Z a-z 0-9 . _ ~ + / = -"
# Streams are long and silent while queued at the engine: HAProxy must not cut them.
STREAM_TIMEOUT_S = 3600


@dataclass(frozen=True)
class AdmissionConfig:
    """The admission layer of one cluster, validated. `keys` are secrets: never printed."""

    host: str
    listen_addr: str
    port: int
    cap: int
    queue: int
    queue_timeout_s: int
    overflow_status: int
    api_keys_file: str
    # (host, address, port) of each gateway HAProxy spreads the requests over
    gateways: tuple[tuple[str, str, int], ...]
    keys: tuple[str, ...] = field(default=(), repr=False, compare=False)
    # HAProxy's own Prometheus exporter (GET /metrics) on listen_addr; None: not served
    metrics_port: int | None = None
    # further admission hosts, each (host, its listen address), with the same settings: two or
    # more HAProxy, each a front door of its own (docs/gateway.md "The front door itself")
    others: tuple[tuple[str, str], ...] = ()
    # the virtual address keepalived holds on one of them (VRRP), its interface and router id
    vip: str | None = None
    vrrp_interface: str | None = None
    vrrp_router_id: int = 51
    # a lone gateway's stand-in (host, address, port): a server rendered disabled (MAINT), put in
    # service only while the gateway restarts (docs/gateway.md "Restarting the only gateway")
    standby: tuple[str, str, int] | None = None

    @property
    def hosts(self) -> tuple[str, ...]:
        return (self.host,) + tuple(h for h, _ in self.others)

    def addr_of(self, host: str) -> str:
        return dict(((self.host, self.listen_addr),) + self.others)[host]

    def url_of(self, host: str) -> str:
        addr = self.addr_of(host)
        addr = "127.0.0.1" if addr in ("0.0.0.0", "::") else addr
        return f"http://{addr}:{self.port}"

    def metrics_addr_of(self, host: str) -> str:
        addr = self.addr_of(host)
        return "127.0.0.1" if addr in ("0.0.0.0", "::") else addr

    @property
    def metrics_addr(self) -> str:
        return self.metrics_addr_of(self.host)

    @property
    def url(self) -> str:
        """The first admission host's URL (pdops's own probes; clients use the VIP, or every URL)."""
        return self.url_of(self.host)

    @property
    def key_ids(self) -> tuple[str, ...]:
        return tuple(key_id(k) for k in self.keys)


def key_id(key: str) -> str:
    """What the access log shows for a key: a hash prefix, never the key."""
    return "k-" + hashlib.sha256(key.encode()).hexdigest()[:12]


# ---------------------------------------------------------------- validation

def _int(d: dict, key: str, lo: int, fix: str, hi: int | None = None) -> int:
    val = d.get(key, DEFAULTS.get(key))
    where = f"{VAR}.{key}"
    if isinstance(val, bool) or not isinstance(val, int):
        raise InvalidInput(where, f"must be an integer, got {val!r}", fix=fix)
    if val < lo or (hi is not None and val > hi):
        bound = f"at least {lo}" if hi is None else f"in {lo}..{hi}"
        raise InvalidInput(where, f"{val} is not {bound}", fix=fix)
    return val


def read_keys(path: str | Path) -> tuple[str, ...]:
    """Read and validate an API key file: exists, mode 0600 or stricter, one key per line.

    Blank lines and lines starting with `#` are skipped. A refused line is named by its
    number; the key itself is never echoed.
    """
    where = f"{VAR}.api_keys_file"
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise InvalidInput(where, f"{p} does not exist",
                           fix=f"create it with one key per line and `chmod 600 {p}`") from None
    except OSError as exc:
        raise InvalidInput(where, f"{p}: {exc.strerror}", fix="make the key file readable by the operator") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidInput(where, f"{p} is not a regular file", fix="point api_keys_file at a file of keys")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise InvalidInput(where, f"{p} has mode {mode:04o}: readable or writable by group/others",
                           fix=f"chmod 600 {p}")
    try:
        text = p.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        raise InvalidInput(where, f"{p} is not readable UTF-8 text", fix="one ASCII key per line") from None
    keys: list[str] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(text.split("\n"), 1):
        if line == "" or line.startswith("#"):
            continue
        if not KEY_RE.fullmatch(line):
            what = ("contains characters outside " + KEY_CHARSET
                    if not re.fullmatch(r"[A-Za-z0-9._~+/=-]*", line) else f"is {len(line)} characters, not 16..256")
            raise InvalidInput(where, f"{p} line {n}: the key {what} (key not shown)",
                               fix="one key per line, no spaces, quotes, tabs or CR; "
                                   f"16 to 256 characters of {KEY_CHARSET}")
        if line in seen:
            raise InvalidInput(where, f"{p} line {n}: same key as line {seen[line]}", fix="list each key once")
        seen[line] = n
        keys.append(line)
    if not keys:
        raise InvalidInput(where, f"{p} holds no key", fix="add at least one key (one per line)")
    return tuple(keys)


def parse_admission(all_vars: dict, inv) -> AdmissionConfig | None:
    """Validate `pdops_admission` (None when absent) and read its key file. Writes nothing.
    `inv`: the inventory being loaded (its hosts, gateway and port plan)."""
    raw = all_vars.get(VAR)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidInput(VAR, "must be a mapping", fix="pdops_admission: {port: 8080, cap: 16, queue: 32, ...}")
    unknown = sorted(set(raw) - KNOWN)
    if unknown:
        raise InvalidInput(f"{VAR}.{unknown[0]}", "unknown setting", fix=f"use only: {', '.join(sorted(KNOWN))}")
    host_names = _admission_hosts(raw, inv)
    if len(host_names) > 1 and "listen_addr" in raw and str(raw["listen_addr"]) not in ("0.0.0.0", "::"):
        raise InvalidInput(f"{VAR}.listen_addr", f"{raw['listen_addr']!r} would be every admission host's address",
                           fix="leave it out (each listens on its own pdops_data_addr), or 0.0.0.0; clients use "
                               "the vip or every host's address")
    listens = []
    for name in host_names:
        listen = raw.get("listen_addr", inv.host(name).data_addr)
        try:
            listens.append(str(ipaddress.ip_address(str(listen))))
        except ValueError:
            raise InvalidInput(f"{VAR}.listen_addr", f"{listen!r} is not an IP address",
                               fix="use the address clients reach (default: the host's pdops_data_addr)") from None
    host_name, listen = host_names[0], listens[0]
    vip, iface, vrid = _vrrp(raw, len(host_names))
    if vip and getattr(inv, "virtual_hardware", False):
        raise InvalidInput(f"{VAR}.vip", "the lab's hosts share one network namespace: keepalived there would put "
                           "the virtual address on this machine's own interface",
                           fix="leave vip out in the lab: each admission host answers on its own address")
    port = raw.get("port", DEFAULTS["port"])
    if isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535:
        raise InvalidInput(f"{VAR}.port", f"{port!r} is not a port in 1024-65535", fix="pick an unprivileged port")
    cap = _int(raw, "cap", 1, "the cap is the most requests in flight at the engines: 1 or more")
    queue = _int(raw, "queue", 0, "the queue holds requests waiting for a permit: 0 (none) or more")
    qto = _int(raw, "queue_timeout_s", 1, "seconds a request may wait in the queue: 1 or more", hi=86400)
    overflow = raw.get("overflow_status", DEFAULTS["overflow_status"])
    if overflow not in OVERFLOW_STATUSES or isinstance(overflow, bool):
        raise InvalidInput(f"{VAR}.overflow_status", f"{overflow!r} is not 429 or 503",
                           fix="429 (Too Many Requests, clients back off) or 503")
    kf = raw.get("api_keys_file", DEFAULTS["api_keys_file"])
    if not isinstance(kf, str) or not kf.startswith("/"):
        raise InvalidInput(f"{VAR}.api_keys_file", f"{kf!r} is not an absolute path",
                           fix="the absolute path of the key file on the operator machine")

    gw = inv.gateway
    taken: dict[str, range] = {}
    if set(host_names) & set(gw.hosts):
        taken["pdops_gateway.port"] = range(gw.port, gw.port + 1)
        taken["pdops_gateway.prometheus_port"] = range(gw.prometheus_port, gw.prometheus_port + 1)
        if len(gw.nodes) == 1:  # the only gateway's stand-in listens there while it restarts
            taken["pdops_gateway.standby_port"] = range(gw.standby_port, gw.standby_port + 1)
            taken["pdops_gateway.standby_prometheus_port"] = range(gw.standby_prometheus_port,
                                                                   gw.standby_prometheus_port + 1)
    taken.update(inv.reserved_port_ranges())
    for name, r in taken.items():
        if port in r:
            what = f"{name} ({r.start}-{r.stop - 1})" if len(r) > 1 else name
            raise InvalidInput(f"{VAR}.port", f"port {port} on {host_name} collides with {what}",
                               fix="pick a port no other pdops service uses on that host")
    mport = raw.get("metrics_port")
    if mport is not None:
        if isinstance(mport, bool) or not isinstance(mport, int) or not 1024 <= mport <= 65535:
            raise InvalidInput(f"{VAR}.metrics_port", f"{mport!r} is not a port in 1024-65535",
                               fix="pick an unprivileged port for HAProxy's Prometheus exporter, or leave it out")
        for name, r in {**taken, f"{VAR}.port": range(port, port + 1)}.items():
            if mport in r:
                raise InvalidInput(f"{VAR}.metrics_port", f"port {mport} on {host_name} collides with {name}",
                                   fix="pick a port no other pdops service uses on that host")
    keys = read_keys(kf)
    return AdmissionConfig(host=host_name, listen_addr=listen, port=port, cap=cap, queue=queue,
                           queue_timeout_s=qto, overflow_status=overflow, api_keys_file=kf,
                           gateways=tuple((n.host, n.addr, n.port) for n in gw.nodes), keys=keys,
                           standby=((gw.nodes[0].host, gw.nodes[0].addr, gw.standby(gw.nodes[0].host).port)
                                    if len(gw.nodes) == 1 else None),
                           metrics_port=mport, others=tuple(zip(host_names[1:], listens[1:])), vip=vip,
                           vrrp_interface=iface, vrrp_router_id=vrid)

def _admission_hosts(raw: dict, inv) -> list[str]:
    """`host: gpu01` (default: the first gateway host) or `hosts: [gpu01, gpu02]` (two front doors)."""
    names = [h.name for h in inv.hosts]
    if "host" in raw and "hosts" in raw:
        raise InvalidInput(VAR, "both `host` and `hosts` are set",
                           fix="`host: <name>` for one admission host, `hosts: [<name>, <name>]` for two")
    val = raw["hosts"] if "hosts" in raw else [raw.get("host", inv.gateway.first.host)]
    field_name = f"{VAR}.hosts" if "hosts" in raw else f"{VAR}.host"
    if not isinstance(val, list) or not val or not all(isinstance(h, str) for h in val):
        raise InvalidInput(field_name, f"{val!r} is not a list of host names", fix="e.g. hosts: [gpu01, gpu02]")
    for h in val:
        if h not in names:
            raise InvalidInput(field_name, f"{h!r} is not a host of this inventory",
                               fix=one_of(names, h) + " (default: the first gateway host)")
    if len(set(val)) != len(val):
        raise InvalidInput(field_name, "a host is named more than once", fix="one HAProxy per host: name each once")
    return list(val)


def _vrrp(raw: dict, n_hosts: int) -> tuple[str | None, str | None, int]:
    """`vip`, `vrrp_interface`, `vrrp_router_id`: keepalived's pair, with two admission hosts or more."""
    vip = raw.get("vip")
    if vip is None:
        for k in ("vrrp_interface", "vrrp_router_id"):
            if k in raw:
                raise InvalidInput(f"{VAR}.{k}", "set without `vip`",
                                   fix="set vip (the virtual address) too, or remove it")
        return None, None, 51
    if n_hosts < 2:
        raise InvalidInput(f"{VAR}.vip", "a virtual address needs two admission hosts or more to move between",
                           fix="name them in pdops_admission.hosts, or remove vip")
    try:
        vip = str(ipaddress.ip_address(str(vip)))
    except ValueError:
        raise InvalidInput(f"{VAR}.vip", f"{vip!r} is not an IP address", fix="the address clients use") from None
    iface = raw.get("vrrp_interface")
    if not isinstance(iface, str) or not IFACE_RE.fullmatch(iface):
        raise InvalidInput(f"{VAR}.vrrp_interface", f"{iface!r} is not a network interface name",
                           fix="the interface that carries the data addresses on the admission hosts, e.g. bond0")
    vrid = raw.get("vrrp_router_id", 51)
    if isinstance(vrid, bool) or not isinstance(vrid, int) or not 1 <= vrid <= 255:
        raise InvalidInput(f"{VAR}.vrrp_router_id", f"{vrid!r} is not 1..255",
                           fix="a VRRP router id unique on the admission hosts' network")
    return vip, iface, vrid



# ---------------------------------------------------------------- rendering

def keys_map(keys: tuple[str, ...]) -> str:
    """The HAProxy map: `<key> <key id>` per line; a reload re-reads it."""
    return "".join(f"{k} {key_id(k)}\n" for k in keys)


def overflow_response(status: int) -> str:
    """The raw HTTP response HAProxy sends when the queue is full or the wait timed out."""
    reason = {429: "Too Many Requests", 503: "Service Unavailable"}[status]
    body = '{"error":{"type":"overloaded","message":"admission queue full or queue timeout; retry later"}}\n'
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n")
    return head + body


def check_config(path: str | Path) -> None:
    """`haproxy -c -f path`: raise InvalidInput with HAProxy's own message if it refuses."""
    exe = shutil.which("haproxy") or HAPROXY_BIN
    try:
        proc = subprocess.run([exe, "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise InvalidInput("haproxy", "haproxy is not installed", fix="bash scripts/setup-system.sh") from None
    if proc.returncode != 0:
        msg = "\n".join(ln for ln in (proc.stdout + proc.stderr).splitlines() if "ALERT" in ln or "error" in ln.lower())
        raise InvalidInput(str(path), f"haproxy -c refused the config:\n{msg or proc.stderr.strip()}",
                           fix="fix the admission settings (the file is rendered by pdops)")


# ---------------------------------------------------------------- local key maps (tests, bench)

def write_keys_map(path: str | Path, keys: tuple[str, ...]) -> None:
    """Replace the key map atomically, mode 0600 (then reload to apply)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.touch(mode=0o600)
    tmp.chmod(0o600)
    tmp.write_text(keys_map(keys))
    tmp.replace(p)
