"""TITO: train on the exact sampled token IDs; drift is checked and repaired at turn boundaries (design §5).

This module is the pure part: the ``Segment`` the learner trains on, the boundary check and classification,
the drift counters, and ``SegmentBuilder`` (the arrays of one open segment and their repair). The episode
state around it (reordering, dedupe, when segments are returned) is ``t1async.ingest.assembly``.

For actors: ``keep`` = the common prefix of this turn's full input and the previous turn's full sequence
(its input followed by its output), and ``routed_experts_start_len`` = ``min(keep, len(previous sequence) - 1)``
(0 on the first turn). Anything smaller is accepted (counted as understated keep / routing overlap).

Terms. ``S_k`` is the sampler's full sequence of turn k (its input ``I_k`` followed by its output ``O_k``);
the learner's open segment always ends with exactly ``S_k`` after turn k has been added. A turn's
``keep`` says how many leading tokens of its input ``I_{k+1}`` equal ``S_k``, so the learner reconstructs
``I_{k+1} = S_k[:keep] + input_delta`` and verifies it against ``input_digest``. The classification uses
the *true* common prefix ``lcp`` of ``I_{k+1}`` and ``S_k`` (``keep`` is only a lower bound the actor
promises; an actor that always sends ``keep = 0`` is still classified correctly):

- CLEAN   ``lcp == len(S_k)``: ``I_{k+1}`` extends ``S_k``; append the new tokens.
- REALIGN ``len(I_k) <= lcp < len(S_k)``: the agent dropped a trailing run of turn k's output (text after the
  action, a trimmed stop string). The run leaves the sequence and the loss (counted); the rest is shared.
- FORK    ``lcp < len(I_k)``: the prefix itself differs (re-rendered text, merged BPE tokens, ...). The open
  segment ends at the boundary with its own context; a new segment starts whose context is ``I_{k+1}``,
  loss-masked, so every earlier turn keeps the context it was sampled in.

Nothing the sampler generated is ever retokenized: the loss tokens are the sampled IDs, at positions whose
preceding tokens are exactly the sampler's input for that turn.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

import numpy as np

from t1async.ingest.routing import RouteTrack, RoutingStats
from t1async.protocol import wire
from t1async.protocol.errors import T1Error
from t1async.protocol.sampling import common_prefix_len


class Boundary(str, Enum):
    CLEAN = "clean"
    REALIGN = "realign"
    FORK = "fork"


class AssemblyError(T1Error):
    """An episode's turns cannot be assembled as given (used for programming errors, never for bad input:
    bad input is counted and logged by the assembler)."""


# --------------------------------------------------------------------------------------------- segment


@dataclass(frozen=True, eq=False)
class Segment:
    """One trainable token sequence of an episode (design §5), produced by ``t1async.ingest.assembly.Assembler``.

    ``tokens`` is exactly the context the sampler saw followed by sampled outputs; ``loss_mask`` is True
    exactly at the sampled output tokens this segment trains (turns already returned in an earlier cut of the
    same segment are context here, not loss). ``turn_ends``/``turn_rewards`` list only the turns trained here.
    """

    episode: str
    index: int  # 0, 1, ... within the episode: every segment returned gets the next index
    tokens: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T]
    logprobs: np.ndarray  # float32 [T]: sampler logprob at loss positions, 0 elsewhere
    versions: np.ndarray  # int32 [T]: the policy version that sampled each loss token (per token), -1 elsewhere
    turn_ids: np.ndarray  # int32 [T]: turn owning each output position (loss or context), -1 for non-output
    routing: np.ndarray | None  # int16 [T, L, K]: experts used to compute position t, -1 = missing
    turn_ends: np.ndarray  # int32 [n]: position of the last output token of each turn trained here
    turn_rewards: np.ndarray  # float32 [n]: that turn's reward (design §8)
    done: bool  # the episode ended inside this segment; False: cut (bootstrap from the value at the end)
    # additions (defaults keep the agreed constructor working)
    turn_numbers: np.ndarray | None = None  # int32 [n]: the turn number of each entry of turn_ends
    turn_starts: np.ndarray | None = None  # int32 [n]: position of the first output token of each such turn
    forked: bool = False  # this segment's context came from a FORK (its prefix re-contextualised)

    def __post_init__(self) -> None:
        t = len(self.tokens)
        for name in ("loss_mask", "logprobs", "versions", "turn_ids"):
            arr = getattr(self, name)
            if arr.ndim != 1 or len(arr) != t:
                raise ValueError(f"Segment {self.episode}#{self.index}: {name} has shape {arr.shape}, want [{t}]")
        if self.routing is not None and (self.routing.ndim != 3 or len(self.routing) != t):
            raise ValueError(
                f"Segment {self.episode}#{self.index}: routing has shape {self.routing.shape}, want [{t}, L, K]"
            )
        n = len(self.turn_ends)
        for name in ("turn_rewards", "turn_numbers", "turn_starts"):
            arr = getattr(self, name)
            if arr is not None and len(arr) != n:
                raise ValueError(
                    f"Segment {self.episode}#{self.index}: {name} has {len(arr)} entries for {n} turn_ends"
                )

    @property
    def loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    def __len__(self) -> int:
        return len(self.tokens)


# --------------------------------------------------------------------------------------------- stats

_FIRST_DIFF_KEEP = 256  # bounded list of first-difference positions kept for inspection


@dataclass
class DriftStats:
    """Drift counters, per episode and (merged) in total. ``as_dict()`` is what metrics publish."""

    turns: int = 0  # turns assembled (trainable or not)
    boundaries: int = 0  # boundaries checked (every turn after an episode's first)
    clean: int = 0
    realign: int = 0
    fork: int = 0
    compactions: int = 0  # turns whose input the actor's context policy compacted (each a FORK by construction)
    keep_understated: int = 0  # keep < true common prefix (the actor promised less than it shared)
    digest_mismatch: int = 0  # S_k[:keep] + delta did not hash to input_digest: the keep claim was wrong
    untrainable_turns: int = 0  # turns whose input could not be reconstructed (not trained)
    resyncs: int = 0  # a full input (keep = 0) after untrainable turns restarted the episode
    tokens_recontextualised: int = 0  # FORK: tokens of I_{k+1} from the first difference on
    route_forks: int = 0  # turns whose context the sampler re-routed (prefix cache flushed): own segment (design §6)
    rerouted_rows: int = 0  # context positions whose recorded routes the sampler no longer used
    stale_context_routes: int = 0  # turns sampled under newer weights whose trace did not re-route the context
    tokens_dropped: int = 0  # REALIGN: sampled tokens that left the sequence and the loss
    dropped_after_cut: int = 0  # of those, tokens already returned (and maybe trained) in an earlier cut
    ended_after_cut: int = 0  # episodes that ended with nothing new after a cut (that cut was not marked done)
    unstreamed_unapplied: int = 0  # ends whose unstreamed reward found its last turn already trained
    duplicates: int = 0  # exact redeliveries, dropped
    conflicts: int = 0  # same (episode, turn) with different content: the later one is dropped
    late_turns: int = 0  # turns for an episode that already ended
    tokens_in: int = 0  # input_delta + output tokens received for trainable turns
    loss_tokens: int = 0  # loss tokens returned in segments
    segments: int = 0
    first_diff: list[int] = field(default_factory=list)  # offsets (position - len(S_k)) of non-clean boundaries

    def note_first_diff(self, offset: int) -> None:
        if len(self.first_diff) < _FIRST_DIFF_KEEP:
            self.first_diff.append(offset)

    def merge(self, other: DriftStats) -> None:
        for f in fields(self):
            if f.name == "first_diff":
                room = _FIRST_DIFF_KEEP - len(self.first_diff)
                self.first_diff.extend(other.first_diff[: max(room, 0)])
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "first_diff"}
        fd = self.first_diff
        d["first_diff"] = {
            "n": len(fd),
            "min": min(fd) if fd else 0,
            "max": max(fd) if fd else 0,
            "mean": float(np.mean(fd)) if fd else 0.0,
        }
        return d


# --------------------------------------------------------------------------------------------- check


def classify(prev_len: int, out_start: int, lcp: int) -> Boundary:
    """The boundary kind from the length of ``S_k``, where turn k's output starts in it, and the true common
    prefix of ``I_{k+1}`` and ``S_k``."""
    if lcp >= prev_len:
        return Boundary.CLEAN
    if lcp >= out_start:
        return Boundary.REALIGN
    return Boundary.FORK


def new_hasher() -> Any:
    """A running hash compatible with ``wire.digest_ids`` (SHA-256 over little-endian int32, first 16 bytes)."""
    return hashlib.sha256()


def hash_digest(h: Any) -> bytes:
    """The ``input_digest`` a running hasher stands for."""
    return h.digest()[:16]


def hash_update(h: Any, ids: np.ndarray) -> None:
    """Feed int32 ids to a hasher without copying when they are already contiguous little-endian int32."""
    a = ids if ids.dtype == np.dtype("<i4") and ids.flags.c_contiguous else np.ascontiguousarray(ids, dtype="<i4")
    h.update(memoryview(a).cast("B"))  # type: ignore[arg-type]  # ndarray is a buffer; numpy types __buffer__ for 3.12+ only


@dataclass(frozen=True)
class BoundaryCheck:
    """The verdict on one turn's input against the open sequence ``S_k``."""

    ok: bool  # the input was reconstructed and matches its digest
    kind: Boundary | None  # None when not ok, or for an episode's first turn
    lcp: int  # true common prefix of I_{k+1} and S_k
    input_len: int
    hasher: Any  # running hash over I_{k+1} (continue it with the outputs); None when not ok
    reason: str = ""


