"""SGLang's structured request log (`--log-requests --log-requests-format json`), read from
the unit's journal: which request IDs an engine received and which it finished.

SGLang 0.5.23 (srt/utils/request_logger.py, log_json) logs one JSON object per line:
`{"timestamp": ..., "event": "request.received", "rid": ...}` and
`{"event": "request.finished", "rid": ..., "out": {"meta_info": {"finish_reason": ...}}}`.
Lines that are not such objects (other log output) are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pdops.facts import q


def command(unit: str, invocation_id: str | None = None) -> str:
    """The unit's journal for its current invocation, message text only."""
    match = f" _SYSTEMD_INVOCATION_ID={q(invocation_id)}" if invocation_id else ""
    return f"journalctl -u {q(unit)}{match} -o cat --no-pager"


@dataclass
class RequestLog:
    received: dict[str, str] = field(default_factory=dict)  # rid -> timestamp
    finished: dict[str, str] = field(default_factory=dict)  # rid -> finish reason type

    @property
    def open(self) -> list[str]:
        """Request IDs received and not (yet) finished, in arrival order."""
        return [rid for rid in self.received if rid not in self.finished]


def parse(output: str) -> RequestLog:
    log = RequestLog()
    for line in output.splitlines():
        start = line.find("{")
        if start < 0 or '"event"' not in line:
            continue
        try:
            doc = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if not isinstance(doc, dict):
            continue
        rid, event = doc.get("rid"), doc.get("event")
        if isinstance(rid, list):  # batch requests log a list of rids
            rids = [str(r) for r in rid]
        elif rid is None:
            continue
        else:
            rids = [str(rid)]
        for r in rids:
            if event == "request.received":
                log.received.setdefault(r, str(doc.get("timestamp", "")))
            elif event == "request.finished":
                fr = ((doc.get("out") or {}).get("meta_info") or {}).get("finish_reason")
                log.finished[r] = (fr.get("type") if isinstance(fr, dict) else str(fr)) if fr else "unknown"
    return log
