# The cluster's record and lock, on its state host (stdlib only; the host's python3).
#
# pdops sends this script over the SSH connection it already has (`python3 -c <script> <args>`).
# Layout under the state dir D (0700, files 0600, owned by the SSH user, root):
#
#   format.json                  {"format": 1, "cluster": C}: a newer format or another cluster is refused
#   revisions/0001/revision.json one record per change (temp file + fsync + rename)
#   current                      the number of the revision in force
#   journal.jsonl                one JSON line per step of every operation (O_APPEND + fsync)
#   lock.flock                   flock(2) held by the `hold` process for the operation's life
#   lock                         who holds it: operator, machine, operation, op id, since, and the
#                                holder process here (PID and start time); left behind by a holder
#                                that never released, it is the evidence of an interrupted operation
#   moved.json                   {"to", "by", "at", "op_id"}: the record was migrated elsewhere
#                                (`inv state.migrate`); `hold` refuses, reads still answer
#   set-aside-<time>/            an older copy moved aside by a migration back into this dir
#
#   snapshot --dir D --cluster C [--journal]        the record, read-only (creates nothing)
#   revision-snapshot --dir D --cluster C --number N  one revision's snapshot.json, read-only
#   journal  --dir D --cluster C [--op ID] [--last-ops N] [--contains S ...]
#            the journal lines asked for, read-only, filtered here so that only they travel (see
#            query_journal): one operation's, the last N operations' (read backwards from the end of
#            the file, however long it is), those containing every S; options combine as AND
#   hold     --dir D --cluster C --holder JSON --lease S [--even-if-moved]
#            takes the lock (refused when moved.json says the record moved, unless --even-if-moved:
#            a migration back) or answers who holds it; then serves JSON requests, one per line on
#            stdin (ping, journal, put-revision, snapshot-of, set-current, snapshot, journal-of,
#            journal-query {op_id, last_ops, contains}, mark-moved {to}, set-aside, release) until
#            release, end of input (the
#            operator's session ended: laptop gone, SSH cut, process killed) or S seconds without
#            a word (lease expired). The kernel frees the flock when this process ends, however it ends.
#   unlock   --dir D --cluster C --by JSON --reason R --op-id ID
#            ends a live holder process (by its recorded PID and start time, never by name),
#            removes the lock file and journals who did it and why.
import argparse
import errno
import fcntl
import json
import os
import select
import signal
import stat
import sys
import time

FORMAT = 1
# A record marked as moved (`inv state.migrate`) says format 2: a pdops that does not know moved.json
# (format 1 only) refuses it as newer instead of taking its lock; this one reads it with moved.json.
MOVED_FORMAT = 2


class Refusal(Exception):
    def __init__(self, code, message, **extra):
        super().__init__(message)
        self.code, self.message, self.extra = code, message, extra


def reply(doc):
    sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
    sys.stdout.flush()


def now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, text):
    tmp = "%s.%d.tmp" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except ValueError:
        return {"unreadable": open(path, encoding="utf-8", errors="replace").read()[-500:]}


def proc_start(pid):
    """The start time (clock ticks since boot) of `pid`, or None when there is no such process."""
    try:
        with open("/proc/%d/stat" % int(pid), "rb") as f:
            data = f.read().decode("utf-8", "replace")
    except (OSError, ValueError, TypeError):
        return None
    return int(data[data.rindex(")") + 2:].split()[19])


def boot_id():
    try:
        return open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        return ""


def check_dir(d, create):
    """The state dir must be absolute, owned by us and writable by nobody else, nor may any
    directory above it be (without the sticky bit). Returns False when it does not exist."""
    if not os.path.isabs(d):
        raise Refusal("dir", "state dir %r is not an absolute path" % d)
    if not os.path.lexists(d):
        if not create:
            return False
        parent = os.path.dirname(d)
        os.makedirs(parent, mode=0o755, exist_ok=True)
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise Refusal("dir", "state dir %s is not a directory" % d)
    if st.st_uid != os.geteuid():
        raise Refusal("dir", "state dir %s is owned by uid %d, not by uid %d" % (d, st.st_uid, os.geteuid()))
    if st.st_mode & 0o022:
        raise Refusal("dir", "state dir %s is writable by others (mode %04o)" % (d, stat.S_IMODE(st.st_mode)))
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)  # readable by others: only root may read the record
    up = os.path.dirname(d)
    while True:
        pst = os.stat(up)
        if pst.st_mode & 0o002 and not pst.st_mode & stat.S_ISVTX:
            raise Refusal("dir", "%s, above the state dir, is world-writable" % up)
        if up == "/":
            break
        up = os.path.dirname(up)
    return True


