"""One actor-critic PPO training step over TITO segments, with R3 routing replay.

    trainer = Trainer(model, TrainerConfig(replay=True))
    metrics = trainer.step(segments, policy_version=v, drift={"clean": 9, "realign": 1, "fork": 0})

A step: pack segments into micro-batches; score them with the current weights (no gradient) to get the
proximal log-probs and the values; compute GAE advantages per segment (ppo.segment_advantages) and
normalise them over the step's loss tokens; then, for each PPO epoch, accumulate the decoupled PPO + value
loss over the micro-batches and take one AdamW step with gradient clipping. When the whole step is one
micro-batch and one epoch, the scoring forward is the training forward (no second pass).

The forward replays the recorded routing (R3) when ``config.replay`` is on; either way the metrics compare
the learner's own top-k with the recorded experts (routing drift) and its log-probs with the sampler's
(mean |Δlogp|, k3 KL, ESS of the importance weights).

The same ``step`` trains over any number of ranks. Where the ranks meet is a hook, a no-op here (one rank):
``_scatter`` (this rank's part of the step's segments), ``_pad`` (zero-weight micro-batches, so every rank
runs as many forward/backward passes), ``_adv_moments`` (the advantage moments over every rank's loss
tokens), ``_reduce_grads`` (before each optimizer step; the gradients themselves are FSDP's reduce-scatter),
``_gather`` (the metric parts to rank 0) and ``_step_raised``. learner.distributed.DistributedTrainer meets
over torch.distributed, its model sharded by FSDP2.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from t1async.learner import ppo
from t1async.learner.batch import Batch, BatchError, SegmentLike, check_segment, pack, plan_microbatches, routing_drift
from t1async.learner.checkpoint import CheckpointInfo, latest_checkpoint, load_checkpoint, save_checkpoint
from t1async.learner.critic import CriticWarmup
from t1async.learner.prefixkv import KV, PrefixKV, cut_point, head
from t1async.learner.stepmetrics import StepMetrics, step_algorithm_metrics, step_metrics
from t1async.learner.trainer_config import TrainDtype, TrainerConfig
from t1async.log import get_logger
from t1async.model.moe import MoETransformer
from t1async.model.tokenizer import ChatTokenizer
from t1async.model.weights import load_pretrained, load_weights_into
from t1async.protocol.errors import ConfigError
from t1async.protocol.sampling import common_prefix_len

log = get_logger("t1async.learner.trainer")


@dataclass
class Scored:
    """A batch after the scoring pass: what ``Trainer._update`` (and ``DistributedTrainer``'s) consumes."""

    batch: Batch
    prox_logp: Tensor  # detached [B, T]
    old_values: Tensor  # detached [B, T], value of the state each token was chosen in
    adv: Tensor  # [B, T] advantages (normalised in place when configured)
    ret: Tensor  # [B, T] returns
    out_logp: Tensor | None = None  # with grad (single-pass mode)
    out_values: Tensor | None = None
    out_entropy: Tensor | None = None
    ref_logp: Tensor | None = None  # detached [B, T], the reference model's (--kl-ref-coef)


class Trainer:
    """Owns the model's optimizer and takes PPO steps on it. The model stays the caller's."""

    def __init__(self, model: MoETransformer, config: TrainerConfig | None = None) -> None:
        self.model = model
        self.config = config = config or TrainerConfig()
        self.mcfg = model.cfg
        # fused AdamW (one kernel over all the parameters) where torch has it; on CPU too, where it is several
        # times faster than foreach (python -m bench.moe_grouped --adamw, docs/results.md)
        fused = next(model.parameters()).device.type in ("cuda", "cpu")
        self.optimizer = torch.optim.AdamW(
            self._param_groups(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay, fused=fused
        )
        self.steps = 0
        self.device = next(model.parameters()).device
        self._baseline: ppo.StepBaseline | None = None  # advantage turn/grpo/rloo: the step's baseline (ppo.py)
        self._warmup = CriticWarmup(model) if config.critic_warmup else None  # value head fit (learner/critic.py)
        self.rank, self.world = 0, 1  # learner.distributed.DistributedTrainer: this rank of ``world``
        self._failed: BaseException | None = None  # this rank's own error in the step now running
        self._t_wait = 0.0  # seconds of this step spent waiting for the other ranks (the gradient meeting)
        self.rank_busy_s: list[float] = []  # each rank's compute seconds in the last step (rank 0)
        self.grad_bytes = 0  # this rank's gradient bytes at the last optimizer step (its shards under FSDP)
        self.prefix = (  # an open episode's kept keys/values (learner.prefixkv); None: re-forward everything
            PrefixKV(max_age=config.prefix_kv_max_age, budget_tokens=config.prefix_kv_tokens)
            if config.prefix_kv == "reuse"
            else None
        )
        self._primes = 0  # this step's priming forwards (``_take_prefixes``)
        # open episode -> (segment index, its tokens): what an earlier step forwarded of its latest segment (metrics)
        self._covered: dict[str, tuple[int, np.ndarray]] = {}
        self.ref: MoETransformer | None = None  # --kl-ref-coef: the frozen initial weights (set_reference)

    def set_reference(self, model: MoETransformer) -> None:
        """The frozen model the KL penalty (``kl_ref_coef``) anchors the policy to: RL's initial weights, kept
        apart from the checkpoints (a resume builds it again from the same model dir)."""
        if self.config.kl_ref_coef <= 0:
            raise ConfigError("Trainer.set_reference: kl_ref_coef is 0, so no step would read the reference")
        self._check_reference(model, "Trainer.set_reference: the reference model")
        model.requires_grad_(False)
        self.ref = model.to(self.device).train(self.model.training)

    def _check_reference(self, model: MoETransformer, what: str) -> None:
        """ConfigError naming ``what`` unless ``model``'s weights have the policy's names and shapes (global ones
        under FSDP)."""
        mine = {n: tuple(p.shape) for n, p in self.model.state_dict().items()}
        if {n: tuple(p.shape) for n, p in model.state_dict().items()} != mine:
            raise ConfigError(f"{what} differs from the policy in its weights' names or shapes")

    def load_reference(self, model_dir: str | Path) -> None:
        """``set_reference`` with the weights of ``model_dir`` (the learner's ``--model``); the N-rank learner
        reads each rank's shards instead (``DistributedTrainer.load_reference``)."""
        self.set_reference(load_pretrained(model_dir))

    def _param_groups(self) -> list[dict[str, Any]]:
        """One group (the policy and the value head at ``lr``), or two when ``value_lr`` is set: the trunk and
        LM head, then the value head at its own rate."""
        if self.config.value_lr is None:
            return [{"params": list(self.model.parameters())}]
        head = {id(p) for p in self.model.value_head.parameters()}
        return [
            {"params": [p for p in self.model.parameters() if id(p) not in head]},
            {"params": list(self.model.value_head.parameters()), "lr": self.config.value_lr},
        ]

    # ----------------------------------------------------------------------------------------- forward

    def _autocast(self) -> torch.autocast:
        """--train-dtype bfloat16: bf16 autocast over the fp32 weights (the master copy AdamW updates)."""
        bf16 = self.config.train_dtype == TrainDtype.BFLOAT16
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16)

    def _forward(self, b: Batch, *, replay: bool, with_entropy: bool, want_kv: bool = False):
        rp = b.recorded if (replay and b.recorded is not None) else None
        with self._autocast():
            # no [B, T, V] logits: the head runs in checkpointed chunks (moe.MoETransformer.token_logprobs)
            out = self.model(
                b.tokens,
                replay=rp,
                logits=False,
                checkpoint_blocks=self.config.checkpoint_blocks,
                past=b.past,
                want_kv=want_kv,
            )
            logp, ent = self.model.token_logprobs(out.hidden, b.tokens, with_entropy=with_entropy)
            v = out.values.float()
            if self.config.critic == "detached":  # same values; the value loss reaches the head only
                v = self.model.value_head(out.hidden.detach()).squeeze(-1).float()
        # value of the state token p was chosen in = value head at p - 1
        vals = torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)
        return out, logp, vals, ent

    @torch.no_grad()
    def _ref_logp(self, b: Batch) -> Tensor:
        """The reference model's log-probs of the batch's tokens, with the same routing replay and dtype as the
        policy's forward (so at step 0 they equal the proximal log-probs)."""
        if self.ref is None or b.past is not None:  # TrainerConfig refuses --kl-ref-coef with --prefix-kv reuse
            raise RuntimeError("Trainer._ref_logp: no reference model, or a batch with kept keys and values")
        rp = b.recorded if (self.config.replay and b.recorded is not None) else None
        with self._autocast():
            out = self.ref(b.tokens, replay=rp, logits=False)
            return self.ref.token_logprobs(out.hidden, b.tokens)[0].detach()

    def _advantages(self, batch: Batch, segs: Sequence[SegmentLike], value_head: Tensor) -> tuple[Tensor, Tensor]:
        """(advantages, returns) [B, T] of ``batch``'s rows."""
        cfg = self.config
        b, t = batch.shape
        adv = np.zeros((b, t), dtype=np.float32)
        ret = np.zeros((b, t), dtype=np.float32)
        vh = value_head.detach().double().cpu().numpy()
        for row, i in enumerate(batch.index):
            s = segs[i]
            n = len(s.tokens)
            values = np.concatenate([[0.0], vh[row, :n]])  # values[p] = head at p - 1; values[n] = bootstrap
            a, r = ppo.segment_advantages(
                s.loss_mask,
                values,
                s.turn_ends,
                s.turn_rewards,
                bool(s.done),
                gamma=cfg.gamma,
                lam=cfg.lam,
                discount_per=cfg.discount_per,
            )
            if self._baseline is not None:
                a = self._baseline.advantages(s)
            adv[row, :n], ret[row, :n] = a, r
        return torch.from_numpy(adv).to(self.device), torch.from_numpy(ret).to(self.device)

    # -------------------------------------------------------------------------------------------- step

    def step(
        self, segments: Sequence[SegmentLike], policy_version: int, *, drift: Mapping[str, int] | None = None
    ) -> StepMetrics:
        t0 = time.perf_counter()
        self._check(segments)
        # advantage turn/grpo/rloo: one baseline from the whole step, so every rank centres its turns alike
        cfg = self.config
        salt = f"step{self.steps}" if cfg.advantage_signs == "random" else None  # the random-sign control
        self._baseline = (
            None if cfg.advantage == "gae" else ppo.StepBaseline.of(cfg.advantage, segments, cfg.gamma, sign_salt=salt)
        )
        # the critic warm-up (learner/critic.py): the head scores this step as fitted on the earlier ones; its
        # held-out EV on this step's returns now, the refit on them after the step, for the next
        warm = self._warmup if self._warmup and self.steps < cfg.critic_warmup else None
        heldout_ev = self._warmup_heldout(segments) if warm else None
        local = self._scatter(segments, policy_version)
        try:
            metrics = self._train(local, policy_version, drift, all_segments=segments, t0=t0)
        except Exception as exc:
            self._step_raised(exc)
            raise
        assert metrics is not None  # rank 0's
        fit_ev = self._warmup_refit() if warm else None
        metrics = step_algorithm_metrics(metrics, self._baseline, fit_ev, heldout_ev)
        log.info(
            "trainer.step",
            step=metrics.step,
            policy_version=policy_version,
            segments=metrics.segments,
            loss_tokens=metrics.loss_tokens,
            loss=round(metrics.loss, 5),
            dlogp=round(metrics.mean_abs_dlogp, 5),
            mismatch=round(metrics.mismatch, 5),
            policy_shift=round(metrics.policy_shift, 5),
            routing_drift=round(metrics.routing_drift, 4),
            max_staleness=metrics.max_staleness,
            t_step_s=round(metrics.t_step_s, 3),
        )
        return metrics

    def _warmup_heldout(self, segments: Sequence[SegmentLike]) -> float | None:
        """The critic warm-up before the step (``CriticWarmup.step``; at N ranks every rank's part together)."""
        assert self._warmup is not None
        return self._warmup.step(segments, self.config)

    def _warmup_refit(self) -> float | None:
        """The critic warm-up after the step (``CriticWarmup.refit``; at N ranks on every rank)."""
        assert self._warmup is not None
        return self._warmup.refit()

    def _check(self, segments: Sequence[SegmentLike]) -> None:
        m = self.mcfg
        if not segments:
            raise BatchError("Trainer.step needs at least one segment")
        for s in segments:
            check_segment(s, n_layers=m.n_layers, top_k=m.top_k, vocab_size=m.vocab_size, n_experts=m.n_experts)

    def _train(
        self,
        local: Sequence[SegmentLike],
        policy_version: int,
        drift: Mapping[str, int] | None,
        *,
        all_segments: Sequence[SegmentLike],
        t0: float,
    ) -> StepMetrics | None:
        """This rank's part of a step (``local``, of ``all_segments``): 1. score, 2. PPO epochs, 3. metrics.
        The metrics are rank 0's (None on the other ranks)."""
        self._failed, self._t_wait = None, 0.0
        scored: list[Scored] = []
        routing, t_fwd_scoring = (0, 0, 0, 0), 0.0
        cost: dict[str, float] = {}
        new_tokens = self._new_tokens(all_segments) if self.rank == 0 else 0.0  # rank 0's all_segments: the step's
        fwd: list[SegmentLike] = []
        batches: list[Batch] = []
        single = False
        try:
            fwd, pasts, cost = self._take_prefixes(local, policy_version)
            batches = self._pack(fwd, pasts) if fwd else []
        except Exception as exc:  # noqa: BLE001 - raised at the next meeting (_adv_moments), on every rank
            self._failed, fwd, batches = exc, [], []
        try:
            batches = self._pad(batches)  # the ranks agree on the count here: a rank that failed above joins too
            single = self._one_pass(batches)
            scored, routing, t_fwd_scoring = self._score(batches, fwd, single=single, policy_version=policy_version)
        except Exception as exc:  # noqa: BLE001 - raised at the next meeting (_adv_moments), on every rank
            self._failed = self._failed or exc
            scored = []
        if self._failed is not None:
            scored = []
            if self.prefix is not None:
                self.prefix.forget([s.episode for s in local])
        n_loss, adv_mean, adv_std = self._normalise_advantages(scored, len(all_segments))
        sums, grad_norm, t_fwd_ppo, t_update = self._update(scored, n_loss)  # 2. PPO epochs
        for k, v in cost.items():
            sums[k] += v
        sums["new_tokens"] += new_tokens
        for sc in scored:  # the scoring forward's positions (the PPO epochs' own were counted by _update)
            n = float(sc.batch.lengths.sum()) if sc.batch.index else 0.0
            sums["fwd_tokens"] += n
            sums["bwd_tokens"] += n if single else 0.0
        toks = self._loss_token_tensors(scored) if scored else {}
        gathered = self._gather((toks, dict(sums), routing, t_fwd_scoring + t_update - self._t_wait))
        if gathered is None:
            return None
        all_sums: defaultdict[str, float] = defaultdict(float)
        all_routing = [0, 0, 0, 0]
        self.rank_busy_s = [busy for *_, busy in gathered]
        for _, part_sums, r, _ in gathered:
            for k, v in part_sums.items():  # an age is the oldest over the ranks, the rest add up
                all_sums[k] = max(all_sums[k], v) if k == "prefix_age" else all_sums[k] + v
            all_routing = [a + b for a, b in zip(all_routing, r)]
        all_toks = {k: torch.cat([g[0][k] for g in gathered if g[0]]) for k in next(g[0] for g in gathered if g[0])}
        return self._metrics(  # 3. metrics over loss tokens
            all_segments,
            all_toks,
            policy_version,
            drift,
            sums=all_sums,
            grad_norm=grad_norm,
            routing=(all_routing[0], all_routing[1], all_routing[2], all_routing[3]),
            n_loss=n_loss,
            adv_mean=adv_mean,
            adv_std=adv_std,
            t0=t0,
            t_fwd=t_fwd_scoring + t_fwd_ppo,
            t_backward=max(t_update - t_fwd_ppo, 0.0),
        )

    def _pack(self, segments: Sequence[SegmentLike], pasts: Sequence[KV | None] = ()) -> list[Batch]:
        """Pack checked segments into micro-batches of at most ``microbatch_tokens``; a segment forwarded after
        kept keys/values (``pasts[i]``) is a micro-batch of its own."""
        m = self.mcfg
        pasts = list(pasts) or [None] * len(segments)
        plain = [i for i, p in enumerate(pasts) if p is None]
        groups = [
            [plain[j] for j in g]
            for g in plan_microbatches([len(segments[i].tokens) for i in plain], self.config.microbatch_tokens)
        ]
        out = [pack(segments, g, n_layers=m.n_layers, top_k=m.top_k, device=self.device) for g in groups]
        for i, p in enumerate(pasts):
            if p is not None:
                b = pack(segments, [i], n_layers=m.n_layers, top_k=m.top_k, device=self.device)
                out.append(replace(b, past=p))
        return out

    def _new_tokens(self, segments: Sequence[SegmentLike]) -> float:
        """The step's positions that no earlier step forwarded (in this context: a fork's are new), counted over
        all of the step's segments by the rank that sees them all (an episode may change rank)."""
        new = 0.0
        for s in segments:
            seen = self._covered.get(s.episode)
            new += len(s.tokens) - (0 if seen is None else common_prefix_len(seen[1], s.tokens))
        for s in segments:  # the latest segment wins, not the longest: a compaction's fork is shorter than before
            if s.done:
                self._covered.pop(s.episode, None)
            elif s.episode not in self._covered or s.index >= self._covered[s.episode][0]:
                self._covered[s.episode] = (s.index, np.asarray(s.tokens))
        if len(self._covered) > 100_000:  # episodes abandoned without an end: forget the oldest
            for ep in list(self._covered)[:50_000]:
                del self._covered[ep]
        return new

    def _take_prefixes(
        self, segments: Sequence[SegmentLike], policy_version: int
    ) -> tuple[list[SegmentLike], list[KV | None], dict[str, float]]:
        """What to forward for each segment (all of it, or its Suffix after kept keys/values) and the step's
        cost counters: ``prefix_reused``, ``prefix_age``, ``prefix_primed`` and its ``fwd_tokens``."""
        cost = {"prefix_reused": 0.0, "prefix_age": 0.0, "prefix_primed": 0.0, "fwd_tokens": 0.0}
        if self.prefix is None:
            return list(segments), [None] * len(segments), cost
        # Two parts of one episode in a step (a route fork closed a segment, and the next cut of the episode came
        # with it): each takes the same kept positions and forwards what follows them, so the closed part's new
        # positions are forwarded twice, not the whole context; PrefixKV.keep keeps the longer (this was the
        # exact path, and made 9 steps in 10 of a default run re-forward a whole context, docs/results.md).
        found = [self.prefix.take(s, policy_version) for s in segments]
        # the cuts to prime (nothing kept, a long context: one per episode) are chosen before any forward, so that
        # the ranks agree on how many priming forwards they run before the first (DistributedTrainer._agree_primes)
        prime: dict[str, int] = {}
        for i, (s, f) in enumerate(zip(segments, found, strict=True)):
            if f.past is None and s.episode not in prime and self._prime_len(s):
                prime[s.episode] = i
        self._primes = len(prime)
        self._agree_primes()
        for i in prime.values():
            primed = self._prime(segments[i], policy_version)
            cost["prefix_primed"] += primed
            cost["fwd_tokens"] += primed
        if prime:  # what the primed cuts, and the other parts of their episodes, now find kept
            found = [f if f.past is not None else self.prefix.take(s, policy_version) for s, f in zip(segments, found)]
        for f in found:
            if f.past is not None:
                cost["prefix_reused"] += f.past[0][0].shape[2]
                cost["prefix_age"] = max(cost["prefix_age"], f.age)
        return [f.segment for f in found], [f.past for f in found], cost

    def _prime(self, s: SegmentLike, policy_version: int) -> int:
        """A cut with nothing kept (learner.prefixkv "primed"): forward its positions before the first trained
        one without gradient, at the current weights and with the recorded routing replayed as the step's own
        forward would, and keep their keys and values. Returns how many (0: none, the prefix is shorter than
        ``prefix_kv_prime_tokens``, or shorter than the rest, or max age 0 asks for the exact step). Only a prefix
        at least as long as what follows it is primed: attention after kept keys runs torch's math kernel, which
        holds the [heads, rest, all] scores (a 32k-token first cut primed its 300-token prompt and peaked at 3.3 GB
        against 1.4 GB forwarded whole, where the causal flash kernel runs), and priming a short prefix saves little."""
        cfg, prefix = self.config, self.prefix
        n = self._prime_len(s)
        if prefix is None or not n:
            return 0
        h = head(s, n)
        b = pack([h], [0], n_layers=self.mcfg.n_layers, top_k=self.mcfg.top_k, device=self.device)
        with torch.no_grad(), self._autocast():
            out = self.model(
                b.tokens, replay=b.recorded if cfg.replay else None, logits=False, checkpoint_blocks=False, want_kv=True
            )
        assert out.kv is not None
        prefix.keep(h, None, out.kv, policy_version)
        return n

    def _prime_len(self, s: SegmentLike) -> int:
        """How many of ``s``'s positions ``_prime`` would forward: its cut point, or 0 (not primed)."""
        cfg, n = self.config, cut_point(s)
        if (
            self.prefix is None
            or cfg.prefix_kv_max_age == 0
            or not cfg.prefix_kv_prime_tokens
            or n < cfg.prefix_kv_prime_tokens
            or n < len(s.tokens) - n
        ):
            return 0
        return n

    # ------------------------------------------------------------------- where the ranks meet (no-ops at 1)

    def _agree_primes(self) -> None:
        """Before this step's priming forwards (``_primes`` of them): every rank runs as many. None on one rank."""

    def _scatter(self, segments: Sequence[SegmentLike], policy_version: int) -> Sequence[SegmentLike]:
        """The segments this rank trains: all of them on one rank."""
        return segments

    def _pad(self, batches: list[Batch]) -> list[Batch]:
        """This rank's micro-batches, plus zero-weight ones so that every rank runs as many: none on one rank."""
        return batches

    def _reduce_grads(self) -> None:
        """Before each optimizer step (the gradients are summed by FSDP's reduce-scatter): nothing on one rank."""

    def _gather(self, part: tuple[Any, ...]) -> list[tuple[Any, ...]] | None:
        """Every rank's metric part (loss-token tensors, loss sums, routing counts, busy seconds), on rank 0."""
        return [part]

    def _step_raised(self, exc: Exception) -> None:
        """A step raised on this rank (after ``_scatter``): nothing to do on one rank."""

    def _one_pass(self, batches: Sequence[Batch]) -> bool:
        """Whether the scoring forward keeps its graph and is the training forward (``one_pass_tokens``): one PPO
        epoch, and one micro-batch or few positions in all (under ``--prefix-kv reuse`` every segment with kept
        keys is a micro-batch of its own, so a step of 8 open episodes is 8 small ones)."""
        cfg = self.config
        if cfg.ppo_epochs != 1:
            return False
        return len(batches) == 1 or sum(int(b.lengths.sum()) for b in batches) <= cfg.one_pass_tokens

    def _score(
        self, batches: Sequence[Batch], segments: Sequence[SegmentLike], *, single: bool, policy_version: int = 0
    ) -> tuple[list[Scored], tuple[int, int, int, int], float]:
        """1. Score with the current weights: proximal log-probs, values, advantages, routing drift.
        Returns (scored, (differ, compared, missing, used_differ), seconds). With ``single`` the forward
        keeps its graph and is the training forward too."""
        cfg = self.config
        want_ent = cfg.entropy_coef > 0
        self.model.train()
        scored: list[Scored] = []
        differ = compared = missing = used_differ = 0
        t_fwd = time.perf_counter()
        for b in batches:
            with torch.set_grad_enabled(single):
                out, logp, vals, ent = self._forward(
                    b, replay=cfg.replay, with_entropy=want_ent, want_kv=self.prefix is not None
                )
            if self.prefix is not None and out.kv is not None:  # kept for the episodes' next cuts
                for row, i in enumerate(b.index):
                    self.prefix.keep(
                        segments[i], b.past, [(k[row : row + 1], v[row : row + 1]) for k, v in out.kv], policy_version
                    )
            sc = Scored(b, logp.detach(), vals.detach(), *self._advantages(b, segments, out.values))
            if self.ref is not None:
                sc.ref_logp = self._ref_logp(b)
            if single:
                sc.out_logp, sc.out_values, sc.out_entropy = logp, vals, ent
            if b.index:  # not a zero-weight padding micro-batch (DistributedTrainer._pad)
                # a dense layer routes nothing (its rows are zeros, or -1 after ingest): compared on MoE layers only
                ml = list(self.mcfg.moe_layers)
                rec = None if b.recorded is None else b.recorded[:, :, ml]
                d, c, mi = routing_drift(out.free_topk.detach()[:, :, ml], rec, b.lengths)
                differ, compared, missing = differ + d, compared + c, missing + mi
                used_differ += routing_drift(out.routing.detach()[:, :, ml], rec, b.lengths)[0]
            scored.append(sc)
            del out
        return scored, (differ, compared, missing, used_differ), time.perf_counter() - t_fwd

    def _normalise_advantages(self, scored: list[Scored], n_segments: int) -> tuple[int, float, float]:
        """The step's loss-token count and advantage mean and std (before normalising); whitens the
        advantages over the step's loss tokens in place when configured."""
        if scored:
            lm_all = torch.cat([sc.batch.loss_mask.flatten() for sc in scored])
            adv_all = torch.cat([sc.adv.flatten() for sc in scored])[lm_all]
        else:  # a rank of the distributed learner given no segment this step
            adv_all = torch.zeros(0, device=self.device)
        n_loss, adv_mean, adv_std = self._adv_moments(adv_all)
        if n_loss == 0:
            raise BatchError(f"Trainer.step: the {n_segments} segments hold no loss tokens")
        if self.config.normalize_advantages:
            for sc in scored:
                sc.adv = torch.where(sc.batch.loss_mask, (sc.adv - adv_mean) / (adv_std + 1e-8), sc.adv)
        return n_loss, adv_mean, adv_std

    def _adv_moments(self, adv_all: Tensor) -> tuple[int, float, float]:
        """(count, mean, population std) of the step's loss-token advantages; over all ranks in
        learner.distributed.DistributedTrainer. The first meeting: a scoring error is raised here."""
        if self._failed is not None:
            raise self._failed
        n = int(adv_all.numel())
        if n == 0:
            return 0, 0.0, 0.0
        return n, float(adv_all.mean()), float(adv_all.std(unbiased=False)) if n > 1 else 0.0

    def _update(self, scored: list[Scored], n_loss: int) -> tuple[defaultdict[str, float], float, float, float]:
        """2. PPO epochs: accumulate the loss over the micro-batches, one optimizer step per epoch.
        Returns (loss sums, last grad norm, seconds in forwards, seconds in all)."""
        cfg = self.config
        want_ent = cfg.entropy_coef > 0
        sums: defaultdict[str, float] = defaultdict(float)
        grad_norm = t_fwd = 0.0
        t_update = time.perf_counter()
        for _epoch in range(cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for sc in scored:
                if sc.out_logp is not None and sc.out_values is not None:  # single pass: set together
                    logp, vals, ent = sc.out_logp, sc.out_values, sc.out_entropy
                    sc.out_logp = sc.out_values = sc.out_entropy = None
                else:
                    t_f = time.perf_counter()
                    _, logp, vals, ent = self._forward(sc.batch, replay=cfg.replay, with_entropy=want_ent)
                    t_fwd += time.perf_counter() - t_f
                    if sc.batch.index:
                        sums["fwd_tokens"] += float(sc.batch.lengths.sum())
                        sums["bwd_tokens"] += float(sc.batch.lengths.sum())
                terms = ppo.ppo_loss(
                    logp,
                    sc.prox_logp,
                    sc.batch.behav_logp,
                    sc.adv,
                    vals,
                    sc.old_values,
                    sc.ret,
                    sc.batch.loss_mask,
                    cfg,
                    normaliser=n_loss,
                    entropy=ent,
                    ref_logp=sc.ref_logp,
                )
                # a padding micro-batch (no rows of the step) runs its forward and backward with weight 0
                (terms.loss if sc.batch.index else terms.loss * 0.0).backward()
                share = float(sc.batch.loss_mask.sum()) / n_loss
                ppo.accumulate(sums, terms, share=share, epoch=_epoch, epochs=cfg.ppo_epochs)
            grad_norm = self._optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return sums, grad_norm, t_fwd, time.perf_counter() - t_update

    def _optimizer_step(self) -> float:
        """Clip the accumulated gradients and step; a non-finite norm skips the step. Returns the norm."""
        self._reduce_grads()
        cfg = self.config
        clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        params = [p for p in self.model.parameters() if p.grad is not None]
        self.grad_bytes = sum(_local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None)
        if cfg.critic == "detached":  # the head's gradient is clipped on its own, the policy's norm reported
            head = {id(p) for p in self.model.value_head.parameters()}
            _clip([p for p in params if id(p) in head], clip)
            params = [p for p in params if id(p) not in head]
        grad_norm = _clip(params, clip)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            log.warning("trainer.nonfinite_grad", step=self.steps, grad_norm=grad_norm)
            return grad_norm
        self.optimizer.step()
        return grad_norm

    @staticmethod
    def _loss_token_tensors(scored: list[Scored]) -> dict[str, Tensor]:
        """The per-loss-token tensors the metrics read (1-D, in the same token order)."""
        lm = torch.cat([sc.batch.loss_mask.flatten() for sc in scored])
        return {
            "prox": torch.cat([sc.prox_logp.flatten() for sc in scored])[lm],
            "behav": torch.cat([sc.batch.behav_logp.flatten() for sc in scored])[lm],
            "versions": torch.cat([sc.batch.versions.flatten() for sc in scored])[lm],
            "old_values": torch.cat([sc.old_values.flatten() for sc in scored])[lm],
            "returns": torch.cat([sc.ret.flatten() for sc in scored])[lm],
        }

    def _metrics(
        self,
        segments: Sequence[SegmentLike],
        toks: Mapping[str, Tensor],
        policy_version: int,
        drift: Mapping[str, int] | None,
        **parts: Any,
    ) -> StepMetrics:
        """3. The step's metrics over its loss tokens (``toks``: _loss_token_tensors; ``parts``: the stages'
        results, learner.stepmetrics.step_metrics)."""
        return step_metrics(
            segments,
            toks,
            policy_version,
            drift,
            step=self.steps,
            replay=self.config.replay,
            with_entropy=self.config.entropy_coef > 0,
            config=self.config,
            **parts,
        )

    # ------------------------------------------------------------------------------------- checkpoints

    def save(
        self,
        root: str | Path,
        policy_version: int,
        *,
        keep: int = 3,
        tokenizer: ChatTokenizer | None = None,
        full: bool = True,
    ) -> CheckpointInfo:
        """Write ``root/v<version>``: a model dir the samplers load (in the training dtype), plus with ``full``
        the sharded model and optimizer state a resume reads (learner.checkpoint)."""
        bf16 = self.config.train_dtype == TrainDtype.BFLOAT16
        info = save_checkpoint(
            root,
            self.model,
            self.optimizer,
            policy_version=policy_version,
            step=self.steps,
            tokenizer=tokenizer,
            keep=keep,
            full=full,
            dtype=torch.bfloat16 if bf16 else None,
        )
        if full and self.prefix is not None:
            # a restart trains the steps after a full checkpoint again with nothing kept (learner.service
            # _resume_pushed): the live run forgets its kept keys/values here too, so the replay is the same
            # computation, bit for bit on one CPU rank (cost: open episodes re-forward once per checkpoint)
            self.prefix.clear()
        return info

    def export_model(self) -> MoETransformer:
        """A model holding the full weights (what the samplers get): the model itself on one rank."""
        return self.model

    def load(self, path: str | Path) -> CheckpointInfo:
        """Resume from a checkpoint directory: weights, optimizer state and the step count."""
        info = load_checkpoint(path, self.model, self.optimizer)
        self.steps = info.step
        self._forget_prefixes()
        return info

    def load_weights(self, model_dir: str | Path) -> None:
        """A model dir's weights (no optimizer state): the initial weights of a fresh run."""
        load_weights_into(self.model, model_dir)
        self._forget_prefixes()

    def _forget_prefixes(self) -> None:
        """New weights from outside a step: kept keys/values and the positions covered no longer apply."""
        if self.prefix is not None:
            self.prefix.clear()
        self._covered.clear()

    def restore(self, checkpoints: Path, policy_version: int, initial: Path) -> str:
        """Put the weights and optimizer state back at ``policy_version`` (a step that raised may have stepped the
        optimizer already): its checkpoint, or ``initial`` weights at version 0 of a fresh run. Returns what
        it loaded ('' when nothing matches ``policy_version``: left as is, logged)."""
        ckpt = latest_checkpoint(checkpoints)
        if ckpt is not None and ckpt.policy_version == policy_version:
            self.load(ckpt.path)
            return str(ckpt.path)
        if policy_version == 0:
            self.load_weights(initial)
            self.optimizer.state.clear()
            self.steps = 0
            return str(initial)
        log.error(
            "learner.restore_missing",
            policy_version=policy_version,
            newest=ckpt.policy_version if ckpt else None,
            hint="no checkpoint of this version: the weights stay as the failed step left them",
        )
        return ""

    # ------------------------------------------------------------------------------------ scoring only

    @torch.no_grad()
    def score(
        self, segments: Sequence[SegmentLike], *, replay: bool | None = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """The learner's per-token log-probs and own top-k routing for each segment, without training:
        ``[(logp float32 [T], free_topk int16 [T, L, K]), ...]`` in segment order (eval mode)."""
        m = self.mcfg
        rp = self.config.replay if replay is None else replay
        was = self.model.training
        self.model.eval()
        res: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(segments)
        try:
            for g in plan_microbatches([len(s.tokens) for s in segments], self.config.microbatch_tokens):
                b = pack(segments, g, n_layers=m.n_layers, top_k=m.top_k, device=self.device)
                out, logp, _, _ = self._forward(b, replay=rp, with_entropy=False)
                for row, i in enumerate(g):
                    n = len(segments[i].tokens)
                    res[i] = (logp[row, :n].float().cpu().numpy(), out.free_topk[row, :n].to(torch.int16).cpu().numpy())
        finally:
            self.model.train(was)
        return res  # type: ignore[return-value]


def _clip(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the gradients of ``params`` to a total norm of ``max_norm``; returns the norm before clipping. The
    norm is over the whole gradient: a sharded one (FSDP's DTensors) is reduced over the ranks first."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


def _local(t: Tensor) -> Tensor:
    """The part of ``t`` this rank holds (a DTensor's local shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(trainer: Trainer) -> dict[str, int]:
    """This rank's resident training state: parameter, gradient (at the last optimizer step) and AdamW bytes,
    its shards under FSDP, and the process's peak RSS (VmHWM, which ``echo 5 > /proc/self/clear_refs`` resets)."""
    import resource

    params = sum(_local(p).numel() * p.element_size() for p in trainer.model.parameters())
    optim = sum(
        _local(v).numel() * v.element_size()
        for st in trainer.optimizer.state.values()
        for v in st.values()
        if isinstance(v, Tensor)
    )
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    try:
        with open("/proc/self/status") as f:
            rss_peak = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:"))
    except (OSError, StopIteration):
        pass
    ref = 0 if trainer.ref is None else sum(_local(p).numel() * p.element_size() for p in trainer.ref.parameters())
    total = params + trainer.grad_bytes + optim + ref
    return {
        "param_bytes": params,
        "grad_bytes": trainer.grad_bytes,
        "optim_bytes": optim,
        "ref_bytes": ref,  # the frozen reference of --kl-ref-coef (its shard under FSDP), 0 without one
        "state_bytes": total,
        "rss_peak_bytes": rss_peak,
    }
