"""SGLang's structured request log (`--log-requests --log-requests-format json`), read from
the unit's journal: which request IDs an engine received and which it finished.

SGLang 0.5.23 (srt/utils/request_logger.py, log_json) logs one JSON object per line:
`{"timestamp": ..., "event": "request.received", "rid": ...}` and
`{"event": "request.finished", "rid": ..., "out": {"meta_info": {"finish_reason": ...}}}`.
Lines that are not such objects (other log output) are ignored, and so are SGLang's own health
probes: every `/health` is a one-token generation logged with rid `HEALTH_CHECK_<hex>`, and on a PD
decode it is logged received and never finished (observed on real SGLang, docs/sim.md). No client
sends such a rid, and a probe holds nothing the queues would not show.
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


# the rid prefix of SGLang's own health probes (srt/constants.py HEALTH_CHECK_RID_PREFIX + "_", used by
# srt/entrypoints/http_server.py for each /health generation)
HEALTH_CHECK_PREFIX = "HEALTH_CHECK_"


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
            if r.startswith(HEALTH_CHECK_PREFIX):
                continue
            if event == "request.received":
                log.received.setdefault(r, str(doc.get("timestamp", "")))
            elif event == "request.finished":
                fr = ((doc.get("out") or {}).get("meta_info") or {}).get("finish_reason")
                log.finished[r] = (fr.get("type") if isinstance(fr, dict) else str(fr)) if fr else "unknown"
    return log


def invocations_command(unit: str, since_epoch: float) -> str:
    """The unit's journal since `since_epoch`, every invocation, as JSON lines carrying each
    message's invocation ID (so what one process received can be told from the next one's)."""
    return (f"journalctl -u {q(unit)} --since @{int(since_epoch)} -o json "
            "--output-fields=MESSAGE,_SYSTEMD_INVOCATION_ID --no-pager")


def by_invocation(output: str) -> dict[str, RequestLog]:
    """{invocation ID: its RequestLog}, in the order the journal shows them. A MESSAGE journald
    stored as bytes (a list of ints) is decoded; lines that are not JSON are ignored."""
    texts: dict[str, list[str]] = {}
    for line in output.splitlines():
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(doc, dict):
            continue
        msg = doc.get("MESSAGE")
        if isinstance(msg, list):
            msg = bytes(x for x in msg if isinstance(x, int) and 0 <= x < 256).decode("utf-8", "replace")
        if not isinstance(msg, str):
            continue
        texts.setdefault(str(doc.get("_SYSTEMD_INVOCATION_ID") or ""), []).append(msg)
    return {k: parse("\n".join(v)) for k, v in texts.items()}


def lost_work(logs: dict[str, RequestLog], current: str | None) -> tuple[list[str], list[str]]:
    """(lost, failed): request IDs received by a process that has ended (any invocation but
    `current`, the running one) and never finished: in flight when it ended; and request IDs any of
    these processes finished with an abort (failed, answered with an error)."""
    lost: list[str] = []
    failed: list[str] = []
    for inv_id, log in logs.items():
        if inv_id != current:
            lost += [r for r in log.open if r not in lost]
        failed += [r for r, why in log.finished.items() if why == "abort" and r not in failed]
    return lost, failed