def check_format(d, cluster, write):
    path = os.path.join(d, "format.json")
    doc = read_json(path)
    if doc is None:
        if write:
            atomic_write(path, json.dumps({"format": FORMAT, "cluster": cluster, "created": now()}) + "\n")
        return
    fmt = doc.get("format")
    if not isinstance(fmt, int):
        raise Refusal("format", "%s is not a pdops record format file" % path)
    if fmt == MOVED_FORMAT and os.path.isfile(os.path.join(d, "moved.json")):
        pass
    elif fmt > FORMAT:
        raise Refusal("newer", "the record in %s was written by a newer pdops (record format %d; this pdops "
                      "reads format %d)" % (d, fmt, FORMAT), format=fmt)
    if doc.get("cluster") != cluster:
        raise Refusal("cluster", "the record in %s is cluster %r's, not %r's" % (d, doc.get("cluster"), cluster))


def lock_doc(d):
    doc = read_json(os.path.join(d, "lock"))
    if doc is None:
        return None
    try:
        doc["last_seen_s"] = round(time.time() - os.stat(os.path.join(d, "lock")).st_mtime, 1)
    except OSError:
        pass
    pid, start = doc.get("state_pid"), doc.get("state_start")
    doc["holder_alive"] = bool(pid) and proc_start(pid) == start and doc.get("boot_id") == boot_id()
    return doc


def snapshot(d, with_journal=False):
    revs = {}
    rdir = os.path.join(d, "revisions")
    if os.path.isdir(rdir):
        for name in sorted(os.listdir(rdir)):
            doc = read_json(os.path.join(rdir, name, "revision.json")) if name.isdigit() else None
            if doc is not None:  # a numbered dir without revision.json is a crash leftover
                revs[str(int(name))] = doc
    try:
        cur = open(os.path.join(d, "current")).read().strip()
    except FileNotFoundError:
        cur = None
    out = {"ok": True, "exists": True, "current": int(cur) if cur and cur.isdigit() else cur, "revisions": revs,
           "lock": lock_doc(d), "moved": read_json(os.path.join(d, "moved.json"))}
    if with_journal:
        out["journal"] = journal_lines(d)
    return out


