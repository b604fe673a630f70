"""A bench's workload: parsed and checked before anything runs."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pdops.errors import InvalidInput


_WORKLOAD = re.compile(r"^\s*(\d+)\s*([kK]?)\s*/\s*(\d+)\s*([kK]?)\s*$")


_WORKLOAD_FIX = ("write it as <input tokens>/<output tokens>, e.g. 160k/1300, 80K/600 or 2000/64 "
                 "(k = 1,000 tokens)")


MAX_TOKENS = 10_000_000


@dataclass(frozen=True)
class Workload:
    """A synthetic workload: every request has `input_tokens` in and `output_tokens` out."""

    input_tokens: int
    output_tokens: int

    def __str__(self) -> str:
        def short(n: int) -> str:
            return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)

        return f"{short(self.input_tokens)}/{short(self.output_tokens)}"


def parse_workload(spec: object, field_name: str = "--workload") -> Workload:
    """Parse `160k/1300` (k = 1,000, any case) into a Workload; junk raises InvalidInput."""
    if spec is None or not str(spec).strip():
        raise InvalidInput(field_name, "missing", fix=_WORKLOAD_FIX)
    m = _WORKLOAD.match(str(spec))
    if not m:
        raise InvalidInput(field_name, f"{spec!r} is not a workload", fix=_WORKLOAD_FIX)
    inp = int(m.group(1)) * (1000 if m.group(2) else 1)
    out = int(m.group(3)) * (1000 if m.group(4) else 1)
    for what, n in (("input", inp), ("output", out)):
        if n < 1:
            raise InvalidInput(field_name, f"{spec!r} asks for {n} {what} tokens", fix="both lengths must be at least 1 token, e.g. 160k/1300")
        if n > MAX_TOKENS:
            raise InvalidInput(field_name, f"{spec!r} asks for {n:,} {what} tokens, beyond any context length",
                               fix=_WORKLOAD_FIX)
    return Workload(inp, out)


def parse_positive_int(value: object, field_name: str, what: str = "value") -> int:
    """A whole number >= 1 (from int or str); InvalidInput otherwise."""
    if isinstance(value, bool):
        raise InvalidInput(field_name, f"{value!r} is not a whole number", fix=f"give the {what} as a whole number >= 1")
    try:
        n = int(str(value).strip())
    except (TypeError, ValueError):
        raise InvalidInput(field_name, f"{value!r} is not a whole number", fix=f"give the {what} as a whole number >= 1") from None
    if n < 1:
        raise InvalidInput(field_name, f"{what} must be at least 1, got {n}", fix=f"give the {what} as a whole number >= 1")
    return n


def parse_concurrency(value: object, field_name: str = "--concurrency") -> int:
    """Concurrent requests in flight: a whole number >= 1."""
    return parse_positive_int(value, field_name, "concurrency")


def stop_condition(requests: object, duration: object) -> tuple[int | None, float | None]:
    if (requests is None) == (duration is None):
        raise InvalidInput("--requests/--duration", "give exactly one of them",
                           fix="--requests N sends N requests; --duration S sends for S seconds")
    if requests is not None:
        return parse_positive_int(requests, "--requests", "number of requests"), None
    try:
        d = float(duration)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidInput("--duration", f"{duration!r} is not a number of seconds", fix="e.g. --duration 300") from None
    if not d > 0 or math.isinf(d):
        raise InvalidInput("--duration", f"{duration!r} must be a positive number of seconds", fix="e.g. --duration 300")
    return None, d
