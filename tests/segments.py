"""Trainer inputs for tests: a tiny real MoE (``CFG``, ``tiny``), segments whose logprobs and routing come from
a model (``sampled_segment``, ``two_turn_segment``, ``segments``), a trainer config with several micro-batches per
rank (``TCFG``), and a spy on the advantages the PPO loss is fed (``advantages_fed_to_the_loss``)."""

from __future__ import annotations

import numpy as np
import torch

from t1async.ingest.tito import Segment
from t1async.learner import ppo
from t1async.learner.trainer import Trainer
from t1async.learner.trainer_config import TrainerConfig
from t1async.model.config import MoEConfig
from t1async.model.moe import MoETransformer

CFG = MoEConfig(
    vocab_size=4096, d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_ff=32, max_seq_len=512, seed=3
)


def tiny() -> MoETransformer:
    return MoETransformer(CFG)


def sampled_segment(
    model: MoETransformer,
    tokens,
    loss_positions,
    *,
    reward: float,
    policy_version: int = 0,
    done: bool = True,
    routing_from: MoETransformer | None = None,
    episode: str = "ep",
) -> Segment:
    """A segment whose 'sampler' is ``model`` (logprobs) run with the routing ``routing_from`` chooses."""
    toks = np.asarray(tokens, dtype=np.int32)
    t = len(toks)
    lm = np.zeros(t, dtype=bool)
    lm[list(loss_positions)] = True
    x = torch.from_numpy(toks[None].astype(np.int64))
    with torch.no_grad():
        routing = (routing_from or model)(x).routing
        out = model(x, replay=routing)
    lp = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(-1, x[0, 1:, None]).squeeze(-1)
    lp = np.concatenate([[0.0], lp.numpy()]).astype(np.float32)
    rt = routing[0].numpy().astype(np.int16)
    rt[-1] = -1  # the sampler never routes a sequence's last token
    last = max(loss_positions)
    return Segment(
        episode=episode,
        index=0,
        tokens=toks,
        loss_mask=lm,
        logprobs=np.where(lm, lp, 0).astype(np.float32),
        versions=np.where(lm, policy_version, -1).astype(np.int32),
        turn_ids=np.where(lm, 0, -1).astype(np.int32),
        routing=rt,
        turn_ends=np.array([last], np.int32),
        turn_rewards=np.array([reward], np.float32),
        done=done,
    )


def two_turn_segment(model, toks, rewards: tuple[float, float], episode: str) -> Segment:
    """Turn 0 outputs positions 10..14, an observation 15..19, turn 1 outputs 20..24."""
    s = sampled_segment(model, toks, [*range(10, 15), *range(20, 25)], reward=0.0, episode=episode)
    tid = np.full(len(toks), -1, np.int32)
    tid[10:15], tid[20:25] = 0, 1
    return Segment(
        **{
            **s.__dict__,
            "turn_ids": tid,
            "turn_ends": np.array([14, 24], np.int32),
            "turn_rewards": np.array(rewards, np.float32),
        }
    )


# several micro-batches per rank, and a different number on each rank
TCFG = TrainerConfig(lr=1e-2, microbatch_tokens=64, ppo_epochs=2)


def segments(model, n: int = 7, seed: int = 0, policy_version: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = int(rng.integers(12, 40))
        toks = rng.integers(5, 4000, size=t).tolist()
        loss = range(t // 2, t)
        out.append(
            sampled_segment(
                model, toks, loss, reward=float(rng.normal()), policy_version=policy_version, episode=f"e{i}"
            )
        )
    return out


def advantages_fed_to_the_loss(monkeypatch, model: MoETransformer, cfg: TrainerConfig, segs) -> tuple[np.ndarray, int]:
    seen: list[np.ndarray] = []
    real = ppo.ppo_loss

    def spy(logp, prox, behav, adv, *rest, **kw):
        seen.append(adv[rest[3]].detach().double().cpu().numpy())  # rest[3] is the loss mask
        return real(logp, prox, behav, adv, *rest, **kw)

    monkeypatch.setattr(ppo, "ppo_loss", spy)
    Trainer(model, cfg).step(segs, 0)
    monkeypatch.setattr(ppo, "ppo_loss", real)
    return np.concatenate(seen), len(seen)
