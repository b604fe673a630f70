"""The admission layer's HAProxy through its runtime API, on the admission host over SSH: read
each gateway's server (`show stat`), send one command and check HAProxy's answer, wait until the
gateways are UP. The commands themselves are made by pdops.model.admission."""

from __future__ import annotations

import time

from pdops.errors import InvalidInput, Unverified
from pdops.model.admission import (FULL_WEIGHT, UNIT, ServerStat, parse_gateway_stats, server_state_command, server_weight_command,
                                   standby_server, stat_command)


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




def set_front_door(pool, adms, *, weights: dict[str, int], drain=(), ready=()) -> list[str]:
    """On every admission host's HAProxy, weights first, then states: a gateway set to drain takes no
    new request, one set ready takes its share again once HAProxy's check sees it UP. Returns what
    was set, for the evidence."""
    for adm in adms:
        for h, w in weights.items():
            runtime(pool, adm, server_weight_command(h, w), f"set the weight of gateway {h} to {w}")
        for h in drain:
            runtime(pool, adm, server_state_command(h, "drain"), f"drain gateway {h}")
        for h in ready:
            runtime(pool, adm, server_state_command(h, "ready"), f"set gateway {h} ready")
    done = [f"{h} weight {w}" for h, w in weights.items()] + [f"{h} drain" for h in drain]
    done += [f"{h} ready" for h in ready]
    return [f"{d} (on {', '.join(adms)})" for d in done]


def front_door_problems(pool, adm_host: str, gateways) -> list[str]:
    """What HAProxy on one admission host does not do as deployed: a gateway's server that is not UP,
    or whose weight is not the rendered one (a change stopped between a drain and its ready)."""
    stats = gateway_stats(pool, adm_host)
    out = []
    for h in gateways:
        st = stats.get(h)
        if st is None:
            out.append(f"HAProxy on {adm_host} has no server for gateway {h} (its running config is not this "
                       "revision's)")
        elif not st.up or st.weight != FULL_WEIGHT:
            out.append(f"HAProxy on {adm_host}: gateway {h} is {st.status}, weight {st.weight} (deployed: UP, "
                       f"weight {FULL_WEIGHT})")
        sb = stats.get(standby_server(h))
        if sb is not None and sb.status != "MAINT":
            out.append(f"HAProxy on {adm_host}: the stand-in of gateway {h} is {sb.status} (deployed: MAINT): a restart "
                       "did not finish; `inv deploy --topology <the current one>` retires it once the gateway serves")
    return out


def require_another_up(pool, adms, others, leaving: str, what: str) -> list[str]:
    """Before a gateway leaves the front door: every admission host's HAProxy must see another gateway
    UP; Unverified (nothing changed) naming each one's state otherwise. Returns those UP (the last read)."""
    up: list[str] = []
    for a in adms:
        stats = gateway_stats(pool, a)
        up = [h for h in others if h in stats and stats[h].up]
        if not up:
            raise Unverified(f"no other gateway is UP in HAProxy on {a} ("
                             f"{', '.join(f'{h}: {stats[h].status if h in stats else None}' for h in others)}): "
                             f"{what} {leaving} would leave that front door with none; nothing was changed",
                             fix="`inv status` shows each gateway; repair the others first (inv deploy --topology "
                                 "<the live one>), then run the change again")
    return up
