"""What a probe request ended as (ok, OOM, transfer or bootstrap failure, timeout, HTTP status) and
the failure signatures harvested from every rank's journal (exception, top frames, allocation
size, transfer error line)."""

from __future__ import annotations

import re
from pathlib import Path


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