def check_input(
    prev: np.ndarray,
    out_start: int,
    running: Any,
    keep: int,
    delta: np.ndarray,
    digest: bytes,
    checkpoints: tuple[list[int], list[Any]] | None = None,
) -> BoundaryCheck:
    """Check one turn's input against ``prev`` = ``S_k`` (empty for the first turn), vectorised.

    ``running`` is the hasher over all of ``prev`` (reused on a CLEAN boundary so a check costs O(delta), not
    O(sequence)); ``checkpoints`` (sorted positions, hashers over ``prev[:pos]``) bound the rehash when
    ``keep < len(prev)`` to the tokens after the nearest checkpoint. Reconstructs ``I = prev[:keep] + delta``,
    verifies ``digest``, then finds the true common prefix with ``prev`` and classifies. ``out_start`` is
    where turn k's output starts in ``prev``.
    """
    n = len(prev)
    input_len = keep + len(delta)
    if keep > n:
        return BoundaryCheck(False, None, 0, input_len, None, f"keep {keep} exceeds the {n} tokens assembled")
    if keep == n:
        h = running.copy()
    else:
        pos = 0
        h = new_hasher()
        if checkpoints is not None and checkpoints[0]:
            i = bisect.bisect_right(checkpoints[0], keep) - 1
            if i >= 0:
                pos, h = checkpoints[0][i], checkpoints[1][i].copy()
        hash_update(h, prev[pos:keep])
    hash_update(h, delta)
    if hash_digest(h) != digest:
        return BoundaryCheck(
            False, None, 0, input_len, None, f"input_digest does not match prev[:{keep}] + input_delta"
        )
    if n == 0:
        return BoundaryCheck(True, None, 0, input_len, h)
    lcp = keep
    if keep < n:
        lcp = keep + common_prefix_len(delta, prev[keep:])
    return BoundaryCheck(True, classify(n, out_start, lcp), lcp, input_len, h)


