"""Check rendered commands with the real parsers: SGLang's `prepare_server_args` and the
gateway package's own `parse_router_args`. Used by the contract tests and `inv render --check`.
"""

from __future__ import annotations

import contextlib
import importlib
import io

from pdops.errors import InvalidInput


def sglang_parser_available() -> bool:
    """True where SGLang's server_args module can be imported (needs torch)."""
    try:
        importlib.import_module("sglang.srt.server_args")
    except Exception:  # pragma: no cover - depends on the environment
        return False
    return True


def check_sglang_args(args: list[str]):
    """Parse SGLang flags (without `python -m sglang.launch_server`) with SGLang 0.5.23's own
    `prepare_server_args`; return its ServerArgs or raise InvalidInput with argparse's message."""
    from sglang.srt.server_args import prepare_server_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return prepare_server_args(list(args))
    except SystemExit as exc:
        msg = err.getvalue().strip().splitlines()
        raise InvalidInput("engine flags", msg[-1] if msg else f"SGLang's parser exited {exc.code}",
                           fix="fix the profile or pdops's rendering; SGLang would refuse to start") from None
    except (ValueError, TypeError, AssertionError) as exc:
        raise InvalidInput("engine flags", f"SGLang rejected the arguments: {exc}",
                           fix="fix the profile or pdops's rendering") from None


def check_gateway_args(args: list[str]):
    """Parse `smg launch` flags with smg's own parser (the part after `launch`)."""
    from smg.launch_router import parse_router_args

    if args and args[0] == "launch":
        args = args[1:]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse_router_args(list(args))
    except SystemExit as exc:
        msg = err.getvalue().strip().splitlines()
        raise InvalidInput("gateway flags", msg[-1] if msg else f"the gateway's parser exited {exc.code}",
                           fix="fix the inventory's pdops_gateway settings") from None
