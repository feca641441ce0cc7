"""The learner's journal: what it has durably taken from the trajectory stream (design §9).

A log-structured store of wire records (length-prefixed), in numbered files under one directory:

    journal/000000000001.jf   sealed: never written again, deleted whole once every episode in it is settled
    journal/000000000002.jf   sealed
    journal/000000000003.jf   active: appended and fsynced before the learner acks JetStream

- One writer: ``append`` (the ingest task, through a worker thread) and ``compact`` (any thread) are
  serialised by one lock held only for the file write and the bookkeeping, never for a deletion.
- ``append`` rolls over to a new file once the active one reaches ``file_bytes``.
- ``compact(live)`` deletes sealed files whose episodes are all settled (not in ``live``). Settled episodes
  that still have records in kept files are listed in ``settled.json`` (written before the deletion) and
  skipped by replay, so a restart never sees half an episode. Records are never rewritten: a record acked
  into a file stays there until the whole file goes.
- The directory is fsynced after every create, rename and delete.
- Replay reads the files in order. A torn tail (a crash mid-append) can only be in the last file; it
  is truncated on open.

A restarted learner replays the journal to rebuild its episodes (context included) and skips the turns its
last checkpoint says were trained: no admitted turn is lost, and none is trained twice.
"""

from __future__ import annotations

import json
import os
import re
import struct
import threading
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from t1async.log import get_logger
from t1async.protocol import wire
from t1async.protocol.errors import T1Error, WireError

_LEN = struct.Struct("<I")
_SEG = re.compile(r"^(\d{12})\.jf$")
SETTLED_NAME = "settled.json"
log = get_logger("t1async.ingest.journal")


class JournalClosedError(T1Error):
    """The journal was used after ``close()``: a bug in the caller (the learner closes it last)."""


class JournalWriteError(T1Error):
    """An append could not be written or fsynced (a full disk, a quota, an I/O error). Nothing of it is in
    the journal: the file was cut back to where the append began, so the caller may retry it as it is."""

    def __init__(self, message: str, errno: int | None) -> None:
        super().__init__(message)
        self.errno = errno


