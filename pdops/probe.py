"""`inv probe`: try a candidate parameter bundle with a few long requests; keep the outcome and the
failure signature; never call a bundle best (field report 000, section 5).

A probe, under the cluster lock, on the runner:

- **--spare**: a new prefill x decode pair on free GPUs (the lowest free ids), started from the
  revision's files with the bundle's flags, health-gated, canaried, never registered with the
  gateway; the long requests go straight to the pair; then the pair's verified stop, its files
  removed, and every instance of the revision shown to run the revision's files (nothing of the
  revision was touched).
- **--instances p01,d01**: that pair leaves the gateway and drains (the drain sub-plan), restarts
  from the bundle's files, is canaried, probed, then restored by the change planner (the repair's
  path: verified stop, the revision's own files, canary with every pair, register, record); with
  `--keep` (every request ok) it restarts on the bundle's files instead and that is recorded as the
  new revision.

The requests come from the ledgered client (`pdops.load.run_pair`), one row per request, never
retried. Each request's outcome (ok / OOM / transfer failure / bootstrap failure / timeout / HTTP
status) is read from the answers of both sides and the engines' journals; the failure signatures
(exception, top frames, allocation size, transfer error line) are harvested from the journal of
every rank. The probe table lives in the cluster's journal (`probe-result`, `probe-note` records):
shared by every operator, append-only.
"""

from __future__ import annotations

import csv
import io
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

# imported for their step kinds' executors too (pdops.runner.EXECUTORS): a probe walks them
import pdops.scale  # noqa: F401
from pdops.deploy import do_canary
from pdops.errors import InvalidInput, PdopsError, Refused, Unverified
from pdops.inventory import Inventory
from pdops.placement import Instance, Placement
from pdops.runner import Outcome, RunContext, Step, register_executors, run_steps
from pdops.state import new_op_id, now_iso

# Flags pdops renders from the inventory and the placement: a bundle does not set them.
OWNED = frozenset({
    "--model-path", "--served-model-name", "--host", "--port", "--tp-size", "--pp-size", "--ep-size",
    "--tensor-parallel-size", "--pipeline-parallel-size", "--expert-parallel-size", "--disaggregation-mode",
    "--disaggregation-bootstrap-port", "--disaggregation-transfer-backend", "--disaggregation-ib-device",
    "--nnodes", "--node-rank", "--dist-init-addr", "--api-key", "--admin-api-key", "--enable-metrics",
    "--log-requests", "--log-requests-level", "--log-requests-format", "--base-gpu-id", "--config",
})
OUTCOMES = ("ok", "OOM", "transfer failure", "bootstrap failure", "timeout")
DEFAULT_TIMEOUT_S = 1800.0


# ---------------------------------------------------------------- the bundle

@dataclass(frozen=True)
class Bundle:
    """A candidate parameter bundle: SGLang flags (full names) with their values; None is a flag
    without a value (store_true), False removes the flag."""

    name: str
    path: str
    flags: tuple[tuple[str, object], ...]

    def as_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "flags": {k: v for k, v in self.flags}}


def _flag_table() -> dict[str, tuple]:
    from pdops.sglang_flags import FLAGS

    return {row[0]: row for row in FLAGS}


def check_flags(flags: dict, where: str) -> tuple[tuple[str, object], ...]:
    """Each flag against SGLang 0.5.23's own flag table (its names, types, choices): an unknown
    name, an abbreviation, a flag pdops owns, or a value the table rejects is InvalidInput."""
    from pdops.sim.args import build_parser

    if not isinstance(flags, dict) or not flags:
        raise InvalidInput(where, "must be a non-empty mapping of SGLang flags to values",
                           fix="flags: {chunked-prefill-size: 16384, mem-fraction-static: 0.5}")
    table = _flag_table()
    out, argv = [], []
    for raw, value in flags.items():
        flag = "--" + str(raw).lstrip("-")
        if flag not in table:
            near = sorted(k for k in table if k.startswith(flag) or flag[2:].replace("_", "-") in k)[:3]
            raise InvalidInput(f"{where}.{raw}", f"{flag} is not a flag of SGLang 0.5.23's launch_server",
                               fix=f"use the full flag name ({', '.join(near)})" if near
                               else "see `python -m sglang.launch_server --help` of the pinned SGLang")
        if flag in OWNED:
            raise InvalidInput(f"{where}.{raw}", f"{flag} is set by pdops from the inventory and the placement",
                               fix="a bundle holds engine parameters only; change the inventory for this one")
        kind = table[flag][2]
        if isinstance(value, (dict, list)) and kind != "multi":
            raise InvalidInput(f"{where}.{raw}", f"{value!r} is not a single value", fix="give one value")
        if kind in ("flag", "flag_false"):
            if value not in (True, False, None):
                raise InvalidInput(f"{where}.{raw}", f"{flag} takes no value; {value!r} given",
                                   fix=f"{raw}: true to set it, false to remove it")
            v = None if value in (True, None) else False
            out.append((flag, v))
            if v is None:
                argv.append(flag)
            continue
        if value is None or isinstance(value, bool):
            raise InvalidInput(f"{where}.{raw}", f"{flag} needs a value", fix=f"{raw}: <value>")
        sval = " ".join(map(str, value)) if isinstance(value, list) else str(value)
        out.append((flag, sval))
        argv += [flag, *(map(str, value) if isinstance(value, list) else [sval])]
    parser = build_parser()
    parser.exit_on_error = False
    try:
        ns, rest = parser.parse_known_args(["--model-path", "x", *argv])
    except Exception as exc:  # argparse.ArgumentError: a value the table rejects
        raise InvalidInput(where, f"SGLang's flag table rejects the bundle: {exc}",
                           fix="give each flag a value of its type (see the flag's choices)") from None
    if rest:
        raise InvalidInput(where, f"SGLang's flag table rejects {' '.join(rest)}", fix="check the values")
    return tuple(out)


