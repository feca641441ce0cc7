"""The learner's ingest stage: from the trajectory stream to assembled segments (design §3, §7).

    ingest   batch ─ screen (validate.py) ─┬─ good → journal (fsync) → ack → take (credits, assembly)
                                           └─ bad  → poison book (fsync) + t1.dead.<reason> → ack
    replay   journal files in order ─ screened the same way ─ take
    compact  after each step: the live set on the loop, journal file deletion in a worker thread
    failures a record whose taking raises: t1.dead.assembly, episode dropped whole;
             a step that raises (``step_failed``): segments to t1.dead.train_step, episodes stopped

``Ingest`` owns the journal, the poison book, the assembler (TITO, routing) and the closed segments waiting
for a step (``ready``). The learner builds it with the credit side it reports to: the settler (the open
turns), the credit gate and server (a delivered turn, an ended episode's unspent credit) and the actors'
liveness (which actor owns which running episode).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.abc

from t1async.credits.ledger import CreditGate
from t1async.credits.liveness import ActorLiveness, actor_of
from t1async.credits.server import CreditServer
from t1async.credits.settle import Settler, loss_turns
from t1async.ingest.assembly import Assembler
from t1async.ingest.journal import Journal, JournalWriteError
from t1async.ingest.poison import Poison, PoisonBook, Screened, segment_letter
from t1async.ingest.tito import Segment
from t1async.ingest.validate import ModelLimits
from t1async.log import get_logger
from t1async.protocol import wire
from t1async.protocol.errors import DeadReason, WireError
from t1async.transport.base import Transport, traj_subject

_A = TypeVar("_A")
_R = TypeVar("_R")
log = get_logger("t1async.learner")


class Ingest:
    """What the learner has durably taken from ``transport`` (consumer ``durable``), under ``learner_dir``:
    ``journal/`` and ``poisoned.jsonl``. ``version()`` is the learner's policy version now (records are
    screened against it)."""

    def __init__(
        self,
        learner_dir: Path,
        limits: ModelLimits,
        transport: Transport,
        *,
        settler: Settler,
        gate: CreditGate,
        credits: CreditServer,
        liveness: ActorLiveness,
        policy_version: Callable[[], int],
        durable: str,
        journal_file_bytes: int,
    ) -> None:
        self.transport, self.durable, self.policy_version = transport, durable, policy_version
        self.settler, self.gate, self.credits, self.liveness = settler, gate, credits, liveness
        self.poison = PoisonBook(learner_dir / "poisoned.jsonl", limits)
        self.journal = Journal(learner_dir / "journal", file_bytes=journal_file_bytes)
        self.blocked_since: float | None = None  # the journal or poison book refuses writes since (epoch s)
        self.blocked_error = ""
        self.assembler = Assembler()
        self.ready: list[Segment] = []  # closed segments waiting for a step
        self.ended: deque[wire.EndRecord] = deque(maxlen=200)  # the last episodes ended (live, not replayed)
        self.arrived = anyio.Event()  # set (and replaced) after each batch taken
        self._taking: set[str] = set()  # episodes of the batch ingest is journaling and taking now

    @property
    def untrained(self) -> dict[tuple[str, int], int]:
        """Delivered turns not settled yet (the settler's): (episode, turn) -> oldest version."""
        return self.settler.untrained

    # ------------------------------------------------------------------------------------------ the stream

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        async with self.transport.consume(self.durable) as batches:
            task_status.started()
            async for batch in batches:
                s = self.poison.screen(
                    [d.record for d in batch], self.policy_version()
                )  # validate.py: what a step relies on
                # journaled before the assembler knows them: live for compaction until taken
                self._taking = {getattr(r, "episode", "") for r in s.good}
                changed: list[Poison] = []
                if s.bad or s.dropped:  # the poison book and dead letters first: durable before the ack
                    changed = await self._durably(self.poison.add, s.poisons)
                    await self.dead_letter(s)
                await self._durably(self.journal.append, s.good)
                await batch.ack()  # durably taken: in the journal, or dead-lettered
                failed = [f for rec in s.good if (f := self._take_safely(rec, live=True)) is not None]
                if s.bad or s.dropped:
                    self._poisoned(changed, s.rejected_keys)
                self._taking = set()
                for f in failed:
                    await self.dead_letter(f)
                self.arrived.set()
                self.arrived = anyio.Event()

    async def _durably(self, write: Callable[[_A], _R], arg: _A) -> _R:
        """``write(arg)`` in a worker thread, retried until it succeeds. While it cannot (a full disk, an I/O
        error: ``JournalWriteError``, which leaves nothing behind) the batch stays unacked, so JetStream
        keeps its records and the actors' publishes queue behind it: backpressure, never an ack without a
        durable write and never a crash loop. One event when it blocks, one when it resumes."""
        delay = 0.5
        while True:
            try:
                result = await anyio.to_thread.run_sync(write, arg)
            except JournalWriteError as exc:
                if self.blocked_since is None:
                    self.blocked_since = time.time()
                    self.blocked_error = str(exc)
                    log.error(
                        "learner.journal_blocked",
                        error=str(exc),
                        errno=exc.errno,
                        action="not acking: JetStream keeps the records; retrying until the disk takes writes",
                    )
                await anyio.sleep(delay)
                delay = min(2 * delay, 5.0)
                continue
            if self.blocked_since is not None:
                log.info("learner.journal_resumed", blocked_s=round(time.time() - self.blocked_since, 1))
                self.blocked_since, self.blocked_error = None, ""
            return result

    def blocked_s(self) -> float:
        """Seconds the journal has refused writes (0 when it takes them): the dashboard's disk-full flag."""
        return 0.0 if self.blocked_since is None else round(time.time() - self.blocked_since, 1)

    def replay(self) -> list[Screened]:
        """Rebuild from the journal, screened as at ingest: a record journaled before validation existed (or
        under a model with other sizes) is not taken. Returns the dead letters to send once the stream runs."""
        dead: list[Screened] = []
        n = 0
        for rec in self.journal.replay():
            s = self.poison.screen([rec], self.policy_version())
            if s.bad:
                dead.append(s)
                self.poison.add(s.poisons)
            for good in s.good:
                if (f := self._take_safely(good, live=False)) is not None:
                    dead.append(f)
            n += 1
        for p in self.poison.at.values():
            if p.episode in self.assembler.open:
                self.stop(p.episode, p.turn)  # its dropped turns settled, no longer its actor's open work
        if n:
            log.info(
                "learner.journal_replayed",
                records=n,
                untrained_turns=len(self.untrained),
                policy_version=self.policy_version(),
            )
        return dead

    async def dead_letter(self, s: Screened) -> None:
        for rec, err in s.bad:
            await self.transport.publish_dead(traj_subject(rec.episode), wire.encode(rec), err)  # type: ignore[union-attr]
        self.poison.count(s)

    # ------------------------------------------------------------------------------------------ taking

    def _take(self, rec: wire.Record, *, live: bool) -> None:
        if isinstance(rec, wire.TurnRecord):
            key = (rec.episode, rec.turn)
            # a turn trained before a restart, or settled already (a redelivery), is not taken again
            if self.settler.open(key, rec.policy_version) and live:
                self.credits.on_delivered(*key)
                self.gate.on_delivered(*key)
        elif isinstance(rec, wire.StartRecord):
            if self.running(rec.episode):
                self.liveness.owns(rec.episode, rec.actor, rec.created_at)
        elif isinstance(rec, wire.EndRecord):
            if live:
                self.ended.append(rec)
            # a credit still unspent when its episode ended (the last sample returned no tokens, failed, or was
            # cut by the wall time) can never be used: release it now, not when its lease runs out
            if self.gate.release_episode(rec.episode, from_turn=rec.turns):
                self.credits.forget(episodes={rec.episode})
        self.ready.extend(self.assembler.feed(rec))
        if isinstance(rec, (wire.TurnRecord, wire.EndRecord)):
            self._settle_dropped(rec.episode)  # and no longer the actor's open work once it is assembled
            if self.running(rec.episode) and rec.episode not in self.liveness.owner:  # its start record was not seen
                self.liveness.owns(rec.episode, actor_of(rec.episode))

    def _take_safely(self, rec: wire.Record, *, live: bool) -> Screened | None:
        """``_take`` behind a fault barrier: a validated record that still makes taking it raise (an assembly
        defect) poisons its whole episode, so neither this learner nor a restart replaying it dies on it.
        Returns the dead letter to send."""
        try:
            self._take(rec, live=live)
            return None
        except Exception as exc:  # noqa: BLE001 - one record must never take the learner down
            ep, turn = getattr(rec, "episode", ""), getattr(rec, "turn", -1)
            log.exception("learner.take_failed", episode=ep, turn=turn, error=f"{type(exc).__name__}: {exc}")
            err = WireError(
                f"turn {ep}#{turn}: taking it failed ({type(exc).__name__}: {exc}); its episode is dropped whole",
                field="",
                reason=DeadReason.ASSEMBLY,
            )
            self._poisoned(self.poison.add([Poison(ep, 0, DeadReason.ASSEMBLY, str(err))]), [])
            return Screened(bad=[(rec, err)])

    def running(self, episode: str) -> bool:
        """Is ``episode`` still open work of its actor (not yet retired by the assembler)?"""
        return episode in self.assembler.open or episode not in self.assembler.ended

    def stop(self, episode: str, turn: int, *, emit: bool = True) -> None:
        """Stop ``episode`` before ``turn`` (its turns before that a segment, when ``emit``) and settle what
        the assembler dropped."""
        self.ready.extend(self.assembler.stop(episode, turn, emit=emit))
        self._settle_dropped(episode)

    def _settle_dropped(self, episode: str) -> None:
        by_reason: dict[str, list[tuple[str, int]]] = {}
        for ep, turn, reason in self.assembler.drain_dropped(episode):
            by_reason.setdefault(reason, []).append((ep, turn))
        for reason, keys in by_reason.items():
            self.settler.settle(keys, reason)
        if not self.running(episode):  # ended or stopped (poisoned, aborted): no longer its actor's open work
            self.liveness.closed(episode)

    # ------------------------------------------------------------------------------------------ poison

    def _poisoned(self, changed: list[Poison], keys: list[tuple[str, int]]) -> None:
        """Settle the poisoned turns and stop their episodes before the first of them (poison.py)."""
        for p in changed:
            keys += [k for k in self.untrained if k[0] == p.episode and k[1] >= p.turn]
        if keys:
            self.settler.settle(keys, "poisoned")
        for p in changed:
            self.stop(p.episode, p.turn, emit=p.reason != DeadReason.ASSEMBLY)

    async def step_failed(self, segments: list[Segment], policy_version: int, exc: Exception) -> None:
        """A training step at ``policy_version`` raised despite validation: dead-letter its segments and poison their
        episodes at the first turn each held, so no restart retries it. (Putting the weights back is the
        learner's.)"""
        self.poison.failed_steps += 1
        log.error(
            "learner.step_failed",
            policy_version=policy_version,
            segments=len(segments),
            error=f"{type(exc).__name__}: {exc}",
            hint="its segments are dead-lettered to t1.dead.train_step and their episodes stopped",
        )
        err = WireError(
            f"training step at version {policy_version} failed: {type(exc).__name__}: {exc}",
            reason=DeadReason.TRAIN_STEP,
        )
        poisons = []
        for s in segments:
            turns = s.turn_ids[s.loss_mask]
            await self.transport.publish_dead(traj_subject(s.episode), segment_letter(s), err)
            self.poison.dead[DeadReason.TRAIN_STEP] += 1
            if turns.size:
                poisons.append(Poison(s.episode, int(turns.min()), DeadReason.TRAIN_STEP, str(err)))
        changed = await anyio.to_thread.run_sync(self.poison.add, poisons)
        self._poisoned(changed, loss_turns(segments))

    # ------------------------------------------------------------------------------------------ for a step

    def take_ready(self) -> list[Segment]:
        """The closed segments waiting for a step, handed over (``ready`` is left empty)."""
        segs, self.ready = self.ready, []
        return segs

    def cut(self, episodes: Iterable[str]) -> list[Segment]:
        """A segment of each open episode's turns so far (assembly.Assembler.cut), in ``episodes`` order."""
        return [s for ep in episodes for s in self.assembler.cut(ep)]

    def drift(self) -> dict[str, int]:
        d = self.assembler.stats().as_dict()
        return {k: int(d.get(k, 0)) for k in ("clean", "realign", "fork")}

    async def compact(self) -> None:
        """Delete the journal files whose episodes are all settled, in a worker thread: ingest keeps
        appending (to the active journal file) and credits keep flowing meanwhile."""
        before = self.journal.active_seq  # journal files sealed after this may hold episodes ``live`` does not know
        live = set(self.assembler.open) | {ep for ep, _ in self.untrained} | {s.episode for s in self.ready}
        try:
            r = await anyio.to_thread.run_sync(self.journal.compact, live | self._taking, before)
        except OSError as exc:  # a full disk: settled.json could not be written; nothing changed, tried next step
            log.warning("learner.journal_compact_failed", error=str(exc))
            return
        if r.deleted_files:
            log.info(
                "learner.journal_compacted",
                deleted_files=r.deleted_files,
                deleted_bytes=r.deleted_bytes,
                kept_files=r.kept_files,
                kept_bytes=r.kept_bytes,
            )
