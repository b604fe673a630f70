"""Load with a ledger: generation requests through the gateway, one row per request.

Every request carries its own request ID (`rid` and `x-request-id`). A failed or
unknown-state request is recorded, never retried (rule 3).

`run_load` keeps a fixed concurrency with one worker coroutine per slot: each worker
sends its next request as soon as its previous one ended, until `requests` have been
sent or `duration` seconds have passed (requests already sent are always waited out
and recorded). Streams are read line by line; only the first and the last data chunk
are parsed as JSON, so the client's CPU cost per token stays flat however long the
(cumulative-text) chunks grow; bytes are read as they arrive and split into lines here. Chunk arrival gaps are kept as the row's inter-token
latencies (`itl`), as SGLang's own bench_serving counts them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping

import aiohttp

# Statuses a row can end with. `http_<code>` for any non-200 answer.
STATUSES = ("ok", "timeout", "aborted", "error")

# (response headers) -> (prefill instance, decode instance); None where unknown.
RouteFromHeaders = Callable[[Mapping[str, str]], "tuple[str | None, str | None]"]


@dataclass
class LedgerRow:
    rid: str
    stream: bool
    start: float
    first_token: float | None = None
    end: float | None = None
    status: str = "pending"  # ok | http_<code> | timeout | aborted | error
    http_status: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)
    prefill_instance: str | None = None
    decode_instance: str | None = None
    chunks: int = 0
    itl: list = field(default_factory=list)  # seconds between consecutive stream chunks

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "LedgerRow":
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in known})


def _meta(doc: dict) -> dict:
    meta = doc.get("meta_info")
    return meta if isinstance(meta, dict) else {}


async def _read_stream(resp: aiohttp.ClientResponse, row: LedgerRow) -> dict | None:
    """Read an SSE stream; returns the last chunk's meta_info, or None (row marked) on a bad stream.

    Reads whatever bytes have arrived (`iter_any`) and splits lines here: far fewer
    event-loop round trips than a readline per line when a thousand streams share a core.
    Every data line in one read gets that read's arrival time.
    """
    first: bytes | None = None
    last: bytes | None = None
    prev_t: float | None = None
    itl = row.itl
    buf = b""
    done = False
    async for block in resp.content.iter_any():
        now = time.time()
        buf += block
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            if not raw.startswith(b"data:"):
                continue
            data = raw[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            if data.startswith(b'{"error"'):
                row.status = "error"
                row.error = data.decode(errors="replace")[-300:]
                return None
            if prev_t is None:
                row.first_token = now
                first = data
            else:
                itl.append(now - prev_t)
            prev_t = now
            row.chunks += 1
            last = data
        if done:
            break
    if not done:
        row.status = "error"
        row.error = "stream ended without [DONE]"
        return None
    if last is None:
        row.status = "error"
        row.error = "stream had no data chunk"
        return None
    json.loads(first)  # a malformed first chunk is a protocol error (ValueError in the caller)
    doc = json.loads(last)
    if isinstance(doc, dict) and "error" in doc:
        row.status = "error"
        row.error = json.dumps(doc["error"])[-300:]
        return None
    return _meta(doc)


async def _one(session: aiohttp.ClientSession, url: str, body: dict, row: LedgerRow, timeout: float,
               headers: dict, route_from_headers: RouteFromHeaders | None = None) -> None:
    try:
        async with session.post(url, json=body, headers={"x-request-id": row.rid, **headers},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            row.http_status = resp.status
            if route_from_headers is not None:
                row.prefill_instance, row.decode_instance = route_from_headers(resp.headers)
            if resp.status != 200:
                row.status = f"http_{resp.status}"
                row.error = (await resp.text())[-300:]
                return
            if not row.stream:
                doc = await resp.json(content_type=None)
                row.first_token = time.time()
                meta = _meta(doc)
            else:
                meta = await _read_stream(resp, row)
                if meta is None:
                    return
            row.prompt_tokens = meta.get("prompt_tokens")
            row.completion_tokens = meta.get("completion_tokens")
            fr = meta.get("finish_reason")
            row.finish_reason = fr.get("type") if isinstance(fr, dict) else fr
            row.status = "ok" if row.finish_reason != "abort" else "aborted"
    except asyncio.TimeoutError:
        row.status = "timeout"
    except aiohttp.ClientError as exc:
        row.status = "error"
        row.error = f"{type(exc).__name__}: {exc}"
    except ValueError as exc:  # malformed JSON or an over-long line: a protocol error
        row.status = "error"
        row.error = f"protocol: {type(exc).__name__}: {exc}"[:300]
    except asyncio.CancelledError:
        row.status = "aborted"
        row.error = "client cancelled the run"
        raise
    finally:
        row.end = time.time()


async def run_load(base_url: str, *, requests: int | None = None, concurrency: int, prompt: str | None = None,
                   max_new_tokens: int = 16, stream_every: int = 2, timeout: float = 120.0,
                   rid_prefix: str = "pdops-load", ignore_eos: bool = True, headers: dict | None = None,
                   prompt_for=None, duration: float | None = None,
                   route_from_headers: RouteFromHeaders | None = None) -> list[LedgerRow]:
    """Send generation requests at a fixed `concurrency`; every `stream_every`-th streams.

    Stops after `requests` requests, or once `duration` seconds have passed (whichever
    comes first when both are given); rows are in the order requests were sent.
    """
    if requests is None and duration is None:
        raise ValueError("run_load needs requests or duration")
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    rows: list[LedgerRow] = []
    url = base_url.rstrip("/") + "/generate"
    counter = itertools.count()
    deadline = None if duration is None else time.monotonic() + duration
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn, read_bufsize=1 << 20) as session:
        async def worker() -> None:
            while True:
                i = next(counter)
                if requests is not None and i >= requests:
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    return
                stream = stream_every > 0 and i % stream_every == 0
                row = LedgerRow(rid=f"{rid_prefix}-{i:06d}-{uuid.uuid4().hex[:8]}", stream=stream, start=time.time())
                rows.append(row)
                text = prompt_for(i) if prompt_for else (prompt or f"pdops load request {i}")
                body = {"text": text, "rid": row.rid, "stream": stream,
                        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos}}
                await _one(session, url, body, row, timeout, headers or {}, route_from_headers)

        n_workers = concurrency if requests is None else min(concurrency, requests)
        await asyncio.gather(*(worker() for _ in range(n_workers)))
    return rows


def send(base_url: str, **kw) -> list[LedgerRow]:
    """Synchronous wrapper of run_load."""
    return asyncio.run(run_load(base_url, **kw))


async def run_pair(prefill_url: str, decode_url: str, bootstrap_host: str, bootstrap_port: int, *, requests: int,
                   concurrency: int, prompt_for, max_new_tokens: int = 16, timeout: float = 600.0,
                   rid_prefix: str = "pdops-probe", headers: dict | None = None) -> list[LedgerRow]:
    """Requests straight to one prefill x decode pair, sent as the gateway sends them: the same body
    (bootstrap address and a room of its own) to both at once; the decode's answer is the row, the
    prefill's is kept in ``row.extra["prefill"]``. When the decode fails first the prefill is told to
    drop the room (POST /abort_request). Never retried."""
    import random

    if concurrency < 1 or requests < 1:
        raise ValueError("run_pair needs at least one request and a concurrency of at least 1")
    rows: list[LedgerRow] = []
    counter = itertools.count()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, read_bufsize=1 << 20) as session:
        async def prefill_side(body: dict, row: LedgerRow) -> None:
            side = row.extra.setdefault("prefill", {})
            try:
                async with session.post(prefill_url.rstrip("/") + "/generate", json=body,
                                        headers={"x-request-id": row.rid, **(headers or {})},
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                    side["http_status"] = resp.status
                    text = await resp.text()
                    if resp.status != 200:
                        side["error"] = text[:1000]
                    else:
                        try:
                            fr = _meta(json.loads(text)).get("finish_reason")
                        except ValueError:
                            fr = None
                        if isinstance(fr, dict) and fr.get("type") == "abort":
                            side["error"] = str(fr.get("message"))[:1000]
            except asyncio.TimeoutError:
                side["error"] = "timeout"
            except aiohttp.ClientError as exc:
                side["error"] = f"{type(exc).__name__}: {exc}"

        async def worker() -> None:
            while True:
                i = next(counter)
                if i >= requests:
                    return
                row = LedgerRow(rid=f"{rid_prefix}-{i:04d}-{uuid.uuid4().hex[:8]}", stream=False, start=time.time())
                rows.append(row)
                body = {"text": prompt_for(i), "rid": row.rid, "stream": False,
                        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
                        "bootstrap_host": bootstrap_host, "bootstrap_port": bootstrap_port,
                        "bootstrap_room": random.getrandbits(62)}
                pre = asyncio.create_task(prefill_side(body, row))
                await _one(session, decode_url.rstrip("/") + "/generate", body, row, timeout, headers or {})
                if not row.ok and not pre.done():
                    try:
                        async with session.post(prefill_url.rstrip("/") + "/abort_request", json={"rid": row.rid},
                                                timeout=aiohttp.ClientTimeout(total=5)):
                            pass
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        pass
                await pre

        await asyncio.gather(*(worker() for _ in range(min(concurrency, requests))))
    return rows


def send_pair(prefill_url: str, decode_url: str, bootstrap_host: str, bootstrap_port: int, **kw) -> list[LedgerRow]:
    """Synchronous wrapper of run_pair."""
    return asyncio.run(run_pair(prefill_url, decode_url, bootstrap_host, bootstrap_port, **kw))
