# Runs on a host with its system python3 (stdlib only), sent by pdops.steps.preflight.pairing as `python3 -c`.
import selectors, socket, sys
addr = sys.argv[1]
sel = selectors.DefaultSelector()
for p in sys.argv[2:]:
    s = socket.socket(socket.AF_INET6 if ':' in addr else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((addr, int(p)))
        s.listen(128)
    except OSError as e:
        sys.exit(f'cannot listen on {addr}:{p}: {e}')
    sel.register(s, selectors.EVENT_READ)
while True:
    for key, _ in sel.select():
        conn, _ = key.fileobj.accept()
        conn.close()
