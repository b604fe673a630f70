"""Topology specs: `8p4d` strings (case-insensitive) or an explicit YAML form."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from pdops.errors import InvalidInput

_SPEC = re.compile(r"^\s*(\d+)\s*p\s*(\d+)\s*d\s*$", re.IGNORECASE)
_FIX = "write it as <prefills>p<decodes>d, e.g. 8p4d, or a YAML file with `prefill: 8` and `decode: 4`"


@dataclass(frozen=True, order=True)
class Topology:
    prefill: int
    decode: int

    def __str__(self) -> str:
        return f"{self.prefill}p{self.decode}d"

    def count(self, role: str) -> int:
        return self.prefill if role == "prefill" else self.decode


def _counts(prefill: object, decode: object, where: str) -> Topology:
    for role, n in (("prefill", prefill), ("decode", decode)):
        if isinstance(n, bool) or not isinstance(n, int):
            raise InvalidInput(f"{where}.{role}", f"{n!r} is not a whole number", fix=_FIX)
        if n < 1:
            raise InvalidInput(f"{where}.{role}", f"needs at least one {role} instance, got {n}",
                               fix="a PD topology needs at least 1 prefill and 1 decode (e.g. 1p1d)")
        if n > 999:
            raise InvalidInput(f"{where}.{role}", f"{n} {role} instances is beyond any fleet", fix=_FIX)
    return Topology(prefill, decode)  # type: ignore[arg-type]


def parse_topology(spec: str) -> Topology:
    """Parse `8p4d` (any case) or a path to a YAML file `{prefill: 8, decode: 4}`."""
    if spec is None or not str(spec).strip():
        raise InvalidInput("--topology", "missing", fix=_FIX)
    spec = str(spec)
    if spec.endswith((".yml", ".yaml")):
        path = Path(spec)
        try:
            doc = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise InvalidInput("--topology", f"cannot read {spec}: {exc.strerror}", fix=_FIX) from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark else ""
            raise InvalidInput("--topology", f"YAML syntax error in {spec}{at}", fix="fix the YAML and retry") from None
        if not isinstance(doc, dict) or set(doc) - {"prefill", "decode"} or not {"prefill", "decode"} <= set(doc):
            raise InvalidInput(spec, "must hold exactly `prefill: N` and `decode: M`", fix=_FIX)
        return _counts(doc["prefill"], doc["decode"], spec)
    m = _SPEC.match(spec)
    if not m:
        raise InvalidInput("--topology", f"{spec!r} is not a topology", fix=_FIX)
    return _counts(int(m.group(1)), int(m.group(2)), "--topology")
