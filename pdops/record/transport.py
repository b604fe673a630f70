"""Reaching the state host: the holder process there (pdops/hostscripts/record.py), over SSH or
locally, one request and one answer at a time, pinged while it holds the lock."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from pdops.errors import PdopsError, RemoteCommandFailed, Unreachable, Unverified
from pdops.facts import q
from pdops.remote.hosts import HostPool


SCRIPT = (Path(__file__).resolve().parents[1] / "hostscripts" / "record.py").read_text()


LEASE_S = 30.0  # the holder process on the state host gives up after this long without a word


PING_S = 5.0  # how often the operator's process says it is alive


REPLY_S = 60.0  # longest wait for one answer of the state host


def lock_lost(why: str) -> Unreachable:
    """The error of an operation whose lock session broke (`why`): its next request stops with it."""
    return Unreachable(f"lost the cluster lock: {why}",
                       fix="the operation stopped here; its journal says how far it got. Check "
                           "`inv status` and `inv journal`, then run it again")


class _Lines:
    """Lines from a byte source read in chunks with a timeout (paramiko channel or pipe)."""

    def __init__(self, read_chunk: Callable[[float], bytes]):
        self._read = read_chunk
        self._buf = b""

    def readline(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer in {timeout:.0f} s")
            chunk = self._read(left)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode("utf-8")


class Session:
    """One `hold` process on the state host: JSON requests and answers, one per line, serialised
    between the operation's thread and the heartbeat."""

    def __init__(self, where: str, send: Callable[[bytes], None], read_chunk: Callable[[float], bytes],
                 close: Callable[[], None]):
        self.where = where
        self._send, self._lines, self._close = send, _Lines(read_chunk), close
        self._lock = threading.Lock()
        self.broken: str | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def first(self) -> dict:
        line = self._lines.readline(REPLY_S)
        if line is None:
            raise Unreachable(f"{self.where}: the state host ended the lock session before answering")
        return json.loads(line)

    def request(self, doc: dict) -> dict:
        with self._lock:
            if self.broken:
                raise lock_lost(self.broken)
            try:
                self._send((json.dumps(doc) + "\n").encode("utf-8"))
                line = self._lines.readline(REPLY_S)
            except (OSError, EOFError, TimeoutError) as e:
                self.broken = f"{self.where}: the lock session failed: {e}"
                raise Unreachable(f"lost the cluster lock: {self.broken}") from None
            if line is None:
                self.broken = f"{self.where}: the state host ended the lock session"
                raise Unreachable(f"lost the cluster lock: {self.broken}",
                                  fix="someone may have run `inv unlock --force`; see `inv journal`")
        ans = json.loads(line)
        if not ans.get("ok"):
            raise Unverified(f"{self.where}: the state host refused {doc.get('op')!r}: {ans.get('message')}")
        return ans

    def start_heartbeat(self, every: float = PING_S) -> None:
        def beat():
            while not self._stop.wait(every):
                try:
                    self.request({"op": "ping"})
                except PdopsError:
                    return

        self._beat = threading.Thread(target=beat, name="pdops-lock-heartbeat", daemon=True)
        self._beat.start()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            try:
                self._close()
            except Exception:  # noqa: BLE001 - closing a dead session
                pass


class SSHTransport:
    """The host script over the state host's own SSH connection (not the operation's pool)."""

    def __init__(self, inv, host: str):
        self.host = host
        self._pool = HostPool(inv)

    def _command(self, args: list[str]) -> str:
        return f"python3 -c {q(SCRIPT)} " + " ".join(q(a) for a in args)

    def call(self, args: list[str], timeout: float = REPLY_S) -> dict:
        try:
            res = self._pool.run(self.host, self._command(args), timeout=timeout)
        except Unreachable as e:  # say why, without the script the command carried
            why = e.message.rsplit("`: ", 1)[-1] if " running `" in e.message else e.message
            raise Unreachable(f"{self.host} cannot be reached over SSH: {why}") from None
        except RemoteCommandFailed as e:
            raise Unverified(f"{self.host}: the record script exited {e.returncode}", evidence=e.output[-1500:]) from None
        return _last_json(res.stdout, self.host)

    def open_session(self, args: list[str]) -> Session:
        try:
            conn = self._pool[self.host]
            conn.open()
            chan = conn.client.get_transport().open_session()
            chan.exec_command(self._command(args))
        except Exception as e:  # noqa: BLE001 - paramiko / socket errors: the host is not reachable
            raise Unreachable(f"{self.host}: cannot open the lock session: {type(e).__name__}: {e}") from None

        def read_chunk(timeout: float) -> bytes:
            chan.settimeout(timeout)
            try:
                return chan.recv(65536)
            except socket.timeout:
                raise TimeoutError(f"no answer in {timeout:.0f} s") from None

        return Session(self.host, chan.sendall, read_chunk, chan.close)

    def close(self) -> None:
        self._pool.close()


class LocalTransport:
    """The host script on this machine (the state host is the operator machine; unit tests)."""

    host = "localhost"

    def call(self, args: list[str], timeout: float = REPLY_S) -> dict:
        res = subprocess.run(["python3", "-c", SCRIPT, *args], capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise Unverified(f"the record script exited {res.returncode}", evidence=res.stderr[-1500:])
        return _last_json(res.stdout, self.host)

    def open_session(self, args: list[str]) -> Session:
        proc = subprocess.Popen(["python3", "-c", SCRIPT, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

        def send(data: bytes) -> None:
            proc.stdin.write(data)
            proc.stdin.flush()

        def read_chunk(timeout: float) -> bytes:
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            if not ready:
                raise TimeoutError(f"no answer in {timeout:.0f} s")
            return os.read(proc.stdout.fileno(), 65536)

        def close() -> None:
            proc.stdin.close()
            proc.wait(10)
            proc.stdout.close()

        return Session(self.host, send, read_chunk, close)

    def close(self) -> None:
        pass


def _last_json(stdout: str, host: str) -> dict:
    try:
        return json.loads(stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise Unverified(f"{host}: the record script gave no answer", evidence=stdout[-1000:]) from None
