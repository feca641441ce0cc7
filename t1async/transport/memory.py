"""In-process transport for tests of the layers above: a ``MemoryBroker`` plays nats-server, and each
``MemoryTransport(broker)`` is one client of it. Same behaviour as NatsTransport in the conformance suite:
the trajectory stream keeps every record, deduplicates by msg_id within the duplicate window, durable
consumers redeliver what was not acknowledged (after ``ack_wait_s``, and at once to a re-opened consumer),
core subscriptions are live only, request/reply may be held, malformed messages are dead-lettered.
Payloads still go through ``wire.encode``/``decode``, so validation is identical.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from t1async.log import get_logger
from t1async.protocol import wire
from t1async.protocol.errors import WireError
from t1async.protocol.wire import Record
from t1async.transport.base import (
    HDR_MSG_ID,
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
    subject_matches,
)
from t1async.transport.delivery import Fetched, StreamIntake, count_dead

log = get_logger("transport.memory")
_SUB_BUFFER = 4096


@dataclass(frozen=True)
class _Stored:
    seq: int
    subject: str
    data: bytes
    headers: dict[str, str]


@dataclass
class _Durable:
    filter: str
    next_seq: int = 1
    pending: dict[int, list[float]] = field(default_factory=dict)  # seq -> [num_delivered, redeliver_at]


@dataclass(eq=False)
class _Sub:
    pattern: str
    send: MemoryObjectSendStream
    queue: str = ""


class MemoryBroker:
    """The in-process stand-in for nats-server (one stream, ``T1_TRAJ``, on ``t1.traj.>``).

    ``clock`` times the duplicate window and redeliveries: ``anyio.current_time`` puts them on the event loop's
    clock, which a test's trio MockClock drives (the default, the wall clock, lets a broker be used outside
    async code)."""

    def __init__(
        self,
        *,
        duplicate_window_s: float = 120.0,
        ack_wait_s: float = 30.0,
        max_payload: int = 1 << 20,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.duplicate_window_s, self.ack_wait_s, self.max_payload = duplicate_window_s, ack_wait_s, max_payload
        self.clock = clock
        self.stream: list[_Stored] = []
        self._dedupe: dict[str, float] = {}
        self._durables: dict[str, _Durable] = {}
        self._subs: list[_Sub] = []
        self._changed_ev: anyio.Event | None = None  # made on first use: a broker may be built outside async code

    # -------------------------------------------------------------------- publishing side

    def store(self, subject: str, data: bytes, headers: dict[str, str]) -> int | None:
        """Append to the stream (None: a duplicate msg_id within the window), and deliver to core subs."""
        now = self.clock()
        msg_id = headers.get(HDR_MSG_ID)
        if msg_id is not None:
            if now - self._dedupe.get(msg_id, -math.inf) < self.duplicate_window_s:
                return None
            self._dedupe[msg_id] = now
        seq = len(self.stream) + 1
        self.stream.append(_Stored(seq, subject, bytes(data), dict(headers)))
        self.core(subject, data, headers)
        self._wake()
        return seq

    def core(self, subject: str, data: bytes, headers: dict[str, str], reply: Any = None) -> int:
        """Deliver to every matching plain subscription and to one member of each queue group; returns how many."""
        targets, groups = [], set()
        for sub in random.sample(self._subs, len(self._subs)):
            if subject_matches(sub.pattern, subject) and (not sub.queue or sub.queue not in groups):
                groups.add(sub.queue)
                targets.append(sub)
        for sub in targets:
            try:
                sub.send.send_nowait((subject, bytes(data), dict(headers), reply.clone() if reply else None))
            except anyio.WouldBlock:
                log.warning("transport.slow_consumer", subject=subject, pattern=sub.pattern)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
        return len(targets)

    async def inject(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        """Publish raw bytes, as a misbehaving client would (stored if ``subject`` is in the stream)."""
        if is_traj(subject):
            self.store(subject, data, headers or {})
        else:
            self.core(subject, data, headers or {})
        await anyio.lowlevel.checkpoint()

    def add_sub(self, sub: _Sub) -> None:
        """Deliver core messages matching ``sub.pattern`` to ``sub`` until ``remove_sub``."""
        self._subs.append(sub)

    def remove_sub(self, sub: _Sub) -> None:
        self._subs.remove(sub)

    def _wake(self) -> None:
        if self._changed_ev is not None:
            self._changed_ev.set()
        self._changed_ev = None

    # -------------------------------------------------------------------- durable consumers

    @property
    def changed(self) -> anyio.Event:
        """Set at the next change (a message stored, settled or released): what a waiting consumer awaits."""
        if self._changed_ev is None:
            self._changed_ev = anyio.Event()
        return self._changed_ev

    def open_durable(self, name: str, filter: str) -> None:
        """Create the durable consumer ``name`` on ``filter`` (a no-op if it exists)."""
        self._durables.setdefault(name, _Durable(filter))

    def fetch(self, name: str, n: int) -> tuple[list[tuple[_Stored, int]], float]:
        """Up to ``n`` messages (redeliveries first) and the time of the next redelivery (inf if none)."""
        d, now = self._durables[name], self.clock()
        out: list[tuple[_Stored, int]] = []
        for seq, p in sorted(d.pending.items()):
            if len(out) >= n:
                break
            if p[1] <= now:
                p[0] += 1
                p[1] = now + self.ack_wait_s
                out.append((self.stream[seq - 1], int(p[0])))
        while len(out) < n and d.next_seq <= len(self.stream):
            m = self.stream[d.next_seq - 1]
            d.next_seq += 1
            if subject_matches(d.filter, m.subject):
                d.pending[m.seq] = [1, now + self.ack_wait_s]
                out.append((m, 1))
        return out, min((p[1] for p in d.pending.values()), default=math.inf)

    def settle(self, name: str, seqs: list[int], ack: bool) -> None:
        d = self._durables[name]
        for s in seqs:
            if ack:
                d.pending.pop(s, None)
            elif s in d.pending:
                d.pending[s][1] = 0.0
        if not ack:
            self._wake()

    def release(self, name: str) -> None:
        """A consumer went away: what it held unacknowledged is redelivered to the next one at once."""
        for p in self._durables[name].pending.values():
            p[1] = 0.0
        self._wake()


class MemoryTransport(Transport):
    """One client of a ``MemoryBroker`` (share the broker between the transports of one test)."""

    def __init__(self, broker: MemoryBroker | None = None):
        self.broker = broker or MemoryBroker()
        self.stats = TransportStats()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError("MemoryTransport used after it was closed (its `async with` block ended)")

    async def aclose(self) -> None:
        self._closed = True

    async def publish(self, subject: str, record: Record, *, msg_id: str | None = None) -> None:
        self._check_open()
        data = wire.encode(record)
        if is_traj(subject):
            self.broker.store(subject, data, {HDR_MSG_ID: msg_id or default_msg_id(record)})
        else:
            self.broker.core(subject, data, {})
        self.stats.published += 1
        await anyio.lowlevel.checkpoint()

    async def publish_dead(self, subject: str, data: bytes, error: WireError) -> None:
        self._check_open()
        self._dead(subject, data, error)
        await anyio.lowlevel.checkpoint()

    def _dead(self, subject: str, data: bytes, err: WireError) -> None:
        dsubj, headers, payload = count_dead(self.stats, subject, data, err, self.broker.max_payload)
        self.broker.core(dsubj, payload, headers)

    @asynccontextmanager
    async def consume(
        self, durable: str, subject: str = TRAJ_SUBJECTS, *, batch: int = 256, max_wait_s: float = 1.0
    ) -> AsyncIterator[AsyncIterator[Batch]]:
        self._check_open()
        self.broker.open_durable(durable, subject)
        intake: StreamIntake[int] = StreamIntake(self.stats, max_payload=self.broker.max_payload, chunk_timeout_s=300.0)
        gen = self._batches(durable, batch, intake)
        try:
            yield gen
        finally:
            await gen.aclose()
            intake.release_all()
            self.broker.release(durable)

    async def _batches(self, durable: str, n: int, intake: StreamIntake[int]) -> AsyncGenerator[Batch, None]:
        while True:
            self._check_open()
            changed = self.broker.changed
            stored, next_at = self.broker.fetch(durable, n)
            got = intake.take(
                [Fetched(m.subject, m.data, m.headers, m.seq, m.seq, k) for m, k in stored], self.broker.clock()
            )
            if got.ack_now or got.term:
                self.broker.settle(durable, got.ack_now + got.term, True)
            for subject, headers, payload in got.dead:
                self.broker.core(subject, payload, headers)
            if got.deliveries:
                yield Batch(got.deliveries, self._settler(durable, got.seqs, intake))
                continue
            with anyio.move_on_after(max(0.0, next_at - self.broker.clock()) if next_at < math.inf else math.inf):
                await changed.wait()

    def _settler(self, durable: str, seqs: list[int], intake: StreamIntake[int]):
        async def settle(ack: bool) -> None:
            self._check_open()
            self.broker.settle(durable, intake.settle(seqs, ack), ack)
            await anyio.lowlevel.checkpoint()

        return settle

    @asynccontextmanager
    async def _core_sub(self, pattern: str, queue: str) -> AsyncIterator[_Sub]:
        self._check_open()
        send, recv = anyio.create_memory_object_stream[tuple](_SUB_BUFFER)
        sub = _Sub(pattern, send, queue)
        self.broker.add_sub(sub)
        try:
            async with recv:
                yield recv  # type: ignore[misc]
        finally:
            self.broker.remove_sub(sub)
            send.close()

    @asynccontextmanager
    async def subscribe(
        self, subject: str, *, include_malformed: bool = False
    ) -> AsyncIterator[AsyncIterator[Message]]:
        async with self._core_sub(subject, "") as recv:
            yield self._messages(recv, include_malformed)

    async def _messages(self, recv, include_malformed: bool) -> AsyncIterator[Message]:
        async for subject, data, headers, reply in recv:
            if reply is not None:
                reply.close()
            try:
                rec = wire.decode(data)
            except WireError as err:
                if include_malformed:
                    yield Message(subject, data, None, err, headers)
                else:
                    self._dead(subject, data, err)
                continue
            yield Message(subject, data, rec, None, headers)

    async def request(self, subject: str, record: Record, *, timeout: float) -> Record:
        self._check_open()
        reply_send, reply_recv = anyio.create_memory_object_stream[bytes](16)
        async with reply_recv, reply_send:
            if not self.broker.core(subject, wire.encode(record), {}, reply_send):
                raise NoRespondersError(f"no server for request on {subject!r} (is the learner running?): retry later")
            with anyio.move_on_after(timeout):
                return wire.decode(await reply_recv.receive())
        raise RequestTimeoutError(f"no reply on {subject!r} within {timeout}s (the server may be holding it): retry")

    @asynccontextmanager
    async def serve(self, subject: str, *, queue: str = "") -> AsyncIterator[AsyncIterator[Request]]:
        async with self._core_sub(subject, queue) as recv:
            yield self._requests(recv)

    async def _requests(self, recv) -> AsyncIterator[Request]:
        async for subject, data, _headers, reply in recv:
            try:
                rec = wire.decode(data)
            except WireError as err:
                self._dead(subject, data, err)
                if reply is not None:
                    reply.close()
                continue
            if reply is None:
                log.warning("transport.request_without_reply", subject=subject)
                continue
            yield Request(subject, rec, self._responder(reply))

    def _responder(self, reply: MemoryObjectSendStream):
        async def respond(record: Record) -> None:
            self._check_open()
            with reply:
                try:
                    reply.send_nowait(wire.encode(record))
                except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    log.info("transport.reply_dropped", reason="requester gave up")
            await anyio.lowlevel.checkpoint()

        return respond
