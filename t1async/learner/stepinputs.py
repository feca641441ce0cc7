"""What a training step trains: ingest's ready segments plus cuts of the open episodes that must train now,
with already-trained and too-stale tokens masked out of the loss (design §5, §7); and the record of each step's
segments that a restart trains again (``save_step_inputs``).

    <run_dir>/learner/inputs/v000007.npz   the segments step 7 trained (version 7 -> 8), exactly as handed to
                                           the trainer: written (fsync, rename) before the step trains, kept
                                           until a full checkpoint at a later version holds their training

Between full checkpoints (``--checkpoint-every``) the learner pushes push-only exports. A restart loads the
last full checkpoint (version ``c``) and trains the recorded steps ``c .. e-1`` again in order, ``e`` being
the newest export (a pushed version): the same segments at the same versions from the same weights and AdamW
state, so the weights come back to those pushed at ``e`` and no version the samplers saw goes back
(learner/service.py). Rebuilding those segments from the journal instead would have to repeat each cut at
the moment it was taken (which turns had arrived, which an earlier cut in the same process had marked
trained, an end's reward applied or not): the record holds them as trained.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from t1async.credits.ledger import CreditGate
from t1async.credits.settle import Settler
from t1async.ingest.stage import Ingest
from t1async.ingest.tito import Segment
from t1async.log import get_logger

log = get_logger("t1async.learner")


class StepInputs:
    """Picks each step's segments from ``ingest`` under staleness bound ``max_staleness`` (η): the credit
    order (``gate``) says which turns are due; masked turns are settled with ``settler``. Owns the count of
    too-stale tokens masked."""

    def __init__(self, ingest: Ingest, gate: CreditGate, settler: Settler, max_staleness: int) -> None:
        self.ingest, self.gate, self.settler, self.max_staleness = ingest, gate, settler, max_staleness
        self.stale_masked_tokens = 0

    def take(self, policy_version: int, trained: Mapping[str, Collection[int]]) -> list[Segment]:
        """Closed segments, plus a cut of each open episode that holds a turn this step must train: one the
        credit order makes due, or one that would be too stale for the next step. Other open episodes keep
        growing (under ``--prefix-kv exact`` a cut re-forwards the episode's whole context, so cutting less often
        is what η buys; under ``reuse`` a cut forwards only its new positions, learner.prefixkv).
        ``trained``: episode -> turns trained before (the learner's state)."""
        v, eta = policy_version, self.max_staleness
        must = {ep for ep, _ in self.gate.ledger.due(v)}
        must |= {ep for (ep, _), u in self.settler.untrained.items() if u <= v - eta}
        if not must and not self.ingest.ready:  # nothing due (e.g. its credits expired): train what has arrived
            must = set(self.ingest.assembler.open)
        cuts = self.ingest.cut(sorted(must))
        segs = self.ingest.take_ready() + cuts
        out = []
        for s in segs:
            masked = self.mask(s, policy_version, trained)
            if masked is not None:
                out.append(masked)
        return out

    def mask(self, s: Segment, policy_version: int, trained: Mapping[str, Collection[int]]) -> Segment | None:
        """Drop from the loss what was trained before a restart, and (a safety net for turns delivered
        after their credit's lease expired) what would exceed the staleness bound at ``policy_version``. Counted; a
        turn left with no loss token is settled ``stale_masked``."""
        keep = s.loss_mask.copy()
        done = trained.get(s.episode)
        if done:
            keep &= ~np.isin(s.turn_ids, np.fromiter(done, dtype=np.int32))
        too_stale = keep & (s.versions >= 0) & (policy_version - s.versions > self.max_staleness)
        if too_stale.any():
            self.stale_masked_tokens += int(too_stale.sum())
            log.warning(
                "learner.stale_masked", episode=s.episode, tokens=int(too_stale.sum()), policy_version=policy_version
            )
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

    def forget_unreachable(self) -> None:
        """Turns the assembler will never emit (their episode is closed: untrainable, late, or abandoned)
        stop counting as work waiting for a step. Counted by the assembler's drift stats."""
        waiting = {s.episode for s in self.ingest.ready}
        open_ = self.ingest.assembler.open
        gone = [k for k in self.settler.untrained if k[0] not in open_ and k[0] not in waiting]
        if gone:  # the assembler names what it drops (Ingest._settle_dropped): anything left here is a gap in that
            log.warning("learner.unreachable_turns", turns=len(gone), first=f"{gone[0][0]}#{gone[0][1]}")
            self.settler.settle(gone, "abandoned")


# ------------------------------------------------------------------------------------------ step inputs

_INPUTS = re.compile(r"^v(\d{6,})\.npz$")


def step_inputs_path(root: Path, policy_version: int) -> Path:
    return root / f"v{policy_version:06d}.npz"


def save_step_inputs(root: Path, policy_version: int, segments: list[Segment]) -> Path:
    """Write the segments of the step at ``policy_version`` to ``root/v<version>.npz`` (fsynced, renamed into
    place, replacing a record of a step that never finished), every array as it is and the scalars beside."""
    root.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, Any] = {}
    scalars: list[dict] = []
    for i, s in enumerate(segments):
        row: dict = {}
        for fld in fields(s):
            val = getattr(s, fld.name)
            if isinstance(val, np.ndarray):
                arrays[f"{i}.{fld.name}"] = val
            else:
                row[fld.name] = val.item() if isinstance(val, np.generic) else val
        scalars.append(row)
    arrays["scalars"] = np.frombuffer(json.dumps(scalars).encode(), dtype=np.uint8)
    path = step_inputs_path(root, policy_version)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_step_inputs(root: Path, policy_version: int) -> list[Segment]:
    """The segments ``save_step_inputs`` wrote for the step at ``policy_version``, equal to the last bit."""
    with np.load(step_inputs_path(root, policy_version)) as z:
        scalars = json.loads(bytes(z["scalars"]).decode())
        return [
            Segment(**row, **{k.split(".", 1)[1]: z[k] for k in z.files if k.startswith(f"{i}.")})
            for i, row in enumerate(scalars)
        ]


def recorded_steps(root: Path) -> list[int]:
    """The versions of the steps recorded under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _INPUTS.match(p.name)))


def prune_step_inputs(root: Path, below: int) -> int:
    """Drop the records of steps before ``below`` (a full checkpoint at ``below`` holds their training)."""
    gone = [v for v in recorded_steps(root) if v < below]
    for v in gone:
        step_inputs_path(root, v).unlink(missing_ok=True)
    return len(gone)
