"""The etcd members pdops runs itself (`pdops_state.etcd.members`): one systemd unit per member,
rendered here, delivered by Ansible (playbooks/etcd.yml), started by `inv state.etcd-up`.

Plain HTTP between members and to clients: for the lab's loopback hosts, or a cluster network an
on-call rotation trusts. Where TLS is wanted, run etcd as the site runs it and name its client URLs
(`pdops_state.etcd.endpoints`, with ca/cert/key): validation refuses members with TLS files. The
members keep their data in DATA_ROOT/<cluster> (pdops's own /var/lib/pdops, 0700), compact their
history every hour (etcd keeps every old version of a key otherwise) and restart on failure.
"""

from __future__ import annotations

import shlex

from pdops.model.inventory import ETCD_CLIENT_PORT, ETCD_PEER_PORT, Inventory
from pdops.model.render import RenderedFile

UNIT = "pdops-etcd.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
DATA_ROOT = "/var/lib/pdops/etcd"
ETCD_BIN = "/usr/bin/etcd"  # Debian's etcd-server (3.4)


def member_name(host: str) -> str:
    return host


def initial_cluster(inv: Inventory) -> str:
    e = inv.state.etcd
    return ",".join(f"{member_name(h)}=http://{a}:{ETCD_PEER_PORT}" for h, a in zip(e.members, e.member_addrs))


def member_unit(inv: Inventory, host: str) -> RenderedFile:
    """The unit of the member on `host` (one of `pdops_state.etcd.members`)."""
    e = inv.state.etcd
    addr = dict(zip(e.members, e.member_addrs))[host]
    args = [ETCD_BIN, "--name", member_name(host), "--data-dir", f"{DATA_ROOT}/{inv.cluster}",
            "--listen-client-urls", f"http://{addr}:{ETCD_CLIENT_PORT}",
            "--advertise-client-urls", f"http://{addr}:{ETCD_CLIENT_PORT}",
            "--listen-peer-urls", f"http://{addr}:{ETCD_PEER_PORT}",
            "--initial-advertise-peer-urls", f"http://{addr}:{ETCD_PEER_PORT}",
            "--initial-cluster", initial_cluster(inv), "--initial-cluster-token", f"pdops-{inv.cluster}",
            "--initial-cluster-state", "new", "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", "1h"]
    text = "\n".join([
        "# Rendered by pdops (inv state.etcd-up): a member of the etcd cluster that holds the record of",
        f"# cluster {inv.cluster}. Members: {', '.join(e.members)}.",
        "[Unit]",
        f"Description=pdops record store: etcd member {member_name(host)} of cluster {inv.cluster}",
        "After=network.target",
        "",
        "[Service]",
        "Type=notify",
        f"ExecStart={' '.join(shlex.quote(a) for a in args)}",
        "Restart=on-failure",
        "RestartSec=2",
        "TimeoutStartSec=120",
        "LimitNOFILE=65536",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])
    return RenderedFile(host, UNIT_PATH, text, 0o644)


def member_units(inv: Inventory) -> list[RenderedFile]:
    if inv.state is None or inv.state.etcd is None or not inv.state.etcd.members:
        return []
    return [member_unit(inv, h) for h in inv.state.etcd.members]
