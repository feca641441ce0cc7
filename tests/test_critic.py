"""The critic's warm-up (``t1async.learner.critic``) fits on earlier steps and scores the next: a step's
advantages never use a head fitted on that step's own returns, and ``critic_ev_heldout`` is the explained
variance of returns the head was not fitted on."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from t1async.learner.critic import Moments
from t1async.learner.trainer import Trainer
from t1async.learner.trainer_config import TrainerConfig
from tests.segments import sampled_segment, tiny


def _segments(model, rng, *, n: int, readable: bool, tag: str) -> list:
    """``n`` one-turn segments. ``readable``: the return (0 or 3) shows in the tokens (rewarded episodes draw
    from 20 tokens, the others from 20 others); else the rewards are coin flips the tokens say nothing about."""
    segs = []
    for i in range(n):
        r = float(rng.integers(0, 2)) * 3.0
        lo, width = ((10 if r else 3000), 20) if readable else (10, 3000)
        toks = rng.integers(lo, lo + width, size=24).tolist()
        segs.append(sampled_segment(model, toks, range(12, 24), reward=r, episode=f"{tag}{i}"))
    return segs


def test_a_step_is_scored_by_a_head_not_fitted_on_its_own_returns():
    """Returns that are pure noise: a head fitted on a step's own returns explains them in-sample (the old
    warm-up refit before scoring: its advantages were each return against itself); fitted on the earlier step
    only, it explains none of the next step's."""
    torch.manual_seed(0)
    base = tiny()
    rng = np.random.default_rng(5)
    first, second = (_segments(base, rng, n=4, readable=False, tag=t) for t in ("a", "b"))
    trainer = Trainer(copy.deepcopy(base), TrainerConfig(lr=1e-5, advantage="gae", critic_warmup=2))
    m0 = trainer.step(first, 0)
    assert m0.critic_warmup_ev is not None and m0.critic_warmup_ev > 0.3  # the fit after it: in-sample
    m1 = trainer.step(second, 1)
    assert m1.explained_variance < 0.1  # the values this step's GAE used: not fitted on its returns
    assert m1.critic_ev_heldout is not None and m1.critic_ev_heldout < 0.1  # noise is not predicted
    assert m1.critic_warmup_ev is not None and m1.critic_warmup_ev > 0.3
    assert trainer.step(second, 2).critic_ev_heldout is None  # past the warm-up


def test_the_heldout_ev_is_the_next_steps_and_high_where_the_return_is_readable():
    torch.manual_seed(0)
    base = tiny()
    rng = np.random.default_rng(2)
    steps = [_segments(base, rng, n=16, readable=True, tag=f"s{k}") for k in range(3)]
    trainer = Trainer(copy.deepcopy(base), TrainerConfig(lr=1e-5, advantage="gae", critic_warmup=3))
    m = [trainer.step(s, k) for k, s in enumerate(steps)]
    assert m[0].critic_ev_heldout is not None and m[0].critic_ev_heldout < 0.05  # a fresh head: nothing yet
    assert all(x.critic_ev_heldout is not None and x.critic_ev_heldout > 0.3 for x in m[1:])  # fitted before
    assert m[2].explained_variance > 0.3 and m[2].value_mean > 0.5  # what the step's GAE used
    assert m[2].to_dict()["critic_ev_heldout"] == m[2].critic_ev_heldout  # reaches metrics.jsonl


def test_moments_give_the_explained_variance_of_any_head():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=(50, 3)), np.ones((50, 1))], axis=1)
    y = x @ np.array([1.0, -2.0, 0.5, 0.3]) + rng.normal(0, 0.1, 50)
    mom = Moments.zeros(3)
    mom.add(x[:20], y[:20])
    other = Moments.zeros(3)
    other.add(x[20:], y[20:])
    mom.merge(other)
    for w in (np.array([1.0, -2.0, 0.5, 0.3]), np.zeros(4), np.array([0.5, 0.0, 0.0, 0.0])):
        direct = 1.0 - np.var(y - x @ w) / np.var(y)  # ppo.explained_variance's definition
        assert abs(mom.ev(w) - direct) < 1e-9


def test_two_ranks_warm_up_the_head_as_one_rank_does(ranks2):
    """At 2 ranks (FSDP2) each rank forwards its own part of a step's segments, the ranks sum the moments, and
    every rank writes the same fit into its shard of the head: the held-out and in-sample explained variances
    and the head's weights are one rank's on the same segments. 17 segments of 24 tokens, 4 to a micro-batch:
    the parts need 3 and 2 micro-batches, so a rank pads its warm-up forwards too."""
    from t1async.learner.distributed import DistributedTrainer

    ranks, holder = ranks2
    torch.manual_seed(0)
    base = tiny()
    rng = np.random.default_rng(2)
    steps = [_segments(base, rng, n=17, readable=True, tag=f"s{k}") for k in range(3)]
    cfg = TrainerConfig(lr=1e-5, advantage="gae", critic_warmup=2, microbatch_tokens=96)
    one = Trainer(copy.deepcopy(base), cfg)
    two = holder["trainer"] = ranks.start(copy.deepcopy(base), cfg)
    assert isinstance(two, DistributedTrainer) and two.world == 2

    def head(t) -> torch.Tensor:  # noqa: ANN001 - a Trainer or a DistributedTrainer (gathered)
        h = (t.export_model() if isinstance(t, DistributedTrainer) else t.model).value_head
        return torch.cat([h.weight.detach()[0], h.bias.detach()])

    # rank 0's warm-up raises after its forwards: rank 1 learns of it at the moments' sum and fails too (no
    # hang), and the step can be run again
    assert two._warmup is not None
    real = two._warmup.moments

    def fails(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        real(*args, **kwargs)
        raise FloatingPointError("injected")

    two._warmup.moments = fails  # type: ignore[method-assign]
    with pytest.raises(FloatingPointError, match="injected"):
        two.step(steps[0], 0)
    del two._warmup.moments
    for k, segs in enumerate(steps):
        m1, m2 = one.step(segs, k), two.step(segs, k)
        for key in ("critic_ev_heldout", "critic_warmup_ev"):
            a, b = getattr(m1, key), getattr(m2, key)
            assert (a is None) == (b is None) == (k >= 2), (k, key, a, b)
            assert a is None or b == pytest.approx(a, rel=1e-4, abs=1e-5), (k, key)
        assert m2.explained_variance == pytest.approx(m1.explained_variance, rel=1e-4, abs=1e-5), k
        torch.testing.assert_close(head(two), head(one), rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"step {k}: {m}")
        if k == 1:  # the head scoring step 1 was fitted on step 0: the fit means something
            assert m2.critic_ev_heldout is not None and m2.critic_ev_heldout > 0.3
