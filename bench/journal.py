"""bench.journal: compaction of the journal files while appends go on.

    python -m bench.journal [--mb 64] [--file-mb 8] [--json]

The journal gets ``--mb`` of turn records (8 episodes of 40 turns run at a time; all but the last 8 are
settled), then compacts while a worker thread keeps appending records of a live episode, one at a time, each
fsynced (as the learner's ingest does). Reported: how long compaction took, the worst and p99 append latency
while it ran, the appends that failed, and the acked live records that a reopened journal no longer holds.

``compact(live)`` (t1async.ingest.journal) deletes sealed journal files whose episodes are all settled, from a
worker thread; the lock appends share is held only to pick the files. The journal it replaced rewrote the
whole file on the event loop; the two were compared side by side in docs/results.md (2026-12-01, 22f891e).

``--json`` prints {compact_s, append_p99_ms, append_max_ms, append_errors, acked, lost, mb} last.
"""

from __future__ import annotations

import argparse
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

CONCURRENT, TURNS = 8, 40  # episodes running at once, turns per episode


def episode_of(k: int) -> str:
    """Record k of a run with CONCURRENT episodes at a time, each TURNS turns long."""
    return f"ep{(k // (CONCURRENT * TURNS)) * CONCURRENT + k % CONCURRENT}"


def fill(append: Callable[[list[wire.TurnRecord]], object], records: list[wire.TurnRecord], n_bytes: int) -> int:
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


def race(journal: Journal, compact: Callable[[], object], record: wire.TurnRecord) -> dict:
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
            except Exception:  # noqa: BLE001 - counted: an append that fails is ingest failing
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
    ap.add_argument("--file-mb", type=float, default=8.0, help="the size of one journal file (default 8)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    records = make_records(64, output_tokens=256, delta=256, layers=4, topk=2)
    n = int(a.mb * 1e6)
    with tempfile.TemporaryDirectory() as d:
        journal = Journal(Path(d) / "journal", file_bytes=int(a.file_mb * 1e6))
        list(journal.replay())
        k = fill(journal.append, records, n)
        live = {episode_of(k - 1 - j) for j in range(CONCURRENT)} | {"live"}
        r = race(journal, lambda: journal.compact(live), records[0])
        journal.close()
        have = {
            x.turn for x in read_journal(Path(d) / "journal") if isinstance(x, wire.TurnRecord) and x.episode == "live"
        }
    lat = np.asarray(r["lat"] or [0.0]) * 1000
    out = {
        "compact_s": r["compact_s"],
        "append_p99_ms": float(np.percentile(lat, 99)),
        "append_max_ms": float(lat.max()),
        "append_errors": r["errors"],
        "acked": len(r["acked"]),
        "lost": len(set(r["acked"]) - have),
    }
    print_grid(
        ["compact s", "append p99 ms", "append max ms", "append errors", "acked", "acked lost"],
        [list(out.values())],
        title=f"compacting {a.mb:g} MB (all but the running {CONCURRENT} episodes settled) while appending",
    )
    out["mb"] = a.mb
    if a.json:
        emit_json(out)


if __name__ == "__main__":
    main()
