"""The critic's warm-up (``t1async.learner.critic``) fits on earlier steps and scores the next: a step's
advantages never use a head fitted on that step's own returns, and ``critic_ev_heldout`` is the explained
variance of returns the head was not fitted on."""

from __future__ import annotations

import copy

import numpy as np
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
