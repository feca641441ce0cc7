"""Token sampling for a batch of rows with per-row settings and per-row uniform draws (pure maths).

``sample(logits, temperature, top_p, top_k, uniforms)`` returns the chosen tokens and their logprobs.
The logprob is always ``log_softmax(raw logits)`` at temperature 1, computed in fp32, whatever the row's
temperature, top-p or top-k: the model's own probability of the sampled token, which is what the learner
recomputes. Temperature 0 is greedy. Top-k (k <= 0: off) and top-p filter the temperature-scaled
distribution; the row's uniform draw ``uniforms[i]`` in [0, 1) (the caller draws it from that request's own
seeded generator) picks the token by inverse CDF, so a request's samples depend only on its seed and its
logits, not on its batch neighbours. The whole batch is sampled with a fixed number of tensor ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

_BLOCK = 64  # inverse CDF in two levels: a cumsum over blocks of the vocabulary, then within one block
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1


def sample(
    logits: Tensor,
    temperature: Sequence[float],
    top_p: Sequence[float],
    top_k: Sequence[int],
    uniforms: Sequence[float],
) -> tuple[list[int], list[float]]:
    lf = logits.float()
    b, v = lf.shape
    logp = torch.log_softmax(lf, dim=-1)
    rows = [i for i in range(b) if temperature[i] > 0]
    every = len(rows) == b
    tokens = torch.empty(b, dtype=torch.long) if every else torch.argmax(lf, dim=-1)
    if rows:
        idx = None if every else torch.tensor(rows)
        temps = [temperature[i] for i in rows]
        u = torch.tensor([uniforms[i] for i in rows], dtype=torch.float32).clamp_(0.0, _BELOW_ONE)
        if all(t == 1.0 for t in temps):  # softmax(l) = exp(log_softmax(l)): reuse the logprobs
            probs = (logp if idx is None else logp[idx]).exp()
        else:
            t = torch.tensor(temps, dtype=torch.float32)[:, None]
            probs = torch.softmax((lf if idx is None else lf[idx]) / t, dim=-1)
        pick = _pick(probs, u, [top_k[i] for i in rows], [top_p[i] for i in rows])
        if idx is None:
            tokens = pick
        else:
            tokens[idx] = pick
    lps = logp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), lps.tolist()


def _pick(probs: Tensor, u: Tensor, top_k: list[int], top_p: list[float]) -> Tensor:
    """Unfiltered rows by ``inverse_cdf`` in vocabulary order, top-k/top-p rows by ``_filtered_pick``: each
    row takes its own path, so its token does not depend on its neighbours' settings."""
    filt = [j for j in range(len(top_k)) if top_k[j] > 0 or top_p[j] < 1.0]
    if not filt:
        return inverse_cdf(probs, u)
    if len(filt) == len(top_k):
        return _filtered_pick(probs, u, top_k, top_p)
    f = torch.tensor(filt)
    plain = torch.tensor(sorted(set(range(len(top_k))) - set(filt)))
    pick = torch.empty(len(top_k), dtype=torch.long)
    pick[plain] = inverse_cdf(probs[plain], u[plain])
    pick[f] = _filtered_pick(probs[f], u[f], [top_k[j] for j in filt], [top_p[j] for j in filt])
    return pick


def _filtered_pick(probs: Tensor, u: Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> Tensor:
    """Inverse CDF over the tokens sorted by probability, keeping the top-k and the top-p nucleus."""
    v = probs.shape[1]
    sp, order = torch.sort(probs, dim=-1, descending=True)
    ks = torch.tensor([k if k > 0 else v for k in top_k])[:, None]
    ps = torch.tensor(top_p, dtype=torch.float32)[:, None]
    rank = torch.arange(v)[None, :]
    before = sp.cumsum(-1) - sp  # mass strictly before each sorted token
    keep = (rank < ks) & ((before < ps) | (rank == 0))
    sp = sp * keep
    cdf = sp.cumsum(-1)
    j = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    j = torch.minimum(j, keep.sum(-1, keepdim=True) - 1)
    return order.gather(1, j)[:, 0]


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """The token i of each row with cdf[i - 1] <= u * total < cdf[i] (probs [n, V] >= 0, each row with some
    mass; u [n] in [0, 1)). A cumsum over the whole vocabulary is the slow part of sampling on a CPU, so it
    is done in two levels: block masses locate the block, one block's cumsum the token. A token of zero
    probability is never chosen, even where rounding puts the target at or past the total."""
    n, v = probs.shape
    if n <= 2:  # a row or two: one cumsum is cheaper than the extra ops
        cdf = probs.cumsum(-1)
        last = torch.where(probs > 0, torch.arange(v), -1).amax(-1, keepdim=True)
        return torch.minimum(torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True), last)[:, 0]
    nb = -(-v // _BLOCK)
    if nb * _BLOCK != v:
        probs = F.pad(probs, (0, nb * _BLOCK - v))
    blocks = probs.view(n, nb, _BLOCK)
    ar = torch.arange(n)
    mass = blocks.sum(-1)  # [n, nb]
    cb = mass.cumsum(-1)
    target = u[:, None] * cb[:, -1:]  # [n, 1]
    last_block = torch.where(mass > 0, torch.arange(nb), -1).amax(-1, keepdim=True)
    j = torch.minimum(torch.searchsorted(cb, target, right=True), last_block)  # [n, 1]
    before = torch.where(j > 0, cb.gather(1, (j - 1).clamp(min=0)), 0.0)
    within = blocks[ar, j[:, 0]]  # [n, BLOCK]
    cw = within.cumsum(-1)
    last_tok = torch.where(within > 0, torch.arange(_BLOCK), -1).amax(-1, keepdim=True)
    i = torch.minimum(torch.searchsorted(cw, target - before, right=True), last_tok)
    return (j * _BLOCK + i)[:, 0]


class StopStrings:
    """Finds a stop string completed by the latest token, decoding only the output's tail."""

    def __init__(self, decode, stops: Sequence[str]) -> None:
        self.decode = decode
        self.stops = tuple(stops)
        # a token decodes to >= 1 byte and a char is <= 4 bytes; +4 covers a partial UTF-8 char at the edge
        self.window = 4 * max((len(s) for s in stops), default=0) + 4

    def match(self, output_ids: Sequence[int]) -> str | None:
        if not self.stops:
            return None
        tail = self.decode(output_ids[-self.window :])
        prev = self.decode(output_ids[-self.window : -1]) if len(output_ids) > 1 else ""
        for s in self.stops:
            if s in tail and s not in prev:
                return s
        return None
