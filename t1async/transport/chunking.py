"""Split a payload larger than the server's max payload into chunks, and rejoin them. Pure: no I/O.

Each chunk is its own message on the record's subject with headers

    Nats-Msg-Id   <msg_id>#<i>     (so a retried chunk is deduplicated by the stream like any message)
    T1-Chunk      <i>/<n>
    T1-Chunk-Of   <msg_id>
    T1-Chunk-Len  <total bytes>

A payload that fits travels as one message with just ``Nats-Msg-Id: <msg_id>``. ``Rejoiner`` collects
chunks (in any order, duplicates ignored) keyed by ``T1-Chunk-Of`` and returns the payload when complete.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from t1async.protocol.errors import DeadReason, WireError
from t1async.transport.base import HDR_MSG_ID

HDR_CHUNK = "T1-Chunk"
HDR_CHUNK_OF = "T1-Chunk-Of"
HDR_CHUNK_LEN = "T1-Chunk-Len"
HEADER_ROOM = 1024  # bytes of max_payload left for the protocol headers of a chunk
MAX_CHUNKS = 100_000
H = TypeVar("H")


def chunk_size(max_payload: int, msg_id: str) -> int:
    size = max_payload - HEADER_ROOM - 2 * len(msg_id.encode())
    if size < 1024:
        raise ValueError(f"max_payload {max_payload} leaves no room for chunks of msg_id {msg_id!r}")
    return size


def split(data: bytes, msg_id: str, max_payload: int) -> list[tuple[dict[str, str], bytes]]:
    """``[(headers, payload), ...]``: one message if ``data`` fits in ``max_payload``, else chunks (zero-copy
    memoryviews of ``data``)."""
    size = chunk_size(max_payload, msg_id)
    if len(data) <= size:
        return [({HDR_MSG_ID: msg_id}, data)]
    n = -(-len(data) // size)
    view = memoryview(data)
    return [
        (
            {HDR_MSG_ID: f"{msg_id}#{i}", HDR_CHUNK: f"{i}/{n}", HDR_CHUNK_OF: msg_id, HDR_CHUNK_LEN: str(len(data))},
            view[i * size : (i + 1) * size],  # type: ignore[misc]
        )
        for i in range(n)
    ]


def is_chunk(headers: Mapping[str, str] | None) -> bool:
    return bool(headers) and HDR_CHUNK in headers  # type: ignore[operator]


class ChunkError(WireError):
    """A chunk contradicts its headers or its group; ``handles`` are every message of the group dropped."""

    def __init__(self, message: str, handles: list | None = None):
        super().__init__(message, field="T1-Chunk", reason=DeadReason.CHUNK)
        self.handles = handles or []


def _err(what: str, handles: list | None = None) -> ChunkError:
    return ChunkError(f"chunk: {what}", handles)


def parse(headers: Mapping[str, str]) -> tuple[str, int, int, int]:
    """``(group, index, count, total_len)`` of a chunk; ChunkError naming the bad header otherwise."""
    try:
        i_s, n_s = headers[HDR_CHUNK].split("/")
        i, n, total = int(i_s), int(n_s), int(headers[HDR_CHUNK_LEN])
        group = headers[HDR_CHUNK_OF]
    except (KeyError, ValueError) as exc:
        raise _err(f"bad chunk headers {dict(headers)!r} ({type(exc).__name__}: {exc})") from None
    if not group or not 0 <= i < n <= MAX_CHUNKS or total < 0:
        raise _err(f"chunk {i}/{n} of {group!r} (total {total} bytes) is out of range")
    return group, i, n, total


@dataclass
class _Group(Generic[H]):
    count: int
    total: int
    first_seen: float
    parts: dict[int, bytes] = field(default_factory=dict)
    handles: list[H] = field(default_factory=list)
    subject: str = ""


@dataclass(frozen=True)
class Joined(Generic[H]):
    msg_id: str
    subject: str
    data: bytes
    handles: list[H]  # every message that carried a piece (to acknowledge them together)


class Rejoiner(Generic[H]):
    """Collects chunks; ``add`` returns the joined payload once a group is complete."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group[H]] = {}

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, subject: str, headers: Mapping[str, str], data: bytes, handle: H, now: float) -> Joined[H] | None:
        """Add one chunk. Raises ChunkError (reason ``chunk``) for chunks that contradict their group."""
        try:
            group, i, n, total = parse(headers)
        except ChunkError as exc:
            exc.handles = [handle]
            raise
        g = self._groups.get(group)
        if g is None:
            g = self._groups[group] = _Group(n, total, now, subject=subject)
        elif (g.count, g.total) != (n, total):
            del self._groups[group]
            raise _err(
                f"chunk {i}/{n} of {group!r} says {total} bytes, earlier chunks said {g.count} chunks/{g.total} bytes",
                [*g.handles, handle],
            )
        g.handles.append(handle)
        g.parts.setdefault(i, data)
        if len(g.parts) < g.count:
            return None
        del self._groups[group]
        joined = b"".join(g.parts[k] for k in range(g.count))
        if len(joined) != g.total:
            raise _err(f"{group!r} rejoined to {len(joined)} bytes, its headers promised {g.total}", g.handles)
        return Joined(group, g.subject, joined, g.handles)

    def expire(self, now: float, max_age_s: float) -> list[tuple[str, list[H], int, int]]:
        """Drop groups older than ``max_age_s``: ``[(group, handles, have, count)]`` for dead-lettering."""
        old = [k for k, g in self._groups.items() if now - g.first_seen > max_age_s]
        out = []
        for k in old:
            g = self._groups.pop(k)
            out.append((k, g.handles, len(g.parts), g.count))
        return out