def load_bundle(path) -> Bundle:
    """A bundle file: ``{name: T3, flags: {...}}``, or per role ``{prefill: {...}, decode: {...}}``,
    which must then be the same (a heterogeneous bundle is refused)."""
    p = Path(str(path))
    if not p.is_file():
        raise InvalidInput("--bundle", f"{path} is not a file", fix="a YAML file: flags: {chunked-prefill-size: 8192}")
    try:
        doc = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise InvalidInput("--bundle", f"{path} is not YAML: {exc}", fix="fix the file") from None
    if not isinstance(doc, dict):
        raise InvalidInput("--bundle", f"{path} must hold a mapping", fix="flags: {chunked-prefill-size: 8192}")
    unknown = set(doc) - {"name", "flags", "prefill", "decode", "description"}
    if unknown:
        raise InvalidInput(f"--bundle {path}", f"unknown key(s) {', '.join(sorted(map(str, unknown)))}",
                           fix="keys: name, description, flags (or prefill and decode, the same)")
    roles = {r: doc[r] for r in ("prefill", "decode") if r in doc}
    if roles:
        if "flags" in doc:
            raise InvalidInput(f"--bundle {path}", "both flags and per-role flags", fix="one of them")
        checked = {r: check_flags(v, f"{path}:{r}") for r, v in roles.items()}
        if len(checked) != 2 or dict(checked["prefill"]) != dict(checked["decode"]):
            raise InvalidInput(f"--bundle {path}", "the bundle changes prefill and decode differently "
                               "(heterogeneous P/D)", fix="P and D run the same parameters in pdops; put them "
                               "under `flags:` once")
        flags = checked["prefill"]
    else:
        flags = check_flags(doc.get("flags"), f"{path}:flags")
    name = doc.get("name") or p.stem
    return Bundle(str(name), str(p), flags)


def parse_workload(value, profile) -> tuple[int, int]:
    """'380k/7000' -> (380000, 7000); None: the profile's workload."""
    if value in (None, ""):
        w = profile.workload or {}
        return int(w.get("input_tokens", 2000)), int(w.get("output_tokens", 64))
    m = re.fullmatch(r"\s*(\d+)([kK]?)\s*/\s*(\d+)([kK]?)\s*", str(value))
    if not m:
        raise InvalidInput("--workload", f"{value!r} is not INPUT/OUTPUT tokens", fix="e.g. 380k/7000")
    i = int(m.group(1)) * (1000 if m.group(2) else 1)
    o = int(m.group(3)) * (1000 if m.group(4) else 1)
    if i < 1 or o < 1:
        raise InvalidInput("--workload", f"{value!r}: both counts must be at least 1", fix="e.g. 380k/7000")
    return i, o


def _value_of(args: list[str], flag: str, table: dict) -> str | None:
    if flag not in args:
        d = table[flag][5]
        return None if d is None else (str(d) if not isinstance(d, bool) else ("set" if d else None))
    i = args.index(flag)
    if i + 1 < len(args) and not args[i + 1].startswith("--"):
        return args[i + 1]
    return "set"


def _norm(v) -> str | None:
    if v is None:
        return None
    try:
        f = float(v)
        return repr(int(f)) if f == int(f) else repr(f)
    except (TypeError, ValueError):
        return str(v)


def changed_variables(baseline: list[str], bundle: Bundle) -> list[dict]:
    """The bundle's flags whose value differs from the baseline command line (a flag absent from it
    counts with SGLang's default)."""
    table = _flag_table()
    out = []
    for flag, v in bundle.flags:
        base = _value_of(baseline, flag, table)
        cand = None if v is False else ("set" if v is None else str(v))
        if _norm(base) != _norm(cand):
            out.append({"flag": flag, "baseline": base, "candidate": cand})
    return out


# ---------------------------------------------------------------- outcomes and signatures

_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
_EXC = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): ?(.*)$")
_ALLOC = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) (GiB|MiB|KiB|B)\b")
_TRANSFER = re.compile(r"(KV transfer failed|transfer failed|Transfer Error|TransferEngine|mooncake.*(error|fail))",
                       re.IGNORECASE)
_RID = re.compile(r"request(?: rid=| )([\w.-]+)")


def _alloc_gib(text: str) -> float | None:
    m = _ALLOC.search(text)
    if not m:
        return None
    scale = {"GiB": 1.0, "MiB": 1 / 1024, "KiB": 1 / 1024 ** 2, "B": 1 / 1024 ** 3}[m.group(2)]
    return round(float(m.group(1)) * scale, 2)


