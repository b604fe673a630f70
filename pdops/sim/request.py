"""One request in the sim: its phase, tokens, events and output (SGLang's shapes), and the
exception that ends it with finish_reason abort."""

from __future__ import annotations

import asyncio
import time

from pdops.sim.tokens import output_word

FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's warmup/health marker: no real transfer


class RequestFailed(Exception):
    """Ends a request with finish_reason abort and an HTTP status."""

    def __init__(self, message: str, status: int = 500, kind: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind  # "bootstrap" | "transfer" | None


class Req:
    """One request: its phase (the queue it is in), tokens so far, events for its waiters, its output."""

    def __init__(self, rid, prompt_tokens, max_new, stream, room=None, bhost=None, bport=None):
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.max_new = max_new
        self.stream = stream
        self.room = room
        self.bhost = bhost
        self.bport = bport
        self.created = time.time()
        self.first_token_t: float | None = None
        self.last_token_t: float = 0.0
        self.tokens = 0
        self.phase = "new"
        self.finish_reason: dict | None = None
        self.status = 200
        self.progress = asyncio.Event()
        self.done = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.abort_reason: RequestFailed | None = None
        self.started = False  # its task ran: cancelling it reaches _run's handlers
        self.kvconn = None
        self._text = ""
        self._text_n = 0
        self.streamed_ids = 0  # output ids already sent in a stream chunk

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def text(self) -> str:
        while self._text_n < self.tokens:  # grows incrementally: O(new tokens) per call
            w = output_word(self._text_n)
            self._text = w if not self._text_n else self._text + " " + w
            self._text_n += 1
        return self._text

    def meta(self) -> dict:
        return {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens,
            "cached_tokens": 0,
            "e2e_latency": time.time() - self.created,
        }

    def output(self) -> dict:
        return {"text": self.text(), "output_ids": list(range(self.tokens)), "meta_info": self.meta()}

    def stream_chunk(self) -> dict:
        """A streaming chunk: cumulative text (SGLang's default), the new output ids."""
        ids = list(range(self.streamed_ids, self.tokens))
        self.streamed_ids = self.tokens
        return {"text": self.text(), "output_ids": ids, "meta_info": self.meta()}
