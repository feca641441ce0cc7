"""bench.journal: compaction beside appends, the old rewrite-in-place journal vs the one in journal files.

    python -m bench.journal [--mb 64] [--file-mb 8] [--json]

Both sides get the same turn records (``--mb`` of them; 8 episodes of 40 turns run at a time; all but the
last 8 are settled), then compact while a
worker thread keeps appending records of a live episode, one at a time, each fsynced (as the learner's
ingest does). Reported per side: how long compaction took, the worst and p99 append latency while it ran,
the appends that failed, and the acked live records that a reopened journal no longer holds.

- old: ``compact(keep)`` reads the whole file, rewrites the kept records to a temp file and renames it over
  the journal. In the learner it ran on the event loop, so ingest and credits waited for all of it.
- new: ``compact(live)`` (t1async.ingest.journal) deletes sealed journal files whose episodes are all
  settled, from a worker thread; the lock appends share is held only to pick the files.

``--json`` prints {old_compact_s, new_compact_s, old_lost, new_lost, old_append_errors, ...} last.
"""

from __future__ import annotations

import argparse
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench._common import emit_json, print_grid
from bench.transport import make_records
from t1async.ingest.journal import Journal, read_journal
from t1async.protocol import wire

_LEN = struct.Struct("<I")


class RewriteJournal:
    """The journal before journal files (commit 34955e3^), reduced to what this bench drives."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "ab")  # noqa: SIM115

    def append(self, records: list[wire.Record]) -> None:
        buf = b"".join(_LEN.pack(len(b)) + b for b in map(wire.encode, records))
        self._f.write(buf)
        self._f.flush()
        os.fsync(self._f.fileno())

    def compact(self, keep: Callable[[wire.Record], bool]) -> None:
        kept = [r for r in read_journal(self.path) if keep(r)]
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

    def close(self) -> None:
        self._f.close()


CONCURRENT, TURNS = 8, 40  # episodes running at once, turns per episode


def episode_of(k: int) -> str:
    """Record k of a run with CONCURRENT episodes at a time, each TURNS turns long."""
    return f"ep{(k // (CONCURRENT * TURNS)) * CONCURRENT + k % CONCURRENT}"


def fill(append: Callable[[list], None], records: list[wire.TurnRecord], n_bytes: int) -> int:
    """Append records until ``n_bytes``; returns how many."""
    size = len(wire.encode(records[0])) + 4
    k = 0
    while k * size < n_bytes:
        append([_as(records[(k + j) % len(records)], episode_of(k + j), k + j) for j in range(16)])
        k += 16
    return k


def _as(rec: wire.TurnRecord, episode: str, turn: int) -> wire.TurnRecord:
    from dataclasses import replace

    return replace(rec, episode=episode, turn=turn)


def race(journal, compact: Callable[[], None], record: wire.TurnRecord) -> dict:
    """Compact while a thread appends live records; (compaction seconds, latencies, errors, acked turns)."""
    lat: list[float] = []
    acked: list[int] = []
    errors = 0
    stop = threading.Event()

    def writer() -> None:
        nonlocal errors
        t = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                journal.append([_as(record, "live", t)])
                acked.append(t)
                lat.append(time.perf_counter() - t0)
            except Exception:  # noqa: BLE001 - counted: what the old journal did to ingest
                errors += 1
            t += 1

    th = threading.Thread(target=writer)
    th.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    compact()
    took = time.perf_counter() - t0
    time.sleep(0.05)
    stop.set()
    th.join()
    return {"compact_s": took, "lat": lat, "errors": errors, "acked": acked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=64.0, help="journal size to compact (default 64)")
    ap.add_argument("--file-mb", type=float, default=8.0, help="the new journal's file size (default 8)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    records = make_records(64, output_tokens=256, delta=256, layers=4, topk=2)
    n = int(a.mb * 1e6)
    rows, out = [], {}
    with tempfile.TemporaryDirectory() as d:
        old = RewriteJournal(Path(d) / "journal.bin")
        k = fill(old.append, records, n)
        live = {episode_of(k - 1 - j) for j in range(CONCURRENT)} | {"live"}
        r_old = race(old, lambda: old.compact(lambda r: r.episode in live), records[0])
        old.close()
        have_old = {r.turn for r in read_journal(Path(d) / "journal.bin") if r.episode == "live"}

        new = Journal(Path(d) / "journal", file_bytes=int(a.file_mb * 1e6))
        list(new.replay())
        fill(new.append, records, n)
        r_new = race(new, lambda: new.compact(live), records[0])
        new.close()
        have_new = {r.turn for r in read_journal(Path(d) / "journal") if r.episode == "live"}
    for name, r, have in (("old", r_old, have_old), ("new", r_new, have_new)):
        lat = np.asarray(r["lat"] or [0.0]) * 1000
        lost = len(set(r["acked"]) - have)
        rows.append(
            [name, r["compact_s"], float(np.percentile(lat, 99)), float(lat.max()), r["errors"], len(r["acked"]), lost]
        )
        out.update(
            {
                f"{name}_compact_s": r["compact_s"],
                f"{name}_append_p99_ms": float(np.percentile(lat, 99)),
                f"{name}_append_max_ms": float(lat.max()),
                f"{name}_append_errors": r["errors"],
                f"{name}_acked": len(r["acked"]),
                f"{name}_lost": lost,
            }
        )
    print_grid(
        ["journal", "compact s", "append p99 ms", "append max ms", "append errors", "acked", "acked lost"],
        rows,
        title=f"compacting {a.mb:g} MB (all but the running {CONCURRENT} episodes settled) while appending",
    )
    out["mb"] = a.mb
    if a.json:
        emit_json(out)


if __name__ == "__main__":
    main()
