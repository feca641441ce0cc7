"""The Transport seam: publish, durable consume, subscribe, request/serve; plus the types they hand out.

Two implementations pass one conformance suite (tests/test_transport.py): ``NatsTransport`` (JetStream)
and ``MemoryTransport`` (in-process, for tests of the layers above). Both are ``async with`` resources;
any call after the block ended raises ``TransportClosedError``.

Errors (all ``TransportError``, see t1async.protocol.errors):

    TransportError
    ├── TransportClosedError   your code used the transport after closing it
    ├── RequestTimeoutError    no reply within the timeout (the server may be holding it: retry)
    └── NoRespondersError      nobody serves that subject right now (retry later)

Malformed messages never reach user code and never crash a consumer: they are counted in
``transport.stats``, logged, published to ``t1.dead.<reason>`` (raw bytes as the payload, the error in
headers ``T1-Dead-*``), and acknowledged/terminated. ``subscribe(..., include_malformed=True)`` (for ``tail``)
yields them as ``Message(error=...)`` instead.
"""

from __future__ import annotations

import abc
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

from t1async.protocol.errors import DeadReason, TransportError, WireError
from t1async.protocol.wire import EndRecord, Record, StartRecord, TurnRecord

TRAJ_STREAM = "T1_TRAJ"
TRAJ_SUBJECTS = "t1.traj.>"
TRAJ_PREFIX = "t1.traj."
DEAD_PREFIX = "t1.dead."
HDR_MSG_ID = "Nats-Msg-Id"
HDR_DEAD_REASON = "T1-Dead-Reason"
HDR_DEAD_ERROR = "T1-Dead-Error"
HDR_DEAD_SUBJECT = "T1-Dead-Subject"
HDR_DEAD_SIZE = "T1-Dead-Size"  # the original size, when the payload was truncated to fit


class TransportClosedError(TransportError):
    """The transport was used after its ``async with`` block ended (or after ``aclose()``): a bug in the caller."""


class RequestTimeoutError(TransportError):
    """No reply within the timeout. The server may hold replies on purpose (backpressure): retry."""


class NoRespondersError(TransportError):
    """Nobody serves this subject right now (e.g. the learner has not started): retry later."""


# ------------------------------------------------------------------------------------------ types


@dataclass(frozen=True, eq=False)
class Message:
    """One core message. ``record`` is None exactly when ``error`` is set (only with include_malformed)."""

    subject: str
    data: bytes
    record: Record | None
    error: WireError | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Delivery:
    """One record from a durable consumer. ``num_delivered`` > 1 means the server redelivered it."""

    subject: str
    record: Record
    msg_id: str
    stream_seq: int
    num_delivered: int = 1


class Batch(Sequence[Delivery]):
    """Deliveries fetched together. Acknowledge with ``await batch.ack()`` once they are durably taken.

    Unacknowledged deliveries are redelivered: to the same consumer after its ack wait, and to the next
    ``consume()`` of the same durable after a restart. ``nak()`` asks for redelivery now.
    """

    def __init__(self, deliveries: Sequence[Delivery], ack: Callable[[bool], Awaitable[None]]):
        self._deliveries = tuple(deliveries)
        self._settle = ack
        self._settled = False

    def __getitem__(self, i):
        return self._deliveries[i]

    def __len__(self) -> int:
        return len(self._deliveries)

    def __iter__(self) -> Iterator[Delivery]:
        return iter(self._deliveries)

    @property
    def settled(self) -> bool:
        return self._settled

    async def ack(self) -> None:
        """Acknowledge every delivery of the batch (idempotent)."""
        if not self._settled:
            self._settled = True
            await self._settle(True)

    async def nak(self) -> None:
        """Ask the server to redeliver every delivery of the batch (idempotent; no-op after ack)."""
        if not self._settled:
            self._settled = True
            await self._settle(False)

    def __repr__(self) -> str:
        return f"Batch({len(self)} deliveries, settled={self._settled})"


class Request:
    """One request received by ``serve()``. Reply with ``await req.respond(record)``, whenever you may."""

    def __init__(self, subject: str, record: Record, respond: Callable[[Record], Awaitable[None]]):
        self.subject, self.record = subject, record
        self._respond = respond
        self.responded = False

    async def respond(self, record: Record) -> None:
        if self.responded:
            raise TransportError(f"request on {self.subject} was already answered; a request takes one reply")
        self.responded = True
        await self._respond(record)


@dataclass
class TransportStats:
    """Counters a transport keeps (read them, never write them)."""

    published: int = 0
    delivered: int = 0
    redelivered_skipped: int = 0  # redeliveries of messages this consumer already holds or acknowledged
    dead: Counter = field(default_factory=Counter)  # reason -> count


# ------------------------------------------------------------------------------------------ the seam


