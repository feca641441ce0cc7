"""The critic's warm start (``TrainerConfig.critic_warmup``): the value head, a linear map of the trunk's last
hidden state, fitted by ridge regression to the Monte-Carlo returns of the first steps' rollouts.

T1 warm-starts its critic aggressively to stabilise actor-critic. A fresh head predicts ~0 while the returns of
a warm-started policy average well above it, so GAE's first advantages would be each return against one global
baseline. Least squares gives the head the returns' structure (turn, task, progress) in one solve, before the
policy's first update uses it. The sufficient statistics (``X^T X``, ``X^T y``) are accumulated, so each refit
uses every warm-up step's tokens at the cost of a [d + 1, d + 1] matrix.

The head a step scores its rollouts with is fitted on the *earlier* steps only: ``step`` (before the step's
advantages) measures the head as it is on the step's tokens and keeps their statistics aside, and ``refit``
(after the step) adds them and solves, for the next step. Fitting on the step's own returns before scoring them
(as this module did first) gives each token a baseline that has seen its own return: advantages shrunk towards
0 and an explained variance that is in-sample. ``step``'s value, ``StepMetrics.critic_ev_heldout``, is the
explained variance of the returns of rollouts the head has not been fitted on: step 0's is a fresh head's, the
next ones' are what the warm start is worth (the issue's target: > 0.3 at the end of the warm-up).

One rank only: under FSDP (``learner/distributed.py``) the warm-up's forward and the head's write would be
collectives every rank must run together, which the N-rank step does not do yet; there it is skipped, logged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from t1async.learner import ppo
from t1async.learner.batch import SegmentLike, pack, plan_microbatches
from t1async.log import get_logger
from t1async.model.moe import MoETransformer

log = get_logger("t1async.learner.critic")


@dataclass
class Moments:
    """The sufficient statistics of a least-squares fit of returns ``y`` on states ``x`` (bias column last)."""

    xtx: np.ndarray
    xty: np.ndarray
    yy: float = 0.0
    ysum: float = 0.0
    n: int = 0

    @classmethod
    def zeros(cls, d: int) -> Moments:
        return cls(np.zeros((d + 1, d + 1)), np.zeros(d + 1))

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        self.xtx += x.T @ x
        self.xty += x.T @ y
        self.yy += float(y @ y)
        self.ysum += float(y.sum())
        self.n += len(y)

    def merge(self, other: Moments) -> None:
        self.xtx += other.xtx
        self.xty += other.xty
        self.yy += other.yy
        self.ysum += other.ysum
        self.n += other.n

    def ev(self, w: np.ndarray) -> float:
        """Explained variance ``1 - Var(y - x w) / Var(y)`` (``ppo.explained_variance``'s) from the statistics:
        the residuals' sum of squares is y'y - 2 w'X'y + w'X'Xw and their sum ysum - w'X'1 (X'1: the bias
        column of X'X)."""
        if self.n == 0:
            return 0.0
        sse = self.yy - 2.0 * float(w @ self.xty) + float(w @ self.xtx @ w)
        res_mean = (self.ysum - float(w @ self.xtx[:, -1])) / self.n
        var_res = sse / self.n - res_mean**2
        var_y = self.yy / self.n - (self.ysum / self.n) ** 2
        return 1.0 - var_res / var_y if var_y > 1e-12 else 0.0


class CriticWarmup:
    """Accumulates (hidden state, return) pairs over loss tokens and refits ``model.value_head`` on them."""

    def __init__(self, model: MoETransformer, *, ridge: float = 1e-2) -> None:
        d = int(model.value_head.in_features)
        self.model, self.ridge = model, ridge
        self.seen = Moments.zeros(d)  # every step's statistics the head has been fitted on
        self.pending: Moments | None = None  # the current step's, added by ``refit`` after the step
        self.fits = 0

    @torch.no_grad()
    def moments(
        self,
        segments: Sequence[SegmentLike],
        *,
        gamma: float,
        discount_per: str,
        replay: bool,
        microbatch_tokens: int,
    ) -> Moments:
        """Forward ``segments`` (no gradient): the statistics of their loss tokens' (state, return) pairs; the
        return is the discounted reward-to-go (lambda 1), a cut segment bootstrapping from the head's value at
        its end."""
        m, dev = self.model, next(self.model.parameters()).device
        cfg = m.cfg
        was = m.training
        m.eval()
        mom = Moments.zeros(int(m.value_head.in_features))
        try:
            for g in plan_microbatches([len(s.tokens) for s in segments], microbatch_tokens):
                b = pack(segments, g, n_layers=cfg.n_layers, top_k=cfg.top_k, device=dev)
                rp = b.recorded if (replay and b.recorded is not None) else None
                out = m(b.tokens, replay=rp, logits=False)
                hid = out.hidden.double().cpu().numpy()
                vals = out.values.double().cpu().numpy()
                for row, i in enumerate(g):
                    s = segments[i]
                    n = len(s.tokens)
                    values = np.zeros(n + 1)
                    values[n] = vals[row, n - 1]  # the bootstrap of a cut (unused when done)
                    _, ret = ppo.segment_advantages(
                        s.loss_mask,
                        values,
                        s.turn_ends,
                        s.turn_rewards,
                        bool(s.done),
                        gamma=gamma,
                        lam=1.0,
                        discount_per=discount_per,
                    )
                    pos = np.flatnonzero(np.asarray(s.loss_mask, dtype=bool))
                    x = np.concatenate([hid[row, pos - 1], np.ones((len(pos), 1))], axis=1)
                    mom.add(x, ret[pos])
        finally:
            m.train(was)
        return mom

    def head_weights(self) -> np.ndarray:
        """The value head as the fit's ``w`` (weights, then the bias)."""
        head = self.model.value_head
        return np.concatenate(
            [head.weight.detach().double().cpu().numpy()[0], head.bias.detach().double().cpu().numpy()]
        )

    @torch.no_grad()
    def fit(self) -> float:
        """Solve the ridge regression on everything seen and write the head. Returns the fit's explained
        variance on those tokens (in-sample)."""
        mom = self.seen
        if mom.n == 0:
            return 0.0
        d = mom.xtx.shape[0] - 1
        reg = self.ridge * max(1.0, float(np.trace(mom.xtx[:d, :d])) / max(d, 1)) * np.eye(d + 1)
        reg[d, d] = 0.0  # the bias is not shrunk
        w = np.linalg.solve(mom.xtx + reg, mom.xty)
        head = self.model.value_head
        head.weight.copy_(torch.from_numpy(w[:d]).to(head.weight)[None])
        head.bias.copy_(torch.tensor([w[d]]).to(head.bias))
        self.fits += 1
        ev = mom.ev(w)
        log.info("critic.warmup_fit", fit=self.fits, tokens=mom.n, explained_variance_in_sample=round(ev, 4))
        return ev

    def step(self, segments: Sequence[SegmentLike], cfg) -> float | None:  # noqa: ANN001 - a TrainerConfig
        """A warm-up step, before the step scores ``segments``: the held-out explained variance of their returns
        by the head as it is (fitted on earlier steps only); their statistics wait for ``refit``. None (and
        nothing done) on a sharded learner, where one rank's forward is not the model's."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            log.warning("critic.warmup_skipped", reason="the critic warm-up runs on a one-rank learner only")
            return None
        self.pending = self.moments(
            segments,
            gamma=cfg.gamma,
            discount_per=cfg.discount_per,
            replay=cfg.replay,
            microbatch_tokens=cfg.microbatch_tokens,
        )
        ev = self.pending.ev(self.head_weights())
        log.info("critic.warmup_heldout", fits=self.fits, tokens=self.pending.n, explained_variance=round(ev, 4))
        return ev

    def refit(self) -> float | None:
        """After the step: add its statistics (``step``'s) and refit the head for the next step. The fit's
        in-sample explained variance; None when ``step`` kept nothing."""
        if self.pending is None:
            return None
        self.seen.merge(self.pending)
        self.pending = None
        return self.fit()
