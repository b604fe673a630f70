"""A host whose SSH port accepts TCP but does not speak SSH (an sshd past MaxStartups, a load
balancer): the operator sees pdops's one clean "unreachable" message, not paramiko's thread
traceback, and pdops used the inventory's `ansible_port` (the port Ansible uses too). No lab: a
local socket on a loopback address answers with HTTP and closes; `inv status` runs as a process."""

import socket
import subprocess
import sys
import threading
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
ADDR = "127.0.77.1"


def _not_ssh_server():
    srv = socket.socket()
    srv.bind((ADDR, 0))
    srv.listen(16)
    srv.settimeout(30)  # stops by itself
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv, stop


def test_a_port_that_does_not_speak_ssh_gives_one_clean_message(tmp_path):
    srv, stop = _not_ssh_server()
    port = srv.getsockname()[1]
    try:
        inv_dir = tmp_path / "inv"
        subprocess.run(["cp", "-r", str(REPO / "inventory" / "lab"), str(inv_dir)], check=True)
        doc = yaml.safe_load((inv_dir / "hosts.yml").read_text())
        for i, hv in enumerate(doc["all"]["children"]["gpu_hosts"]["hosts"].values(), start=1):
            hv.update(ansible_host=f"127.0.77.{i}", pdops_data_addr=f"127.0.77.{i}", ansible_port=port)
        (inv_dir / "hosts.yml").write_text(yaml.safe_dump(doc))
        proc = subprocess.run([sys.executable, "-m", "invoke", "status", "-i", str(inv_dir)], cwd=REPO,
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    finally:
        stop.set()
        srv.close()
    assert proc.returncode == 3, proc.stdout + proc.stderr
    # it reached the configured port (a banner error, not "unable to connect to port 22")
    assert "Error reading SSH protocol banner" in proc.stderr, proc.stderr
    assert proc.stderr.startswith("unreachable: "), proc.stderr
    assert "Traceback" not in proc.stderr and "Exception (client)" not in proc.stderr, proc.stderr
