"""The learner's journal: what it has durably taken from the trajectory stream.

The learner appends every trajectory record it consumes (as wire bytes, length-prefixed) and fsyncs before
it acknowledges the batch to JetStream. A restarted learner replays the journal to rebuild its episodes
(context included), and skips the turns its last checkpoint says were trained: no admitted turn is lost, and
none is trained twice. ``compact()`` drops the records of episodes that ended and were fully trained.

A torn tail (a crash mid-append) is detected by the length prefix and truncated on open.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Callable, Iterable, Iterator

from t1async import wire
from t1async.errors import WireError
from t1async.log import get_logger

_LEN = struct.Struct("<I")
log = get_logger("t1async.learner.journal")


def read_journal(path: str | Path) -> Iterator[wire.Record]:
    """The records of a journal, read-only (safe while a learner appends; a torn tail is left alone)."""
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos + 4 <= len(data):
        (n,) = _LEN.unpack_from(data, pos)
        if pos + 4 + n > len(data):
            return
        chunk = data[pos + 4 : pos + 4 + n]
        pos += 4 + n
        try:
            yield wire.decode(chunk)
        except WireError as exc:  # cannot happen for what we wrote, unless the disk lies
            log.error("journal.bad_record", offset=pos, error=str(exc))


class Journal:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repair_tail()
        self._f = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        self.records = 0

    def _repair_tail(self) -> None:
        if not self.path.exists():
            return
        good = 0
        with open(self.path, "rb") as f:
            data = f.read()
        while good + 4 <= len(data):
            (n,) = _LEN.unpack_from(data, good)
            if good + 4 + n > len(data):
                break
            good += 4 + n
        if good != len(data):
            log.warning("journal.torn_tail", path=str(self.path), kept_bytes=good, dropped_bytes=len(data) - good)
            with open(self.path, "r+b") as f:
                f.truncate(good)

    def append(self, records: Iterable[wire.Record]) -> int:
        """Append and fsync. Returns the number of records written."""
        buf = bytearray()
        n = 0
        for r in records:
            b = wire.encode(r)
            buf += _LEN.pack(len(b)) + b
            n += 1
        if n:
            self._f.write(buf)
            self._f.flush()
            os.fsync(self._f.fileno())
            self.records += n
        return n

    def replay(self) -> Iterator[wire.Record]:
        self._f.flush()
        return read_journal(self.path)

    def compact(self, keep: Callable[[wire.Record], bool]) -> tuple[int, int]:
        """Rewrite the journal with only the records ``keep`` accepts (atomic rename). Returns (kept, dropped)."""
        kept: list[wire.Record] = []
        before = 0
        for r in self.replay():
            before += 1
            if keep(r):
                kept.append(r)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for r in kept:
                b = wire.encode(r)
                f.write(_LEN.pack(len(b)) + b)
            f.flush()
            os.fsync(f.fileno())
        self._f.close()
        os.replace(tmp, self.path)
        self._f = open(self.path, "ab")  # noqa: SIM115
        return len(kept), before - len(kept)

    def size_bytes(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def close(self) -> None:
        self._f.close()
