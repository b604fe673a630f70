"""Listening sockets from ss (samples: tests/data/facts/ss_listening.source)."""

from pathlib import Path

import pytest

from pdops.errors import Unverified
from pdops.facts import ports

DATA = Path(__file__).resolve().parents[2] / "data" / "facts"


def real():
    return ports.parse((DATA / "ss_listening.txt").read_text())


def extra():
    return ports.parse((DATA / "ss_listening_extra.txt").read_text())


def test_command():
    assert ports.command() == "ss -Hltnp"


def test_parse_real_capture():
    ls = real()
    assert len(ls) == 6
    by_port = {lst.port: lst for lst in ls}
    assert by_port[30000].addr == "127.0.0.1" and by_port[30000].pids == (7025,)
    assert by_port[2024].pids == ()  # no process column for another user's socket
    assert by_port[30011].addr == "::1"
    assert by_port[30010].addr == "*" and by_port[30010].is_wildcard


def test_is_listening_exact_and_wildcards():
    ls = real()
    assert ports.is_listening(ls, "127.0.0.1", 30000)
    assert not ports.is_listening(ls, "127.0.10.3", 30000)
    assert ports.is_listening(ls, "10.1.2.3", 8998)  # 0.0.0.0 covers any v4 address
    assert not ports.is_listening(ls, "::1", 8998)  # ...but not v6
    assert ports.is_listening(ls, "10.1.2.3", 30010)  # dual-stack *
    assert not ports.is_listening(ls, "127.0.0.1", 30011)
    assert not ports.is_listening(ls, "127.0.0.1", 31999)
    assert {lst.port for lst in ports.wildcard_listeners(ls)} == {2024, 8998, 30010}


def test_interface_scope_mapped_v6_and_shared_socket():
    ls = extra()
    resolved = ls[0]
    assert (resolved.addr, resolved.interface, resolved.port) == ("127.0.0.53", "lo", 53)
    assert ports.is_listening(ls, "10.0.0.5", 30000)  # [::ffff:10.0.0.5]
    assert ports.pids_on_port(ls, 8998) == {4300, 4242}
    assert ls[2].names == ("sglang::schedul", "python3")
    assert ls[3].addr == "::" and ls[3].is_wildcard and ports.is_listening(ls, "10.9.9.9", 22)


def test_garbage_is_unverified():
    with pytest.raises(Unverified):
        ports.parse("LISTEN 0 128 nonsense\n")
