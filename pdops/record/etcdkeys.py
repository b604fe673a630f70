"""The record on etcd's key layout (pdops.record.etcdstore's docstring) and its limits: what the
store and the lock session (pdops.record.etcdlock) both write."""

from __future__ import annotations

import urllib.parse

FORMAT = 1
MOVED_FORMAT = 2  # P/format of a record marked as moved: a pdops that does not know P/moved refuses it
PART_BYTES = 512 * 1024  # < etcd's 1.5 MiB request limit once base64'd, with room for the rest
MAX_TXN_OPS = 100  # etcd's default --max-txn-ops is 128
TXN_BYTES = 1024 * 1024  # values per transaction, under etcd's default --max-request-bytes of 1.5 MiB
REF = "ref:"  # an operation's or a tag's copy of a line too big to copy: the key of the line itself
RETRY_S = 20.0  # a write whose member died is sent again for this long (a new leader takes ~1-3 s)
PAGE = 1000


def key_segment(name: str) -> str:
    """An op id or a tag as one key segment (a "/" in it would reach into another's keys)."""
    return urllib.parse.quote(str(name), safe=":")


def seq_key(n: int) -> str:
    return f"{int(n):012d}"


def rev_key(n: int) -> str:
    return f"{int(n):08d}"
