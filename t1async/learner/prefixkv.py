"""Train an open episode's new turns without re-forwarding its history (design §5 "Cost per trained token").

An episode streamed turn by turn is cut across many steps: each cut segment holds the whole context the
sampler saw, and only its new turns are in the loss. Forwarding that context at every cut costs O(n) per
step and O(n²) per episode. With ``prefix_kv="reuse"`` the trainer keeps, per open episode, the keys and values
of every position it has forwarded (``PrefixKV``); the next cut forwards only the positions after them,
attending to the kept ones as constants. Each position is then forwarded once per refresh, so the cost per
trained token stays flat as the episode grows. A cut with nothing kept (an episode's first, a FORK's
re-contextualised prefix, a refresh) whose positions before its first trained one number at least
``prefix_kv_prime_tokens`` is *primed*: those positions are forwarded once without gradient, at the current
weights, and kept, and the cut forwards with gradient only after them (``Trainer._prime``).

What this computes, exactly (``prefix_kv="exact"`` re-forwards everything and is the reference):

- the new positions' forward is exact given the kept keys and values, which were computed by the weights of
  the step that first forwarded them, at most ``prefix_kv_max_age`` versions before (older: the entry is dropped
  and the whole context is re-forwarded, exact, and kept again);
- the gradient is the exact gradient of the loss *with the kept (or primed) keys and values held constant*:
  it omits the path from the loss through the prefix's keys and values back into the weights. With
  ``prefix_kv_max_age`` 0 nothing is kept or primed, and the step is the exact one.

Both differences are measured, not assumed: ``bench.longhorizon`` reports the gradient's cosine against the
exact one on the same batch, and the step metrics' mismatch (learner vs sampler log-probs) includes them.
An entry is used only when its tokens equal the segment's (a FORK re-contextualised prefix misses) and is
dropped when its episode ends, when the trainer loads weights, and least recently used first past
``budget_tokens``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from t1async.learner.batch import SegmentLike
from t1async.log import get_logger

log = get_logger("t1async.learner.prefixkv")

KV = list[tuple[Tensor, Tensor]]  # one (keys, values) [1, KV, P, hd] per layer


@dataclass(frozen=True)
class Suffix:
    """A segment's positions from ``start`` on (a ``SegmentLike``): what the trainer forwards after the kept
    prefix. Its position 0 is the segment's position ``start``; ``turn_ends``/``turn_starts`` are shifted."""

    episode: str
    index: int
    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    turn_ids: np.ndarray
    routing: np.ndarray | None
    turn_ends: np.ndarray
    turn_rewards: np.ndarray
    done: bool
    turn_numbers: np.ndarray | None
    turn_starts: np.ndarray | None
    forked: bool
    start: int
    # the kept positions it follows (``PrefixKV.take``): their tokens, and the version of the weights that
    # computed the oldest of them; what ``keep`` records with its keys and values
    kept: np.ndarray | None = None
    kept_oldest: int = -1


def suffix(s: SegmentLike, start: int) -> Suffix:
    """``s`` from position ``start`` (every loss position and turn end of ``s`` must be > ``start``)."""
    starts = getattr(s, "turn_starts", None)
    return Suffix(
        episode=s.episode,
        index=s.index,
        tokens=s.tokens[start:],
        loss_mask=s.loss_mask[start:],
        logprobs=s.logprobs[start:],
        versions=s.versions[start:],
        turn_ids=s.turn_ids[start:],
        routing=None if s.routing is None else s.routing[start:],
        turn_ends=np.asarray(s.turn_ends) - start,
        turn_rewards=s.turn_rewards,
        done=s.done,
        turn_numbers=getattr(s, "turn_numbers", None),
        turn_starts=None if starts is None else np.asarray(starts) - start,
        forked=bool(getattr(s, "forked", False)),
        start=start,
    )


def head(s: SegmentLike, n: int) -> Suffix:
    """``s``'s first ``n`` positions as a segment with no loss and no turn end: what ``Trainer`` primes."""
    return Suffix(
        episode=s.episode,
        index=s.index,
        tokens=s.tokens[:n],
        loss_mask=np.zeros(n, dtype=bool),
        logprobs=np.zeros(n, dtype=np.float32),
        versions=np.full(n, -1, dtype=np.int32),
        turn_ids=s.turn_ids[:n],
        routing=None if s.routing is None else s.routing[:n],
        turn_ends=np.zeros(0, dtype=np.int64),
        turn_rewards=np.zeros(0, dtype=np.float32),
        done=False,
        turn_numbers=None,
        turn_starts=None,
        forked=False,
        start=0,
    )


