"""NATS JetStream transport: the only module in t1async that knows asyncio exists.

nats-py is asyncio-only. Under trio (the default backend) this module opens a trio-asyncio loop for the
lifetime of the transport and crosses the bridge in batches, never once per message:

- ``publish()`` encodes on the caller's side and queues the pieces (transport/pipeline.py). A sender task
  hands everything queued to nats-py in one crossing (pipelined publishes whose acks come back on our
  own inbox, collected in bulk: no asyncio future per message); an acker task awaits a whole batch of
  acks in one crossing and wakes the publishers. Unacknowledged publishes are retried with the same
  ``Nats-Msg-Id`` (the stream stores them once) until ``publish_deadline_s``.
- A durable consumer pulls ``batch`` messages per crossing and acks a whole ``Batch`` per crossing.
- Core subscriptions drain every message already received per crossing.

Under asyncio (anyio on asyncio, ``T1_BACKEND=asyncio``) the same coroutines are awaited directly. The
asyncio side (the nats-py connection, one coroutine per crossing) is transport/natsio.py. nats-py errors
are translated here into TransportError subclasses with the cause and what to do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from enum import StrEnum
from functools import partial
from typing import Any

import anyio
import nats.errors
import nats.js.errors
from nats.nuid import NUID

from t1async.log import get_logger
from t1async.protocol import wire
from t1async.protocol.errors import TransportError, WireError
from t1async.protocol.wire import Record
from t1async.transport import chunking
from t1async.transport.auth import redact
from t1async.transport.base import (
    HDR_MSG_ID,
    TRAJ_STREAM,
    TRAJ_SUBJECTS,
    Batch,
    Message,
    NoRespondersError,
    Request,
    RequestTimeoutError,
    Transport,
    TransportClosedError,
    TransportStats,
    default_msg_id,
    is_traj,
)
from t1async.transport.delivery import CoreIntake, StreamIntake, count_dead
from t1async.transport.natsio import DEFAULT_URL, AioNats, Bridge, NatsConfig
from t1async.transport.pipeline import Outgoing, PipelineConfig, PublishPipeline

__all__ = ["NatsTransport"]
log = get_logger("transport.nats")


def _single_leaf(group: BaseExceptionGroup) -> BaseException | None:
    while len(group.exceptions) == 1 and isinstance(group.exceptions[0], BaseExceptionGroup):
        group = group.exceptions[0]
    return group.exceptions[0] if len(group.exceptions) == 1 else None


_PERMANENT = (
    nats.errors.MaxPayloadError,
    nats.errors.ConnectionClosedError,
    nats.errors.BadSubjectError,
    nats.js.errors.BadRequestError,
)


class _State(StrEnum):
    """A NatsTransport's life: opened once (its ``async with``), closed for good after."""

    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


