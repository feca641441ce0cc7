"""The learner's intake: ingest, journal replay and compaction, and what happens to a poison record or a
failed step (design §3, §7). Mixed into ``service.Learner``, whose state these methods share.

    ingest   batch ─ screen (validate.py) ─┬─ good → journal (fsync) → ack → take (assembly, credits)
                                           └─ bad  → poison book (fsync) + t1.dead.<reason> → ack
    replay   journal segments in order ─ screened the same way ─ take
    compact  after each step: the live set on the loop, segment deletion in a worker thread
    failures a record whose taking raises: t1.dead.assembly, episode dropped whole;
             a step that raises: weights restored, segments to t1.dead.train_step, episodes stopped
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from t1async.credits.settle import loss_turns
from t1async.ingest.poison import ASSEMBLY, TRAIN_STEP, Poison, PoisonBook, Screened, restore_weights, segment_letter
from t1async.ingest.tito import Segment
from t1async.log import get_logger
from t1async.model.weights import default_model_dir
from t1async.protocol import wire
from t1async.protocol.errors import WireError
from t1async.transport.base import traj_subject

if TYPE_CHECKING:
    from t1async.ingest.assembly import Assembler
    from t1async.ingest.journal import Journal
    from t1async.learner.service import LearnerConfig
    from t1async.learner.trainer import Trainer
    from t1async.transport.base import Transport

log = get_logger("t1async.learner")


class Intake:
    """The intake half of the learner. Everything below the annotations is the learner's (service.py)."""

    cfg: LearnerConfig
    transport: Transport
    journal: Journal
    poison: PoisonBook
    assembler: Assembler
    trainer: Trainer
    untrained: dict[tuple[str, int], int]
    ready: list[Segment]
    version: int
    _taking: set[str]
    _replay_dead: list[Screened]
    _arrived: Any
    _take: Callable[..., None]
    settle: Callable[[list[tuple[str, int]], str], int]
    _settle_dropped: Callable[[str], None]
    _publish_metrics: Callable[[], Any]

    async def _ingest(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        async with self.transport.consume(self.cfg.durable) as batches:
            task_status.started()
            async for batch in batches:
                s = self.poison.screen([d.record for d in batch], self.version)  # validate.py: what a step relies on
                # journaled before the assembler knows them: live for compaction until taken
                self._taking = {getattr(r, "episode", "") for r in s.good}
                changed: list[Poison] = []
                if s.bad or s.dropped:  # the poison book and dead letters first: durable before the ack
                    changed = await anyio.to_thread.run_sync(self.poison.add, s.poisons)
                    await self._dead_letter(s)
                await anyio.to_thread.run_sync(self.journal.append, s.good)
                await batch.ack()  # durably taken: in the journal, or dead-lettered
                failed = [f for rec in s.good if (f := self._take_safely(rec, live=True)) is not None]
                if s.bad or s.dropped:
                    self._poisoned(changed, s.rejected_keys)
                self._taking = set()
                for f in failed:
                    await self._dead_letter(f)
                self._arrived.set()
                self._arrived = anyio.Event()

    def _replay_journal(self) -> None:
        """Rebuild from the journal, screened as at ingest: a record journaled before validation existed (or
        under a model with other sizes) is dead-lettered once ``run`` starts, never trained."""
        n = 0
        for rec in self.journal.replay():
            s = self.poison.screen([rec], self.version)
            if s.bad:
                self._replay_dead.append(s)
                self.poison.add(s.poisons)
            for good in s.good:
                if (f := self._take_safely(good, live=False)) is not None:
                    self._replay_dead.append(f)
            n += 1
        for p in self.poison.at.values():
            if p.episode in self.assembler.open:
                self.ready.extend(self.assembler.stop(p.episode, p.turn))
                self._settle_dropped(p.episode)  # its dropped turns settled, no longer its actor's open work
        if n:
            log.info("learner.journal_replayed", records=n, untrained_turns=len(self.untrained), version=self.version)

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
                reason=ASSEMBLY,
            )
            self._poisoned(self.poison.add([Poison(ep, 0, ASSEMBLY, str(err))]), [])
            return Screened(bad=[(rec, err)])

    async def _dead_letter(self, s: Screened) -> None:
        for rec, err in s.bad:
            await self.transport.publish_dead(traj_subject(rec.episode), wire.encode(rec), err)  # type: ignore[union-attr]
        self.poison.count(s)

    def _poisoned(self, changed: list[Poison], keys: list[tuple[str, int]]) -> None:
        """Settle the poisoned turns and stop their episodes before the first of them (poison.py)."""
        for p in changed:
            keys += [k for k in self.untrained if k[0] == p.episode and k[1] >= p.turn]
        if keys:
            self.settle(keys, "poisoned")
        for p in changed:
            self.ready.extend(self.assembler.stop(p.episode, p.turn, emit=p.reason != ASSEMBLY))
            self._settle_dropped(p.episode)

    async def _step_failed(self, segments: list[Segment], version: int, exc: Exception) -> None:
        """Trainer.step raised despite validation: dead-letter the step's segments, poison their episodes at
        the first turn each held (so no restart retries it), put the weights back at ``version`` (it may have
        stepped), and go on."""
        self.poison.failed_steps += 1
        log.error(
            "learner.step_failed",
            version=version,
            segments=len(segments),
            error=f"{type(exc).__name__}: {exc}",
            hint="its segments are dead-lettered to t1.dead.train_step and their episodes stopped",
        )
        err = WireError(f"training step at version {version} failed: {type(exc).__name__}: {exc}", reason=TRAIN_STEP)
        poisons = []
        for s in segments:
            turns = s.turn_ids[s.loss_mask]
            await self.transport.publish_dead(traj_subject(s.episode), segment_letter(s), err)
            self.poison.dead[TRAIN_STEP] += 1
            if turns.size:
                poisons.append(Poison(s.episode, int(turns.min()), TRAIN_STEP, str(err)))
        changed = await anyio.to_thread.run_sync(self.poison.add, poisons)
        self._poisoned(changed, loss_turns(segments))
        # after the poison book: if restoring fails too, the restarted learner loads the checkpoint itself and
        # never retries this step
        initial = self.cfg.model_dir or default_model_dir()
        restored = await anyio.to_thread.run_sync(restore_weights, self.trainer, self.cfg.checkpoints, version, initial)
        log.info("learner.weights_restored", version=version, source=restored)
        await self._publish_metrics()

    async def _compact_journal(self) -> None:
        """Delete the journal segments whose episodes are all settled, in a worker thread: ingest keeps
        appending (to the active segment) and credits keep flowing meanwhile."""
        before = self.journal.active_seq  # segments sealed after this may hold episodes ``live`` does not know
        live = set(self.assembler.open) | {ep for ep, _ in self.untrained} | {s.episode for s in self.ready}
        r = await anyio.to_thread.run_sync(self.journal.compact, live | self._taking, before)
        if r.deleted_segments:
            log.info(
                "learner.journal_compacted",
                deleted_segments=r.deleted_segments,
                deleted_bytes=r.deleted_bytes,
                kept_segments=r.kept_segments,
                kept_bytes=r.kept_bytes,
            )