def signatures(journal: str, where: str = "") -> list[dict]:
    """The failure signatures in one rank's journal text (`journalctl -o cat`): every Python
    traceback (exception type, the three innermost frames, the allocation size of a CUDA OOM, the
    request it names) and every KV transfer error line. Same signature twice: counted once."""
    out: dict[tuple, dict] = {}
    lines = journal.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if "Traceback (most recent call last)" in line:
            rid_m = _RID.search(line)
            frames, j = [], i + 1
            while j < len(lines) and (lines[j].startswith("  ") or _FRAME.match(lines[j])):
                m = _FRAME.match(lines[j])
                if m:
                    frames.append(f"{Path(m.group(1)).name}:{m.group(2)} {m.group(3)}")
                j += 1
            exc = _EXC.match(lines[j].strip()) if j < len(lines) else None
            if exc:
                top = list(reversed(frames))[:3]
                key = ("exception", exc.group(1), tuple(top))
                sig = out.setdefault(key, {"kind": "exception", "exception": exc.group(1),
                                           "message": exc.group(2)[:200], "top_frames": top,
                                           "alloc_gib": _alloc_gib(exc.group(2)), "count": 0, "rids": [],
                                           "where": []})
                sig["count"] += 1
                if rid_m and rid_m.group(1) not in sig["rids"]:
                    sig["rids"].append(rid_m.group(1))
                if where and where not in sig["where"]:
                    sig["where"].append(where)
                i = j + 1
                continue
        if _TRANSFER.search(line) and "Traceback" not in line:
            text = re.sub(r"rid=[\w.-]+", "rid=*", line.split("] ", 1)[-1]).strip()[:200]
            key = ("transfer", text)
            sig = out.setdefault(key, {"kind": "transfer", "line": text, "count": 0, "rids": [], "where": []})
            sig["count"] += 1
            rid_m = re.search(r"rid=([\w.-]+)", line)
            if rid_m and rid_m.group(1) not in sig["rids"]:
                sig["rids"].append(rid_m.group(1))
            if where and where not in sig["where"]:
                sig["where"].append(where)
        i += 1
    return list(out.values())


def merge_signatures(groups: list[list[dict]]) -> list[dict]:
    out: dict[tuple, dict] = {}
    for sigs in groups:
        for s in sigs:
            key = (s["kind"], s.get("exception"), tuple(s.get("top_frames") or ()), s.get("line"))
            if key not in out:
                out[key] = {**s, "rids": list(s["rids"]), "where": list(s["where"])}
                continue
            m = out[key]
            m["count"] += s["count"]
            m["rids"] += [r for r in s["rids"] if r not in m["rids"]]
            m["where"] += [w for w in s["where"] if w not in m["where"]]
    return list(out.values())


def classify(row, sigs: list[dict] = ()) -> str:
    """One request's outcome from its ledger row (the decode's answer, the prefill's in extra) and
    the signatures that name its request ID."""
    pre = (row.extra or {}).get("prefill") or {}
    text = f"{row.error or ''} {pre.get('error') or ''}"
    named = [s for s in sigs if row.rid in s.get("rids", ())]
    if row.ok and not pre.get("error") and pre.get("http_status", 200) == 200:
        return "ok"
    low = text.lower()
    if "out of memory" in low or any(s.get("exception", "").endswith("OutOfMemoryError") for s in named):
        return "OOM"
    if "bootstrap" in low and ("timed out" in low or "failed to get" in low or "bootstrap server" in low):
        return "bootstrap failure"
    if "transfer" in low or any(s["kind"] == "transfer" for s in named):
        return "transfer failure"
    if row.status == "timeout" or pre.get("error") == "timeout":
        return "timeout"
    code = row.http_status if row.http_status and row.http_status != 200 else pre.get("http_status")
    if code and code != 200:
        return f"HTTP {code}"
    return row.status if row.status != "ok" else "error"


def result_line(outcomes: list[str]) -> str:
    """'1/4 ok, 3/4 OOM': ok first, then the rest by count."""
    n = len(outcomes)
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o] = counts.get(o, 0) + 1
    order = sorted(counts, key=lambda k: (k != "ok", -counts[k], k))
    parts = [f"{counts[k]}/{n} {k}" for k in order]
    if "ok" not in counts:
        parts.insert(0, f"0/{n} ok")
    return ", ".join(parts)


def oom_units(sigs: list[dict]) -> set[str]:
    """The units ("host:unit") whose journal shows a CUDA OOM in the window."""
    return {w for s in sigs if s["kind"] == "exception" and s.get("exception", "").endswith("OutOfMemoryError")
            for w in s.get("where", ())}


def attribute_crash(outcomes: list[str], restarts: list[str], sigs: list[dict]) -> list[str]:
    """A real SGLang scheduler exits on a CUDA OOM and takes its requests with it: they end with a
    cut connection or a bare 5xx, not an OOM message. Where a unit of the pair restarted after an OOM
    in its journal, those unattributed failures are the OOM's."""
    if not set(restarts) & oom_units(sigs):
        return outcomes
    return ["OOM" if o in ("error", "aborted") or o.startswith("HTTP 5") else o for o in outcomes]


def mixed_reasons(outcomes: list[str], restarts: list[str], canary_retried: bool,
                  sigs: list[dict] = ()) -> list[str]:
    """Why a probe's window is not clean: a fault next to the new variable proves nothing about it.
    A restart after the unit's own OOM is the bundle's outcome, not a fault."""
    out = []
    for kind in ("transfer failure", "bootstrap failure"):
        n = outcomes.count(kind)
        if n:
            out.append(f"{n} request(s) ended in a {kind} (not an OOM of the bundle)")
    explained = oom_units(list(sigs))
    out += [f"{r} restarted during the window" for r in restarts if r not in explained]
    if canary_retried:
        out.append("the pair's canary failed once before it passed")
    return out


# ---------------------------------------------------------------- the plan

