"""Token sampling for a batch of rows with per-row settings and per-row seeded generators (pure maths).

``sample(logits, temperature, top_p, top_k, generators)`` returns the chosen tokens and their logprobs.
The logprob is always ``log_softmax(raw logits)`` at temperature 1, computed in fp32, whatever the row's
temperature, top-p or top-k: the model's own probability of the sampled token, which is what the learner
recomputes. Temperature 0 is greedy. Top-k (k <= 0: off) and top-p filter the temperature-scaled
distribution; one uniform draw per row from that row's ``torch.Generator`` picks the token by inverse CDF,
so a request's samples depend only on its seed and its logits, not on its batch neighbours.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def sample(
    logits: Tensor,
    temperature: Sequence[float],
    top_p: Sequence[float],
    top_k: Sequence[int],
    generators: Sequence[torch.Generator],
) -> tuple[list[int], list[float]]:
    lf = logits.float()
    b, v = lf.shape
    logp = torch.log_softmax(lf, dim=-1)
    tokens = torch.argmax(lf, dim=-1)
    rows = [i for i in range(b) if temperature[i] > 0]
    if rows:
        idx = torch.tensor(rows)
        t = torch.tensor([temperature[i] for i in rows], dtype=torch.float32)[:, None]
        probs = torch.softmax(lf[idx] / t, dim=-1)
        u = torch.cat([torch.rand(1, generator=generators[i]) for i in rows])
        if all(top_k[i] <= 0 and top_p[i] >= 1.0 for i in rows):
            cdf = probs.cumsum(-1)
            pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=v - 1)[:, 0]
        else:
            sp, order = torch.sort(probs, dim=-1, descending=True)
            ks = torch.tensor([top_k[i] if top_k[i] > 0 else v for i in rows])[:, None]
            ps = torch.tensor([top_p[i] for i in rows], dtype=torch.float32)[:, None]
            rank = torch.arange(v)[None, :]
            before = sp.cumsum(-1) - sp  # mass strictly before each sorted token
            keep = (rank < ks) & ((before < ps) | (rank == 0))
            sp = sp * keep
            cdf = sp.cumsum(-1)
            j = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
            j = torch.minimum(j, keep.sum(-1, keepdim=True) - 1)
            pick = order.gather(1, j)[:, 0]
        tokens[idx] = pick
    lps = logp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), lps.tolist()


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
