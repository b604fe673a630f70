"""Child processes shaped like SGLang's: ``sglang::scheduler_TP<n>`` per local rank and
``sglang::detokenizer``, each with PR_SET_PDEATHSIG=SIGKILL.

They are forked from the main process before it imports anything heavy, so each costs a
few MB (copy-on-write). A child waits on a control pipe: EOF (the main process is gone)
ends it, ``x`` makes it exit 1 (the crash_child fault), ``s`` makes it leave a stray
double-forked process (the stray_grandchild fault) whose pid it reports back.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from dataclasses import dataclass

PR_SET_PDEATHSIG = 1


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:
        pass


def set_title(title: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        pass


@dataclass
class Child:
    pid: int
    title: str
    ctl_w: int  # main writes commands here
    expected_exit: bool = False
    exit_status: int | None = None


def scheduler_titles(tp_size: int, pp_size: int, nnodes: int, node_rank: int) -> list[str]:
    """Process titles of this node's scheduler ranks, as SGLang names them."""
    total = tp_size * pp_size
    local = max(1, total // max(nnodes, 1))
    titles = []
    for i in range(node_rank * local, node_rank * local + local):
        pp_rank, tp_rank = divmod(i, tp_size)
        prefix = ""
        if pp_size > 1:
            prefix += f"_PP{pp_rank}"
        if tp_size > 1:
            prefix += f"_TP{tp_rank}"
        titles.append(f"sglang::scheduler{prefix}")
    return titles


def _spawn_stray(report_w: int) -> None:
    """Double-fork a process that outlives its parent and has no parent-death signal."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                set_title("sglang::stray")
                os.write(report_w, f"stray {os.getpid()}\n".encode())
                for fd in (0,):
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                time.sleep(float(os.environ.get("PDOPS_SIM_STRAY_SECONDS", "3600")))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


ESCAPED_CGROUP = "pdops-sim-escaped"


def escape_targets(mountinfo: str) -> list[str]:
    """``cgroup.procs`` files of a cgroup outside every unit (``/pdops-sim-escaped`` at the
    root of the cgroup2 and name=systemd hierarchies), from this process's mount table."""
    from pdops.facts import cgroup as cg  # lazy: before the fork; only an escaping rank reads cgroups

    layout = cg.detect_layout(cg.parse_mountinfo(mountinfo))
    roots = [r for r in (layout.unified_root, layout.systemd_root) if r]
    return [f"{r.rstrip('/')}/{ESCAPED_CGROUP}/cgroup.procs" for r in roots]


def spawn_escaper(targets: list[str]) -> int:
    """Fork ``sglang::scheduler_escaped`` from the main process (the escape_cgroup fault).

    The child keeps every inherited descriptor, the listening sockets included, so the
    instance's ports stay held after the main process exits; a forked child has no
    parent-death signal; it moves itself into ``targets`` (other cgroups), so a stop of
    the unit neither signals it nor sees it in the unit's cgroup. Only raw syscalls run
    after the fork (the parent has threads)."""
    pid = os.fork()
    if pid == 0:
        try:
            me = str(os.getpid()).encode()
            for path in targets:
                try:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    fd = os.open(path, os.O_WRONLY)
                    try:
                        os.write(fd, me)
                    finally:
                        os.close(fd)
                except OSError:
                    pass
            set_title("sglang::scheduler_escaped")
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            time.sleep(float(os.environ.get("PDOPS_SIM_STRAY_SECONDS", "3600")))
        finally:
            os._exit(0)
    return pid


def _child_main(title: str, ctl_r: int, report_w: int, parent: int) -> None:
    set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)
    set_title(title)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        try:
            data = os.read(ctl_r, 1)
        except InterruptedError:
            continue
        if not data:
            os._exit(0)
        if data == b"x":
            os._exit(1)
        if data == b"s":
            _spawn_stray(report_w)


def fork_children(titles: list[str], report_w: int) -> list[Child]:
    """Fork one child per title; call before starting threads or an event loop."""
    children = []
    parent = os.getpid()
    for title in titles:
        ctl_r, ctl_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                for c in children:
                    os.close(c.ctl_w)
                os.close(ctl_w)
                _child_main(title, ctl_r, report_w, parent)
            finally:
                os._exit(0)
        os.close(ctl_r)
        children.append(Child(pid=pid, title=title, ctl_w=ctl_w))
    return children


def send(child: Child, cmd: bytes) -> None:
    try:
        os.write(child.ctl_w, cmd)
    except OSError:
        pass


def reap(children: list[Child]) -> list[Child]:
    """Collect exited children without blocking; returns those that just exited."""
    gone = []
    for c in children:
        if c.exit_status is not None:
            continue
        try:
            pid, status = os.waitpid(c.pid, os.WNOHANG)
        except ChildProcessError:
            c.exit_status = -1
            gone.append(c)
            continue
        if pid:
            c.exit_status = os.waitstatus_to_exitcode(status)
            gone.append(c)
    return gone


def stop_children(children: list[Child], timeout: float = 15.0) -> None:
    """Close control pipes (children exit), wait up to ``timeout``, SIGKILL the rest."""
    for c in children:
        c.expected_exit = True
        try:
            os.close(c.ctl_w)
        except OSError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(c.exit_status is None for c in children):
        reap(children)
        time.sleep(0.02)
    for c in children:
        if c.exit_status is None:
            try:
                os.kill(c.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for c in children:
        if c.exit_status is None:
            try:
                os.waitpid(c.pid, 0)
            except ChildProcessError:
                pass
            c.exit_status = -9
