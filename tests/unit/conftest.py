"""Fixtures the unit tests of several layers share."""

from __future__ import annotations

import pytest


class _Kinds(dict):
    """The table of kinds for one test: `table["k"] = fn` binds kind k to fn (no outputs); `bind` with
    the outputs it gives and reads."""

    def __setitem__(self, kind, fn):
        from pdops.kinds import Kind

        super().__setitem__(kind, fn if isinstance(fn, Kind) else Kind(fn))

    def update(self, other=(), **kw):
        for k, v in dict(other, **kw).items():
            self[k] = v

    def bind(self, table: dict, *, gives: dict | None = None, needs: dict | None = None):
        from pdops.kinds import Kind

        for kind, fn in table.items():
            self[kind] = Kind(fn, tuple((gives or {}).get(kind, ())), tuple((needs or {}).get(kind, ())))


@pytest.fixture
def registry(monkeypatch):
    """The table of kinds (pdops.kinds.KINDS) the runner reads, emptied for the test: it binds the kinds it
    walks."""
    import pdops.kinds

    table = _Kinds()
    monkeypatch.setattr(pdops.kinds, "KINDS", table)
    return table
