"""A publish pipeline that crosses to the client library in batches, with acks awaited per batch and retries.

    publish() -> bounded queue -> sender: takes all queued (up to max_batch / max_batch_bytes),
                                  ``send(batch)`` once -> one handle per message (e.g. an ack future)
                               -> acker:  ``wait(handles, ack_timeout_s)`` once per batch -> result per message:
                                  None (acknowledged) | an exception: ``fatal(exc, item, expired)`` says
                                  what the publisher raises, or None: resend it (same headers, so the
                                  same Nats-Msg-Id) after ``before_retry(results)``.

No library knowledge here: NatsTransport supplies ``send``/``wait`` (each one bridge crossing).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from t1async.log import get_logger
from t1async.transport.base import TransportClosedError

log = get_logger("transport.pipeline")


@dataclass(eq=False)
class Outgoing:
    subject: str
    data: bytes
    headers: dict[str, str] | None
    acked: bool  # a JetStream publish (wait for the stream's ack) or a core publish (sent is done)
    deadline: float
    done: anyio.Event = field(default_factory=anyio.Event)
    error: Exception | None = None


@dataclass(frozen=True)
class PipelineConfig:
    ack_timeout_s: float = 5.0
    publish_deadline_s: float = 120.0
    retry_wait_s: float = 0.25
    max_batch: int = 1024
    max_batch_bytes: int = 32 << 20
    max_inflight_batches: int = 8
    queue_size: int = 4096


class PublishPipeline:
    def __init__(
        self,
        config: PipelineConfig,
        send: Callable[[list[Outgoing]], Awaitable[list[Any]]],
        wait: Callable[[list[Any], float], Awaitable[list[BaseException | None]]],
        *,
        fatal: Callable[[BaseException, Outgoing, bool], Exception | None],
        before_retry: Callable[[list[BaseException | None]], Awaitable[None]],
    ):
        self.config, self._send, self._wait, self._fatal, self._before_retry = config, send, wait, fatal, before_retry
        self._tx, self._rx = anyio.create_memory_object_stream[Outgoing](config.queue_size)
        self._infl_tx, self._infl_rx = anyio.create_memory_object_stream[tuple](config.max_inflight_batches)
        self.drained = anyio.Event()

    async def put(self, subject: str, pieces: Sequence[tuple[dict[str, str] | None, bytes]], acked: bool) -> None:
        """Queue the pieces of one message and return once all were acknowledged (or raise why not)."""
        deadline = time.monotonic() + self.config.publish_deadline_s
        items = [Outgoing(subject, d, h, acked, deadline) for h, d in pieces]
        try:
            for it in items:
                await self._tx.send(it)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise TransportClosedError("transport closed while publishing") from None
        for it in items:
            await it.done.wait()
            if it.error is not None:
                raise it.error

    def close(self) -> None:
        """No more puts; what is queued is still sent, then ``drained`` is set."""
        self._tx.close()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._sender)
            tg.start_soon(self._acker)

    async def _sender(self) -> None:
        cfg = self.config
        async with self._infl_tx:
            async for first in self._rx:
                batch, size = [first], len(first.data)
                while len(batch) < cfg.max_batch and size < cfg.max_batch_bytes:
                    try:
                        it = self._rx.receive_nowait()
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                    batch.append(it)
                    size += len(it.data)
                await self._infl_tx.send((batch, await self._send(batch)))

    async def _acker(self) -> None:
        cfg = self.config
        async for batch, sent in self._infl_rx:
            while batch:
                results = await self._wait(sent, cfg.ack_timeout_s)
                retry, now = [], time.monotonic()
                for it, res in zip(batch, results):
                    if res is None:
                        it.done.set()
                        continue
                    it.error = self._fatal(res, it, now > it.deadline)
                    if it.error is not None:
                        it.done.set()
                    else:
                        retry.append(it)
                if not retry:
                    break
                log.warning(
                    "transport.publish_retry", n=len(retry), error=repr(next(r for r in results if r is not None))
                )
                await self._before_retry(results)
                await anyio.sleep(cfg.retry_wait_s)
                batch, sent = retry, await self._send(retry)
        self.drained.set()