# --------------------------------------------------------------------------------------------- repair


@dataclass
class TurnSpan:
    turn: int
    out_start: int
    out_end: int
    reward: float
    trained: bool = False


class SegmentBuilder:
    """One open segment: growable token arrays whose first ``n`` entries are exactly ``S_k``, the turns in
    it, the running hash of ``S_k`` with checkpoints, and its routing track. Used by ``t1async.ingest.assembly``."""

    def __init__(self, rstats: RoutingStats, num_experts: int | None, cap: int = 4096) -> None:
        # appends write every array over the range they cover, so nothing needs an initial fill
        self.tokens = np.empty(cap, np.int32)
        self.loss = np.empty(cap, bool)
        self.logprobs = np.empty(cap, np.float32)
        self.versions = np.empty(cap, np.int32)
        self.turn_ids = np.empty(cap, np.int32)
        self.n = 0
        self.spans: list[TurnSpan] = []
        self.hasher: Any = new_hasher()
        self.ckpt: tuple[list[int], list[Any]] = ([], [])  # hash states at turn inputs/outputs ends
        self.track = RouteTrack(rstats, num_experts)
        self.forked = False

    def _grow(self, need: int) -> None:
        cap = len(self.tokens)
        if need <= cap:
            return
        cap = max(need, 2 * cap)
        for name in ("tokens", "loss", "logprobs", "versions", "turn_ids"):  # appends write every array
            old = getattr(self, name)
            new = np.empty(cap, old.dtype)
            new[: self.n] = old[: self.n]
            setattr(self, name, new)

    def checkpoint(self) -> None:
        """Remember the hash state at ``n`` (a REALIGN or FORK then rehashes only from here)."""
        pos, hs = self.ckpt
        if not pos or pos[-1] < self.n:
            pos.append(self.n)
            hs.append(self.hasher.copy())

    def share_checkpoints(self, old: SegmentBuilder, lcp: int) -> None:
        i = bisect.bisect_right(old.ckpt[0], lcp)
        self.ckpt = (old.ckpt[0][:i], old.ckpt[1][:i])

    def append_context(self, ids: np.ndarray, turn_ids: np.ndarray | None = None) -> None:
        a, b = self.n, self.n + len(ids)
        self._grow(b)
        self.tokens[a:b] = ids
        self.loss[a:b] = False
        self.logprobs[a:b] = 0.0
        self.versions[a:b] = -1
        self.turn_ids[a:b] = -1 if turn_ids is None else turn_ids
        self.n = b

    def append_output(self, rec: wire.TurnRecord, carry: float) -> None:
        out = rec.output_ids
        a, b = self.n, self.n + len(out)
        self._grow(b)
        self.tokens[a:b] = out
        self.loss[a:b] = True
        self.logprobs[a:b] = rec.output_logprobs
        self.versions[a:b] = rec.policy_version if rec.output_versions is None else rec.output_versions
        self.turn_ids[a:b] = rec.turn
        self.n = b
        self.spans.append(TurnSpan(rec.turn, a, b, float(rec.reward) + carry))

    def truncate(self, lcp: int) -> tuple[int, int, float]:
        """REALIGN: keep ``[0, lcp)``. Returns (tokens dropped, of them already returned, reward to carry)."""
        dropped, self.n = self.n - lcp, lcp
        last = self.spans[-1]
        after_cut = dropped if last.trained else 0
        carry = 0.0
        last.out_end = max(last.out_start, lcp)
        if last.out_end == last.out_start:  # the whole output was discarded: its reward moves to the next turn
            self.spans.pop()
            carry = 0.0 if last.trained else last.reward
        self.track.truncate(lcp)
        self.share_checkpoints(self, lcp)
        return dropped, after_cut, carry

    def emit(self, episode: str, index: int, done: bool, copy: bool) -> Segment | None:
        new = [s for s in self.spans if not s.trained]
        if not new:
            return None
        t, first = self.n, new[0].out_start
        trained_before = len(new) < len(self.spans)

        def part(arr: np.ndarray, fill: Any) -> np.ndarray:
            if not trained_before:
                return arr[:t].copy() if copy else arr[:t]
            out = arr[:t].copy()
            out[:first] = np.where(self.loss[:first], fill, out[:first])
            return out

        seg = Segment(
            episode=episode,
            index=index,
            tokens=self.tokens[:t].copy() if copy else self.tokens[:t],
            loss_mask=part(self.loss, False),
            logprobs=part(self.logprobs, 0.0),
            versions=part(self.versions, -1),
            turn_ids=self.turn_ids[:t].copy() if copy else self.turn_ids[:t],
            routing=self.track.take(),
            turn_ends=np.array([s.out_end - 1 for s in new], np.int32),
            turn_rewards=np.array([s.reward for s in new], np.float32),
            done=done,
            turn_numbers=np.array([s.turn for s in new], np.int32),
            turn_starts=np.array([s.out_start for s in new], np.int32),
            forked=self.forked,
        )
        for s in new:
            s.trained = True
        return seg
