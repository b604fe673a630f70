"""A sim node with --node-rank >= 1: it joins rank 0 over TCP, serves no HTTP, and exits with it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time

from pdops.sim import procs

log = logging.getLogger("pdops.sim")


async def run_follower(args, children) -> int:
    """A node with --node-rank >= 1: join rank 0 over TCP, serve no HTTP, exit with it."""
    host, _, port = args.dist_init_addr.rpartition(":")
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: log.info("SIGTERM received on node rank %d: ignored; exits when rank 0 exits", args.node_rank))
    deadline = time.monotonic() + float(args.all.get("dist_timeout") or 600)
    while True:
        try:
            reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
            break
        except OSError:
            if time.monotonic() > deadline:
                log.error("could not join rank 0 at %s", args.dist_init_addr)
                procs.stop_children(children, 1)
                return 1
            await asyncio.sleep(0.2)
    writer.write(f"node_rank {args.node_rank} pid {os.getpid()} {socket.gethostname()}\n".encode())
    await writer.drain()
    log.info("node rank %d joined rank 0 at %s", args.node_rank, args.dist_init_addr)

    async def watch():
        while True:
            await asyncio.sleep(0.2)
            for c in procs.reap(children):
                if not c.expected_exit:
                    return 1

    w = asyncio.create_task(watch())
    r = asyncio.create_task(reader.read())
    done, _ = await asyncio.wait({w, r}, return_when=asyncio.FIRST_COMPLETED)
    code = w.result() if w in done else 0
    w.cancel()
    r.cancel()
    log.info("rank 0 is gone; node rank %d exits", args.node_rank)
    procs.stop_children(children, 1)
    return code or 0
