"""The admission layer's HAProxy through its runtime API, on the admission host over SSH: read
each gateway's server (`show stat`), send one command and check HAProxy's answer, wait until the
gateways are UP. The commands themselves are made by pdops.model.admission."""

from __future__ import annotations

import time

from pdops.errors import InvalidInput, Unverified
from pdops.model.admission import UNIT, ServerStat, parse_gateway_stats, stat_command


def gateway_stats(pool, adm_host: str) -> dict[str, ServerStat]:
    """{gateway host: ServerStat} as HAProxy on the admission host reports it now."""
    out = pool.run(adm_host, stat_command(), timeout=15).stdout
    try:
        return parse_gateway_stats(out)
    except InvalidInput as exc:
        raise Unverified(f"admission layer on {adm_host}: `show stat` unreadable", evidence=exc.message) from None


def runtime(pool, adm_host: str, command: str, what: str) -> None:
    """One command to HAProxy's runtime API; Unverified with the way out when HAProxy answers
    anything but its empty success."""
    answer = pool.run(adm_host, command, timeout=15).stdout.strip()
    if answer:
        raise Unverified(f"admission layer on {adm_host}: HAProxy did not {what}: {answer}",
                         fix=f"systemctl reload {UNIT} on {adm_host} re-reads its config (every gateway in "
                             "service, checks on); then run the change again")


def wait_gateways_up(pool, adm_host: str, hosts, deadline_s: float) -> dict[str, ServerStat]:
    """Until HAProxy reports every gateway of `hosts` UP (its health check passed `rise` times);
    Unverified naming each that is not by the deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        stats = gateway_stats(pool, adm_host)
        late = {h: (stats[h].status if h in stats else "not in its config") for h in hosts
                if h not in stats or not stats[h].up}
        if not late:
            return stats
        if time.monotonic() > deadline:
            raise Unverified(f"the admission layer on {adm_host} does not see gateway(s) "
                             f"{', '.join(f'{h} ({s})' for h, s in late.items())} UP after {deadline_s:g}s",
                             fix="`inv status` shows each gateway; its readiness (GET /readiness) must answer 200")
        time.sleep(0.5)