@dataclass
class ProbePlan:
    inv: Inventory
    probe_inv: Inventory  # the inventory with the bundle's flags on the probed instances
    state: object
    rev: object
    bundle: Bundle
    mode: str  # "spare" | "instances"
    pair: tuple[Instance, Instance]
    baseline: Placement
    workload: tuple[int, int]
    requests: int
    concurrency: int
    timeout_s: float
    keep: bool
    variables: list[dict]
    steps: list[Step] = field(default_factory=list)
    files: list = field(default_factory=list)  # the probed instances' files, rendered with the bundle

    @property
    def ids(self) -> list[str]:
        return [i.id for i in self.pair]

    def render(self) -> str:
        p, d = self.pair
        head = (f"plan: probe bundle {self.bundle.name!r} ({self.bundle.path}) on {self.inv.cluster} "
                f"(revision {self.rev.number}, {self.rev.topology}): {self.mode} pair {p.id} x {d.id}")
        lines = [head]
        n = len(self.variables)
        if n:
            lines.append(f"  changes {n} variable(s) against the baseline" + (" (multi-variable: it cannot prove "
                         "what any one of them does)" if n > 1 else "") + ":")
            lines += [f"    {v['flag']}: {v['baseline']} -> {v['candidate']}" for v in self.variables]
        else:
            lines.append("  changes no variable against the baseline: a control probe")
        i, o = self.workload
        lines.append(f"  {self.requests} request(s) of {i} input / {o} output tokens, {self.concurrency} at once, "
                     f"straight to the pair (never through the gateway, never retried), each within "
                     f"{self.timeout_s:g}s")
        if self.mode == "spare":
            lines.append(f"  {p.id} on {'/'.join(p.hosts)}, {d.id} on {'/'.join(d.hosts)}: free GPUs; never "
                         "registered; stopped and removed afterwards; the revision's instances are not touched")
        else:
            lines.append(f"  {p.id} and {d.id} leave the gateway for the probe (the rest serves); afterwards "
                         + ("they restart on the bundle, recorded as a new revision (--keep, only if every "
                            "request is ok)" if self.keep else "the revision's own files, recorded as a new "
                            "revision (same files, new processes)"))
        lines.append("  steps:")
        lines += [f"    {k:2d}. {s.line()}" for k, s in enumerate(self.steps, 1)]
        if self.mode == "spare":
            lines.append("  then, whatever the probe did:")
            back = restore_steps(self)
            lines += [f"    {k:2d}. {s.line()}" for k, s in enumerate(back, len(self.steps) + 1)]
        else:
            lines.append("  then, whatever the probe did, the change planner replaces "
                         f"{' and '.join(self.ids)}: drain (empty), verified stop, "
                         + ("the bundle's files if every request was ok, else " if self.keep else "")
                         + "the revision's files, start, canary with every pair, register, record a revision")
        lines.append("  nothing is ever called best: the outcome is a candidate's, for this workload, this window")
        return "\n".join(lines)


def _refuse_other_files(inv: Inventory, rev) -> None:
    from pdops.render import manifest, render_files

    now = manifest(render_files(inv, Placement.from_dict(rev.placement)))
    changes = [k for k in sorted(set(now) | set(rev.manifest)) if now.get(k) != rev.manifest.get(k)]
    if changes:
        raise Refused(f"the inventory on disk renders other files than revision {rev.number}: a probe against it "
                      "would change more than the bundle", evidence="\n".join(changes[:20]),
                      fix=f"`inv deploy --topology {rev.topology}` first, or restore the running revision's inventory")


def check_options(*, instances, spare: bool, requests, concurrency, keep: bool) -> int:
    """The operator's options, checked before anything is read (the record is over SSH); returns the
    concurrency."""
    if isinstance(requests, bool) or not isinstance(requests, int) or not 1 <= requests <= 64:
        raise InvalidInput("--requests", f"{requests!r} is not 1..64", fix="a few long requests: 4")
    conc = requests if concurrency is None else concurrency
    if isinstance(conc, bool) or not isinstance(conc, int) or not 1 <= conc <= requests:
        raise InvalidInput("--concurrency", f"{conc!r} is not 1..{requests}", fix="at most --requests")
    if bool(spare) == bool(instances):
        raise InvalidInput("--instances/--spare", "give exactly one of --instances p01,d01 and --spare",
                           fix="--spare starts a pair on free GPUs; --instances takes a serving pair out for the probe")
    if keep and spare:
        raise InvalidInput("--keep", "a spare pair is removed after its probe; there is nothing to keep",
                           fix="probe on --instances p01,d01 --keep to keep a bundle on that pair")
    if instances is not None and not re.fullmatch(r"[pd]\d{2,3}(,[pd]\d{2,3})*", str(instances).replace(" ", "")):
        raise InvalidInput("--instances", f"{instances!r} is not a list of instance ids", fix="e.g. --instances p01,d01")
    return conc


