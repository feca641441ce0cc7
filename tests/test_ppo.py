"""The PPO maths: GAE with a bootstrap at a cut, per-turn rewards, the decoupled loss, KL and ESS."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from t1async.learner import ppo
from t1async.learner.trainer_config import TrainerConfig


def test_gae_matches_hand_computation_with_bootstrap():
    # 3 actions, gamma 0.9, lambda 0.8, bootstrap 2.0 (cut, not done)
    r = np.array([0.0, 1.0, 0.5])
    v = np.array([0.2, 0.4, 0.6])
    adv, ret = ppo.gae(r, v, 2.0, gamma=0.9, lam=0.8)
    d2 = 0.5 + 0.9 * 2.0 - 0.6  # 1.7
    d1 = 1.0 + 0.9 * 0.6 - 0.4  # 1.14
    d0 = 0.0 + 0.9 * 0.4 - 0.2  # 0.16
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    np.testing.assert_allclose(adv, [a0, a1, a2], rtol=1e-12)
    np.testing.assert_allclose(ret, [a0 + 0.2, a1 + 0.4, a2 + 0.6], rtol=1e-12)


def test_gae_done_ignores_bootstrap_and_lambda_one_is_monte_carlo():
    r = np.array([1.0, 0.0, 2.0])
    v = np.array([0.3, -0.1, 0.7])
    _, ret = ppo.gae(r, v, 0.0, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(ret, [3.0, 2.0, 2.0])


def _segment_case():
    # positions: 0 prompt, 1 prompt, 2-3 turn 0 output, 4-5 observation, 6-7 turn 1 output
    lm = np.array([0, 0, 1, 1, 0, 0, 1, 1], dtype=bool)
    head = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.9])  # value head per position
    values = np.concatenate([[0.0], head])  # values[p] = head[p - 1]; values[8] = head[7] = bootstrap
    return lm, values, np.array([3, 7]), np.array([1.0, 0.5])


def test_segment_advantages_skip_context_tokens_and_bootstrap_at_cut():
    lm, values, ends, rw = _segment_case()
    adv, ret = ppo.segment_advantages(lm, values, ends, rw, done=False, gamma=0.9, lam=0.8, discount_per="token")
    # actions at 2, 3, 6, 7 with values head[1], head[2], head[5], head[6] and bootstrap head[7]
    v = [0.2, 0.3, 0.6, 0.7]
    rewards = [0.0, 1.0, 0.0, 0.5]
    nxt = v[1:] + [0.9]
    a, exp = 0.0, [0.0] * 4
    for i in range(3, -1, -1):
        a = rewards[i] + 0.9 * nxt[i] - v[i] + 0.72 * a
        exp[i] = a
    np.testing.assert_allclose(adv[[2, 3, 6, 7]], exp, rtol=1e-12)
    assert np.all(adv[~lm] == 0) and np.all(ret[~lm] == 0)
    np.testing.assert_allclose(ret[[2, 3, 6, 7]], np.array(exp) + v, rtol=1e-12)
    # done: no bootstrap, so the last advantage is r - V
    adv_done, _ = ppo.segment_advantages(lm, values, ends, rw, done=True, gamma=0.9, lam=0.8, discount_per="token")
    assert adv_done[7] == pytest.approx(0.5 - 0.7)
    assert adv[7] == pytest.approx(0.5 + 0.9 * 0.9 - 0.7)


def test_turn_discount_applies_only_across_turns():
    lm, values, ends, rw = _segment_case()
    adv, _ = ppo.segment_advantages(lm, values, ends, rw, done=True, gamma=0.5, lam=1.0, discount_per="turn")
    # within turn 1: step 6 -> 7 undiscounted; turn end 7 is terminal
    a7 = 0.5 - 0.7
    a6 = 0.0 + 1.0 * 0.7 - 0.6 + a7
    a3 = 1.0 + 0.5 * 0.6 - 0.3 + 0.5 * a6  # turn 0's end discounts into turn 1
    a2 = 0.0 + 0.3 - 0.2 + a3
    np.testing.assert_allclose(adv[[2, 3, 6, 7]], [a2, a3, a6, a7], rtol=1e-12)


def test_reward_on_masked_turn_end_goes_to_previous_loss_token():
    lm = np.array([0, 1, 1, 0, 0], dtype=bool)  # turn ends at 4, which is not a loss token (realigned away)
    values = np.zeros(6)
    adv, _ = ppo.segment_advantages(lm, values, np.array([4]), np.array([3.0]), True, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv[[1, 2]], [3.0, 3.0])


def test_segment_advantages_reject_bad_shapes():
    with pytest.raises(ValueError, match="T \\+ 1"):
        ppo.segment_advantages(np.ones(3, bool), np.zeros(3), np.array([2]), np.array([1.0]), True, gamma=1, lam=1)
    with pytest.raises(ValueError, match="discount_per"):
        ppo.segment_advantages(
            np.ones(3, bool), np.zeros(4), np.array([2]), np.array([1.0]), True, gamma=1, lam=1, discount_per="episode"
        )


POLICY_ONLY = TrainerConfig(value_coef=0.0)  # the policy loss alone


def _loss(logp, adv, *, prox=None, behav=None, cfg=POLICY_ONLY):
    n = logp.shape[0]
    z = torch.zeros(n)
    prox = logp.detach() if prox is None else prox
    behav = prox if behav is None else behav
    return ppo.ppo_loss(logp, prox, behav, adv, z, z, z, torch.ones(n, dtype=torch.bool), cfg)


def test_policy_gradient_sign_follows_advantage():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    terms = _loss(logp, torch.tensor([1.0, -1.0]))
    terms.loss.backward()
    # minimising the loss raises logp of the positive action and lowers the negative one
    assert logp.grad[0] < 0 < logp.grad[1]


def test_ratio_clip_stops_gradient_beyond_eps():
    prox = torch.tensor([-1.0, -1.0])
    logp = torch.tensor([-1.0 + math.log(1.5), -1.0 + math.log(1.1)], requires_grad=True)
    terms = _loss(logp, torch.tensor([1.0, 1.0]), prox=prox)
    terms.loss.backward()
    assert logp.grad[0] == 0  # ratio 1.5 > 1.2 with positive advantage: clipped
    assert logp.grad[1] < 0
    assert terms.clip_frac.item() == pytest.approx(0.5)


def test_importance_weight_is_truncated_and_scales_gradient():
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    behav = torch.tensor([-1.0 - math.log(0.5), -1.0 - math.log(5.0)])  # w = 0.5 and 5 (capped at 2)
    terms = _loss(logp, torch.tensor([1.0, 1.0]), behav=behav)
    terms.loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), [-0.5 / 2, -2.0 / 2], rtol=1e-6)
    assert terms.is_trunc_frac.item() == pytest.approx(0.5)


def test_value_loss_pulls_value_to_return_and_respects_clip():
    v = torch.tensor([0.0, 0.0], requires_grad=True)
    old = torch.tensor([0.0, 0.0])
    ret = torch.tensor([1.0, -0.1])
    z = torch.zeros(2)
    m = torch.ones(2, dtype=torch.bool)
    cfg = TrainerConfig(value_coef=1.0, value_clip=0.2)
    terms = ppo.ppo_loss(z, z, z, z, v, old, ret, m, cfg)
    terms.loss.backward()
    assert v.grad[0] < 0 < v.grad[1]  # gradient descent moves both toward their returns


def test_normaliser_makes_microbatches_sum_to_full_batch():
    torch.manual_seed(0)
    logp = torch.randn(6, requires_grad=True)
    adv = torch.randn(6)
    full = _loss(logp, adv).loss
    g_full = torch.autograd.grad(full, logp)[0]
    z = torch.zeros(3)
    m = torch.ones(3, dtype=torch.bool)
    cfg = TrainerConfig(value_coef=0.0)
    parts = [
        ppo.ppo_loss(
            logp[i : i + 3],
            logp[i : i + 3].detach(),
            logp[i : i + 3].detach(),
            adv[i : i + 3],
            z,
            z,
            z,
            m,
            cfg,
            normaliser=6,
        ).loss
        for i in (0, 3)
    ]
    g_parts = torch.autograd.grad(parts[0] + parts[1], logp)[0]
    torch.testing.assert_close(g_full, g_parts)


def test_k3_kl_and_ess():
    m = torch.ones(4, dtype=torch.bool)
    same = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    assert ppo.k3_kl(same, same, m) == 0.0
    assert ppo.ess(same - same, m) == pytest.approx(1.0)
    other = same + torch.tensor([0.3, -0.2, 0.0, 0.1])
    lr = (other - same).double()
    assert ppo.k3_kl(other, same, m) == pytest.approx(float((lr.exp() - 1 - lr).mean()))
    assert ppo.k3_kl(other, same, m) > 0
    w = torch.tensor([1.0, 1.0, 1.0, 1e-6])  # one weight near zero: ESS ~ 3/4
    assert ppo.ess(w.log(), m) == pytest.approx(0.75, abs=1e-4)


def test_token_logprobs_shift_by_one():
    logits = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]]))
    tokens = torch.tensor([[1, 0, 1]])
    lp, ent = ppo.token_logprobs(logits, tokens, with_entropy=True)
    np.testing.assert_allclose(lp.numpy(), [[0.0, math.log(0.5), math.log(0.1)]], rtol=1e-6)
    assert ent[0, 1].item() == pytest.approx(math.log(2.0), rel=1e-6)


def test_dlogp_split_separates_fresh_mismatch_from_stale_policy_shift():
    prox = torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0])
    behav = torch.tensor([-1.01, -2.03, -3.5, -4.0, -6.0, -6.0])
    stale = torch.tensor([0, 0, 1, 1, 2, -1])  # -1: never valid (sampled by a newer version); in neither mean
    s = ppo.dlogp_split(prox, behav, stale)
    assert s.mismatch == pytest.approx(0.02, abs=1e-6) and s.mismatch_tokens == 2
    assert s.policy_shift == pytest.approx((0.5 + 0.0 + 1.0) / 3, abs=1e-6) and s.policy_shift_tokens == 3
    assert s.policy_shift_by_staleness == pytest.approx({1: 0.25, 2: 1.0})
    empty = ppo.dlogp_split(prox[:2], behav[:2], stale[:2])
    assert (empty.policy_shift, empty.policy_shift_tokens, empty.policy_shift_by_staleness) == (0.0, 0, {})
    with pytest.raises(ValueError, match="staleness values"):
        ppo.dlogp_split(prox, behav, stale[:3])
