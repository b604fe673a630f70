# Runs on a host with its system python3 (stdlib only), sent by pdops.steps.preflight.pairing as `python3 -c`.
import concurrent.futures as cf, json, socket, sys
targets, src, timeout = json.loads(sys.argv[1]), sys.argv[2], float(sys.argv[3])
def one(t):
    try:
        socket.create_connection((t[0], t[1]), timeout=timeout, source_address=(src, 0) if src else None).close()
        return [t[0], t[1], True, '']
    except OSError as e:
        return [t[0], t[1], False, str(e) or type(e).__name__]
with cf.ThreadPoolExecutor(32) as ex:
    for r in ex.map(one, targets):
        print(json.dumps(r))
