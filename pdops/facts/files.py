"""Files pdops rendered onto a host, as they are there now: mode, owner and sha256 of each path.

`inv verify` judges every file of a revision with it, and pdops.reads.observe reads each engine's own
files with it (unit, launch script, env file), so that `inv status` and `inv deploy` see a file edited
on the host, not only `inv verify`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdops.facts import q


@dataclass(frozen=True)
class FileFact:
    mode: int | None  # None: missing
    owner: str
    sha256: str


def command(paths) -> str:
    """`<mode> <owner> <sha256>  <path>` per path, or `missing - - <path>`."""
    return "; ".join(f"if [ -e {q(p)} ]; then stat -c '%a %U' {q(p)} | tr '\\n' ' '; sha256sum {q(p)}; "
                     f"else echo missing - - {q(p)}; fi" for p in sorted(paths)) or "true"


def parse(text: str) -> dict[str, FileFact]:
    out = {}
    for line in text.splitlines():
        parts = line.split(None, 3)
        if len(parts) != 4:
            continue
        mode, owner, digest, path = parts
        out[path] = FileFact(None, "-", "-") if mode == "missing" else FileFact(int(mode, 8), owner, digest)
    return out
