"""Inventory: hosts, GPUs, NICs, gateway and port settings, model profile.

An inventory is an Ansible YAML inventory (`ansible-inventory -i inventory/<name> --list`
reads it) with pdops's variables. `load_inventory` reads it and validates everything
before any host is touched; every error names the field and the fix.

The package, by concern (each module imports only those listed before it):
- ``model``: hosts, GPUs, NICs, gateway, ports, the model profile (data);
- ``read``: reading through ansible-core, and the cache of that reading;
- ``parse``: Ansible's merged variables to the model; the inventory as one YAML document;
- ``validate``: every rule, each error naming the field and the fix;
- ``load``: ``load_inventory``.
"""

from pdops.model.inventory.load import load_inventory
from pdops.model.inventory.schema import (MOONCAKE_RPC_PORTS, Gateway, GatewayNode, Host, Inventory, Nic, Ports, Profile, StateLocation, EtcdSetting, ETCD_CLIENT_PORT, ETCD_PEER_PORT,
                                   max_slots)
from pdops.model.inventory.parse import load_profile, single_file_doc
from pdops.model.inventory.read import ANSIBLE_CFG, inventory_files, read_with_ansible, sources_digest
from pdops.model.inventory.validate import PREFILL_POLICIES, ROUTING_POLICIES

__all__ = ["ANSIBLE_CFG", "MOONCAKE_RPC_PORTS", "PREFILL_POLICIES", "ROUTING_POLICIES", "Gateway", "GatewayNode", "Host", "Inventory",
           "Nic", "Ports", "Profile", "StateLocation", "EtcdSetting", "ETCD_CLIENT_PORT", "ETCD_PEER_PORT", "inventory_files", "load_inventory", "load_profile", "max_slots",
           "read_with_ansible", "single_file_doc", "sources_digest"]
