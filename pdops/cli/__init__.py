"""Invoke task modules. Each task parses arguments, calls one pdops function, prints.

`cli_errors` turns every PdopsError into one clear message and its exit status, never
a traceback, as an operator at 3 a.m. needs.
"""

from __future__ import annotations

import functools
import os
import sys
import time

from invoke.exceptions import Exit

from pdops.errors import InvalidInput, PdopsError
from pdops.runner import operator_cpu_s

# Busier than this share of its cores on average, this machine (not the fleet) held the operation back.
BOTTLENECK_SHARE = 0.8


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
    print(f"  {machine_cost()}")


def machine_cost(cpu_s: float | None = None, wall_s: float | None = None, cores: int | None = None) -> str:
    """What the operation cost the machine it ran on: its CPU seconds since the process started (this
    process and the children it waited for: ansible-playbook and its forks; not ssh's ControlPersist
    masters, which outlive the command: bench/fleet_cost.py counts those) over the process's wall time,
    as cores busy on average; named the bottleneck past BOTTLENECK_SHARE of its cores."""
    import psutil  # loaded by the verdict's last line only: 37 ms that `inv plan` does not pay

    cpu_s = operator_cpu_s() if cpu_s is None else cpu_s
    wall_s = time.time() - psutil.Process().create_time() if wall_s is None else wall_s
    cores = (os.cpu_count() or 1) if cores is None else cores
    busy = cpu_s / wall_s if wall_s > 0 else 0.0
    line = f"this machine: {cpu_s:.1f} CPU-s in {wall_s:.1f} s, {busy:.2f} of its {cores} core(s) busy on average"
    if busy > BOTTLENECK_SHARE * cores:
        line += " (this machine, not the fleet, held the operation back: run it from a machine with more cores)"
    return line


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
