"""The maths of one actor-critic PPO step, pure and tensor-only (no model, no I/O).

Conventions (one segment = one token sequence ``tokens[0..T)``):

- A **loss token** at position ``p >= 1`` is an action the sampler generated. Its log-prob comes from the
  logits at ``p - 1`` and the value of the state it was taken in is ``values[p - 1]`` (the value head reads
  the same hidden state the policy does).
- **Rewards** are per turn (design §8: the change in the number of passing tests) and sit on the turn's last
  output token.
- **GAE runs over the loss tokens only.** Non-loss tokens (prompt, observations, template bridges) are
  transitions of the environment, not actions: they are skipped, so the step after a turn's last token is
  the first token of the next turn, and its value already conditions on the observation in between. The
  discount therefore counts actions, not context tokens, and a long tool output does not decay credit.
  ``discount_per="turn"`` applies ``gamma`` and ``lam`` only across turn boundaries (tokens within one turn
  are undiscounted), which suits long horizons; ``"token"`` is classic token-level GAE.
- **Bootstrap at a cut**: a segment with ``done=False`` ends before its episode does; the value after its
  last loss token is ``bootstrap`` (the value head at the last position of the segment), so partial
  trajectories train before the episode ends. With ``done=True`` it is 0.

The policy loss is decoupled PPO (Hilton et al. 2022; AReaL): behaviour policy = the sampler's logprobs,
proximal policy = the learner's logprobs at the start of the step (detached). The PPO ratio and its clip are
taken against the proximal policy; the importance weight ``w = pi_prox / pi_behav`` corrects for staleness and
sampler/learner mismatch, detached: ``is_correction="tis"`` truncates it at ``is_cap`` (truncated IS),
``"mis"`` zeroes the tokens whose ``w`` leaves ``[is_low, is_high]`` (masked IS) and keeps ``w`` elsewhere;
``"none"`` takes ``w = 1``: the loss ignores the mismatch (an ablation).
With ``ppo_epochs > 1`` every epoch re-runs the forward, so from the second epoch on the ratio differs from 1
and the clip binds; ``clip_frac_by_epoch`` shows it.

Baselines without a critic (``StepBaseline``): ``turn`` centres each turn's own reward on the step's mean for
its turn number; ``grpo`` / ``rloo`` centre each turn's return-to-go (``gamma`` across the turns of the
segment) on the mean return-to-go at the same turn number of the other episodes of the same task group
(``grpo``: the group's mean including itself; ``rloo``: leave-one-out). A turn whose group has no other
episode with that turn number in the step falls back to the step's mean for the turn number.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from t1async.learner.groups import episode_group
from t1async.learner.trainer_config import TrainerConfig


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    bootstrap: float,
    *,
    gamma: float,
    lam: float,
    step_discount: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over a sequence of M actions.

    ``rewards[i]`` and ``values[i]`` belong to action i; ``bootstrap`` is the value after the last action
    (0 when the episode ended). ``step_discount[i]`` (default all True) says whether the step from i to
    i + 1 is discounted by ``gamma`` / ``lam`` (False: undiscounted, used within a turn). Returns
    ``(advantages, returns)``, float64, with ``returns = advantages + values``.
    """
    r = np.asarray(rewards, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if r.shape != v.shape or r.ndim != 1:
        raise ValueError(f"rewards {r.shape} and values {v.shape} must be equal 1-d shapes")
    m = len(r)
    disc = np.ones(m, dtype=bool) if step_discount is None else np.asarray(step_discount, dtype=bool)
    if disc.shape != (m,):
        raise ValueError(f"step_discount has shape {disc.shape}, expected ({m},)")
    g = np.where(disc, gamma, 1.0)
    gl = np.where(disc, gamma * lam, 1.0)
    nxt = np.append(v[1:], float(bootstrap))
    delta = r + g * nxt - v
    adv = np.empty(m, dtype=np.float64)
    acc = 0.0
    for i in range(m - 1, -1, -1):
        acc = delta[i] + gl[i] * acc
        adv[i] = acc
    return adv, adv + v


def segment_advantages(
    loss_mask: np.ndarray,
    values: np.ndarray,
    turn_ends: np.ndarray,
    turn_rewards: np.ndarray,
    done: bool,
    *,
    gamma: float,
    lam: float,
    discount_per: str = "turn",
) -> tuple[np.ndarray, np.ndarray]:
    """Per-token advantages and returns of one segment (zeros off the loss mask).

    ``values[p]`` is the value of the state in which token p was chosen (the value head at ``p - 1``);
    ``values[-1]`` must be the value after the segment's last token (the value head at ``T - 1``), used as
    the bootstrap when ``done`` is False. ``turn_ends[j]`` is the position of turn j's last output token and
    ``turn_rewards[j]`` its reward. A turn end that is not a loss token (a REALIGNed or masked turn) gives
    its reward to the last loss token before it, so no reward is lost.
    """
    lm = np.asarray(loss_mask, dtype=bool)
    t = len(lm)
    vals = np.asarray(values, dtype=np.float64)
    if vals.shape != (t + 1,):
        raise ValueError(
            f"values must have T + 1 = {t + 1} entries (per position, then the bootstrap), got {vals.shape}"
        )
    if discount_per not in ("turn", "token"):
        raise ValueError(f"discount_per must be 'turn' or 'token', got {discount_per!r}")
    pos = np.flatnonzero(lm)
    adv_full = np.zeros(t, dtype=np.float64)
    ret_full = np.zeros(t, dtype=np.float64)
    if len(pos) == 0:
        return adv_full, ret_full
    ends = np.asarray(turn_ends, dtype=np.int64)
    rw = np.asarray(turn_rewards, dtype=np.float64)
    if ends.shape != rw.shape:
        raise ValueError(f"turn_ends {ends.shape} and turn_rewards {rw.shape} differ in shape")
    rewards = np.zeros(len(pos), dtype=np.float64)
    # index of the last loss token at or before each turn end; rewards before the first loss token are
    # not attributable to any action of this segment and are dropped.
    idx = np.searchsorted(pos, ends, side="right") - 1
    ok = idx >= 0
    np.add.at(rewards, idx[ok], rw[ok])
    if discount_per == "token":
        step_discount = None
    else:
        is_end = np.zeros(t, dtype=bool)
        is_end[ends[(ends >= 0) & (ends < t)]] = True
        # discount the step out of action i iff a turn ends at or after pos[i] and before pos[i + 1]
        csum = np.concatenate([[0], np.cumsum(is_end)])
        nxt = np.append(pos[1:], t)
        step_discount = (csum[nxt] - csum[pos]) > 0
    boot = 0.0 if done else float(vals[t])
    adv, ret = gae(rewards, vals[pos], boot, gamma=gamma, lam=lam, step_discount=step_discount)
    adv_full[pos] = adv
    ret_full[pos] = ret
    return adv_full, ret_full


def _turn_rewards(loss_mask, turn_ids, turn_ends, turn_rewards) -> dict[int, float]:
    """Turn number -> reward of the turns of one segment that have loss tokens here."""
    lm, tid = np.asarray(loss_mask, dtype=bool), np.asarray(turn_ids)
    trained = set(np.unique(tid[lm]).tolist())
    out: dict[int, float] = {}
    for end, r in zip(np.asarray(turn_ends, dtype=np.int64), np.asarray(turn_rewards, dtype=np.float64)):
        if 0 <= end < len(tid) and int(tid[end]) in trained:
            out[int(tid[end])] = out.get(int(tid[end]), 0.0) + float(r)
    return out


def turn_baseline(segments) -> dict[int, float]:
    """The mean reward of a step's trained turns per turn number (turn 0 of every episode together, turn 1, ...):
    the baseline of ``turn_advantages``. A state-independent, action-independent baseline (the turn number is
    part of the state), so the policy gradient stays unbiased; a turn number seen once has advantage 0."""
    sums: dict[int, list[float]] = {}
    for s in segments:
        for t, r in _turn_rewards(s.loss_mask, s.turn_ids, s.turn_ends, s.turn_rewards).items():
            acc = sums.setdefault(t, [0.0, 0.0])
            acc[0] += r
            acc[1] += 1.0
    return {t: total / n for t, (total, n) in sums.items()}


def turn_advantages(
    loss_mask: np.ndarray,
    turn_ids: np.ndarray,
    turn_ends: np.ndarray,
    turn_rewards: np.ndarray,
    baseline: dict[int, float],
) -> np.ndarray:
    """Per-token advantages of one segment under ``TrainerConfig.advantage = "turn"``: every loss token of a turn
    gets that turn's reward minus ``baseline[turn number]`` (zeros off the loss mask)."""
    lm, tid = np.asarray(loss_mask, dtype=bool), np.asarray(turn_ids)
    adv = np.zeros(len(lm), dtype=np.float64)
    for t, r in _turn_rewards(lm, tid, turn_ends, turn_rewards).items():
        adv[lm & (tid == t)] = r - baseline.get(t, r)
    return adv


def turn_returns(turn_rewards: dict[int, float], gamma: float) -> dict[int, float]:
    """Return-to-go of each turn over the turns given (turn number -> reward): ``G_t = r_t + gamma * G_next``,
    the next being the following turn number present."""
    out: dict[int, float] = {}
    acc = 0.0
    for t in sorted(turn_rewards, reverse=True):
        acc = turn_rewards[t] + gamma * acc
        out[t] = acc
    return out


@dataclass(frozen=True)
class StepBaseline:
    """The critic-free baseline of one step (``TrainerConfig.advantage`` ``turn``, ``grpo`` or ``rloo``).

    ``per_turn``: turn number -> the step's mean of the per-turn value (``turn``: the turn's reward; group modes:
    its return-to-go); ``groups``: (task group, turn number) -> [sum of the episodes' values, episodes]; ``own``:
    (episode, turn number) -> that episode's value, summed over its segments in the step; ``cut``: the (episode,
    turn number)s of ``own`` whose segment was cut (``Segment.done`` False): the episode runs on, so their
    return-to-go lacks the rewards still to come (``truncated_share``); ``sign_salt``: when set
    (``--advantage-signs random``, a control), each (episode, turn)'s advantage is multiplied by a sign drawn from
    a hash of (salt, episode, turn), the same on every rank and for every segment of that turn.
    """

    mode: str
    gamma: float = 1.0
    per_turn: dict[int, float] = field(default_factory=dict)
    groups: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    own: dict[tuple[str, int], float] = field(default_factory=dict)
    cut: frozenset[tuple[str, int]] = frozenset()
    sign_salt: str | None = None

    @classmethod
    def of(cls, mode: str, segments: Iterable, gamma: float = 1.0, *, sign_salt: str | None = None) -> StepBaseline:
        if mode not in ("turn", "grpo", "rloo"):
            raise ValueError(f"StepBaseline mode must be turn, grpo or rloo, got {mode!r}")
        segments = list(segments)
        if mode == "turn":
            return cls(mode, gamma, turn_baseline(segments), sign_salt=sign_salt)
        own: dict[tuple[str, int], float] = {}
        cut: set[tuple[str, int]] = set()
        for s in segments:
            rw = _turn_rewards(s.loss_mask, s.turn_ids, s.turn_ends, s.turn_rewards)
            for t, g in turn_returns(rw, gamma).items():
                own[(s.episode, t)] = own.get((s.episode, t), 0.0) + g
                if not getattr(s, "done", True):
                    cut.add((s.episode, t))
        groups: dict[tuple[str, int], list[float]] = {}
        sums: dict[int, list[float]] = {}
        for (ep, t), g in own.items():
            acc = groups.setdefault((episode_group(ep), t), [0.0, 0.0])
            acc[0] += g
            acc[1] += 1.0
            tot = sums.setdefault(t, [0.0, 0.0])
            tot[0] += g
            tot[1] += 1.0
        per_turn = {t: a / n for t, (a, n) in sums.items()}
        return cls(mode, gamma, per_turn, groups, own, frozenset(cut), sign_salt)

    def baseline(self, episode: str, turn: int, value: float) -> float:
        """The baseline of ``episode``'s turn ``turn`` whose value (reward or return-to-go) is ``value``."""
        if self.mode == "turn":
            return self.per_turn.get(turn, value)
        total, n = self.groups.get((episode_group(episode), turn), (0.0, 0.0))
        if n >= 2:
            if self.mode == "rloo":
                return (total - self.own.get((episode, turn), value)) / (n - 1)
            return total / n
        return self.per_turn.get(turn, value)

    def advantages(self, seg) -> np.ndarray:
        """Per-token advantages of one segment (zeros off the loss mask)."""
        lm, tid = np.asarray(seg.loss_mask, dtype=bool), np.asarray(seg.turn_ids)
        adv = np.zeros(len(lm), dtype=np.float64)
        rw = _turn_rewards(lm, tid, seg.turn_ends, seg.turn_rewards)
        vals = rw if self.mode == "turn" else turn_returns(rw, self.gamma)
        for t, v in vals.items():
            adv[lm & (tid == t)] = (v - self.baseline(seg.episode, t, v)) * self.sign(seg.episode, t)
        return adv

    def sign(self, episode: str, turn: int) -> float:
        """+1, or under the random-sign control (``sign_salt`` set) a fair coin fixed by (salt, episode, turn)."""
        if self.sign_salt is None:
            return 1.0
        h = hashlib.blake2b(f"{self.sign_salt}\0{episode}\0{turn}".encode(), digest_size=1).digest()[0]
        return 1.0 if h & 1 else -1.0

    def truncated_share(self) -> float:
        """The share of the step's (episode, turn) entries whose return-to-go is truncated: their episode was cut
        open for this step (a turn due before it ended), so the rewards of its later turns, trained in a later
        step, are not in it (group modes with gamma > 0; 0 else). Monte-Carlo returns need the episode's end;
        ``gae`` bootstraps a cut segment from the critic instead. (On ``learn-choresn`` it read ~0.1 at η 1 and
        at η 3 alike: docs/results.md, 2026-12-06 16:30.)"""
        if not self.own or self.gamma == 0:
            return 0.0
        return len(self.cut) / len(self.own)

    def grouped_share(self) -> float:
        """The share of the step's (episode, turn) entries centred on their own group (group modes; 0 else)."""
        if not self.own:
            return 0.0
        hit = sum(1 for ep, t in self.own if self.groups.get((episode_group(ep), t), (0, 0))[1] >= 2)
        return hit / len(self.own)


@dataclass(frozen=True)
class LossTerms:
    loss: Tensor  # scalar to backprop (sum over tokens / normaliser)
    policy_loss: Tensor
    value_loss: Tensor
    entropy: Tensor
    clip_frac: Tensor  # share of loss tokens whose ratio was clipped
    is_trunc_frac: Tensor  # share of loss tokens whose importance weight hit the cap (tis)
    is_masked_frac: Tensor = field(default_factory=lambda: torch.zeros(()))  # share dropped by masked IS (mis)
    kl_ref: Tensor = field(default_factory=lambda: torch.zeros(()))  # mean k3 KL(pi || ref) a loss token

    def shares(self) -> dict[str, Tensor]:
        """The per-token shares, to be averaged over micro-batches weighted by their loss tokens."""
        return {"clip_frac": self.clip_frac, "is_trunc_frac": self.is_trunc_frac, "is_masked_frac": self.is_masked_frac}


def raw_is_weights(prox_logp: Tensor, behav_logp: Tensor) -> Tensor:
    """``w = pi_prox / pi_behav`` per token, detached, before any correction (log w clamped to ±20)."""
    return torch.exp((prox_logp.detach() - behav_logp.detach()).clamp(-20.0, 20.0))


def outside_band(raw: Tensor, cfg: TrainerConfig) -> Tensor:
    """Where ``raw`` leaves ``[is_low, is_high]``: the tokens masked IS drops."""
    return (raw < cfg.is_low) | (raw > cfg.is_high)


def is_weights(prox_logp: Tensor, behav_logp: Tensor, cfg: TrainerConfig) -> tuple[Tensor, Tensor, Tensor]:
    """The corrected importance weights of ``w = pi_prox / pi_behav`` under ``cfg.is_correction`` and the
    (truncated, masked) boolean tensors saying where the correction acted."""
    raw = raw_is_weights(prox_logp, behav_logp)
    if cfg.is_correction == "mis":
        masked = outside_band(raw, cfg)
        return torch.where(masked, torch.zeros_like(raw), raw), torch.zeros_like(masked), masked
    if cfg.is_correction == "none":
        none = torch.zeros_like(raw, dtype=torch.bool)
        return torch.ones_like(raw), none, none
    if cfg.is_correction != "tis":
        raise ValueError(f"TrainerConfig.is_correction must be 'tis', 'mis' or 'none', got {cfg.is_correction!r}")
    trunc = raw > cfg.is_cap
    return raw.clamp(max=cfg.is_cap), trunc, torch.zeros_like(trunc)


def accumulate(sums: dict[str, float], terms: LossTerms, *, share: float, epoch: int, epochs: int) -> None:
    """Add one micro-batch's ``terms`` to the step's ``sums``: the losses averaged over the epochs, the token
    shares weighted by the micro-batch's ``share`` of the step's loss tokens, and the clipped share per epoch
    (``clip_frac_e<k>``: with one epoch the ratio is 1 and nothing clips)."""
    for k in ("loss", "policy_loss", "value_loss", "entropy", "kl_ref"):
        sums[k] += float(getattr(terms, k).detach()) / epochs
    for k, v in terms.shares().items():
        sums[k] += float(v.detach()) * share / epochs
    sums[f"clip_frac_e{epoch}"] += float(terms.clip_frac.detach()) * share


def ppo_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    cfg: TrainerConfig,
    *,
    normaliser: float | None = None,
    entropy: Tensor | None = None,
    ref_logp: Tensor | None = None,
) -> LossTerms:
    """Decoupled PPO + value loss over masked tokens (all tensors the same shape).

    ``logp`` and ``values`` carry gradient; the rest are treated as constants. Terms are summed over the
    mask and divided by ``normaliser`` (default: the mask's count), so micro-batches of one step can pass
    the step's total token count and accumulate gradients to the same result as one big batch. With
    ``ref_logp`` (the reference model's log-probs) the loss adds ``cfg.kl_ref_coef`` times the k3 estimate of
    KL(pi || ref) per token, ``exp(ref - logp) - (ref - logp) - 1``, whose gradient pulls ``logp`` towards
    ``ref`` (verl's "low_var_kl" loss; the tokens were sampled from about pi).
    """
    m = mask.to(logp.dtype)
    n = float(m.sum().item()) if normaliser is None else float(normaliser)
    n = max(n, 1.0)
    prox, behav = prox_logp.detach(), behav_logp.detach()
    adv, ret, oldv = advantages.detach(), returns.detach(), old_values.detach()
    ratio = torch.exp((logp - prox).clamp(-20.0, 20.0))
    hi = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    clipped = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + hi)
    w, trunc_at, masked_at = is_weights(prox, behav, cfg)
    surr = torch.minimum(ratio * adv, clipped * adv)
    pg = -(w * surr * m).sum() / n
    if cfg.value_clip is None:
        vl = 0.5 * ((values - ret) ** 2)
    else:
        v_clip = oldv + (values - oldv).clamp(-cfg.value_clip, cfg.value_clip)
        vl = 0.5 * torch.maximum((values - ret) ** 2, (v_clip - ret) ** 2)
    vloss = (vl * m).sum() / n
    ent = (entropy * m).sum() / n if entropy is not None else torch.zeros((), dtype=logp.dtype)
    loss = pg + cfg.value_coef * vloss - cfg.entropy_coef * ent
    kl = torch.zeros((), dtype=logp.dtype)
    if ref_logp is not None:
        d = (ref_logp.detach() - logp).clamp(-20.0, 20.0)
        kl = ((torch.expm1(d) - d) * m).sum() / n
        loss = loss + cfg.kl_ref_coef * kl
    with torch.no_grad():
        cnt = m.sum().clamp(min=1.0)
        was_clipped = ((ratio * adv) != surr) & mask.bool()
        clip_frac = was_clipped.to(m.dtype).sum() / cnt
        trunc = (trunc_at & mask.bool()).to(m.dtype).sum() / cnt
        masked = (masked_at & mask.bool()).to(m.dtype).sum() / cnt
    return LossTerms(loss, pg, vloss, ent, clip_frac, trunc, masked, kl)


