"""Connections to inventory hosts (Fabric over SSH, one per host, reused) and small HTTP helpers."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

from pdops.errors import Unreachable
from pdops.facts import batch_command, q, split_sections, systemd as systemd_facts
from pdops.model.inventory import Inventory
from pdops.fanout import failures, run_parallel, run_remote
from pdops.remote.gateway import Gateways

if TYPE_CHECKING:
    from fabric import Connection

# A host that accepts TCP on its SSH port but does not speak SSH (sshd past MaxStartups, a load
# balancer) fails paramiko's handshake in its transport thread, which logs the traceback at
# ERROR; with no handler configured, Python's last-resort handler prints it on the operator's
# terminal before pdops's own message. pdops reports the failure itself (Unreachable, with
# paramiko's one-line reason), so paramiko's records stop here unless logging is configured.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class HostPool:
    """One Fabric connection per host for the whole operation; pass it to the DO functions."""

    def __init__(self, inv: Inventory):
        self.inv = inv
        self._conns: dict[str, Connection] = {}
        self._lock = threading.Lock()

    def __getitem__(self, host: str) -> Connection:
        with self._lock:
            if host not in self._conns:
                # Fabric (and paramiko under it) is loaded by the first connection, not at import: 65 ms
                # that `inv plan`, `render` and `--dry-run`, which contact no host, do not pay
                from fabric import Config, Connection

                h = self.inv.host(host)
                key = self.inv.vars.get("ansible_ssh_private_key_file")
                kwargs: dict = {"key_filename": str(key), "look_for_keys": False, "allow_agent": False} if key else {}
                self._conns[host] = Connection(h.ssh_addr, port=h.ssh_port,
                                               user=str(self.inv.vars.get("ansible_user", "root")),
                                               config=Config(overrides={"load_ssh_configs": not key}),
                                               connect_kwargs=kwargs, connect_timeout=10)
            return self._conns[host]

    def run(self, host: str, command: str, timeout: float | None = 60):
        return run_remote(self[host], command, timeout=timeout)

    def read_sections(self, host: str, commands: dict[str, str], timeout: float | None = 60) -> dict[str, tuple[int, str]]:
        """Several reads in one SSH round trip: {name: (exit code, output)} of each command (the batch
        protocol of pdops.facts; a command that did not run is absent)."""
        return split_sections(self.run(host, batch_command(commands), timeout=timeout).stdout)

    def unit_states(self, host: str, units: list[str]) -> dict[str, systemd_facts.UnitState]:
        if not units:
            return {}
        out = self.run(host, systemd_facts.command(*units)).stdout
        return systemd_facts.parse_by_id(out)

    def journal_tail(self, host: str, unit: str, lines: int = 30) -> str:
        try:
            return self.run(host, f"journalctl -u {q(unit)} -n {int(lines)} --no-pager -o short-iso").stdout
        except Exception as exc:  # noqa: BLE001 - evidence is best effort
            return f"(journal unavailable: {exc})"

    def connect_all(self, hosts: list[str]) -> dict[str, str]:
        """Reach every host in parallel (one SSH round trip each); Unreachable naming every
        host that failed, before anything is changed. Returns each host's systemd state."""
        res = run_parallel(hosts, lambda h: self.run(h, "systemctl is-system-running || true", timeout=20).stdout.strip())
        bad = failures(res)
        if bad:
            raise Unreachable("cannot reach " + ", ".join(f"{h} ({e})" for h, e in bad.items()),
                              fix="check the hosts and SSH; nothing was changed")
        return dict(res)

    def close(self) -> None:
        with self._lock:
            for c in self._conns.values():
                try:
                    c.close()
                except Exception:  # noqa: BLE001
                    pass
            self._conns.clear()

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 10.0,
              headers: dict | None = None) -> tuple[int, object]:
    """(status, parsed JSON or text) for one HTTP request; Unreachable when nothing answers."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        raise Unreachable(f"{method} {url}: {getattr(e, 'reason', e)}") from None
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


@contextlib.contextmanager
def connections(inv: Inventory):
    """An operation's connections, opened once by its caller (the CLI) and passed to the runner:
    one SSH connection per host (opened on first use, closed at the end) and the gateway client."""

    with HostPool(inv) as pool:
        yield {"pool": pool, "gateways": Gateways.of(inv)}
