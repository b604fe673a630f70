"""The figures of a run, from its ledger rows only: TPM, TTFT, TPOT, ITL percentiles, failures."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Iterable, Mapping, Sequence


def _get(row: object, name: str):
    return row.get(name) if isinstance(row, Mapping) else getattr(row, name, None)


def _ok(row: object) -> bool:
    ok = _get(row, "ok")
    if ok is None:
        return _get(row, "status") == "ok"
    return bool(ok)


def wall_clock(rows: Sequence) -> float:
    """Seconds from the first request's start to the last request's end (every request sent)."""
    starts = [_get(r, "start") for r in rows if _get(r, "start") is not None]
    ends = [_get(r, "end") for r in rows if _get(r, "end") is not None]
    if not starts or not ends:
        return 0.0
    return max(ends) - min(starts)


def _check_wall(wall_s: float) -> None:
    if not wall_s or wall_s <= 0:
        raise ValueError(f"wall clock must be positive, got {wall_s!r}")


def success_count(rows: Sequence) -> tuple[int, int]:
    """(successful requests, requests sent)."""
    return sum(1 for r in rows if _ok(r)), len(rows)


def total_tpm(rows: Sequence, wall_s: float) -> float:
    """60 x (prompt + completion tokens of successful requests) / wall clock in seconds."""
    _check_wall(wall_s)
    tokens = sum((_get(r, "prompt_tokens") or 0) + (_get(r, "completion_tokens") or 0) for r in rows if _ok(r))
    return 60.0 * tokens / wall_s


def output_tpm(rows: Sequence, wall_s: float) -> float:
    """60 x (completion tokens of successful requests) / wall clock in seconds."""
    _check_wall(wall_s)
    return 60.0 * sum((_get(r, "completion_tokens") or 0) for r in rows if _ok(r)) / wall_s


def tpm_per_gpu(tpm: float, gpus: int) -> float:
    """A TPM figure divided by the GPUs of the topology that produced it."""
    if not gpus or gpus < 1:
        raise ValueError(f"GPU count must be at least 1, got {gpus!r}")
    return tpm / gpus


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear interpolation between order statistics
    (numpy's default, which SGLang's bench_serving uses). None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in 0..100, got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ttfts(rows: Sequence) -> list[float]:
    """Time to first token of each successful request, seconds."""
    return [_get(r, "first_token") - _get(r, "start") for r in rows
            if _ok(r) and _get(r, "first_token") is not None and _get(r, "start") is not None]


def tpots(rows: Sequence) -> list[float]:
    """Time per output token after the first, per successful request with >1 token, seconds."""
    out = []
    for r in rows:
        n = _get(r, "completion_tokens") or 0
        if _ok(r) and n > 1 and _get(r, "first_token") is not None and _get(r, "end") is not None:
            out.append((_get(r, "end") - _get(r, "first_token")) / (n - 1))
    return out


def itls(rows: Sequence) -> list[float]:
    """Gaps between consecutive stream chunks of every successful request, seconds."""
    out: list[float] = []
    for r in rows:
        if _ok(r):
            out.extend(_get(r, "itl") or ())
    return out


def failure_counts(rows: Sequence) -> dict[str, int]:
    """{status: count} of every request that did not succeed (http_503, timeout, aborted, error...)."""
    out: dict[str, int] = {}
    for r in rows:
        if not _ok(r):
            s = str(_get(r, "status") or "unknown")
            out[s] = out.get(s, 0) + 1
    return dict(sorted(out.items()))


def describe_failures(counts: Mapping[str, int]) -> str:
    """`HTTP 503 x3, timeout x1` from failure counts."""
    parts = []
    for status, n in counts.items():
        label = f"HTTP {status[5:]}" if status.startswith("http_") else status
        parts.append(f"{label} x{n}")
    return ", ".join(parts)


@dataclass
class Figures:
    """The figures of one run, all computed from its ledger by the functions above."""

    sent: int
    ok: int
    failures: dict
    wall_s: float
    total_tpm: float | None
    output_tpm: float | None
    gpus: int | None
    tpm_per_gpu: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    invalid: str | None = None

    @property
    def failed_requests(self) -> int:
        return self.sent - self.ok

    @property
    def any_failure(self) -> bool:
        return self.ok < self.sent

    @property
    def mark(self) -> str:
        """Empty for a clean run; otherwise what every table must show next to its figures."""
        marks = []
        if self.invalid:
            marks.append(f"INVALID: {self.invalid}")
        if self.any_failure:
            marks.append(f"FAILURES {self.failed_requests}/{self.sent}: {describe_failures(self.failures)}")
        return "; ".join(marks)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mark"] = self.mark
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "Figures":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def compute_figures(rows: Sequence, *, gpus: int | None = None, wall_s: float | None = None,
                    invalid: str | None = None) -> Figures:
    """Every figure of a run from its ledger rows (wall clock from the ledger unless given)."""
    ok, sent = success_count(rows)
    wall = wall_clock(rows) if wall_s is None else wall_s
    tot = total_tpm(rows, wall) if wall > 0 else None
    out = output_tpm(rows, wall) if wall > 0 else None
    tt, tp, il = ttfts(rows), tpots(rows), itls(rows)
    return Figures(
        sent=sent, ok=ok, failures=failure_counts(rows), wall_s=wall, total_tpm=tot, output_tpm=out, gpus=gpus,
        tpm_per_gpu=tpm_per_gpu(tot, gpus) if (tot is not None and gpus) else None,
        ttft_p50=percentile(tt, 50), ttft_p99=percentile(tt, 99),
        tpot_p50=percentile(tp, 50), tpot_p99=percentile(tp, 99),
        itl_p50=percentile(il, 50), itl_p99=percentile(il, 99), invalid=invalid,
    )


def fmt_int(x: float | None) -> str:
    return "N/A" if x is None else f"{x:,.0f}"


def fmt_s(x: float | None) -> str:
    if x is None:
        return "N/A"
    return f"{x:.2f} s" if x >= 1 else f"{x * 1000:.1f} ms"


def text_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in body)])


def format_table(entries: Sequence[tuple[str, Figures]]) -> str:
    """One line per run: label, success, TPMs, TPM/GPU, TTFT/TPOT/ITL p50 and p99, and its mark."""
    header = ("run", "ok/sent", "total TPM", "output TPM", "TPM/GPU", "TTFT p50", "TTFT p99",
              "TPOT p50", "TPOT p99", "ITL p50", "ITL p99", "wall", "note")
    body = []
    for label, f in entries:
        body.append((label, f"{f.ok}/{f.sent}", fmt_int(f.total_tpm), fmt_int(f.output_tpm), fmt_int(f.tpm_per_gpu),
                     fmt_s(f.ttft_p50), fmt_s(f.ttft_p99), fmt_s(f.tpot_p50), fmt_s(f.tpot_p99),
                     fmt_s(f.itl_p50), fmt_s(f.itl_p99), fmt_s(f.wall_s), f.mark or "all ok"))
    return text_table(header, body)
