"""`inv verify`'s host checks: the deployed state of the current revision, read on each host in
ONE SSH round trip (the batch protocol preflight uses: pdops.steps.preflight.batch), then judged here.

What is read per host (one command, sections framed by markers with their exit codes):
  units    `systemctl show` of every unit the revision put there (engines, the gateway, the
           admission layer), with UnitFileState and NeedDaemonReload
  files    mode, owner and sha256 of every file the revision rendered for the host
  cgroups  the PIDs in each unit's cgroup
  limits   'Max locked memory' of each unit's MainPID (proc(5), /proc/<pid>/limits)
  listen   the listening sockets (`ss -Hltnp`)
  health   the gateway's /health, asked on the gateway host itself
What each check asserts is in `judge`; it reads the facts only, so a unit test can feed it
documented output and see it fail. Which process runs which files (the launch script's note) and
the gateway's workers are pdops.reads.observe's part of `inv verify`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdops.reads.check_result import CheckResult, fail_result, ok_result, skip_result
from pdops.facts import q
from pdops.facts import files as file_facts
from pdops.facts.files import FileFact
from pdops.facts import ports as port_facts
from pdops.facts import systemd as systemd_facts
from pdops.facts.systemd import UnitState
from pdops.model.placement import Placement
from pdops.facts import batch_command, split_sections

SYSTEMD_DIR = "/etc/systemd/system/"
GATEWAY_UNIT_PATH = SYSTEMD_DIR + "pdops-gateway.service"
# The admission layer (HAProxy in front of the gateway): any rendered unit named so.
ADMISSION_UNIT_PREFIXES = ("pdops-admission", "haproxy")
ADMISSION_CONFIG_SUFFIX = "/pdops-admission.cfg"
ADMISSION_KEYS_SUFFIX = "/pdops-admission-keys.map"
CGROUP_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd")
UNIT_PROPERTIES = systemd_facts.PROPERTIES + ("NeedDaemonReload",)


@dataclass(frozen=True)
class HostPlan:
    """What the revision put on one host, as verify needs it."""

    host: str
    engine_units: tuple[str, ...]
    files: dict  # {path: sha256} rendered for the host
    listeners: tuple[tuple[str, str, int], ...]  # (instance id, data address, port) expected to listen
    gateway_url: str | None  # set on the gateway host only

    @property
    def gateway_unit(self) -> str | None:
        return GATEWAY_UNIT_PATH.rsplit("/", 1)[1] if GATEWAY_UNIT_PATH in self.files else None

    @property
    def admission_units(self) -> tuple[str, ...]:
        return tuple(sorted(p[len(SYSTEMD_DIR):] for p in self.files if p.startswith(SYSTEMD_DIR)
                            and p[len(SYSTEMD_DIR):].startswith(ADMISSION_UNIT_PREFIXES)))

    @property
    def units(self) -> tuple[str, ...]:
        return self.engine_units + ((self.gateway_unit,) if self.gateway_unit else ()) + self.admission_units


def host_plans(rev) -> list[HostPlan]:
    """One HostPlan per host the revision placed something on: the units from its placement (as
    pdops.reads.observe reads them), the files from its manifest, which names every such host."""
    engine: dict[str, list[str]] = {}
    listen: dict[str, list[tuple[str, str, int]]] = {}
    for inst in Placement.from_dict(rev.placement).instances:
        for host, unit in inst.units:
            engine.setdefault(host, []).append(unit)
        head = inst.head  # ranks >= 1 serve no HTTP
        ports = [inst.http_port] + ([inst.bootstrap_port] if inst.bootstrap_port else [])
        listen.setdefault(head.host, []).extend((inst.id, head.data_addr, p) for p in ports)
    extra = rev.extra or {}
    # {host: URL} since several gateways; one "gateway" URL in older records
    gw_urls = extra.get("gateways") or {}
    out = []
    for host in sorted(set(rev.manifest) | set(engine)):
        files = {p: m["sha256"] for p, m in (rev.manifest.get(host) or {}).items()}
        out.append(HostPlan(host, tuple(engine.get(host, ())), files, tuple(listen.get(host, ())),
                            gw_urls.get(host, extra.get("gateway")) if GATEWAY_UNIT_PATH in files else None))
    return out


# ---------------------------------------------------------------- the one command per host

def _cgroups_command(units) -> str:
    roots = " ".join(CGROUP_ROOTS)
    return "; ".join(
        f"cg=$(systemctl show -p ControlGroup --value {q(u)}); printf '%s ' {q(u)}; "
        f"for r in {roots}; do [ -n \"$cg\" ] && cat \"$r$cg/cgroup.procs\" 2>/dev/null; done | tr '\\n' ' '; echo"
        for u in units) or "true"


def _limits_command(units) -> str:
    return "; ".join(
        f"pid=$(systemctl show -p MainPID --value {q(u)}); printf '%s %s ' {q(u)} \"$pid\"; "
        f"grep '^Max locked memory' /proc/\"$pid\"/limits 2>/dev/null || echo -"
        for u in units) or "true"


def _health_command(url: str) -> str:
    script = ("import sys, urllib.request\ntry:\n print(urllib.request.urlopen(sys.argv[1], timeout=5).status)\n"
              "except Exception as e:\n print(getattr(e, 'code', None) or type(e).__name__)")
    return f"python3 -c {q(script)} {q(url.rstrip('/') + '/health')}"


def host_command(plan: HostPlan) -> str:
    """The one shell command that reads everything verify judges on this host."""
    sections = {"files": file_facts.command(plan.files), "listen": port_facts.command()}
    if plan.units:
        sections["units"] = (f"systemctl show -p {','.join(UNIT_PROPERTIES)} --no-pager "
                             + " ".join(q(u) for u in plan.units))
        sections["cgroups"] = _cgroups_command(plan.engine_units)
        sections["limits"] = _limits_command(plan.engine_units)
    if plan.gateway_url:
        sections["health"] = _health_command(plan.gateway_url)
    configs = [p for p in plan.files if p.endswith(ADMISSION_CONFIG_SUFFIX)]
    if configs:
        sections["binds"] = "grep -h '^ *bind ' " + " ".join(q(p) for p in configs)
    return batch_command(sections)


# ---------------------------------------------------------------- parsing

def parse_words(text: str) -> dict[str, list[str]]:
    """`<unit> <word> <word> ...` lines: {unit: words}."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if parts:
            out[parts[0]] = parts[1:]
    return out


