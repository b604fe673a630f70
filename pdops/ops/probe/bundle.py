"""A probe's candidate bundle: read and checked before any connection (its flags through SGLang's
own parser; the flags pdops renders refused), its workload, and what it changes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from pdops.errors import InvalidInput
from pdops.model.generation import sglang_parser
from pdops.model.sglang_flags import FLAGS

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
    return {row[0]: row for row in FLAGS}


def check_flags(flags: dict, where: str) -> tuple[tuple[str, object], ...]:
    """Each flag against SGLang 0.5.23's own flag table (its names, types, choices): an unknown
    name, an abbreviation, a flag pdops owns, or a value the table rejects is InvalidInput."""
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
    parser = sglang_parser(prog="pdops probe bundle")
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
