"""The sim's generation routes: /generate, /v1/completions, /v1/chat/completions (whole or
streamed), /abort_request; each request is submitted to the engine and answered as SGLang does."""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from pdops.sim.request import Req


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": str(status), "param": None, "code": status}, status=status)


async def read_body(request) -> dict:
    """The request's JSON object; ValueError (HTTP 400) otherwise."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("request body is not JSON") from None
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body


class GenerateRoutes:
    """SimServer's generation handlers (a mixin: they submit to and abort through its engine)."""

    def _submit(self, body: dict, prompt_tokens: int, max_new: int, stream: bool) -> Req:
        return self.engine.submit(body, stream, prompt_tokens, max_new)

    async def generate(self, request):
        try:
            body = await read_body(request)
            if "input_ids" in body and body["input_ids"] is not None:
                ids = body["input_ids"]
                if not isinstance(ids, list) or (ids and isinstance(ids[0], list)):
                    raise ValueError("batch input_ids are not supported by the sim")
                n = len(ids)
            elif isinstance(body.get("text"), str):
                n = self.engine.count(body["text"])
            else:
                raise ValueError("Either text or input_ids should be provided (a single string; batches are not supported by the sim).")
            sp = body.get("sampling_params") or {}
            max_new = int(sp.get("max_new_tokens", 128) if sp.get("max_new_tokens") is not None else 128)
            stream = bool(body.get("stream"))
            req = self._submit(body, n, max_new, stream)
        except ValueError as e:
            return web.json_response({"error": {"message": str(e)}}, status=400)
        if stream:
            return await self._stream(request, req, lambda r, last: json.dumps(r.stream_chunk()))
        return await self._wait(req, lambda r: r.output())

    async def _wait(self, req: Req, render) -> web.Response:
        try:
            await req.done.wait()
        except asyncio.CancelledError:
            self.engine.abort(req)  # client disconnected
            raise
        fr = req.finish_reason or {}
        if fr.get("type") == "abort" and fr.get("status_code") and fr["status_code"] >= 400:
            return _error(fr["status_code"], fr.get("message", "Aborted"))
        return web.json_response(render(req))

    async def _stream(self, request, req: Req, render) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            sent = -1
            while True:
                await req.progress.wait()
                req.progress.clear()
                if req.tokens != sent or req.finished:
                    sent = req.tokens
                    await resp.write(b"data: " + render(req, req.finished).encode() + b"\n\n")
                if req.finished:
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionError):
            self.engine.abort(req)  # client disconnected
            raise
        return resp

    def _openai_prompt(self, body: dict, chat: bool) -> int:
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list):
                raise ValueError("messages must be a list")
            text = " ".join(m.get("content", "") if isinstance(m.get("content"), str) else "" for m in msgs)
            return self.engine.count(text)
        p = body.get("prompt")
        if isinstance(p, str):
            return self.engine.count(p)
        if isinstance(p, list) and all(isinstance(x, int) for x in p):
            return len(p)
        raise ValueError("prompt must be a string or a list of token ids (batches are not supported by the sim)")

    async def _openai(self, request, chat: bool):
        try:
            body = await read_body(request)
            n = self._openai_prompt(body, chat)
            mt = body.get("max_completion_tokens") if chat else None
            mt = mt if mt is not None else body.get("max_tokens")
            max_new = int(mt) if mt is not None else 128
            stream = bool(body.get("stream"))
            req = self._submit(body, n, max_new, stream)
        except ValueError as e:
            return web.json_response({"object": "error", "message": str(e), "type": "BadRequestError", "param": None, "code": 400}, status=400)
        model = body.get("model") or self.args.served_model_name
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())

        def finish(r):
            fr = r.finish_reason or {}
            return {"length": "length", "abort": "abort"}.get(fr.get("type"), "stop") if fr else None

        def usage(r):
            return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.tokens, "total_tokens": r.prompt_tokens + r.tokens}

        if stream:
            state = {"sent": 0}

            def chunk(r, last):
                words = r.text().split()
                delta = " ".join(words[state["sent"]:])
                if state["sent"] and delta:
                    delta = " " + delta
                state["sent"] = len(words)
                choice = {"index": 0, "finish_reason": finish(r) if last else None}
                if chat:
                    choice["delta"] = {"role": "assistant", "content": delta}
                else:
                    choice["text"] = delta
                d = {"id": r.rid, "object": obj + ".chunk" if chat else obj, "created": created, "model": model, "choices": [choice]}
                if last:
                    d["usage"] = usage(r)
                return json.dumps(d)

            return await self._stream(request, req, chunk)

        def full(r):
            choice = {"index": 0, "finish_reason": finish(r)}
            if chat:
                choice["message"] = {"role": "assistant", "content": r.text()}
            else:
                choice["text"] = r.text()
            return {"id": r.rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": usage(r)}

        return await self._wait(req, full)

    async def completions(self, request):
        return await self._openai(request, chat=False)

    async def chat(self, request):
        return await self._openai(request, chat=True)

    async def abort_request(self, request):
        try:
            body = await read_body(request)
        except ValueError:
            body = {}
        self.engine.abort_rid(str(body.get("rid") or ""), bool(body.get("abort_all")))
        return web.Response(status=200)