def k3_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> float:
    """Schulman's k3 estimate of KL(ref || pi) from samples of ``ref`` (the sampler): mean of
    ``r - 1 - log r`` with ``r = pi / ref``, over masked tokens. Non-negative, unbiased."""
    lr = (logp - ref_logp).double()[mask.bool()]
    if lr.numel() == 0:
        return 0.0
    return float((torch.expm1(lr) - lr).mean())


def ess(log_weights: Tensor, mask: Tensor) -> float:
    """Normalised effective sample size ``(sum w)^2 / (N sum w^2)`` in (0, 1] of importance weights given
    as logs, over masked tokens (1 = all weights equal, i.e. on-policy)."""
    lw = log_weights.double()[mask.bool()]
    if lw.numel() == 0:
        return 1.0
    lw = lw - lw.max()
    w = torch.exp(lw)
    return float(w.sum() ** 2 / (lw.numel() * (w * w).sum()))


def explained_variance(values: Tensor, returns: Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over 1-d tensors: 1 = the critic predicts the returns,
    0 = no better than their mean, < 0 worse. NaN-free: 0.0 when the returns do not vary."""
    v, r = values.double().flatten(), returns.double().flatten()
    if r.numel() < 2:
        return 0.0
    var = float(r.var(unbiased=False))
    if var <= 1e-12:
        return 0.0
    return 1.0 - float((r - v).var(unbiased=False)) / var


@dataclass(frozen=True)
class DlogpSplit:
    """|Δlogp| = |learner logprob - sampler logprob| over loss tokens, split by staleness (design §7).

    ``mismatch`` is the mean over tokens trained at the version that sampled them (staleness 0): the same
    weights on both sides, so what is left is the train/inference mismatch (T1's metric: numerics, kernels,
    routing, token drift). ``policy_shift`` is the mean over stale tokens (staleness >= 1): how far the policy
    moved since it sampled them, plus that mismatch; ``policy_shift_by_staleness`` has one mean per
    staleness. A mean over no tokens is 0.0, and its token count says so.
    """

    mismatch: float
    mismatch_tokens: int
    policy_shift: float
    policy_shift_tokens: int
    policy_shift_by_staleness: dict[int, float]


def dlogp_split(prox_logp: Tensor, behav_logp: Tensor, staleness: Tensor) -> DlogpSplit:
    """Split mean |prox - behav| by per-token staleness (1-d tensors over the loss tokens)."""
    d = (prox_logp.double() - behav_logp.double()).abs().flatten()
    st = staleness.flatten().long()
    if d.shape != st.shape:
        raise ValueError(f"dlogp_split: {tuple(d.shape)} logprobs but {tuple(st.shape)} staleness values")
    fresh, stale = st == 0, st > 0
    by = {int(k): float(d[st == k].mean()) for k in torch.unique(st[stale]).tolist()}
    return DlogpSplit(
        mismatch=float(d[fresh].mean()) if bool(fresh.any()) else 0.0,
        mismatch_tokens=int(fresh.sum()),
        policy_shift=float(d[stale].mean()) if bool(stale.any()) else 0.0,
        policy_shift_tokens=int(stale.sum()),
        policy_shift_by_staleness=by,
    )


def token_logprobs(logits: Tensor, tokens: Tensor, *, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-prob of ``tokens[:, p]`` under ``logits[:, p - 1]`` (and the entropy there if asked), [B, T];
    position 0 is 0 (no logits precede it). Computed in float32 whatever the model dtype."""
    lsm = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    lp = lsm.gather(-1, tokens[:, 1:, None].long()).squeeze(-1)
    pad = torch.zeros(tokens.shape[0], 1, dtype=lp.dtype, device=lp.device)
    lp = torch.cat([pad, lp], dim=1)
    if not with_entropy:
        return lp, None
    ent = -(lsm.exp() * lsm).sum(-1)
    return lp, torch.cat([pad, ent], dim=1)