def parse_binds(text: str) -> list[tuple[str, int]]:
    """(address, port) of each `bind addr:port` line of an HAProxy config (a bind on a socket,
    `abns@...` or `unix@...`, is inside the host: not a listening port to check)."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "bind" and "@" not in parts[1]:
            addr, port = parts[1].rsplit(":", 1)
            out.append((addr.strip("[]"), int(port)))
    return out


def read_facts(output: str) -> dict:
    """{section: parsed facts, or the text of why it could not be read}."""
    facts: dict = {}
    for name, (rc, text) in split_sections(output).items():
        if rc != 0 and name != "health":
            facts[name] = f"exited {rc}: {text.strip()[-300:]}"
            continue
        try:
            facts[name] = {"units": systemd_facts.parse_by_id, "files": file_facts.parse, "listen": port_facts.parse,
                           "cgroups": parse_words, "limits": parse_words, "health": str.strip,
                           "binds": parse_binds}[name](text)
        except Exception as exc:  # noqa: BLE001 - an unparsable section is a finding, not a crash
            facts[name] = f"unparsable: {type(exc).__name__}: {exc}"
    return facts


# ---------------------------------------------------------------- judging

def judge(plan: HostPlan, facts: dict, *, virtual: bool) -> list[CheckResult]:
    """Every check on one host, from its facts alone."""
    out: list[CheckResult] = []
    h = plan.host

    def add(name: str, problems: list[str], skipped: str | None = None) -> None:
        if skipped:
            out.append(skip_result(h, name, skipped))
        elif problems:
            out.append(fail_result(h, name, "; ".join(problems), ""))
        else:
            out.append(ok_result(h, name, ""))

    def section(name: str):
        f = facts.get(name)
        return f if not isinstance(f, str) and f is not None else None

    def unreadable(name: str) -> list[str]:
        f = facts.get(name)
        return [f"{name} unreadable: {f if isinstance(f, str) else 'no output'}"]

    units: dict[str, UnitState] | None = section("units")
    files: dict[str, FileFact] | None = section("files")

    def file_problems(paths, *, mode: int | None = None, owner: str | None = None, content: bool = True) -> list[str]:
        if files is None:
            return unreadable("files")
        probs = []
        for p in paths:
            f = files.get(p)
            if f is None or f.mode is None:
                probs.append(f"{p} missing")
                continue
            if content and f.sha256 != plan.files[p]:
                probs.append(f"{p} differs from the revision")
            if mode is not None and f.mode != mode:
                probs.append(f"{p}: mode {oct(f.mode)}")
            if owner is not None and f.owner != owner:
                probs.append(f"{p}: owner {f.owner}")
        return probs

    def unit_problems(names) -> list[str]:
        if units is None:
            return unreadable("units")
        probs = []
        for u in names:
            s = units.get(u)
            if s is None or not s.exists:
                probs.append(f"{u} not loaded")
                continue
            if s.active_state != "active":
                probs.append(f"{u} not running ({s.active_state}/{s.sub_state})")
            if s.unit_file_state != "enabled":
                probs.append(f"{u} not enabled ({s.unit_file_state or 'no unit file state'})")
            if s.raw.get("NeedDaemonReload") not in (None, "no"):
                probs.append(f"{u}: its unit file changed on disk since systemd loaded it")
        return probs

    if plan.engine_units:
        add("units", unit_problems(plan.engine_units)
            + file_problems([SYSTEMD_DIR + u for u in plan.engine_units]))
        add("cgroup", _cgroup_problems(plan, units, facts.get("cgroups")))
        add("memlock", *_memlock(plan, units, facts.get("limits"), virtual))
    env_files = [p for p in plan.files if p.endswith(".env")]
    if env_files:
        add("env-0600", file_problems(env_files, mode=0o600))
    if plan.listeners:
        add("ports", _port_problems(plan, section("listen"), facts.get("listen")))
    if plan.gateway_unit:
        probs = unit_problems([plan.gateway_unit]) + file_problems([GATEWAY_UNIT_PATH])
        if not plan.gateway_url:
            probs.append("the revision records no gateway URL")
        else:
            addr, port = plan.gateway_url.split("//", 1)[1].rstrip("/").rsplit(":", 1)
            probs += _listening(section("listen"), facts.get("listen"), [(f"gateway {addr}:{port}", addr, int(port))])
            if facts.get("health") != "200":
                probs.append(f"{plan.gateway_url}/health answered {facts.get('health') or 'nothing'}")
        add("gateway", probs)
    if plan.admission_units:
        probs = unit_problems(plan.admission_units) + file_problems([SYSTEMD_DIR + u for u in plan.admission_units])
        configs = [p for p in plan.files if p.endswith(ADMISSION_CONFIG_SUFFIX)]
        probs += file_problems(configs)
        binds = section("binds")
        if configs and not binds:
            probs.append(f"no bind line read from {', '.join(configs)}: {facts.get('binds') or 'no output'}")
        probs += _listening(section("listen"), facts.get("listen"), [(f"admission bind {a}:{p}", a, p)
                                                                       for a, p in binds or []])
        # the key map's content changes with `inv admission.keys`: its mode and owner are checked
        probs += file_problems([p for p in plan.files if p.endswith(ADMISSION_KEYS_SUFFIX)], mode=0o600, owner="root",
                               content=False)
        add("admission", probs)
    elif plan.gateway_unit:
        add("admission", [], skipped="this revision renders no admission unit on this gateway host (the admission "
                                     "layer runs on another host, or nowhere)")
    return out


def _cgroup_problems(plan: HostPlan, units, procs) -> list[str]:
    if units is None:
        return ["units unreadable (see the units check)"]
    if not isinstance(procs, dict):
        return [f"cgroups unreadable: {procs if isinstance(procs, str) else 'no output'}"]
    probs = []
    for u in plan.engine_units:
        s = units.get(u)
        pid = s.main_pid if s else None
        if not pid:
            probs.append(f"{u} has no MainPID")
        elif str(pid) not in procs.get(u, []):
            probs.append(f"{u}: MainPID {pid} not in its cgroup {s.control_group}")
    return probs


def _memlock(plan: HostPlan, units, limits, virtual: bool) -> tuple[list[str], str | None]:
    """LimitMEMLOCK=infinity as systemd loaded the unit, and unlimited in the running process."""
    if units is None:
        return ["units unreadable (see the units check)"], None
    if not isinstance(limits, dict):
        return [f"limits unreadable: {limits if isinstance(limits, str) else 'no output'}"], None
    probs, lowered = [], []
    for u in plan.engine_units:
        s = units.get(u)
        if s is None:
            probs.append(f"{u} not loaded")
            continue
        if s.limit_memlock is not systemd_facts.INFINITY:
            probs.append(f"{u}: LimitMEMLOCK={s.raw.get('LimitMEMLOCK')}")
        words = limits.get(u, [])
        got = words[4:6] if len(words) >= 6 else None  # <pid> Max locked memory <soft> <hard> bytes
        if got != ["unlimited", "unlimited"]:
            lowered.append(f"{u}: MainPID {words[0] if words else '?'} runs with max locked memory {got}")
    if lowered and virtual and not probs:
        return [], ("virtual hardware: " + "; ".join(lowered) + " (the lab sandbox lacks CAP_SYS_RESOURCE); "
                    "the units themselves ask for infinity")
    return probs + lowered, None


def _listening(listeners, raw, wanted) -> list[str]:
    """Each wanted (what, address, port) reachable: a socket on that address, or a wildcard one
    (`*`, `0.0.0.0`, `::`) that covers it, as `ss` prints them."""
    if listeners is None:
        return [f"listening sockets unreadable: {raw if isinstance(raw, str) else 'no output'}"]
    return [f"{what}: {port} not listening on {addr}" for what, addr, port in wanted
            if not port_facts.is_listening(listeners, addr, port)]


def _port_problems(plan: HostPlan, listeners, raw) -> list[str]:
    probs = _listening(listeners, raw, plan.listeners)
    if listeners is not None:
        wild = {sock.port: sock.addr for sock in listeners if sock.is_wildcard}
        probs += [f"{iid}: {port} listens on every address ({wild[port]}), not only {addr}"
                  for iid, addr, port in plan.listeners if port in wild]
    return probs
