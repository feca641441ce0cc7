"""One request's stream of events between the engine's step loop and its async consumer: the engine fills a
``Handle`` (pending tokens, logprobs, versions, the finish) and sets its ``wake`` event; ``EventStream``
hands them out as ``GenEvent``s (what ``Engine.submit`` returns)."""

from __future__ import annotations

import anyio
import numpy as np

from t1async.model.records import GenEvent
from t1async.model.scheduler import Seq

__all__ = ["EventStream", "Handle"]


class Handle:
    """The event-loop side of one request."""

    def __init__(self, seq: Seq) -> None:
        self.seq = seq
        self.rid = seq.req.rid
        self.pending_ids: list[int] = []
        self.pending_lps: list[float] = []
        self.pending_versions: list[str] = []  # the weight version that produced each pending token
        self.done = False
        self.finish_reason: dict | None = None
        self.routing: np.ndarray | None = None
        self.routing_start = 0
        self.prompt_tokens = seq.prompt_len
        self.cached_tokens = 0
        self.weight_version = "0"
        self.wake = anyio.Event()
        self.admitted = False

    def fail(self, message: str, weight_version: str) -> None:
        self.done = True
        self.finish_reason = {"type": "abort", "message": message}
        self.weight_version = weight_version
        self.wake.set()


class EventStream:
    """Async iterator of one request's ``GenEvent``s (from ``Engine.submit``)."""

    def __init__(self, h: Handle) -> None:
        self._h = h
        self._closed = False

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> GenEvent:
        h = self._h
        if self._closed:
            raise StopAsyncIteration
        while not h.pending_ids and not h.done:
            await h.wake.wait()
            h.wake = anyio.Event()
        ev = GenEvent(
            rid=h.rid,
            new_ids=h.pending_ids,
            new_logprobs=h.pending_lps,
            finished=h.done,
            finish_reason=h.finish_reason,
            prompt_tokens=h.prompt_tokens,
            cached_tokens=h.cached_tokens,
            weight_version=h.weight_version,
            routing=h.routing if h.done else None,
            new_versions=h.pending_versions,
            routing_start=h.routing_start,
        )
        h.pending_ids, h.pending_lps, h.pending_versions = [], [], []
        self._closed = h.done
        return ev
