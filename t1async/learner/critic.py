"""The critic's warm start (``TrainerConfig.critic_warmup``): the value head, a linear map of the trunk's last
hidden state, fitted by ridge regression to the Monte-Carlo returns of the first steps' rollouts.

T1 warm-starts its critic aggressively to stabilise actor-critic. A fresh head predicts ~0 while the returns of
a warm-started policy average well above it, so GAE's first advantages would be each return against one global
baseline. Least squares gives the head the returns' structure (turn, task, progress) in one solve, before the
policy's first update uses it. The sufficient statistics (``X^T X``, ``X^T y``) are accumulated, so each refit
uses every warm-up step's tokens at the cost of a [d + 1, d + 1] matrix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from t1async.learner import ppo
from t1async.learner.batch import SegmentLike, pack, plan_microbatches
from t1async.log import get_logger
from t1async.model.moe import MoETransformer

log = get_logger("t1async.learner.critic")


class CriticWarmup:
    """Accumulates (hidden state, return) pairs over loss tokens and refits ``model.value_head`` on them."""

    def __init__(self, model: MoETransformer, *, ridge: float = 1e-2) -> None:
        d = int(model.value_head.in_features)
        self.model, self.ridge = model, ridge
        self.xtx = np.zeros((d + 1, d + 1), dtype=np.float64)
        self.xty = np.zeros(d + 1, dtype=np.float64)
        self.yy = self.ysum = 0.0
        self.n = 0
        self.fits = 0

    @torch.no_grad()
    def add(
        self,
        segments: Sequence[SegmentLike],
        *,
        gamma: float,
        discount_per: str,
        replay: bool,
        microbatch_tokens: int,
    ) -> int:
        """Forward ``segments`` (no gradient) and add their loss tokens' (state, return) pairs; the return is
        the discounted reward-to-go (lambda 1), a cut segment bootstrapping from the head's value at its end.
        Returns the number of tokens added."""
        m, dev = self.model, next(self.model.parameters()).device
        cfg = m.cfg
        was = m.training
        m.eval()
        added = 0
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
                    y = ret[pos]
                    self.xtx += x.T @ x
                    self.xty += x.T @ y
                    self.yy += float(y @ y)
                    self.ysum += float(y.sum())
                    self.n += len(pos)
                    added += len(pos)
        finally:
            m.train(was)
        return added

    @torch.no_grad()
    def fit(self) -> float:
        """Solve the ridge regression on everything added and write the head. Returns the fit's explained
        variance on those tokens (in-sample)."""
        if self.n == 0:
            return 0.0
        d = self.xtx.shape[0] - 1
        reg = self.ridge * max(1.0, float(np.trace(self.xtx[:d, :d])) / max(d, 1)) * np.eye(d + 1)
        reg[d, d] = 0.0  # the bias is not shrunk
        w = np.linalg.solve(self.xtx + reg, self.xty)
        head = self.model.value_head
        head.weight.copy_(torch.from_numpy(w[:d]).to(head.weight)[None])
        head.bias.copy_(torch.tensor([w[d]]).to(head.bias))
        # in-sample EV from the sufficient statistics: SSE = y'y - 2 w'X'y + w'X'Xw
        sse = self.yy - 2.0 * float(w @ self.xty) + float(w @ self.xtx @ w)
        sst = self.yy - self.ysum**2 / self.n
        self.fits += 1
        ev = 1.0 - sse / sst if sst > 1e-12 else 0.0
        log.info("critic.warmup_fit", fit=self.fits, tokens=self.n, explained_variance=round(ev, 4))
        return ev

    def step(self, segments: Sequence[SegmentLike], cfg) -> float | None:  # noqa: ANN001 - a TrainerConfig
        """One warm-up step: add ``segments`` and refit (before the step scores them with the head). Returns the
        fit's explained variance; None (and nothing done) on a sharded learner, where one rank's forward is not
        the model's."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            log.warning("critic.warmup_skipped", reason="the critic warm-up runs on a one-rank learner only")
            return None
        self.add(
            segments,
            gamma=cfg.gamma,
            discount_per=cfg.discount_per,
            replay=cfg.replay,
            microbatch_tokens=cfg.microbatch_tokens,
        )
        return self.fit()
