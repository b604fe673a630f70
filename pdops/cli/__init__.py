"""Invoke task modules. Each task parses arguments, calls one pdops function, prints.

`cli_errors` turns every PdopsError into one clear message and its exit status, never
a traceback, as an operator at 3 a.m. needs.
"""

from __future__ import annotations

import functools
import sys

from invoke.exceptions import Exit

from pdops.errors import InvalidInput, PdopsError


def seconds(value, flag: str) -> float | None:
    """An operator's `--wait 600`-style value as seconds (None when not given); InvalidInput otherwise."""
    if value is None or value == "":
        return None
    try:
        s = float(value)
    except (TypeError, ValueError):
        raise InvalidInput(flag, f"{value!r} is not a number of seconds", fix=f"e.g. {flag} 30") from None
    if not s >= 0 or s == float("inf"):
        raise InvalidInput(flag, f"{value!r} is not a non-negative number of seconds", fix=f"e.g. {flag} 30")
    return s


def print_verdict(headline: str, verdict: dict) -> None:
    """`verdict: ...` then one line per verified item, per item that could not be verified, per note."""
    print(f"verdict: {headline}")
    for item in verdict.get("verified", ()):
        print(f"  verified: {item}")
    for item in verdict.get("unverified", ()):
        print(f"  not verified: {item}")
    for item in verdict.get("notes", ()):
        print(f"  note: {item}")


def cli_errors(fn):
    """Map PdopsError to `<kind>: <message>` on stderr and the error's exit status."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PdopsError as exc:
            print(exc.render(), file=sys.stderr)
            raise Exit(code=exc.exit_code) from None
        except KeyboardInterrupt:
            print("interrupted: the journal records how far the operation got", file=sys.stderr)
            raise Exit(code=130) from None

    return wrapper
