"""The metrics of one training step (Trainer.step's stage 3): losses, the learner/sampler log-prob gap
(mean |Δlogp|, k3 KL, ESS, split into mismatch and policy shift by staleness), routing drift, staleness,
advantages and where the time went. The distributed learner computes them on rank 0 over every rank's
loss tokens."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from t1async.learner import ppo
from t1async.learner.batch import SegmentLike
from t1async.learner.trainer_config import TrainerConfig


@dataclass(frozen=True)
class StepMetrics:
    step: int  # optimizer steps taken by this trainer after this step
    policy_version: int  # the policy version the step trained at (staleness reference)
    segments: int
    tokens: int  # real tokens forwarded
    loss_tokens: int
    turns: int
    loss: float
    policy_loss: float
    value_loss: float
    entropy: float | None  # None when not computed (entropy_coef 0)
    clip_frac: float
    is_trunc_frac: float
    grad_norm: float
    mean_abs_dlogp: float  # learner (start of step) vs sampler, over all loss tokens (mismatch + policy shift)
    k3_kl: float  # KL(sampler || learner), k3 estimator
    ess: float  # normalised ESS of the importance weights pi_prox / pi_behav
    routing_drift: float  # share of (token, layer) choices where the learner's top-k differs from the recorded
    routing_used_mismatch: float  # same, for the experts the forward actually used (0 under R3 replay)
    routing_compared: int
    routing_missing: int
    replay: bool
    max_staleness: int
    staleness_hist: dict[int, int]
    drift: dict[str, int]
    reward_sum: float
    adv_mean: float
    adv_std: float
    value_mean: float
    return_mean: float
    t_step_s: float
    # mean |Δlogp| split by staleness (ppo.dlogp_split): the train/inference mismatch over tokens trained at
    # the version that sampled them, and the policy's own change since sampling over stale tokens
    mismatch: float = 0.0
    mismatch_tokens: int = 0
    policy_shift: float = 0.0
    policy_shift_tokens: int = 0
    policy_shift_by_staleness: dict[int, float] = field(default_factory=dict)
    # where t_step_s went: forwards (scoring and PPO), backward passes with the optimizer step
    t_forward_s: float = 0.0
    t_backward_s: float = 0.0
    # cost per trained token (learner.prefixkv): positions forwarded (every pass) and back-propagated, over the
    # positions this step covers for the first time (an episode's new turns and the observations between them;
    # 1.0 = each position forwarded once). prefix_reused: kept positions attended to instead of re-forwarded
    forwarded_tokens: int = 0
    backward_tokens: int = 0
    new_tokens: int = 0
    forwarded_per_trained: float = 0.0
    backward_per_trained: float = 0.0
    prefix_reused_tokens: int = 0
    prefix_primed_tokens: int = 0  # of those, forwarded without gradient this step for a cut with nothing kept
    prefix_max_age: int = 0
    # the algorithm's own health (design §8): PPO clipping per epoch (the ratio is 1 in the first, so a clip
    # that binds shows from the second), the off-policy correction, the critic, the group baselines
    clip_frac_by_epoch: dict[int, float] = field(default_factory=dict)
    clip_frac_last: float = 0.0  # clip_frac_by_epoch's last epoch
    is_masked_frac: float = 0.0  # share of loss tokens dropped by masked IS (is_correction "mis")
    # whatever the correction: the share of loss tokens whose raw w = pi_learner / pi_sampler leaves
    # [is_low, is_high] (what mis would drop), and the largest |Δlogp| of one token (a bf16 sampler's tail)
    is_outside_frac: float = 0.0
    dlogp_max: float = 0.0
    ess_corrected: float = 1.0  # normalised ESS of the importance weights after truncation or masking
    explained_variance: float = 0.0  # of the returns by the critic's values at the start of the step
    critic_warmup_ev: float | None = None  # in-sample EV of the warm-up's fit after the step (for the next one)
    # EV of the step's returns by the warm-up's head before it is fitted on them (fitted on earlier steps only)
    critic_ev_heldout: float | None = None
    adv_grouped_share: float = 0.0  # grpo/rloo: share of (episode, turn)s centred on their own task group
    adv_truncated_share: float = 0.0  # grpo/rloo: share of (episode, turn)s whose return-to-go lacks later turns
    # --kl-ref-coef: mean k3 KL(pi || ref) a loss token, pi the learner during the step, ref its initial weights
    kl_ref: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["staleness_hist"] = {str(k): v for k, v in self.staleness_hist.items()}
        d["policy_shift_by_staleness"] = {str(k): v for k, v in self.policy_shift_by_staleness.items()}
        d["clip_frac_by_epoch"] = {str(k): v for k, v in self.clip_frac_by_epoch.items()}
        return d


def step_metrics(
    segments: Sequence[SegmentLike],
    toks: Mapping[str, Tensor],
    policy_version: int,
    drift: Mapping[str, int] | None,
    *,
    step: int,
    replay: bool,
    with_entropy: bool,
    sums: Mapping[str, float],
    grad_norm: float,
    routing: tuple[int, int, int, int],
    n_loss: int,
    adv_mean: float,
    adv_std: float,
    t0: float,
    t_fwd: float,
    t_backward: float,
    config: TrainerConfig | None = None,
) -> StepMetrics:
    """StepMetrics over the step's loss tokens: ``toks`` holds 1-D per-loss-token tensors ``prox``,
    ``behav``, ``versions``, ``old_values``, ``returns``; ``segments`` all the step's segments; ``routing``
    (differ, compared, missing, used_differ) counts; ``t0`` the step's perf_counter start."""
    differ, compared, missing, used_differ = routing
    prox, behav, vers, old_v, ret = (toks[k] for k in ("prox", "behav", "versions", "old_values", "returns"))
    ones = torch.ones_like(prox, dtype=torch.bool)
    stale = (policy_version - vers).cpu().numpy()
    hist = {int(k): int(v) for k, v in zip(*np.unique(stale, return_counts=True))}
    split = ppo.dlogp_split(prox, behav, policy_version - vers)
    cfg = config or TrainerConfig()
    w, _, _ = ppo.is_weights(prox, behav, cfg)
    outside = ppo.outside_band(ppo.raw_is_weights(prox, behav), cfg)  # what mis drops, under any correction
    by_epoch = {int(k.removeprefix("clip_frac_e")): v for k, v in sums.items() if k.startswith("clip_frac_e")}
    return StepMetrics(
        step=step,
        policy_version=policy_version,
        segments=len(segments),
        tokens=int(sum(len(s.tokens) for s in segments)),
        loss_tokens=n_loss,
        turns=int(sum(len(s.turn_ends) for s in segments)),
        loss=sums["loss"],
        policy_loss=sums["policy_loss"],
        value_loss=sums["value_loss"],
        entropy=sums["entropy"] if with_entropy else None,
        clip_frac=sums["clip_frac"],
        is_trunc_frac=sums["is_trunc_frac"],
        grad_norm=grad_norm,
        mean_abs_dlogp=float((prox - behav).abs().mean()),
        k3_kl=ppo.k3_kl(prox, behav, ones),
        ess=ppo.ess(prox - behav, ones),
        routing_drift=differ / compared if compared else 0.0,
        routing_compared=compared,
        routing_used_mismatch=used_differ / compared if compared else 0.0,
        routing_missing=missing,
        replay=replay,
        max_staleness=int(stale.max()),
        staleness_hist=hist,
        drift={str(k): int(v) for k, v in (drift or {}).items()},
        reward_sum=float(sum(float(np.sum(s.turn_rewards)) for s in segments)),
        adv_mean=adv_mean,
        adv_std=adv_std,
        value_mean=float(old_v.mean()),
        return_mean=float(ret.mean()),
        t_step_s=time.perf_counter() - t0,
        mismatch=split.mismatch,
        mismatch_tokens=split.mismatch_tokens,
        policy_shift=split.policy_shift,
        policy_shift_tokens=split.policy_shift_tokens,
        policy_shift_by_staleness=split.policy_shift_by_staleness,
        t_forward_s=t_fwd,
        t_backward_s=t_backward,
        forwarded_tokens=int(sums.get("fwd_tokens", 0)),
        backward_tokens=int(sums.get("bwd_tokens", 0)),
        new_tokens=int(sums.get("new_tokens", 0)),
        forwarded_per_trained=sums.get("fwd_tokens", 0) / max(sums.get("new_tokens", 0), 1),
        backward_per_trained=sums.get("bwd_tokens", 0) / max(sums.get("new_tokens", 0), 1),
        prefix_reused_tokens=int(sums.get("prefix_reused", 0)),
        prefix_primed_tokens=int(sums.get("prefix_primed", 0)),
        prefix_max_age=int(sums.get("prefix_age", 0)),
        clip_frac_by_epoch=by_epoch,
        clip_frac_last=by_epoch[max(by_epoch)] if by_epoch else 0.0,
        is_masked_frac=sums.get("is_masked_frac", 0.0),
        is_outside_frac=float(outside.double().mean()) if outside.numel() else 0.0,
        dlogp_max=float((prox.double() - behav.double()).abs().max()) if prox.numel() else 0.0,
        ess_corrected=_ess_of(w),
        explained_variance=ppo.explained_variance(old_v, ret),
        kl_ref=sums.get("kl_ref", 0.0),
    )


def _ess_of(w: Tensor) -> float:
    """Normalised ESS ``(sum w)^2 / (N sum w^2)`` of weights (zeros count: masking lowers it); 0 if all are 0."""
    w = w.double().flatten()
    sq = float((w * w).sum())
    return float(w.sum() ** 2 / (w.numel() * sq)) if w.numel() and sq > 0 else 0.0


def step_algorithm_metrics(
    m: StepMetrics,
    baseline: ppo.StepBaseline | None,
    critic_warmup_ev: float | None,
    critic_ev_heldout: float | None = None,
) -> StepMetrics:
    """``m`` with what the trainer knows outside the step's tensors: the group baselines' coverage and the
    critic warm-up's fit (in-sample) and held-out explained variance."""
    share = baseline.grouped_share() if baseline is not None else 0.0
    truncated = baseline.truncated_share() if baseline is not None else 0.0
    return replace(
        m,
        adv_grouped_share=share,
        adv_truncated_share=truncated,
        critic_warmup_ev=critic_warmup_ev,
        critic_ev_heldout=critic_ev_heldout,
    )