def plan_probe(inv: Inventory, state, bundle: Bundle, *, instances: str | None = None, spare: bool = False,
               requests: int = 4, concurrency: int | None = None, workload=None, keep: bool = False,
               timeout_s: float | None = None) -> ProbePlan:
    """The probe's plan, from the record only (pure apart from reading it)."""
    import dataclasses

    from pdops import scale as sc
    from pdops.deploy import canary_step, connect_step, delivery_steps, preflight_step, start_steps
    from pdops.drain import drain_steps
    from pdops.render import engine_args, manifest, render_files
    from pdops.scale import instance_files
    from pdops.topology import Topology

    conc = check_options(instances=instances, spare=spare, requests=requests, concurrency=concurrency, keep=keep)
    tmo = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    work = parse_workload(workload, inv.profile)
    rev = state.current_revision()
    if rev is None:
        raise Refused(f"{inv.cluster} has no current revision: nothing to probe against",
                      fix="deploy first (`inv deploy --topology 1p1d`)")
    cur_pl = Placement.from_dict(rev.placement)
    interval = float(inv.vars.get("pdops_empty_check_interval_s", 5))
    if spare:
        _refuse_other_files(inv, rev)
        target = Topology(len(cur_pl.role("prefill")) + 1, len(cur_pl.role("decode")) + 1)
        from pdops.placement import place_change

        try:
            grown = place_change(inv, target, cur_pl, avoid=frozenset(sc.cordoned_hosts(rev)),
                                 last_ports=(rev.extra or {}).get("last_bootstrap"))
        except PdopsError as exc:
            raise Refused(f"no free GPUs for a spare prefill x decode pair: {exc.message}",
                          fix="add a host, or probe on --instances p01,d01 (it leaves the gateway for the probe)") from None
        new = [i for i in grown.instances if i.id not in {c.id for c in cur_pl.instances}]
        p = next(i for i in new if i.role == "prefill")
        d = next(i for i in new if i.role == "decode")
        pair_pl = Placement(Topology(1, 1), (p, d))
    else:
        ids = [x.strip() for x in str(instances).split(",") if x.strip()]
        known = {i.id: i for i in cur_pl.instances}
        bad = [x for x in ids if x not in known]
        if bad or len(ids) != 2:
            raise InvalidInput("--instances", f"{instances!r}: " + (f"{', '.join(bad)} not in revision {rev.number}"
                               if bad else "name one prefill and one decode"),
                               fix=f"a pair of revision {rev.number}: {', '.join(known)}")
        roles = sorted(known[x].role for x in ids)
        if roles != ["decode", "prefill"]:
            raise InvalidInput("--instances", f"{instances!r} is not one prefill and one decode",
                               fix="e.g. --instances p01,d01")
        p = next(known[x] for x in ids if known[x].role == "prefill")
        d = next(known[x] for x in ids if known[x].role == "decode")
        for x in (p, d):
            if len(cur_pl.role(x.role)) < 2:
                raise Refused(f"{x.id} is the last serving {x.role} instance: probing it leaves no {x.role} "
                              "for the time of the probe",
                              fix="--spare starts a pair on free GPUs instead (add a host if there is none)")
        _refuse_other_files(inv, rev)
        pair_pl = Placement(Topology(1, 1), (p, d))
    overrides = {p.id: bundle.flags, d.id: bundle.flags}
    probe_inv = dataclasses.replace(inv, engine_overrides=overrides)
    full_pl = Placement(cur_pl.topology, cur_pl.instances + ((p, d) if spare else ()))
    mf_files = render_files(probe_inv, full_pl)
    mf = manifest(mf_files)
    own = set(instance_files(mf, p.id)) | set(instance_files(mf, d.id))
    # a spare on a host the revision does not use also needs that host's shared files (the slice)
    had = {(h, path) for h, fs in rev.manifest.items() for path in fs}
    hosts_of_pair = {r.host for i in (p, d) for r in i.ranks}
    own |= {(f.host, f.path) for f in mf_files if f.host in hosts_of_pair and (f.host, f.path) not in had}
    files = [f for f in mf_files if (f.host, f.path) in own]
    base_args = engine_args(inv, full_pl, p, p.ranks[0])
    variables = changed_variables(base_args, bundle)
    hosts = sorted({r.host for i in cur_pl.instances + (p, d) for r in i.ranks} | {inv.gateway.host})
    steps = [connect_step(hosts)]
    if spare:
        steps.append(preflight_step(set(), pair_pl, cur_pl))
    else:
        for x in (p, d):
            wid = (rev.instances.get(x.id) or {}).get("worker_id")
            subs = drain_steps(inv, x, wid, wait_s=float(inv.drain_budget_s), interval_s=interval,
                               prefix=f"probe-out {x.id}: ", in_change=True)
            steps += subs
    steps += delivery_steps(probe_inv, pair_pl, files, {"probe": bundle.name, "from": rev.number})
    steps[-1].description += f" (only {p.id}'s and {d.id}'s files, with the bundle's flags)"
    steps += start_steps(probe_inv, [p, d], restart=False, group="probe-start")
    steps.append(canary_step("probe-canary", [(p.id, d.id)], retry_once=True, kind="probe-canary",
                             why="before the long requests: a pair that cannot serve a short one proves nothing"))
    i_tok, o_tok = work
    steps.append(Step("probe-requests", None, f"{requests} request(s) of {i_tok}/{o_tok} tokens straight to {p.id} x "
                      f"{d.id} ({conc} at once), each row in the ledger; then each rank's journal of the window: "
                      "outcomes and failure signatures", tmo + 120, kind="probe-requests",
                      params={"pair": [p.id, d.id]}))
    plan = ProbePlan(inv, probe_inv, state, rev, bundle, "spare" if spare else "instances", (p, d), cur_pl, work,
                     requests, conc, tmo, keep, variables, steps, files)
    return plan


def restore_steps(plan: ProbePlan) -> list[Step]:
    """After a spare pair's probe: the pair's verified stop, its files removed, the revision verified."""
    from pdops.drain import drain_steps

    inv = plan.inv
    out = []
    for x in plan.pair:
        out += drain_steps(inv, x, None, wait_s=float(inv.drain_budget_s), interval_s=0, gateway=False,
                           prefix=f"probe-remove {x.id}: ", resume=False)
    out.append(Step("probe-remove-files", None, f"remove {', '.join(plan.ids)}'s units, launch scripts and env files "
                    "(Ansible); daemon-reload", 300, kind="probe-remove-files"))
    out.append(Step("probe-verify-baseline", None, f"every unit of revision {plan.rev.number} active and its MainPID "
                    "the recorded one, started from the revision's files; the spare pair's units gone", 60,
                    kind="probe-verify-baseline", verifies="the baseline runs as recorded"))
    return out


