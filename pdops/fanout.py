"""Fan-out and checked remote commands: run one function per item in threads and collect every
outcome (never raising for one item's failure), and run a command on a connection, raising
RemoteCommandFailed on a non-zero exit or a timeout and Unreachable when the connection fails.

Functions take the connection as an argument (a Fabric ``Connection`` or anything with the same
``run(command, warn=, hide=, timeout=)`` and ``host``); nothing is global."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Hashable, Iterable, TypeVar

from invoke.exceptions import CommandTimedOut
from invoke.runners import Result

from pdops.errors import PdopsError, RemoteCommandFailed, Unreachable, short_command

T = TypeVar("T", bound=Hashable)
R = TypeVar("R")

TIMEOUT_EXIT = 124  # as timeout(1)


def run_parallel(items: Iterable[T], fn: Callable[[T], R], max_workers: int | None = None) -> dict[T, R | Exception]:
    """Run ``fn(item)`` for every item in threads; collect each result or exception.

    Never raises for one item's failure: the caller sees every host's outcome and decides
    (fabric ``GroupResult`` style). Order of the returned dict follows ``items``.
    """
    items = list(items)
    if not items:
        return {}
    workers = max_workers or len(items)
    results: dict[T, R | Exception] = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {item: pool.submit(fn, item) for item in items}
        for item, fut in futures.items():
            try:
                results[item] = fut.result()
            except Exception as e:  # noqa: BLE001 - collected for the caller
                results[item] = e
    return results


def failures(results: dict[T, Any]) -> dict[T, Exception]:
    """The items whose outcome is an exception."""
    return {k: v for k, v in results.items() if isinstance(v, Exception)}


def succeeded(results: dict[T, Any]) -> dict[T, Any]:
    return {k: v for k, v in results.items() if not isinstance(v, Exception)}


def _host(conn) -> str:
    return str(getattr(conn, "host", None) or "local")


def run_remote(conn, command: str, *, hide: bool | str = True, timeout: float | None = None) -> Result:
    """Run ``command`` on ``conn``; RemoteCommandFailed on non-zero exit or timeout,
    Unreachable when the connection itself fails."""
    host = _host(conn)
    try:
        result = conn.run(command, warn=True, hide=hide, timeout=timeout, in_stream=False)
    except CommandTimedOut as e:
        out = (e.result.stdout or "") + (e.result.stderr or "")
        raise RemoteCommandFailed(host, command, TIMEOUT_EXIT,
                                  out + f"\n(timed out after {timeout}s)") from None
    except PdopsError:
        raise
    except (socket.error, EOFError) as e:
        raise Unreachable(f"{host}: connection failed running `{short_command(command)}`: {e}",
                          fix="check that the host is up and SSH answers") from None
    except Exception as e:
        # paramiko's SSHException / NoValidConnectionsError / AuthenticationException
        if type(e).__module__.startswith("paramiko"):
            raise Unreachable(f"{host}: SSH failed: {type(e).__name__}: {e}") from None
        raise
    if result.exited != 0:
        raise RemoteCommandFailed(host, command, result.exited,
                                  (result.stdout or "") + (result.stderr or ""))
    return result
