"""READ layer: each module offers ``command(...) -> str`` and a pure ``parse(output)``.

A command is a shell string with every interpolated value quoted (``shlex.quote``);
a parser takes the text the command printed and returns typed values, touching nothing.
Commands for optional hardware tools print ``SKIP_MARKER <reason>`` instead of failing
when the tool is absent, and their parsers return :class:`Skipped` (never success).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

SKIP_MARKER = "PDOPS-SKIPPED:"


@dataclass(frozen=True)
class Skipped:
    """A fact that could not be read on this host, and why (e.g. "no nvidia-smi")."""

    reason: str

    def __bool__(self) -> bool:  # a skipped check must never read as a pass
        return False


def q(value: object) -> str:
    """Quote one value for a POSIX shell."""
    return shlex.quote(str(value))


def require_binary(binary: str, command: str) -> str:
    """Wrap ``command`` so that a missing ``binary`` prints a skip marker instead of failing."""
    return (
        f"if command -v {q(binary)} >/dev/null 2>&1; then {command}; "
        f"else echo {q(SKIP_MARKER + ' no ' + binary + ' on this host')}; fi"
    )


def skipped_in(output: str) -> Skipped | None:
    """Return a :class:`Skipped` if ``output`` carries the skip marker."""
    for line in output.splitlines():
        if line.startswith(SKIP_MARKER):
            return Skipped(line[len(SKIP_MARKER):].strip())
    return None


# The shell batch protocol: several reads in ONE command (one SSH round trip); each section's output
# is cut out of it, framed by markers with its exit code (preflight, verify, observe).
_BEGIN, _END = "@@PDOPS-SECTION-BEGIN", "@@PDOPS-SECTION-END"


def batch_command(commands: dict[str, str]) -> str:
    """One shell command running every section in a subshell, each framed by markers with its exit code."""
    parts = []
    for name, cmd in commands.items():
        parts.append(f"echo {q(_BEGIN + ' ' + name)}; ( {cmd} ) 2>&1; echo \"{_END} {name} $?\"")
    return "; ".join(parts)


def split_sections(output: str) -> dict[str, tuple[int, str]]:
    """{section: (exit code, text)} from :func:`batch_command` output."""
    out: dict[str, tuple[int, str]] = {}
    cur, buf = None, []
    for line in output.splitlines():
        if line.startswith(_BEGIN + " "):
            cur, buf = line[len(_BEGIN) + 1:].strip(), []
        elif line.startswith(_END + " ") and cur is not None:
            rc = line.rsplit(" ", 1)[-1]
            out[cur] = (int(rc) if rc.lstrip("-").isdigit() else -1, "\n".join(buf) + ("\n" if buf else ""))
            cur = None
        elif cur is not None:
            buf.append(line)
    return out
