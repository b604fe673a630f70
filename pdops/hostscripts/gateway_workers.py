# The gateway's start-up worker list, on the gateway host (stdlib only; python3 or the gateway's python).
#
# /etc/pdops/gateway-workers.json names the workers the gateway must serve: pdops adds an
# instance after the gateway lists it healthy and removes it before it asks the gateway to drop
# it, so a drained or removed instance never comes back. smg keeps registrations only in memory;
# the gateway unit runs `register` after every start (ExecStartPost), so a crashed, restarted or
# rebooted gateway gets the same workers again with no person involved.
#
#   update   --file F [--clear] [--add JSON-list] [--remove id ...] [--revision N]   (pdops, over SSH)
#   show     --file F                                                     (pdops, over SSH)
#   register --file F --gateway URL [--key-file K] [--wait-s S]           (ExecStartPost)
import argparse
import fcntl
import json
import os
import sys
import time
import urllib.error
import urllib.request


def _read(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _write(path, doc):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def update(a):
    with open(a.file + ".lock", "a") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        doc = {"workers": []} if a.clear else (_read(a.file) or {"workers": []})
        workers = {w["instance"]: w for w in doc.get("workers", [])}
        for w in json.loads(a.add or "[]"):
            workers[w["instance"]] = w
        for i in a.remove or []:
            workers.pop(i, None)
        doc["workers"] = [workers[k] for k in sorted(workers)]
        if a.revision is not None:
            doc["revision"] = a.revision
        doc["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        _write(a.file, doc)
    print(json.dumps(doc))


def show(a):
    print(json.dumps(_read(a.file)))


def _http(method, url, key, body=None, timeout=5):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        return None, str(getattr(e, "reason", e))


def register(a):
    doc = _read(a.file)
    if not doc or not doc.get("workers"):
        print(f"pdops: no workers in {a.file}: nothing to register")
        return 0
    key = None
    if a.key_file:
        with open(a.key_file, encoding="utf-8") as f:
            key = f.read().strip() or None
    gw = a.gateway.rstrip("/")
    deadline = time.monotonic() + a.wait_s
    while True:
        status, _ = _http("GET", gw + "/health", key, timeout=2)
        if status is not None:
            break
        if time.monotonic() > deadline:
            print(f"pdops: gateway {gw} did not answer /health within {a.wait_s:g}s: nothing registered", file=sys.stderr)
            return 1
        time.sleep(0.2)
    status, text = _http("GET", gw + "/workers", key)
    listed = set()
    if status == 200:
        listed = {w.get("url", "").rstrip("/") for w in json.loads(text).get("workers", [])}
    failed = 0
    for w in doc["workers"]:
        if w["url"].rstrip("/") in listed:
            print(f"pdops: {w['instance']} {w['url']} already listed")
            continue
        body = {"url": w["url"], "worker_type": w["worker_type"]}
        if w.get("bootstrap_port") is not None:
            body["bootstrap_port"] = w["bootstrap_port"]
        status, text = _http("POST", gw + "/workers", key, body)
        ok = status in (200, 201, 202)
        failed += not ok
        print(f"pdops: {'queued' if ok else 'FAILED'} {w['instance']} {w['url']} ({w['worker_type']}): HTTP {status} "
              f"{text[:200]}", file=sys.stdout if ok else sys.stderr)
    print(f"pdops: revision {doc.get('revision')}: {len(doc['workers']) - failed} of {len(doc['workers'])} worker(s) "
          "queued or listed; the gateway probes each until it is healthy")
    return 1 if failed else 0


def main(argv):
    p = argparse.ArgumentParser(prog="pdops-gateway-workers")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("update", "show", "register"):
        s = sub.add_parser(name)
        s.add_argument("--file", required=True)
        if name == "update":
            s.add_argument("--add")
            s.add_argument("--remove", nargs="*")
            s.add_argument("--revision", type=int)
            s.add_argument("--clear", action="store_true", help="start from an empty list")
        if name == "register":
            s.add_argument("--gateway", required=True)
            s.add_argument("--key-file")
            s.add_argument("--wait-s", type=float, default=45.0)
    a = p.parse_args(argv)
    return {"update": update, "show": show, "register": register}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