class Transport(abc.ABC):
    """Small interface; see the module docstring. Use as ``async with impl(...) as t: ...``."""

    stats: TransportStats

    @abc.abstractmethod
    async def publish(self, subject: str, record: Record, *, msg_id: str | None = None) -> None:
        """Publish ``record``. On ``t1.traj.*`` this is a JetStream publish that returns once the stream
        stored it (retried with the same ``msg_id`` until then, so it is stored once; the default msg_id
        is ``default_msg_id(record)``). On other subjects it is a core publish (at most once)."""

    @abc.abstractmethod
    def consume(
        self, durable: str, subject: str = TRAJ_SUBJECTS, *, batch: int = 256, max_wait_s: float = 1.0
    ) -> AbstractAsyncContextManager[AsyncIterator[Batch]]:
        """A durable consumer of the trajectory stream: ``async with t.consume("learner") as batches:
        async for batch in batches: ...; await batch.ack()``. Batches are never empty."""

    @abc.abstractmethod
    def subscribe(
        self, subject: str, *, include_malformed: bool = False
    ) -> AbstractAsyncContextManager[AsyncIterator[Message]]:
        """A core subscription (wildcards allowed). Live only: nothing from before it started."""

    @abc.abstractmethod
    async def request(self, subject: str, record: Record, *, timeout: float) -> Record:
        """Send a request and wait up to ``timeout`` seconds for the reply (raises RequestTimeoutError or
        NoRespondersError)."""

    @abc.abstractmethod
    def serve(self, subject: str, *, queue: str = "") -> AbstractAsyncContextManager[AsyncIterator[Request]]:
        """Receive requests on ``subject`` (servers sharing a ``queue`` split them). Replies may be held."""

    @abc.abstractmethod
    async def publish_dead(self, subject: str, data: bytes, error: WireError) -> None:
        """Dead-letter ``data``, a message first published on ``subject`` that a consumer cannot use: to
        ``t1.dead.<error.reason>`` with the ``T1-Dead-*`` headers, counted in ``stats.dead`` and logged, as
        the transport does for malformed messages. Returns once the server has it (JetStream keeps
        ``t1.dead.>`` in stream ``T1_DEAD``)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Flush what was published, then close. Idempotent."""

    async def __aenter__(self) -> Transport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


# ------------------------------------------------------------------------------------------ helpers


def is_traj(subject: str) -> bool:
    return subject.startswith(TRAJ_PREFIX)


def default_msg_id(record: Record) -> str:
    """``<episode>/<seq>``: ``start`` is seq 0, turn k is seq k+1, ``end`` is ``end``."""
    if isinstance(record, StartRecord):
        return f"{record.episode}/0"
    if isinstance(record, TurnRecord):
        return f"{record.episode}/{record.turn + 1}"
    if isinstance(record, EndRecord):
        return f"{record.episode}/end"
    raise TransportError(f"no default msg_id for a {record.kind!r} record on a t1.traj subject: pass msg_id=")


def traj_subject(episode: str) -> str:
    """The subject of an episode's records. Episode ids must not contain '.', '*', '>' or whitespace."""
    if not episode or any(c in episode for c in ".*> \t\r\n"):
        raise TransportError(f"episode id {episode!r} cannot be a subject token: avoid '.', '*', '>' and spaces")
    return TRAJ_PREFIX + episode


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` is one or more tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def dead_letter(subject: str, data: bytes, error: WireError, max_payload: int) -> tuple[str, dict[str, str], bytes]:
    """Subject, headers and (possibly truncated) payload of the dead letter for a malformed message."""
    reason = DeadReason(error.reason).value  # a subject token: a closed set of plain words
    headers = {
        HDR_DEAD_REASON: reason,
        HDR_DEAD_ERROR: " ".join(str(error).split())[:1000],
        HDR_DEAD_SUBJECT: subject,
        HDR_DEAD_SIZE: str(len(data)),
    }
    room = max(0, max_payload - 4096)
    return DEAD_PREFIX + reason, headers, bytes(data[:room])


class SeenSeqs:
    """Stream sequences this consumer holds (delivered, not settled) or acknowledged recently.

    A server restart can lose acks in flight, and an expired ack wait redelivers what we still hold: both
    would hand the caller a record twice. Within one ``consume()`` the transport skips such redeliveries
    (acking again the ones already acknowledged), so each record is handed over once.
    """

    def __init__(self, remember: int = 1 << 20):
        self.holding: set[int] = set()
        self._acked: set[int] = set()
        self._order: deque[int] = deque()
        self._remember = remember

    def acked(self, seq: int) -> bool:
        return seq in self._acked

    def mark_acked(self, seqs: Sequence[int]) -> None:
        for s in seqs:
            self.holding.discard(s)
            if s not in self._acked:
                self._acked.add(s)
                self._order.append(s)
        while len(self._order) > self._remember:
            self._acked.discard(self._order.popleft())

    def release(self, seqs: Sequence[int]) -> None:
        for s in seqs:
            self.holding.discard(s)
