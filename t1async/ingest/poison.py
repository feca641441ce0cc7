"""Poisoned episodes: a record no step could use never reaches the journal, and its episode stops there.

    batch ─ screen ─┬─ good     → journal → ack → assembly
                    ├─ bad      → t1.dead.<reason> (record + reason) ─┐
                    └─ dropped  (later turns of a poisoned episode)  ─┴→ poisoned.jsonl (fsync) → ack
                                                                        → settled ``poisoned``

``screen`` validates every record of a batch against the learner's model (``validate.check_record``). A bad
turn poisons its episode at that turn: it and every later turn of the episode are dropped (counted) and
their credits settled; the earlier turns still train, the episode stopping before the poisoned turn as a cut
(``Assembler.stop``). A training step that raises anyway dead-letters its segments (reason ``train_step``)
and poisons their episodes at the first turn it held, so the same step is never retried. A record whose
assembly raises (a defect no check foresaw) is dead-lettered (reason ``assembly``) and its episode dropped
whole (poisoned at turn 0): its assembly state can no longer be trusted.

The book of poisoned episodes (``<run_dir>/learner/poisoned.jsonl``, one JSON line per episode and turn,
fsynced before the batch is acked) survives a restart: replay drops what it dropped live, so a poison record
can never put the learner in a crash loop, not even from a journal written before this check existed.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from t1async.ingest.journal import JournalWriteError, fsync_dir
from t1async.ingest.tito import Segment
from t1async.ingest.validate import ModelLimits, check_record
from t1async.log import get_logger
from t1async.protocol import wire
from t1async.protocol.errors import DeadReason, T1Error, WireError

log = get_logger("t1async.ingest.poison")


@dataclass(frozen=True)
class Poison:
    episode: str
    turn: int  # the first turn dropped: the episode stops before it
    reason: DeadReason
    error: str


@dataclass
class Screened:
    good: list[wire.Record] = field(default_factory=list)  # journal and take these
    bad: list[tuple[wire.Record, WireError]] = field(default_factory=list)  # dead-letter these
    dropped: list[wire.TurnRecord] = field(default_factory=list)  # later turns of poisoned episodes

    @property
    def poisons(self) -> list[Poison]:
        return [Poison(getattr(r, "episode", ""), getattr(r, "turn", 0), e.reason, str(e)) for r, e in self.bad]

    @property
    def rejected_keys(self) -> list[tuple[str, int]]:
        """(episode, turn) of the turns this batch delivered and the learner will never train."""
        bad = [(r.episode, r.turn) for r, _ in self.bad if isinstance(r, wire.TurnRecord)]
        return bad + [(r.episode, r.turn) for r in self.dropped]


class PoisonBook:
    """The poisoned episodes, their counters, and the file that keeps them across a restart."""

    def __init__(self, path: Path, limits: ModelLimits) -> None:
        self.path, self.limits = path, limits
        self.at: dict[str, Poison] = {}  # episode -> its earliest poison
        self.dead: Counter[str] = Counter()  # records (or segments) dead-lettered, by reason
        self.dropped_turns = 0  # later turns of poisoned episodes, dropped
        self.failed_steps = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        for p in _load(path):
            self._remember(p)

    def stop_turn(self, episode: str) -> int | None:
        p = self.at.get(episode)
        return None if p is None else p.turn

    def screen(self, records: Sequence[wire.Record], policy_version: int | None = None) -> Screened:
        """Split a batch: records to journal, bad records, and later turns of poisoned episodes (this batch's
        new poisons included, whatever the order the turns arrived in). ``policy_version``: the learner's. Counts
        nothing: see ``count``."""
        out = Screened()
        stop: dict[str, int] = {}
        for r in records:
            try:
                check_record(r, self.limits, policy_version)
            except WireError as err:
                out.bad.append((r, err))
                if isinstance(r, wire.TurnRecord):
                    stop[r.episode] = min(r.turn, stop.get(r.episode, r.turn))
                continue
            out.good.append(r)
        keep = []
        for r in out.good:
            if isinstance(r, wire.TurnRecord):
                k = min(
                    stop.get(r.episode, r.turn + 1), self.at[r.episode].turn if r.episode in self.at else r.turn + 1
                )
                if r.turn >= k:
                    out.dropped.append(r)
                    continue
            keep.append(r)
        out.good = keep
        return out

    def count(self, s: Screened) -> None:
        self.dead.update(e.reason for _, e in s.bad)
        self.dropped_turns += len(s.dropped)
        for r in s.dropped:
            log.info("learner.poisoned_turn_dropped", episode=r.episode, turn=r.turn, stop=self.stop_turn(r.episode))

    def add(self, poisons: Iterable[Poison]) -> list[Poison]:
        """Remember poisons durably (fsync). Returns those that changed an episode: newly poisoned, or at an
        earlier turn than before."""
        best: dict[str, Poison] = {}  # the earliest turn per episode that is news; remembered once written
        for p in poisons:
            old = best.get(p.episode) or self.at.get(p.episode)
            if old is None or p.turn < old.turn:
                best[p.episode] = p
        changed = list(best.values())
        if changed:
            new = not self.path.exists()
            lines = "".join(
                json.dumps({"episode": p.episode, "turn": p.turn, "reason": p.reason, "error": p.error}) + "\n"
                for p in changed
            ).encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                start = os.fstat(fd).st_size
                try:
                    view = memoryview(lines)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                    if new:
                        fsync_dir(self.path.parent)
                except OSError as exc:  # a full disk: cut back what was written, remember nothing; retried
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, start)
                    raise JournalWriteError(
                        f"poison book {self.path}: could not write and fsync {len(lines)} bytes "
                        f"({exc.strerror or exc}); nothing of it was kept",
                        exc.errno,
                    ) from exc
            finally:
                os.close(fd)
            self.at.update(best)
            for p in changed:
                log.warning("learner.episode_poisoned", episode=p.episode, turn=p.turn, reason=p.reason, error=p.error)
        return changed

    def _remember(self, p: Poison) -> bool:
        old = self.at.get(p.episode)
        if old is not None and old.turn <= p.turn:
            return False
        self.at[p.episode] = p
        return True

    def metrics(self) -> dict:
        return {
            "dead": dict(self.dead),
            "episodes": len(self.at),
            "dropped_turns": self.dropped_turns,
            "failed_steps": self.failed_steps,
        }


def _load(path: Path) -> list[Poison]:
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(Poison(str(d["episode"]), int(d["turn"]), DeadReason(d["reason"]), str(d.get("error", ""))))
        except (ValueError, KeyError, TypeError) as exc:
            if n == len(lines):  # a torn last line: a crash mid-write, before its batch was acked
                log.warning("learner.poison_book_torn_line", path=str(path), line=n)
                continue
            raise T1Error(f"{path} line {n} is not a poison entry ({exc}): fix or remove that line") from exc
    return out


def segment_letter(s: Segment) -> bytes:
    """The dead-letter payload of a segment a step failed on: its arrays, as a msgpack map."""
    m = {
        "kind": "segment",
        "episode": s.episode,
        "index": int(s.index),
        "done": bool(s.done),
        "tokens": np.asarray(s.tokens, np.int32),
        "loss_mask": np.asarray(s.loss_mask, np.uint8),
        "logprobs": np.asarray(s.logprobs, np.float32),
        "versions": np.asarray(s.versions, np.int32),
        "turn_ids": np.asarray(s.turn_ids, np.int32),
    }
    if s.routing is not None:
        m["routing"] = np.asarray(s.routing, np.int16)
    return wire.encode_map(m)