class NatsTransport(Transport):
    """``async with NatsTransport("nats://127.0.0.1:4222") as t: ...`` (creates stream T1_TRAJ if missing)."""

    def __init__(self, url: str | None = None, *, config: NatsConfig | None = None):
        self.config = config or NatsConfig(url=url or DEFAULT_URL)
        self.stats = TransportStats()
        self._state = _State.UNOPENED
        self._bridge = Bridge()
        self._aio = AioNats(self.config, lambda: self._state is _State.OPEN)
        self._stack: AsyncExitStack | None = None
        self._nuid = NUID()  # group ids of chunked core messages (nats-py's own is its connection's, private)

    # ------------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> NatsTransport:
        if self._state is not _State.UNOPENED:
            raise TransportClosedError(f"NatsTransport is {self._state}: a transport is opened once; make a new one")
        try:
            await self._open()
        except ExceptionGroup as group:  # the bridge's nurseries wrapped our one error: raise it plainly
            leaf = _single_leaf(group)
            if isinstance(leaf, TransportError):
                raise leaf from leaf.__cause__
            raise
        self._state = _State.OPEN
        log.info(
            "transport.connected",
            url=redact(self._nc.connected_url.geturl() if self._nc.connected_url else self.config.url),
            max_payload=self.max_payload,
        )
        return self

    async def _open(self) -> None:
        async with AsyncExitStack() as stack:
            await self._bridge.open(stack)
            await self._bridge.run(self._aio.connect)
            stack.push_async_callback(self._bridge.run, self._aio.nc.close)
            await self._bridge.run(self._aio.ensure_streams)
            await self._bridge.run(self._aio.init_acks)
            c = self.config
            self._pipeline = PublishPipeline(
                PipelineConfig(
                    c.ack_timeout_s,
                    c.publish_deadline_s,
                    c.retry_wait_s,
                    c.max_batch,
                    c.max_batch_bytes,
                    c.max_inflight_batches,
                    c.queue_size,
                ),
                partial(self._bridge.run, self._aio.send),
                partial(self._bridge.run, self._aio.wait),
                fatal=self._fatal,
                before_retry=self._before_retry,
            )
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            self._tg.start_soon(self._pipeline.run)
            self._stack = stack.pop_all()

    async def aclose(self) -> None:
        if self._state is not _State.OPEN:
            self._state = _State.CLOSED
            return
        self._state = _State.CLOSED
        stack, self._stack = self._stack, None
        try:
            self._pipeline.close()  # what is queued is still sent and acknowledged
            with anyio.move_on_after(self.config.publish_deadline_s):
                await self._pipeline.drained.wait()
        finally:
            self._tg.cancel_scope.cancel()
            if stack is not None:
                await stack.aclose()

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise TransportClosedError(f"NatsTransport used while {self._state} (outside its `async with` block)")

    @property
    def _nc(self) -> Any:
        return self._aio.nc

    @property
    def _js(self) -> Any:
        return self._aio.js

    async def stream_info(self, stream: str) -> Any:
        """JetStream's ``StreamInfo`` for ``stream`` (its config, state and cluster: leader, replicas)."""
        return await self._bridge.run(self._js.stream_info, stream)

    async def last_message(self, stream: str, subject: str) -> Any:
        """The last message stored in ``stream`` on ``subject`` (a ``RawStreamMsg``: data, headers), as
        ``nats stream get STREAM --last-for SUBJECT`` shows it."""
        return await self._bridge.run(self._js.get_last_msg, stream, subject)

    @property
    def max_payload(self) -> int:
        return int(self._nc.max_payload) if self._nc is not None else 1 << 20

    # ------------------------------------------------------------------------ publishing

    async def publish(self, subject: str, record: Record, *, msg_id: str | None = None) -> None:
        self._check_open()
        data = wire.encode(record)
        js = is_traj(subject)
        pieces: Sequence[tuple[dict[str, str] | None, bytes]]
        if js:
            pieces = chunking.split(data, msg_id or default_msg_id(record), self.max_payload)
        elif len(data) > chunking.chunk_size(self.max_payload, ""):
            pieces = [
                ({k: v for k, v in h.items() if k != HDR_MSG_ID}, d)
                for h, d in chunking.split(data, msg_id or f"core-{self._nuid.next().decode()}", self.max_payload)
            ]
        else:
            pieces = [(None, data)]
        await self._pipeline.put(subject, pieces, js)
        self.stats.published += 1

    async def publish_dead(self, subject: str, data: bytes, error: WireError) -> None:
        self._check_open()
        letter = count_dead(self.stats, subject, data, error, self.max_payload)
        await self._bridge.run(self._aio.settle, [], [], [], [letter])
        await self._bridge.run(self._aio.sync)

    def _fatal(self, exc: BaseException, item: Outgoing, expired: bool) -> Exception | None:
        """The error a failed publish raises, or None to retry it."""
        if expired or isinstance(exc, _PERMANENT):
            return self._translate(exc, f"publish to {item.subject}")
        return None

    async def _before_retry(self, results: list[BaseException | None]) -> None:
        if any(isinstance(r, nats.js.errors.NoStreamResponseError) for r in results):  # a fresh server: recreate
            with anyio.move_on_after(self.config.ack_timeout_s):
                try:
                    await self._bridge.run(self._aio.ensure_streams)
                except (nats.errors.Error, nats.js.errors.APIError) as exc:  # a cluster without quorum: retried
                    log.warning("transport.ensure_streams_failed", error=repr(exc))

    def _translate(self, exc: BaseException, doing: str) -> TransportError:
        url = redact(self.config.url)
        if isinstance(exc, (asyncio.TimeoutError, nats.errors.TimeoutError)):
            what = f"no acknowledgement from NATS at {url} within {self.config.publish_deadline_s}s"
        elif isinstance(exc, nats.errors.MaxPayloadError):
            what = f"payload exceeds the server's max_payload of {self.max_payload} bytes"
        elif isinstance(exc, nats.js.errors.NoStreamResponseError):
            what = f"no JetStream stream {TRAJ_STREAM} answers (is JetStream enabled on {url}?)"
        else:
            what = f"{type(exc).__name__}: {exc}"
        err = TransportError(
            f"{doing} failed: {what}; is nats-server running? start one with `python -m t1async.cluster up`"
        )
        err.__cause__ = exc
        return err

    # ------------------------------------------------------------------------ durable consumer

    @asynccontextmanager
    async def consume(
        self, durable: str, subject: str = TRAJ_SUBJECTS, *, batch: int = 256, max_wait_s: float = 1.0
    ) -> AsyncIterator[AsyncIterator[Batch]]:
        self._check_open()
        try:
            psub = await self._bridge.run(self._aio.pull_sub, durable, subject)
        except nats.errors.Error as exc:
            raise self._translate(exc, f"creating durable consumer {durable!r} on {subject}") from exc
        intake: StreamIntake[Any] = StreamIntake(
            self.stats, max_payload=self.max_payload, chunk_timeout_s=self.config.chunk_timeout_s
        )
        gen = self._batches(psub, batch, max_wait_s, intake)
        try:
            yield gen
        finally:
            await gen.aclose()
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await self._bridge.run(self._aio.release, psub, intake.release_all())

    async def _batches(
        self, psub: Any, n: int, max_wait_s: float, intake: StreamIntake[Any]
    ) -> AsyncGenerator[Batch, None]:
        while True:
            self._check_open()
            try:
                fetched = await self._bridge.run(self._aio.fetch, psub, n, max_wait_s)
            except nats.errors.ConnectionClosedError as exc:
                raise self._translate(exc, "fetching from the durable consumer") from exc
            except (nats.errors.Error, OSError) as exc:  # disconnected: nats-py reconnects, we ask again
                log.warning("transport.fetch_retry", error=repr(exc))
                await anyio.sleep(self.config.retry_wait_s)
                continue
            got = intake.take(fetched, time.monotonic())
            if got.ack_now or got.term or got.dead:
                await self._bridge.run(self._aio.settle, got.ack_now, got.term, [], got.dead)
            if got.deliveries:
                yield Batch(got.deliveries, self._settler(got.seqs, intake))

    def _settler(self, seqs: list[int], intake: StreamIntake[Any]) -> Callable[[bool], Awaitable[None]]:
        async def settle(ack: bool) -> None:
            self._check_open()
            msgs = intake.settle(seqs, ack)
            try:
                await self._bridge.run(self._aio.settle, msgs if ack else [], [], [] if ack else msgs, [])
            except nats.errors.Error as exc:  # redelivered later, then skipped and re-acked by the intake
                log.warning("transport.ack_failed", n=len(msgs), error=repr(exc))

        return settle

    # ------------------------------------------------------------------------ core: subscribe, request, serve

    @asynccontextmanager
    async def _core_sub(self, subject: str, queue: str) -> AsyncIterator[Any]:
        self._check_open()
        try:
            q, sub = await self._bridge.run(self._aio.subscribe, subject, queue)
        except nats.errors.Error as exc:
            raise self._translate(exc, f"subscribing to {subject}") from exc
        try:
            yield q
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await self._bridge.run(self._aio.unsubscribe, sub)

    async def _received(self, q: Any, include_malformed: bool) -> AsyncIterator[tuple[Message, str]]:
        """(message, reply subject) for each record received; malformed ones dead-lettered unless included."""
        intake = CoreIntake(self.config.chunk_timeout_s)
        while True:
            self._check_open()
            dead = []
            for subject, data, headers, reply in await self._bridge.run(self._aio.drain, q, 1024):
                got = intake.decode(subject, data, headers, time.monotonic())
                if got is None:
                    continue
                data, rec = got
                if isinstance(rec, WireError):
                    if not include_malformed:
                        dead.append(count_dead(self.stats, subject, data, rec, self.max_payload))
                        continue
                    yield Message(subject, data, None, rec, headers), reply
                else:
                    yield Message(subject, data, rec, None, headers), reply
            if dead:
                await self._bridge.run(self._aio.settle, [], [], [], dead)

    @asynccontextmanager
    async def subscribe(
        self, subject: str, *, include_malformed: bool = False
    ) -> AsyncIterator[AsyncIterator[Message]]:
        async with self._core_sub(subject, "") as q:
            gen = self._messages(q, include_malformed)
            try:
                yield gen
            finally:
                await gen.aclose()

    async def _messages(self, q: Any, include_malformed: bool) -> AsyncGenerator[Message, None]:
        async for msg, _reply in self._received(q, include_malformed):
            yield msg

    async def request(self, subject: str, record: Record, *, timeout: float) -> Record:
        self._check_open()
        data = wire.encode(record)
        try:
            msg = await self._bridge.run(self._nc.request, subject, data, timeout=timeout)
        except nats.errors.NoRespondersError:
            raise NoRespondersError(
                f"no server for request on {subject!r} (is the learner running?): retry later"
            ) from None
        except nats.errors.TimeoutError:
            raise RequestTimeoutError(
                f"no reply on {subject!r} within {timeout}s (the server may be holding it): retry"
            ) from None
        except nats.errors.Error as exc:
            raise self._translate(exc, f"request on {subject}") from exc
        return wire.decode(msg.data)

    @asynccontextmanager
    async def serve(self, subject: str, *, queue: str = "") -> AsyncIterator[AsyncIterator[Request]]:
        async with self._core_sub(subject, queue) as q:
            gen = self._requests(q)
            try:
                yield gen
            finally:
                await gen.aclose()

    async def _requests(self, q: Any) -> AsyncGenerator[Request, None]:
        async for msg, reply in self._received(q, include_malformed=False):
            if not reply:
                log.warning("transport.request_without_reply", subject=msg.subject)
            else:
                yield Request(msg.subject, msg.record, self._responder(reply))  # type: ignore[arg-type]

    def _responder(self, reply: str) -> Callable[[Record], Awaitable[None]]:
        async def respond(record: Record) -> None:
            self._check_open()
            await self._pipeline.put(reply, [(None, wire.encode(record))], False)

        return respond
