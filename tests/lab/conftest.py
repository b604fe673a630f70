"""The `lab` fixture: real lab hosts for the whole test session, torn down even on failure.

Boots `$PDOPS_LAB_HOSTS` hosts (default 4) with `pdops.lab.up` once per session and
always runs `pdops.lab.down` afterwards: in the fixture's finally, and again from an
atexit / SIGTERM handler should the session die before the finally runs.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pdops import lab as lab_api  # noqa: E402


@dataclasses.dataclass
class Lab:
    """What tests get: the inventory, the SSH key, the hosts, and connections to them."""

    inventory: Path
    key: Path
    hosts: list[tuple[str, str]]
    lab_dir: Path
    n: int

    def address(self, name: str) -> str:
        return dict(self.hosts)[name]

    def connection(self, name: str):
        """A Fabric Connection to lab host `name` as root with the lab key."""
        from fabric import Config, Connection

        return Connection(
            self.address(name),
            user="root",
            config=Config(overrides={"load_ssh_configs": False, "run": {"in_stream": False}}),
            connect_kwargs={"key_filename": str(self.key), "look_for_keys": False,
                            "allow_agent": False},
            connect_timeout=10,
        )

    def ensure_up(self, boot: str = "lab") -> None:
        """Bring every host back (idempotent): for tests that took hosts down. `boot`: "enabled" boots
        the way a real host does (what pdops enabled starts by itself; pdops.lab.hostfiles)."""
        lab_api.up(self.n, self.lab_dir, boot=boot)


_torn_down = False


def _teardown() -> None:
    global _torn_down
    if _torn_down:
        return
    _torn_down = True
    try:
        lab_api.down()
    except Exception as exc:  # the session is ending: report, do not mask the real failure
        print(f"lab teardown: {exc}", file=sys.stderr)


def _on_signal(signum, frame):
    _teardown()
    raise SystemExit(128 + signum)


@pytest.fixture(scope="session")
def lab():
    n = int(os.environ.get("PDOPS_LAB_HOSTS", 4))
    lab_dir = lab_api.resolve_lab_dir()
    atexit.register(_teardown)
    previous = signal.signal(signal.SIGTERM, _on_signal)
    global _torn_down
    _torn_down = False
    try:
        lab_api.up(n, lab_dir)
        yield Lab(
            inventory=lab_api.inventory_path(lab_dir),
            key=lab_api.ssh_key_path(lab_dir),
            hosts=[(lab_api.host_name(i), lab_api.host_address(i)) for i in range(1, n + 1)],
            lab_dir=lab_dir,
            n=n,
        )
    finally:
        _teardown()
        signal.signal(signal.SIGTERM, previous)
