"""The probe table: every probe of the cluster from its journal, with the notes operators added."""

from __future__ import annotations

import csv
import io
import re

from pdops.errors import InvalidInput
from pdops.record.local import default_operator, new_op_id


# ---------------------------------------------------------------- the table

def probe_table(journal) -> list[dict]:
    """Every probe of the cluster, in order, with the notes operators added (latest last)."""
    rows = [dict(r.get("evidence") or {}) for r in journal.tagged("step:probe-result")]
    notes: dict = {}
    for r in journal.tagged("step:probe-note"):
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


def add_note(record, probe_id: str, note: str) -> dict:
    """An operator's reading of a probe, appended to the journal under the lock."""
    pid, text = check_note(probe_id, note)
    known = {r.get("probe") for r in probe_table(record.journal())}
    if pid not in known:
        raise InvalidInput("--note", f"no probe {pid} in this cluster's table",
                           fix=f"one of: {', '.join(sorted(known, key=lambda x: int(x[1:]))) or 'none yet'}")
    op = new_op_id("probe-note")
    with record.lock("probe-note", op_id=op):
        rec = record.journal().step(op, "probe-note", "ok", {"probe": pid, "note": text, "operator": default_operator()})
    return rec