def fsync_dir(path: Path) -> None:
    """Make a create, rename or delete in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _seg_path(root: Path, seq: int) -> Path:
    return root / f"{seq:012d}.jf"


def _journal_files(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _SEG.match(p.name)))


def _good_prefix(data: bytes | memoryview) -> int:
    """Length of the longest prefix of whole frames."""
    pos = 0
    while pos + 4 <= len(data):
        (n,) = _LEN.unpack_from(data, pos)
        if pos + 4 + n > len(data):
            break
        pos += 4 + n
    return pos


def _read_file(path: Path) -> Iterator[wire.Record]:
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
            log.error("journal.bad_record", path=str(path), offset=pos, error=str(exc))


def _load_settled(path: Path) -> set[str]:
    if not path.exists():
        return set()
    try:
        return {str(e) for e in json.loads(path.read_text())}
    except (ValueError, TypeError) as exc:
        raise T1Error(
            f"{path} is not a JSON list of episode ids ({exc}); it is rewritten whole on every "
            "compaction, so this is disk damage: restore it or delete the journal"
        ) from exc


def read_journal(path: str | Path) -> Iterator[wire.Record]:
    """The records of a journal directory (its files in order, less settled episodes) or of one journal
    file, read-only: safe while a learner appends (a torn tail is left alone). A learner's journal is
    ``<run_dir>/learner/journal``."""
    path = Path(path)
    if path.is_dir():
        settled = _load_settled(path / SETTLED_NAME)
        for _, p in _journal_files(path):
            yield from (r for r in _read_file(p) if getattr(r, "episode", "") not in settled)
    elif path.exists():
        yield from _read_file(path)


@dataclass
class _File:
    seq: int
    path: Path
    size: int = 0
    episodes: set[str] | None = field(default_factory=set)  # None: not scanned yet (never deleted before replay)


@dataclass(frozen=True)
class CompactResult:
    deleted_files: int
    deleted_bytes: int
    kept_files: int
    kept_bytes: int


class Journal:
    """``Journal(run_dir / "learner" / "journal")``."""

    def __init__(self, root: str | Path, *, file_bytes: int = 32 << 20) -> None:
        self.root = Path(root)
        self.file_bytes = file_bytes
        self._lock = threading.Lock()
        self._closed = False
        self.records = 0
        if not self.root.is_dir():
            made = [p for p in [self.root, *self.root.parents] if not p.exists()]
            self.root.mkdir(parents=True)
            for p in made:  # each new directory's entry, in its parent
                fsync_dir(p.parent)
        self._settled: set[str] = _load_settled(self.root / SETTLED_NAME)
        found = _journal_files(self.root)
        self._files = [_File(seq, p, p.stat().st_size, None) for seq, p in found]
        if self._files:
            self._repair_tail(self._files[-1])
        if not self._files or self._files[-1].size >= file_bytes:
            self._files.append(self._create(self._files[-1].seq + 1 if self._files else 1))
        self._fd = os.open(self._files[-1].path, os.O_WRONLY | os.O_APPEND)  # closed in close()
        self._cut_to: int | None = None  # a failed append left bytes past this offset: cut them first

    # -- opening -------------------------------------------------------------------------------------

    def _repair_tail(self, jf: _File) -> None:
        with open(jf.path, "rb") as f:
            data = f.read()
        good = _good_prefix(data)
        if good != len(data):
            log.warning("journal.torn_tail", path=str(jf.path), kept_bytes=good, dropped_bytes=len(data) - good)
            with open(jf.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
            jf.size = good

    def _create(self, seq: int) -> _File:
        path = _seg_path(self.root, seq)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
        try:
            fsync_dir(self.root)
        except OSError:
            path.unlink(missing_ok=True)  # not known to be durable: not a journal file yet
            raise
        return _File(seq, path)

    # -- the writer ----------------------------------------------------------------------------------

    def append(self, records: Iterable[wire.Record]) -> int:
        """Append and fsync (then the records may be acked). Returns the number of records written."""
        buf = bytearray()
        episodes: set[str] = set()
        n = 0
        for r in records:
            b = wire.encode(r)
            buf += _LEN.pack(len(b)) + b
            episodes.add(getattr(r, "episode", ""))
            n += 1
        if not n:
            return 0
        with self._lock:
            if self._closed:
                raise JournalClosedError(f"journal {self.root} was appended to after close(); nothing was written")
            jf = self._files[-1]
            try:
                if self._cut_to is not None:  # an earlier append failed half-way: its bytes go first
                    os.ftruncate(self._fd, self._cut_to)
                    self._cut_to = None
                view = memoryview(buf)
                while view:
                    view = view[os.write(self._fd, view) :]
                os.fsync(self._fd)
            except OSError as exc:
                self._cut_to = jf.size
                try:  # cut it back now if the disk lets us (truncating frees space, so it usually does)
                    os.ftruncate(self._fd, jf.size)
                    self._cut_to = None
                except OSError:
                    pass
                raise JournalWriteError(
                    f"journal {jf.path}: could not write and fsync {len(buf)} bytes ({exc.strerror or exc}); "
                    "nothing of it was kept",
                    exc.errno,
                ) from exc
            jf.size += len(buf)
            if jf.episodes is not None:
                jf.episodes |= episodes
            self.records += n
            if jf.size >= self.file_bytes:
                self._roll()
        return n

    def _roll(self) -> None:
        """Seal the active file and start the next. The records are durable already: a roll that fails (a
        full disk) keeps appending to the active file and is tried again after the next append."""
        try:
            new = self._create(self._files[-1].seq + 1)
            fd = os.open(new.path, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            log.warning("journal.roll_failed", path=str(self.root), error=str(exc))
            return
        old, self._fd = self._fd, fd
        self._files.append(new)
        os.close(old)

    def replay(self) -> Iterator[wire.Record]:
        """Every record, files in order; learns which episodes each file holds (for ``compact``).
        Call before the first append of this process."""
        for jf in list(self._files):
            eps: set[str] = set()
            for rec in _read_file(jf.path):
                ep = getattr(rec, "episode", "")
                eps.add(ep)
                if ep not in self._settled:
                    yield rec
            with self._lock:
                jf.episodes = eps if jf.episodes is None else jf.episodes | eps

    def compact(self, live: Collection[str], before: int | None = None) -> CompactResult:
        """Delete the sealed files whose episodes are all settled (none in ``live``). Safe to run in a
        thread beside ``append``: the lock is held only to pick the files.

        ``before``: only files numbered below it (``active_seq`` read when ``live`` was computed): a
        file sealed later may hold records of an episode that began after ``live`` was computed.

        Settled episodes that still have records in kept files are listed first (``settled.json``, written
        atomically) and skipped by ``replay``, so a restart never sees half an episode."""
        with self._lock:
            if any(s.episodes is None for s in self._files):  # not replayed yet: cannot know what is settled
                return CompactResult(0, 0, len(self._files), self.size_bytes())
            gone = [s for s in self._files[:-1] if (before is None or s.seq < before) and s.episodes.isdisjoint(live)]  # type: ignore[union-attr]
            if not gone:
                return CompactResult(0, 0, len(self._files), self.size_bytes())
            kept_eps: set[str] = set().union(*(s.episodes or () for s in self._files if s not in gone))
            # this round's episodes stay listed whole (a late record of one may be appended right now); older
            # entries only while a kept file still holds a record of theirs
            settled = (self._settled & kept_eps) | set().union(*(s.episodes or () for s in gone))
        if settled != self._settled:  # before the deletions: a crash between leaves no half episode. If it
            self._write_settled(settled)  # fails (a full disk) nothing changed: the files stay, tried next time
        with self._lock:
            self._files = [s for s in self._files if s not in gone]
            kept_bytes = self.size_bytes()
        for s in gone:  # no lock: sealed files are never written again
            s.path.unlink(missing_ok=True)
        fsync_dir(self.root)
        return CompactResult(len(gone), sum(s.size for s in gone), len(self._files), kept_bytes)

    def _write_settled(self, settled: set[str]) -> None:
        path = self.root / SETTLED_NAME
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(sorted(settled), f)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
        fsync_dir(self.root)
        self._settled = settled

    # -- inspection and lifecycle --------------------------------------------------------------------

    @property
    def active_seq(self) -> int:
        """The number of the file appends go to now (see ``compact(before=)``)."""
        return self._files[-1].seq

    @property
    def files(self) -> int:
        return len(self._files)

    def size_bytes(self) -> int:
        return sum(s.size for s in self._files)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._fd)
