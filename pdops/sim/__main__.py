"""Entry point: ``python -m pdops.sim <SGLang launch_server flags>``.

Parses the flags, forks the tiny rank children before anything heavy is imported,
then runs the HTTP server (node rank 0) or joins rank 0 (node rank >= 1).
"""

from __future__ import annotations

import logging
import os
import sys

from pdops.sim import procs
from pdops.sim.args import parse_args
from pdops.model.sim_faults import parse_faults
from pdops.sim.memory import MemoryModel
from pdops.sim.timing import TimingModel


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    timing = TimingModel.from_env()
    try:
        faults = parse_faults(os.environ.get("PDOPS_SIM_FAULTS"))
    except ValueError as e:
        raise SystemExit(f"pdops.sim: {e}") from None
    logging.basicConfig(
        level=os.environ.get("PDOPS_SIM_LOG_LEVEL", "INFO"),
        format=f"[%(asctime)s sim {args.mode} :{args.port}] %(message)s",
    )
    # The gateway probes each worker with HTTP/2 prior knowledge first; the refusal
    # (as from SGLang's HTTP/1.1 server) is expected and not worth a traceback.
    logging.getLogger("aiohttp.server").addFilter(
        lambda r: not (r.exc_info and "PRI/Upgrade" in str(r.exc_info[1]))
    )
    mem = MemoryModel.from_env(args)
    if mem is not None and mem.startup_error():
        # as SGLang: the scheduler cannot allocate its pools, the server exits 1 before serving
        logging.getLogger("pdops.sim").error("Scheduler hit an exception: %s", mem.startup_error())
        return 1
    report_r, report_w = os.pipe()
    titles = procs.scheduler_titles(args.tp_size, args.pp_size, args.nnodes, args.node_rank)
    if args.node_rank == 0:
        titles.append("sglang::detokenizer")
    children = procs.fork_children(titles, report_w)
    os.close(report_w)

    import asyncio  # the heavy imports come after the fork

    if args.node_rank >= 1:
        from pdops.sim.follower import run_follower  # lazy: aiohttp and the engine load after the fork

        return asyncio.run(run_follower(args, children))
    from pdops.sim.server import SimServer  # lazy: aiohttp and the engine load after the fork

    server = SimServer(args, timing, faults, children, report_r)
    return asyncio.run(server.run())


if __name__ == "__main__":
    sys.exit(main())
