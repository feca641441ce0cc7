"""Batched sampling (t1async.model.sampling): the two-level inverse CDF picks exactly the token a full
cumsum would, never a zero-probability token; temperature, top-k, greedy and logprobs per row."""

from __future__ import annotations

import torch

from t1async.model.sampling import inverse_cdf, sample


def reference_pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The textbook inverse CDF in float64: first i with cdf[i] > u * total."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)[:, 0]


def test_inverse_cdf_matches_a_full_cumsum():
    g = torch.Generator().manual_seed(0)
    for v in (4096, 1000, 7, 64, 65):  # whole blocks, a ragged last block, fewer tokens than a block
        probs = torch.softmax(torch.randn(300, v, generator=g) * 3, dim=-1)
        u = torch.rand(300, generator=g)
        got = inverse_cdf(probs, u)
        want = reference_pick(probs, u)
        # float32 block sums vs a float64 cumsum may disagree only for a target within rounding of a boundary
        cdf = probs.double().cumsum(-1)
        t = u.double() * cdf[:, -1]
        close = (cdf - t[:, None]).abs().min(-1).values < 1e-6
        assert torch.equal(got[~close], want[~close]), v
        two = inverse_cdf(probs[:2], u[:2])  # the one-level path for a row or two
        assert torch.equal(two[~close[:2]], want[:2][~close[:2]]), v
        assert ((got - want).abs() <= 1).all()


def test_inverse_cdf_never_picks_a_zero_probability_token():
    probs = torch.zeros(4, 200)
    probs[0, 3] = 1.0  # one token
    probs[1, [0, 130]] = 0.5  # mass in the first and a later block, zeros after
    probs[2, 64:128] = 1.0 / 64  # a middle block only
    probs[3, 199] = 2.0  # the last token of a ragged block, unnormalised
    for u in (0.0, 0.5, 1.0 - 2.0**-24, 1.0):
        picked = inverse_cdf(probs, torch.full((4,), u)).tolist()
        assert all(probs[r, t] > 0 for r, t in enumerate(picked)), (u, picked)
        alone = [inverse_cdf(probs[r : r + 1], torch.full((1,), u)).item() for r in range(4)]  # one-level path
        assert alone == picked, (u, alone, picked)
    assert inverse_cdf(probs, torch.zeros(4)).tolist() == [3, 0, 64, 199]
    assert inverse_cdf(probs, torch.full((4,), 0.75)).tolist() == [3, 130, 112, 199]


def test_sample_rows_follow_their_own_settings():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=g) * 2
    us = [0.3, 0.9, 0.5, 0.99, 0.1]
    toks, lps = sample(logits, [0.0, 1.0, 0.7, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 0.5], [-1, -1, -1, 1, -1], us)
    logp = torch.log_softmax(logits, -1)
    assert toks[0] == int(logits[0].argmax())  # greedy
    assert toks[1] == int(reference_pick(torch.softmax(logits[1:2], -1), torch.tensor([0.9]))[0])
    assert toks[2] == int(reference_pick(torch.softmax(logits[2:3] / 0.7, -1), torch.tensor([0.5]))[0])
    assert toks[3] == int(logits[3].argmax())  # top_k = 1
    order = logits[4].argsort(descending=True)
    p = torch.softmax(logits[4], -1)[order]
    nucleus = order[: int((p.cumsum(0) - p < 0.5).sum())]
    assert toks[4] in nucleus.tolist()
    assert all(abs(lp - logp[i, t].item()) < 1e-6 for i, (t, lp) in enumerate(zip(toks, lps)))
    # the same draws give the same tokens whatever the batch around a row
    alone, _ = sample(logits[1:2], [1.0], [1.0], [-1], [0.9])
    assert alone == [toks[1]]
