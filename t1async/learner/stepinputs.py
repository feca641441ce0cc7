"""What a training step trains: the learner's ready segments plus cuts of the open episodes that must
train now, with already-trained and too-stale tokens masked out of the loss (design §5, §7). Mixed into
``service.Learner``, whose state these methods share."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from t1async.ingest.tito import Segment
from t1async.log import get_logger

if TYPE_CHECKING:
    from t1async.credits.ledger import CreditGate
    from t1async.credits.settle import Settler
    from t1async.ingest.assembly import Assembler
    from t1async.learner.service import LearnerConfig
    from t1async.learner.state import LearnerState

log = get_logger("t1async.learner")


class StepInputs:
    """The batching half of the learner. Everything below the annotations is the learner's (service.py)."""

    cfg: LearnerConfig
    version: int
    gate: CreditGate
    assembler: Assembler
    settler: Settler
    state: LearnerState
    untrained: dict[tuple[str, int], int]
    ready: list[Segment]
    stale_masked_tokens: int

    def _take_segments(self) -> list[Segment]:
        """Closed segments, plus a cut of each open episode that holds a turn this step must train: one the
        credit order makes due, or one that would be too stale for the next step. Other open episodes keep
        growing: a cut re-forwards the episode's whole context, so cutting less often is what η buys."""
        v, eta = self.version, self.cfg.max_staleness
        must = {ep for ep, _ in self.gate.ledger.due(v)}
        must |= {ep for (ep, _), u in self.untrained.items() if u <= v - eta}
        if not must and not self.ready:  # nothing due (e.g. its credits expired): train what has arrived
            must = set(self.assembler.open)
        cuts = [s for ep in sorted(must) for s in self.assembler.cut(ep)]
        segs, self.ready = self.ready + cuts, []
        out = []
        for s in segs:
            masked = self._mask(s)
            if masked is not None:
                out.append(masked)
        return out

    def _mask(self, s: Segment) -> Segment | None:
        """Drop from the loss what was trained before a restart, and (a safety net for turns delivered
        after their credit's lease expired) what would exceed the staleness bound. Counted; a turn left with
        no loss token is settled ``stale_masked``."""
        keep = s.loss_mask.copy()
        trained = self.state.trained.get(s.episode)
        if trained:
            keep &= ~np.isin(s.turn_ids, np.fromiter(trained, dtype=np.int32))
        too_stale = keep & (s.versions >= 0) & (self.version - s.versions > self.cfg.max_staleness)
        if too_stale.any():
            self.stale_masked_tokens += int(too_stale.sum())
            log.warning("learner.stale_masked", episode=s.episode, tokens=int(too_stale.sum()), version=self.version)
            before = set(np.unique(s.turn_ids[keep]).tolist())
            keep &= ~too_stale
            gone = before - set(np.unique(s.turn_ids[keep]).tolist())
            self.settler.settle([(s.episode, int(t)) for t in sorted(gone)], "stale_masked")
        if not keep.any():
            return None
        if np.array_equal(keep, s.loss_mask):
            return s
        return replace(
            s,
            loss_mask=keep,
            logprobs=np.where(keep, s.logprobs, 0).astype(np.float32),
            versions=np.where(keep, s.versions, -1).astype(np.int32),
        )

    def _forget_unreachable(self) -> None:
        """Turns the assembler will never emit (their episode is closed: untrainable, late, or abandoned)
        stop counting as work waiting for a step. Counted by the assembler's drift stats."""
        waiting = {s.episode for s in self.ready}
        gone = [k for k in self.untrained if k[0] not in self.assembler.open and k[0] not in waiting]
        if gone:  # the assembler names what it drops (_settle_dropped): anything left here is a gap in that
            log.warning("learner.unreachable_turns", turns=len(gone), first=f"{gone[0][0]}#{gone[0][1]}")
            self.settler.settle(gone, "abandoned")

    def _drift(self) -> dict[str, int]:
        d = self.assembler.stats().as_dict()
        return {k: int(d.get(k, 0)) for k in ("clean", "realign", "fork")}