def journal_lines(d, op_id=None):
    try:
        with open(os.path.join(d, "journal.jsonl"), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    if op_id is None:
        return lines
    return [ln for ln in lines if ('"op_id": %s' % json.dumps(op_id)) in ln]


JOURNAL_BLOCK = 65536  # bytes read at a time when reading the journal backwards


def _forward_lines(f):
    """The lines of the binary file `f`, first first, without their newline: one line in memory at a time."""
    for raw in f:
        yield raw[:-1] if raw.endswith(b"\n") else raw


def _backward_lines(fd, block=JOURNAL_BLOCK):
    """The lines of the file open at `fd`, last first, as bytes without their newline, read in blocks of
    `block` bytes from its end: the caller stops when it has enough, and the rest is never read. A line
    (or a UTF-8 character) cut by a block boundary is joined before it is given."""
    pos = os.fstat(fd).st_size
    pieces = []  # the end of the line being read, its last piece first
    while pos > 0:
        n = min(block, pos)
        pos -= n
        chunk = os.pread(fd, n, pos)
        parts = chunk.split(b"\n")
        if len(parts) == 1:
            pieces.append(chunk)
            continue
        pieces.append(parts[-1])
        yield b"".join(reversed(pieces))
        for part in reversed(parts[1:-1]):
            yield part
        pieces = [parts[0]]
    yield b"".join(reversed(pieces))


def _record(raw):
    """(line, record) of a journal line, or None when it is not a JSON object (a torn line)."""
    try:
        line = raw.decode("utf-8")
        rec = json.loads(line)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError alike
        return None
    return (line, rec) if isinstance(rec, dict) else None


def _op_key(op):
    return op if op is None or isinstance(op, str) else json.dumps(op, sort_keys=True)


def _last_ops(fd, n):
    """(line, record) of the last `n` operations, in file order: lines are read backwards until one of an
    (n+1)-th operation (distinct op_id) comes. Torn lines are skipped."""
    seen, out = set(), []
    if n <= 0:
        return out
    for raw in _backward_lines(fd):
        got = _record(raw)
        if got is None:
            continue
        key = _op_key(got[1].get("op_id"))
        if key not in seen:
            if len(seen) == n:
                break
            seen.add(key)
        out.append(got)
    out.reverse()
    return out


def query_journal(d, op_id=None, last_ops=None, contains=()):
    """The journal lines (raw strings, in file order) that pass every filter given: `op_id` (the lines of
    that operation), `last_ops` (those of the last N operations, found reading backwards from the end of
    the file: the time does not grow with its length) and `contains` (those containing every string
    given). Torn lines (not JSON) are skipped by `op_id` and `last_ops`. With no filter: every line, as
    journal_lines."""
    if last_ops is not None and (isinstance(last_ops, bool) or not isinstance(last_ops, int) or last_ops < 0):
        raise Refusal("request", "last_ops must be a number of operations (0 or more), not %r" % (last_ops,))
    if isinstance(contains, str) or not all(isinstance(c, str) for c in contains):
        raise Refusal("request", "contains must be a list of strings, not %r" % (contains,))
    if op_id is None and last_ops is None and not contains:
        return journal_lines(d)
    needles = [c.encode("utf-8") for c in contains]
    path = os.path.join(d, "journal.jsonl")
    try:
        with open(path, "rb") as f:
            if last_ops is not None:
                return [line for line, rec in _last_ops(f.fileno(), last_ops)
                        if (op_id is None or rec.get("op_id") == op_id) and all(c in line for c in contains)]
            if op_id is not None:
                needles.append(('"op_id": %s' % json.dumps(op_id)).encode("utf-8"))
            out = []
            for raw in _forward_lines(f):
                if not all(c in raw for c in needles):
                    continue
                if op_id is None:
                    out.append(raw.decode("utf-8", "replace"))
                    continue
                got = _record(raw)
                if got is not None and got[1].get("op_id") == op_id:
                    out.append(got[0])
            return out
    except FileNotFoundError:
        return []
    except OSError as e:
        raise Refusal("journal", "cannot read %s: %s" % (path, e))


def append_journal(d, line):
    if "\n" in line:
        raise Refusal("journal", "a journal record must be one line")
    fd = os.open(os.path.join(d, "journal.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (line + "\n").encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)


def read_snapshot(d, number):
    path = os.path.join(d, "revisions", "%04d" % int(number), "snapshot.json")
    return read_json(path) if os.path.isfile(path) else None


def put_revision(d, doc, number, snap=None):
    rdir = os.path.join(d, "revisions")
    os.makedirs(rdir, mode=0o700, exist_ok=True)
    if number is None:  # a new revision: mkdir is the atomic claim of the next number
        taken = [int(n) for n in os.listdir(rdir) if n.isdigit()]
        number = max(taken, default=0) + 1
        while True:
            try:
                os.mkdir(os.path.join(rdir, "%04d" % number), 0o700)
                break
            except FileExistsError:
                number += 1
    else:
        os.makedirs(os.path.join(rdir, "%04d" % int(number)), mode=0o700, exist_ok=True)
    doc["number"] = int(number)
    if snap is not None:  # before revision.json: a revision is complete once that exists
        atomic_write(os.path.join(rdir, "%04d" % int(number), "snapshot.json"), json.dumps(snap, sort_keys=True) + "\n")
    atomic_write(os.path.join(rdir, "%04d" % int(number), "revision.json"),
                 json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return int(number)


def set_current(d, number):
    if not os.path.isfile(os.path.join(d, "revisions", "%04d" % int(number), "revision.json")):
        raise Refusal("revision", "no revision %s to make current" % number)
    atomic_write(os.path.join(d, "current"), "%d\n" % int(number))


def read_lines(fd, timeout):
    """Lines from `fd`; None at end of input; raises TimeoutError after `timeout` s of silence."""
    buf = b""
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode("utf-8")
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            raise TimeoutError
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        buf += chunk


def set_aside(d):
    """Move the record's files into set-aside-<time>/ (kept, never deleted): a migration back into
    a dir that holds an older copy of the same record."""
    aside = os.path.join(d, "set-aside-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    os.mkdir(aside, 0o700)
    moved = []
    fmt = read_json(os.path.join(d, "format.json")) or {}
    atomic_write(os.path.join(d, "format.json"), json.dumps(dict(fmt, format=FORMAT)) + "\n")  # no longer moved
    for name in ("revisions", "current", "journal.jsonl", "moved.json"):
        if os.path.lexists(os.path.join(d, name)):
            os.rename(os.path.join(d, name), os.path.join(aside, name))
            moved.append(name)
    fsync_dir(d)
    return aside, moved


def hold(a):
    d = a.dir
    check_dir(d, create=True)
    check_format(d, a.cluster, write=True)
    moved = read_json(os.path.join(d, "moved.json"))
    if moved is not None and not a.even_if_moved:
        reply({"ok": False, "error": "moved", "message": "the record in %s was moved to %s by %s at %s" % (
            d, moved.get("to"), moved.get("by"), moved.get("at"))})
        return
    fd = os.open(os.path.join(d, "lock.flock"), os.O_WRONLY | os.O_CREAT, 0o600)
    # The holder takes the flock, then writes who it is: a contender in between would name nobody.
    # So a contender waits (up to 2 s) for a live holder's record, trying the flock again meanwhile
    # (the holder may also be releasing it).
    waited_until = time.time() + 2.0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        holder = lock_doc(d)
        if (holder is not None and holder.get("holder_alive")) or time.time() > waited_until:
            reply({"ok": False, "error": "locked", "holder": holder})
            return
        time.sleep(0.05)
    moved = read_json(os.path.join(d, "moved.json"))  # again, under the flock: a migration may just have marked it
    if moved is not None and not a.even_if_moved:
        reply({"ok": False, "error": "moved", "message": "the record in %s was moved to %s by %s at %s" % (
            d, moved.get("to"), moved.get("by"), moved.get("at"))})
        return
    lock_path = os.path.join(d, "lock")
    previous = read_json(lock_path)  # we hold the flock: whoever wrote it is gone without releasing
    me = dict(json.loads(a.holder))
    me.update(state_pid=os.getpid(), state_start=proc_start(os.getpid()), boot_id=boot_id(),
              ssh_client=(os.environ.get("SSH_CLIENT") or "").split(" ")[0], taken=now(), lease_s=a.lease)
    atomic_write(lock_path, json.dumps(me, indent=2, sort_keys=True) + "\n")
    reply({"ok": True, "interrupted": previous, "holder": me, "snapshot": snapshot(d)})
    try:
        for line in read_lines(0, a.lease):
            req = json.loads(line)
            op = req.get("op")
            try:
                os.utime(lock_path)  # last word from the holder: shown as last_seen_s
                if op == "ping":
                    reply({"ok": True})
                elif op == "journal":
                    for ln in req.get("lines") or [req["line"]]:
                        append_journal(d, ln)
                    reply({"ok": True})
                elif op == "put-revision":
                    reply({"ok": True, "number": put_revision(d, req["doc"], req.get("number"), req.get("snapshot"))})
                elif op == "snapshot-of":
                    reply({"ok": True, "snapshot": read_snapshot(d, req["number"])})
                elif op == "set-current":
                    set_current(d, req["number"])
                    reply({"ok": True})
                elif op == "snapshot":
                    reply(snapshot(d))
                elif op == "journal-of":
                    reply({"ok": True, "lines": journal_lines(d, req["op_id"])})
                elif op == "journal-query":
                    reply({"ok": True, "lines": query_journal(d, req.get("op_id"), req.get("last_ops"),
                                                              req.get("contains") or ())})
                elif op == "mark-moved":
                    atomic_write(os.path.join(d, "moved.json"), json.dumps(req["doc"], sort_keys=True) + "\n")
                    fmt = read_json(os.path.join(d, "format.json")) or {}
                    atomic_write(os.path.join(d, "format.json"), json.dumps(dict(fmt, format=MOVED_FORMAT)) + "\n")
                    reply({"ok": True})
                elif op == "set-aside":
                    aside, names = set_aside(d)
                    reply({"ok": True, "aside": aside, "moved": names})
                elif op == "release":
                    os.unlink(lock_path)
                    reply({"ok": True, "released": True})
                    return
                else:
                    reply({"ok": False, "error": "request", "message": "unknown request %r" % op})
            except Refusal as r:
                reply({"ok": False, "error": r.code, "message": r.message})
    except TimeoutError:
        append_journal(d, json.dumps({"ts": now(), "op_id": me.get("op_id"), "step": "lock.lease-expired",
                                      "status": "failed", "evidence": {"lease_s": a.lease, "holder": me}},
                                     sort_keys=True))
    # end of input or lease expired: the lock file stays as the evidence of an unfinished operation


def unlock(a):
    d = a.dir
    if not check_dir(d, create=False):
        reply({"ok": True, "was": None})
        return
    check_format(d, a.cluster, write=False)
    before = lock_doc(d)
    ended = None
    fd = os.open(os.path.join(d, "lock.flock"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        if not before or not before.get("holder_alive"):
            raise Refusal("unknown-holder", "lock.flock in %s is held, but not by the process the lock file "
                          "names: pdops will not end a process it cannot identify" % d, holder=before)
        os.kill(int(before["state_pid"]), signal.SIGTERM)  # by recorded PID, checked against its start time
        ended = {"pid": before["state_pid"], "start": before["state_start"]}
        deadline = time.time() + 10
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.time() > deadline:
                    raise Refusal("still-held", "the holder process %s did not end within 10 s" % ended["pid"])
                time.sleep(0.05)
    try:
        os.unlink(os.path.join(d, "lock"))
    except FileNotFoundError:
        pass
    by = json.loads(a.by)
    append_journal(d, json.dumps({"ts": now(), "op_id": a.op_id, "step": "lock.unlock-forced", "status": "note",
                                  "evidence": {"reason": a.reason, "by": by, "previous_holder": before,
                                               "ended_holder_process": ended}}, sort_keys=True))
    reply({"ok": True, "was": before, "ended": ended})


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("snapshot", "hold", "unlock", "revision-snapshot", "journal"):
        s = sub.add_parser(name)
        s.add_argument("--dir", required=True)
        s.add_argument("--cluster", required=True)
        if name == "revision-snapshot":
            s.add_argument("--number", type=int, required=True)
        if name == "snapshot":
            s.add_argument("--journal", action="store_true")
        if name == "journal":
            s.add_argument("--op")
            s.add_argument("--last-ops", type=int)
            s.add_argument("--contains", action="append", default=[])
        if name == "hold":
            s.add_argument("--holder", required=True)
            s.add_argument("--lease", type=float, default=60.0)
            s.add_argument("--even-if-moved", action="store_true")
        if name == "unlock":
            s.add_argument("--by", required=True)
            s.add_argument("--reason", required=True)
            s.add_argument("--op-id", required=True)
    a = p.parse_args()
    os.umask(0o077)
    try:
        if a.cmd == "snapshot":
            if not check_dir(a.dir, create=False):
                reply({"ok": True, "exists": False, "current": None, "revisions": {}, "lock": None, "journal": []})
                return
            check_format(a.dir, a.cluster, write=False)
            reply(snapshot(a.dir, a.journal))
        elif a.cmd == "revision-snapshot":
            if not check_dir(a.dir, create=False):
                reply({"ok": True, "snapshot": None})
                return
            check_format(a.dir, a.cluster, write=False)
            reply({"ok": True, "snapshot": read_snapshot(a.dir, a.number)})
        elif a.cmd == "journal":
            if not check_dir(a.dir, create=False):
                reply({"ok": True, "lines": [], "total_lines": None})
                return
            check_format(a.dir, a.cluster, write=False)
            reply({"ok": True, "lines": query_journal(a.dir, a.op, a.last_ops, a.contains)})
        elif a.cmd == "hold":
            hold(a)
        else:
            unlock(a)
    except Refusal as r:
        reply({"ok": False, "error": r.code, "message": r.message, **r.extra})


if __name__ == "__main__":
    main()
