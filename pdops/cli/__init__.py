"""Invoke task modules. Each task parses arguments, calls one pdops function, prints.

`cli_errors` turns every PdopsError into one clear message and its exit status, never
a traceback, as an operator at 3 a.m. needs.
"""

from __future__ import annotations

import functools
import sys

from invoke.exceptions import Exit

from pdops.errors import PdopsError


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