def change_after(plan: ProbePlan, keep: bool):
    """The instances mode's way back (or forward, `keep`): the change planner's replacement of the
    pair, a new revision."""
    from pdops import scale as sc

    why = (f"keep probe bundle {plan.bundle.name!r}" if keep
           else f"restore the baseline after probing bundle {plan.bundle.name!r}")
    inv = plan.probe_inv if keep else plan.inv
    ch = sc.plan_change(inv, plan.rev, plan.baseline, replace_ids={i: why for i in plan.ids}, max_unavailable=1,
                        force=True)
    if sorted(i.id for i in ch.replaced) != sorted(plan.ids) or ch.added or ch.removed or ch.gateway_restart:
        raise Refused(f"the way back from the probe would change more than {', '.join(plan.ids)}",
                      evidence=ch.render())
    for st in ch.run:
        st.name = ("keep: " if keep else "restore: ") + st.name
    return ch


# ---------------------------------------------------------------- doing

def _journal_command(unit: str, since: float) -> str:
    from pdops.facts import q

    return f"journalctl -u {q(unit)} --since @{int(since)} -o cat --no-pager"


def do_probe_requests(ctx: RunContext, step: Step) -> Outcome:
    from pdops.load import send_pair
    from pdops.sim.tokens import make_prompt

    plan: ProbePlan = ctx.data["probe_plan"]
    p, d = plan.pair
    pool = ctx.pool
    units = [(h, u) for x in plan.pair for h, u in x.units]
    before = {f"{h}:{u}": pool.unit_states(h, [u])[u].main_pid for h, u in units}
    t0 = time.time()
    i_tok, o_tok = plan.workload
    ctx.say(f"  probe: {plan.requests} request(s) of {i_tok}/{o_tok} tokens to {p.id} x {d.id} ...")
    rows = send_pair(p.url, d.url, p.head.data_addr, p.bootstrap_port, requests=plan.requests,
                     concurrency=plan.concurrency, prompt_for=lambda k: make_prompt(i_tok, 7919 * (k + 1)),
                     max_new_tokens=o_tok, timeout=plan.timeout_s, rid_prefix=f"pdops-probe-{ctx.op[-8:]}")
    groups, read_errors = [], []
    for h, u in units:
        try:
            text = pool.run(h, _journal_command(u, t0 - 1), timeout=60).stdout
        except PdopsError as exc:
            read_errors.append(f"{h}:{u}: {exc.message}")
            continue
        groups.append(signatures(text, f"{h}:{u}"))
    sigs = merge_signatures(groups)
    after = {f"{h}:{u}": pool.unit_states(h, [u])[u].main_pid for h, u in units}
    restarts = [k for k in before if after.get(k) != before[k]]
    outcomes = attribute_crash([classify(r, sigs) for r in rows], restarts, sigs)
    canary_retried = bool(((ctx.data.get("canary_evidence") or {}).get("first_attempt_failed")))
    doc = {"outcomes": [{"rid": r.rid, "outcome": o, "status": r.status, "http_status": r.http_status,
                         "prefill": (r.extra or {}).get("prefill"), "error": (r.error or "")[:300],
                         "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                         "seconds": round((r.end or t0) - r.start, 2)} for r, o in zip(rows, outcomes)],
           "result": result_line(outcomes), "signatures": sigs, "restarts": restarts,
           "mixed_reasons": mixed_reasons(outcomes, restarts, canary_retried, sigs), "window": [t0, time.time()],
           "journal_unread": read_errors}
    ctx.data["probe_result"] = doc
    ctx.say(f"  probe result: {doc['result']}" + (f"; mixed: {'; '.join(doc['mixed_reasons'])}"
                                                  if doc["mixed_reasons"] else ""))
    verified = [f"{len(rows)} request(s) answered or ended, each in the ledger: {doc['result']}",
                f"failure signatures read from {len(groups)} rank journal(s): {len(sigs)}"]
    return Outcome(evidence=doc, verified=verified,
                   unverified=[f"journal not read: {e}" for e in read_errors])


def do_probe_remove_files(ctx: RunContext, step: Step) -> Outcome:
    from pdops.deploy import deliver

    plan: ProbePlan = ctx.data["probe_plan"]
    remove: dict[str, list[str]] = {}
    for f in plan.files:
        remove.setdefault(f.host, []).append(f.path)
    ev = deliver(ctx.inv, plan.baseline, [], ctx.data["build"], remove, ctx.say)
    return Outcome(evidence=ev, verified=[f"{', '.join(plan.ids)}'s files removed ({sum(map(len, remove.values()))})"])


def do_probe_verify_baseline(ctx: RunContext, step: Step) -> Outcome:
    from pdops.deploy import running_evidence
    from pdops.render import files_of

    plan: ProbePlan = ctx.data["probe_plan"]
    snap = ctx.state.revision_snapshot(plan.rev.number)
    if snap is not None:
        files = files_of(snap)
    else:  # checked at plan time: the inventory renders the revision's files
        from pdops.render import render_files

        files = render_files(plan.inv, plan.baseline)
    ev = running_evidence(ctx.pool, ctx.inv, plan.baseline, files)
    moved = []
    for i in plan.baseline.instances:
        rec = (plan.rev.instances.get(i.id) or {}).get("main_pids") or {}
        for k, pid in rec.items():
            now = (ev.get(k) or {}).get("main_pid")
            if now is not None and pid and int(now) != int(pid):
                moved.append(f"{k} MainPID {now}, recorded {pid}")
    left = []
    for x in plan.pair:
        for h, u in x.units:
            st = ctx.pool.unit_states(h, [u])[u]
            if st.active_state not in ("inactive", "failed") or st.load_state not in ("not-found", "masked", ""):
                if st.active_state == "active" or st.load_state == "loaded":
                    left.append(f"{h}:{u} is {st.load_state}/{st.active_state}")
    if moved or left:
        raise Unverified("the baseline is not as recorded after the probe: " + "; ".join(moved + left),
                         fix="`inv status` shows what runs; `inv repair` or `inv stop` what differs")
    return Outcome(evidence={"units": ev},
                   verified=[f"revision {plan.rev.number}: {len(ev)} unit(s) active with their recorded MainPIDs and "
                             "the revision's files; the spare pair's units gone"])


def do_probe_canary(ctx: RunContext, step: Step) -> Outcome:
    """The deploy canary through the probed pair; its evidence kept for the result table."""
    out = do_canary(ctx, step)
    ctx.data["canary_evidence"] = out.evidence
    return out


# the kinds made here; a probe also walks deploy's, drain's and a change's kinds (scale, imported above)
register_executors({"probe-canary": do_probe_canary, "probe-requests": do_probe_requests,
          "probe-remove-files": do_probe_remove_files, "probe-verify-baseline": do_probe_verify_baseline})


def next_probe_id(journal) -> str:
    n = sum(1 for r in journal.records() if r.get("step") == "probe-result")
    return f"T{n + 1}"


def execute_probe(plan: ProbePlan, say=print, *, pool, gateway) -> dict:
    """Carry out a probe under the cluster lock; the probe-result record (also in the journal).
    The way back always runs, whether the probe's own steps passed or not."""
    from pdops import scale as sc
    from pdops.state import default_operator

    state = plan.state
    op = new_op_id("probe")
    p, d = plan.pair
    with state.lock("probe", op_id=op):
        state.check_basis(plan.rev.number)
        j = state.journal()
        pid = next_probe_id(j)
        say(f"probe {pid}: bundle {plan.bundle.name!r}, {len(plan.variables)} variable(s) changed")
        union = Placement(plan.baseline.topology, plan.baseline.instances + ((p, d) if plan.mode == "spare" else ()))
        ctx = RunContext(plan.probe_inv, state, op, say, pool, gateway,
                         {"placement": union, "old_placement": plan.baseline, "probe_plan": plan,
                          "target": union})
        j.step(op, "plan", "ok", {"operation": "probe", "probe": pid, "bundle": plan.bundle.as_dict(),
                                  "mode": plan.mode, "pair": plan.ids, "steps": [s.name for s in plan.steps]})
        failure: PdopsError | None = None
        interrupted = False
        proven: dict = {"verified": [], "unverified": []}
        try:
            v0 = run_steps(plan.steps, ctx)
            proven["verified"] += v0["verified"]
            proven["unverified"] += v0["unverified"]
        except PdopsError as exc:
            failure = exc
            say(f"probe {pid}: stopped at a step: {exc.message}")
        except KeyboardInterrupt:  # the way back still runs: a candidate is never left behind
            interrupted = True
            failure = PdopsError("interrupted by the operator")
            say(f"probe {pid}: interrupted; the requests in flight are abandoned (never sent again); "
                "taking the pair back now")
        result = ctx.data.get("probe_result")
        all_ok = bool(result) and all(o["outcome"] == "ok" for o in result["outcomes"]) and not result["mixed_reasons"]
        keep = plan.keep and all_ok and failure is None
        after: dict = {}
        back_error: PdopsError | None = None
        try:
            if plan.mode == "spare":
                ctx.inv = plan.inv
                v1 = run_steps(restore_steps(plan), ctx)
                proven["verified"] += v1["verified"]
                proven["unverified"] += v1["unverified"]
                after = {"restored": True, "how": "spare pair stopped and removed; the revision verified untouched"}
            else:
                if plan.keep and not keep:
                    say(f"probe {pid}: --keep not applied: not every request was ok (or the window was mixed); "
                        "restoring the baseline")
                ch = change_after(plan, keep)
                v = sc.walk_scale(ch, state, op, say, pool=pool, gateway=gateway)
                proven["verified"] += v.get("verified", [])
                proven["unverified"] += v.get("unverified", [])
                after = {"restored": not keep, "kept": keep, "revision": v.get("revision"),
                         "how": "kept as a new revision" if keep else "the revision's files, as a new revision"}
        except PdopsError as exc:
            back_error = exc
            after = {"restored": False, "error": exc.message}
        doc = {"probe": pid, "op": op, "when": now_iso(), "operator": default_operator(),
               "revision": plan.rev.number, "bundle": plan.bundle.as_dict(), "mode": plan.mode, "pair": plan.ids,
               "workload": {"input_tokens": plan.workload[0], "output_tokens": plan.workload[1]},
               "requests": plan.requests, "concurrency": plan.concurrency,
               "variables": plan.variables, "n_variables": len(plan.variables),
               "multi_variable": len(plan.variables) > 1,
               "result": (result or {}).get("result") or f"not run: {failure.message if failure else 'unknown'}",
               "outcomes": (result or {}).get("outcomes", []), "signatures": (result or {}).get("signatures", []),
               "mixed": bool((result or {}).get("mixed_reasons")) or (failure is not None and result is None),
               "mixed_reasons": (result or {}).get("mixed_reasons", []) +
               ([f"the probe stopped before its requests: {failure.message}"] if failure and result is None else []),
               "after": after, "verified": proven["verified"], "unverified": proven["unverified"]}
        j.step(op, "probe-result", "ok" if back_error is None else "failed", doc)
        if interrupted and back_error is None:
            raise KeyboardInterrupt
        if back_error is not None:
            back_error.message = (f"probe {pid} ({doc['result']}): the way back did not complete: "
                                  f"{back_error.message}")
            raise back_error
        return doc


# ---------------------------------------------------------------- the table

def probe_table(journal) -> list[dict]:
    """Every probe of the cluster, in order, with the notes operators added (latest last)."""
    rows, notes = [], {}
    for r in journal.records():
        if r.get("step") == "probe-result":
            rows.append(dict(r.get("evidence") or {}))
        elif r.get("step") == "probe-note":
            ev = r.get("evidence") or {}
            notes.setdefault(ev.get("probe"), []).append({"note": ev.get("note"), "by": ev.get("operator"),
                                                          "when": r.get("ts")})
    for row in rows:
        row["notes"] = notes.get(row.get("probe"), [])
    return rows


def signature_line(row: dict) -> str:
    parts = []
    for s in row.get("signatures") or []:
        if s["kind"] == "exception":
            a = f" {s['alloc_gib']:.2f} GiB" if s.get("alloc_gib") is not None else ""
            top = s["top_frames"][0].split(" ", 1)[-1] if s.get("top_frames") else "?"
            parts.append(f"{s['exception'].rsplit('.', 1)[-1]}{a} in {top} (x{s['count']})")
        else:
            parts.append(f"transfer: {s['line'][:60]} (x{s['count']})")
    return "; ".join(parts) or "-"


def variables_line(row: dict) -> str:
    vs = row.get("variables") or []
    if not vs:
        return "none (control)"
    text = ", ".join(f"{v['flag'].lstrip('-')} {v['candidate']}" for v in vs)
    return f"{len(vs)}: {text}" + (" [multi-variable]" if len(vs) > 1 else "")


def render_table(rows: list[dict]) -> str:
    if not rows:
        return "no probes recorded for this cluster (`inv probe --bundle FILE --spare`)"
    out = ["probe  variables changed against the baseline            result                     signature  |  reading"]
    for r in rows:
        mark = " [mixed]" if r.get("mixed") else ""
        reading = r["notes"][-1]["note"] if r.get("notes") else "(no reading yet: inv probe --note " \
            f"{r.get('probe')} --reading \"...\")"
        out.append(f"{r.get('probe'):<6} {variables_line(r):<48} {r.get('result', '')}{mark:<8}  "
                   f"{signature_line(r)}  |  {reading}")
    out.append("a bundle that works is a candidate for this workload, not a best practice; a multi-variable or mixed "
               "probe proves nothing about one variable")
    return "\n".join(out)


CSV_FIELDS = ("probe", "when", "operator", "revision", "bundle", "mode", "pair", "workload", "variables",
              "n_variables", "multi_variable", "result", "mixed", "mixed_reasons", "signature", "reading")


def table_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    w.writeheader()
    for r in rows:
        w.writerow({"probe": r.get("probe"), "when": r.get("when"), "operator": r.get("operator"),
                    "revision": r.get("revision"), "bundle": (r.get("bundle") or {}).get("name"),
                    "mode": r.get("mode"), "pair": " ".join(r.get("pair") or []),
                    "workload": f"{(r.get('workload') or {}).get('input_tokens')}/"
                                f"{(r.get('workload') or {}).get('output_tokens')}",
                    "variables": "; ".join(f"{v['flag']} {v['baseline']}->{v['candidate']}"
                                           for v in r.get("variables") or []),
                    "n_variables": r.get("n_variables"), "multi_variable": r.get("multi_variable"),
                    "result": r.get("result"), "mixed": r.get("mixed"),
                    "mixed_reasons": "; ".join(r.get("mixed_reasons") or []), "signature": signature_line(r),
                    "reading": r["notes"][-1]["note"] if r.get("notes") else ""})
    return buf.getvalue()


def check_note(probe_id, note) -> tuple[str, str]:
    """The probe id and the reading, checked before anything is read or written."""
    pid = str(probe_id or "").strip()
    if not re.fullmatch(r"T\d+", pid):
        raise InvalidInput("--note", f"{probe_id!r} is not a probe id", fix="e.g. --note T3 --reading \"...\"")
    text = str(note or "").strip()
    if not text:
        raise InvalidInput("--reading", "the reading is empty", fix=f"inv probe --note {pid} --reading \"what you read in it\"")
    if len(text) > 2000:
        raise InvalidInput("--reading", "the reading is over 2000 characters", fix="shorten it")
    return pid, text


def add_note(state, probe_id: str, note: str) -> dict:
    """An operator's reading of a probe, appended to the journal under the lock."""
    from pdops.state import default_operator

    pid, text = check_note(probe_id, note)
    known = {r.get("probe") for r in probe_table(state.journal())}
    if pid not in known:
        raise InvalidInput("--note", f"no probe {pid} in this cluster's table",
                           fix=f"one of: {', '.join(sorted(known, key=lambda x: int(x[1:]))) or 'none yet'}")
    op = new_op_id("probe-note")
    with state.lock("probe-note", op_id=op):
        rec = state.journal().step(op, "probe-note", "ok", {"probe": pid, "note": text, "operator": default_operator()})
    return rec
