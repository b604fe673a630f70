"""tests/conftest.py keeps every test on loopback: a connection to any other address fails at once,
naming it (the shipped fleet inventory's addresses are real hosts')."""

from __future__ import annotations

import socket

import pytest


def test_a_connection_past_loopback_fails_at_once_naming_the_address():
    with pytest.raises(OSError, match=r"tests reach loopback only, not 10\.20\.0\.11"):
        socket.create_connection(("10.20.0.11", 22), timeout=5)


def test_a_connection_on_loopback_is_made():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        with socket.create_connection(srv.getsockname(), timeout=5):
            conn, _ = srv.accept()
            conn.close()
