"""What a consumer does with the messages it fetched, shared by every Transport. Pure: no I/O.

``StreamIntake`` turns fetched stream messages into ``Delivery`` objects: it skips redeliveries of what this
consumer already holds or acknowledged (acking the latter again), rejoins chunked records, and turns bad
messages into dead letters. It tells the caller which server-side handles to ack, terminate and publish;
the caller does the I/O, in one crossing. ``CoreIntake`` does the same for core subscriptions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from t1async.log import get_logger
from t1async.protocol import wire
from t1async.protocol.errors import DeadReason, WireError
from t1async.protocol.wire import Record
from t1async.transport import chunking
from t1async.transport.base import HDR_MSG_ID, Delivery, SeenSeqs, TransportStats, dead_letter

log = get_logger("transport")
H = TypeVar("H")
DeadLetter = tuple[str, dict[str, str], bytes]  # subject, headers, payload


@dataclass(frozen=True)
class Fetched(Generic[H]):
    subject: str
    data: bytes
    headers: Mapping[str, str]
    handle: H  # what the server needs to ack this message (a nats Msg; a seq in memory)
    seq: int  # stream sequence
    num_delivered: int = 1


@dataclass
class Intaken(Generic[H]):
    deliveries: list[Delivery] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)  # every stream seq behind the deliveries (chunks included)
    ack_now: list[H] = field(default_factory=list)  # redeliveries of what was already acknowledged
    term: list[H] = field(default_factory=list)  # malformed: never deliver again
    dead: list[DeadLetter] = field(default_factory=list)


class StreamIntake(Generic[H]):
    def __init__(self, stats: TransportStats, *, max_payload: int, chunk_timeout_s: float):
        self.stats, self.max_payload, self.chunk_timeout_s = stats, max_payload, chunk_timeout_s
        self.seen = SeenSeqs()
        self.held: dict[int, H] = {}  # seq -> handle, delivered to us and not settled (chunks waiting too)
        self._rejoin: chunking.Rejoiner[tuple[int, H]] = chunking.Rejoiner()

    def take(self, fetched: list[Fetched[H]], now: float) -> Intaken[H]:
        out: Intaken[H] = Intaken()
        for f in fetched:
            if f.seq in self.seen.holding or self.seen.acked(f.seq):
                self.stats.redelivered_skipped += 1
                if self.seen.acked(f.seq):
                    out.ack_now.append(f.handle)
                continue
            subject, data, parts = f.subject, f.data, [(f.seq, f.handle)]
            msg_id = f.headers.get(HDR_MSG_ID) or f"seq/{f.seq}"
            try:
                if chunking.is_chunk(f.headers):
                    self._hold(parts)
                    joined = self._rejoin.add(subject, f.headers, data, (f.seq, f.handle), now)
                    if joined is None:
                        continue
                    subject, data, parts, msg_id = joined.subject, joined.data, joined.handles, joined.msg_id
                rec = wire.decode(data)
            except WireError as err:
                self._reject(out, subject, data, err, getattr(err, "handles", None) or parts)
                continue
            out.deliveries.append(Delivery(subject, rec, msg_id, parts[0][0], f.num_delivered))
            out.seqs.extend(s for s, _ in parts)
            self._hold(parts)
        for group, parts, have, count in self._rejoin.expire(now, self.chunk_timeout_s):
            late = WireError(
                f"chunk: record {group!r} incomplete after {self.chunk_timeout_s}s ({have} of {count} chunks)",
                field="T1-Chunk",
                reason=DeadReason.CHUNK,
            )
            self._reject(out, group, b"", late, parts)
        self.stats.delivered += len(out.deliveries)
        return out

    def settle(self, seqs: list[int], ack: bool) -> list[H]:
        """The caller acked (or nakked) a batch: the handles to send to the server."""
        handles = [self.held.pop(s) for s in seqs if s in self.held]
        (self.seen.mark_acked if ack else self.seen.release)(seqs)
        return handles

    def release_all(self) -> list[H]:
        """The consumer is closing: everything it holds, to be nakked (redelivered at once to the next one)."""
        handles = list(self.held.values())
        self.seen.release(list(self.held))
        self.held.clear()
        return handles

    def _hold(self, parts: list[tuple[int, H]]) -> None:
        for s, h in parts:
            self.held[s] = h
            self.seen.holding.add(s)

    def _reject(self, out: Intaken[H], subject: str, data: bytes, err: WireError, parts: list[tuple[int, H]]) -> None:
        out.dead.append(count_dead(self.stats, subject, data, err, self.max_payload))
        out.term.extend(h for _, h in parts)
        seqs = [s for s, _ in parts]
        self.seen.release(seqs)
        for s in seqs:
            self.held.pop(s, None)


class CoreIntake:
    """Decodes core messages, rejoining chunked ones; ``decode`` returns None while a record is incomplete."""

    def __init__(self, chunk_timeout_s: float):
        self.chunk_timeout_s = chunk_timeout_s
        self._rejoin: chunking.Rejoiner[None] = chunking.Rejoiner()

    def decode(
        self, subject: str, data: bytes, headers: Mapping[str, str], now: float
    ) -> tuple[bytes, Record | WireError] | None:
        self._rejoin.expire(now, self.chunk_timeout_s)
        try:
            if chunking.is_chunk(headers):
                joined = self._rejoin.add(subject, headers, data, None, now)
                if joined is None:
                    return None
                data = joined.data
            return data, wire.decode(data)
        except WireError as err:
            return data, err


def count_dead(stats: TransportStats, subject: str, data: bytes, err: WireError, max_payload: int) -> DeadLetter:
    """The dead letter for a malformed message, counted in ``stats`` and logged."""
    letter = dead_letter(subject, data, err, max_payload)
    stats.dead[letter[1]["T1-Dead-Reason"]] += 1
    log.warning("transport.dead_letter", subject=subject, dead_subject=letter[0], error=str(err), size=len(data))
    return letter
