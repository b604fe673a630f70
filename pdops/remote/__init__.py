"""REMOTE layer: the connections pdops opens. SSH to hosts (Fabric, one per host), the gateway's
HTTP API, Ansible playbooks, and the load client that sends generation requests. Imports the
model and the runner's checked commands; never the record, the reads or the operations."""
