# One command to HAProxy's runtime API, on the admission host (stdlib only; the host's python3).
# pdops sends it over SSH as `python3 -c <this> SOCKET COMMAND` (pdops.model.admission.runtime_command)
# and prints HAProxy's answer: empty for a command it carried out, else its message.
import socket
import sys

s = socket.socket(socket.AF_UNIX)
s.settimeout(5)
s.connect(sys.argv[1])
s.sendall(sys.argv[2].encode() + b"\n")
out = b""
while True:
    chunk = s.recv(4096)
    if not chunk:
        break
    out += chunk
print(out.decode().strip())
