"""How many concurrent streams one sim instance sustains, and what it costs in CPU.

Starts one sim (no PD), opens N concurrent streaming /generate requests on loopback,
and prints: streams completed, wall time, tokens/s, and the sim's CPU seconds per 1,000
generated tokens (from /proc of the sim and its children). Not a timed test.

    .venv/bin/python bench/sim_streams.py [--streams 500] [--tokens 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
import psutil

from pdops.sim.testing import start_sim
from pdops.model.prompts import make_prompt


def cpu_seconds(pid: int) -> float:
    p = psutil.Process(pid)
    t = p.cpu_times()
    total = t.user + t.system
    for c in p.children(recursive=True):
        ct = c.cpu_times()
        total += ct.user + ct.system
    return total


async def one(session, url, i, tokens, ttfts):
    body = {"text": make_prompt(200, i), "stream": True, "sampling_params": {"max_new_tokens": tokens}}
    t0 = time.monotonic()
    last = None
    first = None
    async with session.post(url + "/generate", json=body) as r:
        assert r.status == 200, r.status
        async for line in r.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                if first is None:
                    first = time.monotonic() - t0
                last = line
    ttfts.append(first)
    return json.loads(last[6:])["meta_info"]["completion_tokens"]


async def run(url, streams, tokens):
    ttfts = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        got = await asyncio.gather(*(one(s, url, i, tokens, ttfts) for i in range(streams)))
    return got, ttfts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=500)
    ap.add_argument("--tokens", type=int, default=200)
    ns = ap.parse_args()
    h = start_sim(["--tp-size", "8", "--max-running-requests", str(max(ns.streams, 1))], {"PDOPS_SIM_LOG_LEVEL": "WARNING"})
    try:
        rss = psutil.Process(h.pid).memory_info().rss
        cpu0 = cpu_seconds(h.pid)
        t0 = time.monotonic()
        got, ttfts = asyncio.run(run(h.url, ns.streams, ns.tokens))
        wall = time.monotonic() - t0
        cpu = cpu_seconds(h.pid) - cpu0
        total = sum(got)
        ttfts.sort()
        print(f"streams completed      {len(got)}/{ns.streams} (all {ns.tokens} tokens: {all(g == ns.tokens for g in got)})")
        print(f"wall time              {wall:.2f} s")
        print(f"generated tokens       {total}  ({total / wall:.0f} tokens/s)")
        print(f"TTFT p50 / p99         {ttfts[len(ttfts) // 2] * 1000:.0f} ms / {ttfts[int(len(ttfts) * 0.99) - 1] * 1000:.0f} ms")
        print(f"sim CPU time           {cpu:.2f} s  = {cpu / total * 1000:.3f} CPU-s per 1,000 tokens")
        print(f"sim main RSS at start  {rss / 2**20:.0f} MiB (+ {len(h.state().get('children', []))} tiny children)")
    finally:
        h.stop()


if __name__ == "__main__":
    main()
