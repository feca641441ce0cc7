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

At N ranks (``learner/distributed.py``) every rank runs ``step`` together on its own part of the step's segments
(FSDP gathers the weights inside each forward, so every rank runs as many forwards: ``n_micro``, a short rank
padding with 2-token ones) and the ranks sum the moments (``reduce``, an all_reduce): every rank then holds the
moments of all the step's tokens, scores the same held-out explained variance and, in ``refit``, solves the same
fit and writes it into its own rows of the sharded head (FSDP2's DTensor, ``weights.local_rows``). The moments
are sums, so any split of the segments gives one rank's figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from t1async.learner import ppo
from t1async.learner.batch import SegmentLike, pack, plan_microbatches
from t1async.log import get_logger
from t1async.model.moe import MoETransformer
from t1async.model.weights import local_rows

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

    def flat(self) -> np.ndarray:
        """Every statistic in one float64 vector (for a sum over ranks); ``of_flat`` reads it back."""
        return np.concatenate([self.xtx.ravel(), self.xty, [self.yy, self.ysum, float(self.n)]])

    @classmethod
    def of_flat(cls, v: np.ndarray, d: int) -> Moments:
        k = d + 1
        return cls(v[: k * k].reshape(k, k).copy(), v[k * k : k * k + k].copy(), float(v[-3]), float(v[-2]), int(v[-1]))

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
        n_micro: int = 0,
    ) -> Moments:
        """Forward ``segments`` (no gradient): the statistics of their loss tokens' (state, return) pairs; the
        return is the discounted reward-to-go (lambda 1), a cut segment bootstrapping from the head's value at
        its end. ``n_micro``: forwards to run in all (a sharded model's ranks must run as many), the ones
        past ``segments``' micro-batches on 2 padding tokens."""
        m, dev = self.model, next(self.model.parameters()).device
        cfg = m.cfg
        was = m.training
        m.eval()
        mom = Moments.zeros(int(m.value_head.in_features))
        groups = plan_microbatches([len(s.tokens) for s in segments], microbatch_tokens) if segments else []
        try:
            for _ in range(n_micro - len(groups)):  # FSDP: the other ranks' forwards gather weights with ours
                m(torch.zeros(1, 2, dtype=torch.long, device=dev), logits=False)
            for g in groups:
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
            if isinstance(m, FSDPModule):  # the root's weights stay gathered after a forward: back to shards
                m.reshard()
        return mom

    def head_weights(self) -> np.ndarray:
        """The value head as the fit's ``w`` (weights, then the bias). Sharded (FSDP2): gathered, every rank
        together."""

        def full(p: torch.Tensor) -> np.ndarray:
            t = p.detach()
            if isinstance(t, DTensor):
                t = t.full_tensor()
            return t.double().cpu().numpy().reshape(-1)

        head = self.model.value_head
        return np.concatenate([full(head.weight), full(head.bias)])

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
        for p, value in ((head.weight, w[:d][None]), (head.bias, w[d:])):
            local, lo = local_rows(p)  # sharded: this rank's rows (every rank writes its own, from the same fit)
            local.copy_(torch.from_numpy(value[lo : lo + local.shape[0]]).to(local))
        self.fits += 1
        ev = mom.ev(w)
        log.info("critic.warmup_fit", fit=self.fits, tokens=mom.n, explained_variance_in_sample=round(ev, 4))
        return ev

    def step(
        self,
        segments: Sequence[SegmentLike],
        cfg,  # noqa: ANN001 - a TrainerConfig
        *,
        n_micro: int = 0,
        reduce: Callable[[Moments | None], Moments | None] | None = None,
    ) -> float:
        """A warm-up step, before the step scores ``segments``: the held-out explained variance of their returns
        by the head as it is (fitted on earlier steps only); their statistics wait for ``refit``. At N ranks
        every rank calls this on its part of the step, with ``n_micro`` (``moments``) and ``reduce``: the sum
        of every rank's moments, called with None when this rank raised, so the others learn of it and raise
        too instead of waiting (an error inside a forward still leaves them in FSDP's gather)."""
        self.pending = None
        mom: Moments | None = None
        try:
            mom = self.moments(
                segments,
                gamma=cfg.gamma,
                discount_per=cfg.discount_per,
                replay=cfg.replay,
                microbatch_tokens=cfg.microbatch_tokens,
                n_micro=n_micro,
            )
        finally:
            if reduce is not None:
                mom = reduce(mom)
        assert mom is not None
        self.pending = mom
        ev = mom.ev(self.head_weights())
        log.info("critic.warmup_heldout", fits=self.fits, tokens=mom.n, explained_variance=round(ev, 4))
        return ev

    def refit(self) -> float | None:
        """After the step: add its statistics (``step``'s) and refit the head for the next step. The fit's
        in-sample explained variance; None when ``step`` kept nothing."""
        if self.pending is None:
            return None
        self.seen.merge(self.pending)
        self.pending = None
        return self.fit()
