"""``TrainerConfig``: the settings of one PPO step (``learner.trainer.Trainer``), checked when built."""

from __future__ import annotations

from dataclasses import dataclass, field

from t1async.learner import ppo
from t1async.learner.options import ADVANTAGES, CRITICS
from t1async.protocol.errors import ConfigError


@dataclass(frozen=True)
class TrainerConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    gamma: float = 1.0
    lam: float = 0.95
    discount_per: str = "turn"  # "turn": gamma/lam apply across turns only; "token": classic token GAE
    normalize_advantages: bool = True
    # "gae": critic-based GAE (ppo.segment_advantages). "turn": each turn's tokens get the turn's own reward minus
    # the step's mean reward of turns with the same turn number (ppo.turn_baseline), no critic and no credit from
    # later turns: a dense per-turn reward (design §8) already says what the turn did
    advantage: str = "gae"
    loss: ppo.LossConfig = field(default_factory=ppo.LossConfig)
    replay: bool = True  # R3: force the recorded experts in the training forward
    ppo_epochs: int = 1
    microbatch_tokens: int = 16384  # padded B x T per forward
    # recompute each block in the backward pass instead of keeping its activations (~72 KB a token with the
    # shipped model; kept instead: each block's input, 0.5 KB a token a layer): one more forward per pass
    checkpoint_blocks: bool = True
    # "shared": the value loss trains the trunk with the policy (one model, one clip). "detached": the value head
    # reads detached hidden states, so its loss trains the head only, and the head's gradient is clipped on its
    # own: the critic neither moves the policy's weights nor shrinks its step. On the touch4 warm start at lr
    # 2e-4 the shared critic's gradient (returns 0-4, values ~0) set the trunk's update and the policy collapsed
    # to invalid replies in 9 steps; detached it did not (docs/results.md, "Learning in CI").
    critic: str = "shared"
    # the value head's own learning rate (None: ``lr``). A fresh head at the policy's RL lr barely moves: on the
    # chores warm start at lr 3e-5 its mean stayed ~0.05 over 40 steps while returns averaged 1.6, so every
    # advantage was a return against one global baseline and a turn's credit was mixed with the turns after it
    value_lr: float | None = None

    def __post_init__(self) -> None:
        if self.critic not in CRITICS:
            raise ConfigError(f"TrainerConfig.critic must be {' or '.join(map(repr, CRITICS))}, got {self.critic!r}")
        if self.advantage not in ADVANTAGES:
            raise ConfigError(
                f"TrainerConfig.advantage must be {' or '.join(map(repr, ADVANTAGES))}, got {self.advantage!r}"
            )
        if self.discount_per not in ("turn", "token"):
            raise ConfigError(f"TrainerConfig.discount_per must be 'turn' or 'token', got {self.discount_per!r}")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ConfigError(f"TrainerConfig.gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.lr <= 0 or self.ppo_epochs < 1 or self.microbatch_tokens < 2 or self.grad_clip < 0:
            raise ConfigError(
                "TrainerConfig needs lr > 0, ppo_epochs >= 1, microbatch_tokens >= 2, grad_clip >= 0; got "
                f"lr={self.lr}, ppo_epochs={self.ppo_epochs}, microbatch_tokens={self.microbatch_tokens}, "
                f"grad_clip={self.grad_clip}"
            )
        if self.value_lr is not None and self.value_lr <= 0:
            raise ConfigError(f"TrainerConfig.value_lr must be > 0 (or None: lr), got {self.value_lr}")
        if self.loss.is_cap <= 0 or self.loss.clip_eps <= 0:
            raise ConfigError(f"LossConfig needs is_cap > 0 and clip_eps > 0, got {self.loss}")
