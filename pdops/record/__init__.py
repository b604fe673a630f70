"""The cluster's record and lock, kept on a state host of the cluster or in etcd (docs/state.md).

The revisions, ``current`` and the journal live in ``pdops_state.dir`` on ``pdops_state.host``
(default: the gateway host, ``/var/lib/pdops/state``), so every engineer of an on-call rotation
with the inventory and SSH access reads and changes the same record. A change holds the cluster
lock for its whole life: a process on the state host (``pdops/hostscripts/record.py hold``) holds
``flock`` on the state dir for as long as the operator's SSH session lives, pinged every
:data:`PING_S` seconds; a killed laptop process, a cut session or :data:`LEASE_S` seconds of silence
end it, and the kernel frees the lock. Every write of the operation (revision, ``current``,
journal line) goes through that process, so nothing is written by an operator who lost the lock.

The operator machine keeps a read-only copy of the last record it read (``<local dir>/cache``):
`inv status` and `inv history` show it, marked as such, when the state host cannot be reached;
nothing that changes the cluster runs from it.

With ``pdops_state.backend: etcd`` the same record lives under a key prefix in an etcd cluster
(``etcdstore``), the lock a key under a lease the operation keeps alive: one interface, two stores.

The package, by concern (each module imports only those listed before it):
- ``local``: the record's formats (revisions, ``current``, journal lines, the lock) in a folder
  on this machine, and where an operator's own files live;
- ``transport``: reaching the holder process on the state host (SSH, or locally);
- ``hoststore``, ``etcdstore``: the two stores, each answering the same reads and serving the same
  requests under the lock;
- ``shared``: the shared record, its journal and its lock, over either store;
- ``commands``: push a local record, unlock, list operations;
and :func:`open_record`, the record of an inventory's cluster. Callers reach it as
``pdops.record.open_record`` (the module attribute, read at call time), so a test replaces it in
one place; an operation takes the record it is given, it never opens one itself.
"""

from pdops.errors import InvalidInput
from pdops.model.inventory import StateLocation
from pdops.record.commands import operations, push_local, unlock
from pdops.record.etcdstore import EtcdStore
from pdops.record.hoststore import HostStore
from pdops.record.local import local_dir
from pdops.record.shared import SharedJournal, SharedLock, SharedRecord, describe_holder, lock_line
from pdops.record.transport import LEASE_S, PING_S, SCRIPT, LocalTransport, Session, SSHTransport

__all__ = ["LEASE_S", "PING_S", "SCRIPT", "HostStore", "LocalTransport", "SSHTransport", "Session", "SharedJournal",
           "SharedLock", "SharedRecord", "describe_holder", "host_store", "lock_line", "open_record", "operations",
           "push_local", "store_of", "unlock"]


def host_store(inv) -> HostStore:
    """The inventory's SSH state host (`pdops_state.host` and `dir`), whichever backend is in use."""
    where = inv.state or StateLocation(inv.gateway.first.host)
    return HostStore(inv.cluster, where.host, where.dir, SSHTransport(inv, where.host))


def etcd_store(inv) -> EtcdStore:
    """The inventory's etcd record (`pdops_state.etcd`); an input error when it names none."""
    if inv.state is None or inv.state.etcd is None:
        raise InvalidInput("pdops_state.etcd", "missing: this inventory names no etcd",
                           fix="name it (docs/state.md, \"The record on etcd\"; docs/runbooks/record-to-etcd.md)")
    return EtcdStore(inv.cluster, inv.state.etcd)


def store_of(inv, backend: str | None = None):
    """The store the record is in (`pdops_state.backend`), or the one `backend` names."""
    backend = backend or (inv.state.backend if inv.state else "host")
    return etcd_store(inv) if backend == "etcd" else host_store(inv)


def open_record(inv, *, cached_ok: bool = False, backend: str | None = None) -> SharedRecord:
    """The cluster's record, in its store (`pdops_state`: the state host, default the gateway
    host, or etcd). `cached_ok`: a read-only command may fall back to this machine's cached copy
    when the store cannot be reached."""
    return SharedRecord(inv.cluster, local_dir(inv), store_of(inv, backend), cached_ok=cached_ok)
