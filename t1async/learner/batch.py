"""Pack TITO segments into padded tensors for the learner's forward pass.

Segments are right-padded: with a causal model, real tokens never attend to the padding after them, so the
forward needs no attention mask (and keeps the fast causal attention path); padded positions are simply
never read. Recorded routing becomes the R3 replay tensor, with -1 (route freely) where it is missing and on
padding. ``plan_microbatches`` groups segments of similar length under a token budget (padded B x T), so a
step over many long segments never materialises one huge batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from t1async.protocol.errors import T1Error


class BatchError(T1Error):
    """A segment cannot be trained as given (inconsistent shapes, a loss token at position 0, ...)."""


class SegmentLike(Protocol):
    """The fields of ``t1async.ingest.tito.Segment`` the learner reads (read-only: a frozen Segment satisfies it)."""

    @property
    def episode(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def tokens(self) -> np.ndarray: ...  # int32 [T]
    @property
    def loss_mask(self) -> np.ndarray: ...  # bool [T]
    @property
    def logprobs(self) -> np.ndarray: ...  # float32 [T]
    @property
    def versions(self) -> np.ndarray: ...  # int32 [T], -1 off the loss mask
    @property
    def turn_ids(self) -> np.ndarray: ...  # int32 [T]
    @property
    def routing(self) -> np.ndarray | None: ...  # int16 [T, L, K], -1 missing
    @property
    def turn_ends(self) -> np.ndarray: ...  # int32 [n]
    @property
    def turn_rewards(self) -> np.ndarray: ...  # float32 [n]
    @property
    def done(self) -> bool: ...


@dataclass(frozen=True)
class Batch:
    """Right-padded tensors of B segments, T = the longest."""

    tokens: Tensor  # long [B, T]
    lengths: Tensor  # long [B]
    loss_mask: Tensor  # bool [B, T]
    behav_logp: Tensor  # float32 [B, T], the sampler's logprobs (0 off the loss mask)
    versions: Tensor  # long [B, T], -1 off the loss mask
    recorded: Tensor | None  # long [B, T, L, K] recorded experts, -1 missing / padding; None: no routing
    index: tuple[int, ...]  # position of each row in the step's segment list
    past: list[tuple[Tensor, Tensor]] | None = None  # B = 1: kept keys/values before tokens (learner.prefixkv)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.tokens.shape[0]), int(self.tokens.shape[1])


def check_segment(
    seg: SegmentLike, *, n_layers: int, top_k: int, vocab_size: int, n_experts: int | None = None
) -> None:
    """Raise ``BatchError`` naming the segment and field if it cannot be trained."""
    name = f"segment {seg.episode}#{seg.index}"
    t = len(seg.tokens)
    if t < 2:
        raise BatchError(f"{name}: has {t} tokens; a trainable segment needs a context token and an action")
    for field in ("loss_mask", "logprobs", "versions", "turn_ids"):
        n = len(getattr(seg, field))
        if n != t:
            raise BatchError(f"{name}: {field} has {n} entries for {t} tokens")
    if bool(np.asarray(seg.loss_mask)[0]):
        raise BatchError(f"{name}: loss_mask[0] is set, but position 0 has no context to predict it from")
    toks = np.asarray(seg.tokens)
    if toks.min() < 0 or toks.max() >= vocab_size:
        raise BatchError(f"{name}: token ids outside [0, {vocab_size}): min {toks.min()}, max {toks.max()}")
    if len(seg.turn_ends) != len(seg.turn_rewards):
        raise BatchError(f"{name}: {len(seg.turn_ends)} turn_ends but {len(seg.turn_rewards)} turn_rewards")
    lm = np.asarray(seg.loss_mask, dtype=bool)
    if not np.all(np.isfinite(np.asarray(seg.logprobs)[lm])):
        raise BatchError(f"{name}: a loss token has a non-finite sampler logprob")
    if seg.routing is not None:
        want = (t, n_layers, top_k)
        if tuple(seg.routing.shape) != want:
            raise BatchError(f"{name}: routing has shape {tuple(seg.routing.shape)}, expected [T, L, K] = {list(want)}")
        r = np.asarray(seg.routing)
        if n_experts is not None and r.size and (int(r.min()) < -1 or int(r.max()) >= n_experts):
            raise BatchError(
                f"{name}: routing holds expert ids outside [-1, {n_experts}): min {r.min()}, max {r.max()}"
            )
        if top_k > 1 and r.size:
            s = np.sort(r, axis=-1)
            dup = ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any(-1)
            if dup.any():
                t0, l0 = (int(v) for v in np.argwhere(dup)[0])
                raise BatchError(
                    f"{name}: routing repeats an expert at position {t0}, layer {l0}: {r[t0, l0].tolist()}"
                )


def plan_microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group segment indices so that each group's padded size (rows x longest) stays within ``max_tokens``
    (a segment longer than the budget gets a group of its own). Longest first, so groups share lengths."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) + 1) * longest > max_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups


def pack(
    segments: Sequence[SegmentLike],
    index: Sequence[int],
    *,
    n_layers: int,
    top_k: int,
    pad_id: int = 0,
    device: str | torch.device = "cpu",
) -> Batch:
    """Pad ``segments[i] for i in index`` into one Batch. Routing is packed if any segment has it."""
    segs = [segments[i] for i in index]
    b = len(segs)
    if b == 0:
        raise BatchError("cannot pack an empty group of segments")
    t = max(len(s.tokens) for s in segs)
    tokens = np.full((b, t), pad_id, dtype=np.int64)
    loss = np.zeros((b, t), dtype=bool)
    behav = np.zeros((b, t), dtype=np.float32)
    vers = np.full((b, t), -1, dtype=np.int64)
    with_routing = any(s.routing is not None for s in segs)
    rec = np.full((b, t, n_layers, top_k), -1, dtype=np.int64) if with_routing else None
    for row, s in enumerate(segs):
        n = len(s.tokens)
        tokens[row, :n] = s.tokens
        lm = np.asarray(s.loss_mask, dtype=bool)
        loss[row, :n] = lm
        behav[row, :n] = np.where(lm, s.logprobs, 0.0)
        vers[row, :n] = np.where(lm, s.versions, -1)
        if rec is not None and s.routing is not None:
            rec[row, :n] = s.routing
    # a row with any -1 is "missing" for the model; make the whole row -1 so it is counted consistently
    if rec is not None:
        rec[(rec < 0).any(-1)] = -1
    return Batch(
        tokens=torch.from_numpy(tokens).to(device),
        lengths=torch.tensor([len(s.tokens) for s in segs], dtype=torch.long, device=device),
        loss_mask=torch.from_numpy(loss).to(device),
        behav_logp=torch.from_numpy(behav).to(device),
        versions=torch.from_numpy(vers).to(device),
        recorded=None if rec is None else torch.from_numpy(rec).to(device),
        index=tuple(index),
    )


def routing_drift(free_topk: Tensor, recorded: Tensor | None, lengths: Tensor) -> tuple[int, int, int]:
    """Compare the learner's own top-k with the recorded experts, as sets, per (token, layer).

    Returns ``(differ, compared, missing)``: (token, layer) choices whose expert sets differ, choices
    compared (a recorded route is present), and rows with no recorded route among real positions except
    each segment's last (the sampler never routes a sequence's last token, design §3).
    """
    if recorded is None:
        return 0, 0, 0
    present = (recorded >= 0).all(-1)  # [B, T, L]
    a = torch.sort(free_topk, dim=-1).values
    r = torch.sort(recorded, dim=-1).values
    differ = ((a != r).any(-1) & present).sum()
    pos = torch.arange(recorded.shape[1], device=recorded.device)[None, :]
    routable = (pos < (lengths[:, None] - 1))[:, :, None]  # [B, T, 1]
    missing = (~present & routable).sum()
    return int(differ), int(present.sum()), int(missing)
