# Runs on a host with its system python3 (stdlib only), sent by pdops.steps.preflight.pairing as `python3 -c`.
# Waits until each port accepts. Given unit=NAME, it stops waiting as soon as that listener
# unit is no longer running and says why: it binds the port itself, which fails with the
# listener's own error (e.g. [Errno 99] Cannot assign requested address).
import json, socket, subprocess, sys, time
unit = next((a[5:] for a in sys.argv[1:] if a.startswith('unit=')), None)
args = [a for a in sys.argv[1:] if not a.startswith('unit=')]
addr, ports, end, res = args[0], [int(p) for p in args[1:]], time.time() + 5, {}
def alive():
    if not unit:
        return True
    try:
        r = subprocess.run(['systemctl', 'is-active', unit], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return True
    return r.stdout.strip() in ('active', 'activating', 'reloading')
def why(p):
    s = socket.socket(socket.AF_INET6 if ':' in addr else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, p))
        return 'the listener exited (the port itself can be bound: see its journal)'
    except OSError as e:
        return str(e)
    finally:
        s.close()
for p in ports:
    while True:
        try:
            socket.create_connection((addr, p), timeout=1).close()
            res[p] = 'ok'
            break
        except OSError as e:
            if not alive():
                res[p] = why(p)
                break
            if time.time() > end:
                res[p] = str(e) or type(e).__name__
                break
            time.sleep(0.05)
print(json.dumps(res))