def cut_point(s: SegmentLike) -> int:
    """The last position of ``s`` that may come from kept keys and values, plus one: every position from the
    one before the first loss token (it predicts that token) and before the first turn end is forwarded."""
    lm = np.asarray(s.loss_mask, dtype=bool)
    first_loss = int(np.argmax(lm)) if lm.any() else len(s.tokens)
    ends = np.asarray(s.turn_ends)
    first_end = int(ends.min()) if len(ends) else len(s.tokens)
    return min(first_loss - 1, first_end - 1, len(s.tokens) - 2)


@dataclass
class _Entry:
    tokens: np.ndarray  # int32 [P]: the positions whose keys and values are kept
    kv: KV
    oldest: int  # the policy version of the weights that computed the oldest kept position


@dataclass(frozen=True)
class Lookup:
    """What ``PrefixKV.take`` found for one segment: the part to forward and the keys/values before it."""

    segment: SegmentLike  # the segment itself (past None) or its Suffix
    past: KV | None
    age: int  # versions since the oldest kept position was computed (0 without past)


class PrefixKV:
    """Per open episode, the keys and values of the positions the trainer has forwarded (module docstring)."""

    def __init__(self, *, max_age: int, budget_tokens: int) -> None:
        self.max_age, self.budget_tokens = max_age, budget_tokens
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.refreshed = 0  # entries dropped for age (their next cut re-forwards everything)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return sum(len(e.tokens) for e in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def take(self, s: SegmentLike, policy_version: int) -> Lookup:
        """The part of ``s`` to forward at ``policy_version``: after the kept prefix when its tokens match and
        it is at most ``max_age`` versions old, else all of ``s``."""
        e = self._entries.get(s.episode)
        if e is None:
            return Lookup(s, None, 0)
        age = policy_version - e.oldest
        if age > self.max_age:
            del self._entries[s.episode]
            self.refreshed += 1
            return Lookup(s, None, 0)
        start = min(len(e.tokens), cut_point(s))
        if start < 1 or not np.array_equal(s.tokens[:start], e.tokens[:start]):
            del self._entries[s.episode]
            return Lookup(s, None, 0)
        self._entries.move_to_end(s.episode)
        part = replace(suffix(s, start), kept=e.tokens[:start], kept_oldest=e.oldest)
        return Lookup(part, [(k[:, :, :start], v[:, :, :start]) for k, v in e.kv], age)

    def keep(self, s: SegmentLike, past: KV | None, new: Sequence[tuple[Tensor, Tensor]], policy_version: int) -> None:
        """After ``s`` (a segment or its Suffix) was forwarded at ``policy_version`` after ``past``: keep the
        keys and values of all its positions for the episode's next cut; forget an ended episode."""
        if s.done:
            self._entries.pop(s.episode, None)
            return
        start = getattr(s, "start", 0)
        old = self._entries.get(s.episode)
        n = len(s.tokens)
        if past is None:
            kv = [(k[:, :, :n].detach().clone(), v[:, :, :n].detach().clone()) for k, v in new]
            tokens = np.array(s.tokens, dtype=np.int32)
            oldest = policy_version
        else:
            if old is None:  # evicted by another episode's keep in this step: its next cut re-forwards
                return
            kv = [
                (torch.cat([pk, k[:, :, :n].detach()], dim=2), torch.cat([pv, v[:, :, :n].detach()], dim=2))
                for (pk, pv), (k, v) in zip(past, new, strict=True)
            ]
            kept = getattr(s, "kept", None)  # the positions ``past`` holds (another part's keep may have replaced
            if kept is None or len(kept) != start:  # the entry since this one was taken: not its tokens)
                raise ValueError(f"keep after a past needs the Suffix PrefixKV.take made; got {type(s).__name__}")
            tokens = np.concatenate([kept, np.asarray(s.tokens, dtype=np.int32)])
            oldest = int(getattr(s, "kept_oldest", old.oldest))
        if old is not None and len(old.tokens) > len(tokens) and np.array_equal(old.tokens[: len(tokens)], tokens):
            return  # two parts of one episode in a step: the later, longer one was kept first; it stays
        self._entries[s.episode] = _Entry(tokens, kv, oldest)
        self._entries.move_to_end(s.episode)
        while self.tokens > self.budget_tokens and len(self._entries) > 1:
            gone, e = self._entries.popitem(last=False)
            log.info("prefixkv.evicted", episode=gone, tokens=len(e.tokens), budget_tokens=self.budget_tokens)

    def forget(self, episodes: Sequence[str]) -> None:
        for ep in episodes:
            self._entries.pop(ep, None)
