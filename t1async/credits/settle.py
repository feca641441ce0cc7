"""Settling delivered turns (design §7): every turn the learner takes is settled exactly once, and settling
releases its credit.

A turn is *open* from the moment the learner takes it (``open``) until it is settled with one reason:

- ``trained``          its loss tokens were in a finished step;
- ``stale_masked``     every one of its loss tokens would exceed η (a lease expired): left out of the loss;
- ``realign_dropped``  a REALIGN discarded its whole output (TITO), so there is nothing to train;
- ``poisoned``         it failed validation (dead-lettered), or a step holding it failed;
- ``abandoned``        it can never be trained: untrainable input, late after its episode's end, or its
                       episode was abandoned (e.g. its actor went silent).

``counts`` holds the number of turns settled per reason in this process. ``StepLog`` writes, before each
step runs, the (episode, turn) set that step trains, read from the segments handed to the trainer (not
from ``LearnerState``): an independent record that the exactly-once tests check.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from t1async.credits.ledger import CreditGate, SettleReason
from t1async.credits.server import CreditServer
from t1async.ingest.tito import Segment
from t1async.log import get_logger

log = get_logger("t1async.credits.settle")
SETTLED_MEMORY = 65_536  # settled keys remembered so a redelivery (within an ack wait) does not reopen them

Key = tuple[str, int]


class Settler:
    """The open turns (``untrained``: key -> oldest sampling version) and their settling."""

    def __init__(self, gate: CreditGate, credits: CreditServer, was_trained: Callable[[str, int], bool]) -> None:
        self.gate, self.credits, self.was_trained = gate, credits, was_trained
        self.untrained: dict[Key, int] = {}
        self.counts: dict[str, int] = {r.value: 0 for r in SettleReason}
        self.opened = 0  # turns taken: opened == sum(counts) + len(untrained) at every moment
        self._settled: OrderedDict[Key, SettleReason] = OrderedDict()

    def open(self, key: Key, policy_version: int) -> bool:
        """Take a delivered turn: open unless it was trained into the weights or already settled."""
        if key in self.untrained or key in self._settled or self.was_trained(*key):
            return False
        self.untrained[key] = policy_version
        self.opened += 1
        return True

    def settle(self, keys: Iterable[Key], reason: SettleReason | str) -> int:
        """Settle open turns with ``reason``: each turn once (settling a settled turn is a no-op). A
        ``poisoned`` turn never opened (its record was rejected before the learner took it) is settled too,
        and its credit released. Returns how many turns this settled."""
        reason = SettleReason.of(reason)
        new: list[Key] = []
        for key in keys:
            if key in self._settled:
                continue
            if self.untrained.pop(key, None) is None:  # not open: only a record rejected before it was taken
                if reason is not SettleReason.POISONED or self.was_trained(*key):
                    continue
                self.opened += 1
                self.gate.on_delivered(*key)  # it uses its credit now
                self.credits.on_delivered(*key)
            self._settled[key] = reason
            new.append(key)
        while len(self._settled) > SETTLED_MEMORY:
            self._settled.popitem(last=False)
        if not new:
            return 0
        self.gate.settle(new, reason)
        self.counts[reason] += len(new)
        if reason is not SettleReason.TRAINED:
            log.debug("learner.settled", reason=reason, turns=len(new), first=f"{new[0][0]}#{new[0][1]}")
        return len(new)

    def reason(self, key: Key) -> SettleReason | None:
        return self._settled.get(key)


def loss_turns(segments: Iterable[Segment]) -> list[Key]:
    """The (episode, turn) pairs with loss tokens in ``segments``, read from the segment arrays."""
    out = {(s.episode, int(t)) for s in segments for t in np.unique(s.turn_ids[s.loss_mask])}
    return sorted(out)


class StepLog:
    """``<run_dir>/learner/steps.jsonl``: one line per step, written (and fsynced) before the step trains,
    ``{"policy_version": v, "turns": [[episode, turn], ...], "tokens": n, "max_staleness": s}``. A step that never
    finished (a crash) is superseded by the line the resumed learner writes for the same version."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, policy_version: int, segments: list[Segment]) -> None:
        turns = loss_turns(segments)
        stale = [policy_version - int(s.versions[s.loss_mask].min()) for s in segments if s.loss_mask.any()]
        body = {
            "policy_version": policy_version,
            "turns": [[e, t] for e, t in turns],
            "tokens": int(sum(s.loss_tokens for s in segments)),
            "max_staleness": max(stale, default=0),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:  # one line a step: opened per write, nothing to close
            f.write(json.dumps(body) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_step_log(path: Path, upto_version: int | None = None) -> dict[int, dict]:
    """The steps that count, by version: a line for version v drops every earlier line for versions >= v (a
    learner that crashed before finishing them was resumed from an older checkpoint). ``upto_version``:
    keep versions below it (the version of the checkpoint the run ended at)."""
    steps: dict[int, dict] = {}
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        v = int(rec["policy_version"])
        for old in [k for k in steps if k >= v]:
            del steps[old]
        steps[v] = rec
    return {v: r for v, r in steps.items() if upto_version is None or v < upto_version}


def trained_counts(run_dir: Path, upto_version: int) -> tuple[dict[int, dict], dict[Key, int]]:
    """The counted steps of a run (``read_step_log``) and how many of them trained each (episode, turn): the
    exactly-once check reads this, not ``LearnerState``."""
    steps = read_step_log(run_dir / "learner" / "steps.jsonl", upto_version)
    counts: dict[Key, int] = {}
    for rec in steps.values():
        for ep, t in rec["turns"]:
            counts[(ep, int(t))] = counts.get((ep, int(t)), 0) + 1
    return steps, counts
