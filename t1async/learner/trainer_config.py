"""``TrainerConfig``: the settings of one PPO step (``learner.trainer.Trainer``), checked when built."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field, replace

import torch

from t1async.config import check_bounds
from t1async.learner import ppo
from t1async.learner.options import Advantage, Critic, Device, IsCorrection, Prefix, TrainDtype, TrainerOptions
from t1async.protocol.errors import ConfigError


@dataclass(frozen=True)
class TrainerConfig(TrainerOptions):
    """``TrainerOptions`` (lr, value_lr, advantage, critic, replay: learner/options.py) and the rest of a step."""

    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    discount_per: str = "turn"  # "turn": gamma/lam apply across turns only; "token": classic token GAE
    normalize_advantages: bool = True
    loss: ppo.LossConfig = field(default_factory=ppo.LossConfig)
    microbatch_tokens: int = 16384  # padded B x T per forward
    # recompute each block in the backward pass instead of keeping its activations (~72 KB a token with the
    # shipped model; kept instead: each block's input, 0.5 KB a token a layer): one more forward per pass
    checkpoint_blocks: bool = True
    prefix_kv_tokens: int = 1 << 18  # positions of kept keys/values over all open episodes (learner.prefixkv)
    # with reuse (max age > 0): a cut with nothing kept and at least this many positions before its first trained
    # one forwards them once without gradient first (learner.prefixkv "primed"); 0 = never
    prefix_kv_prime_tokens: int = 256
    # with one PPO epoch: a step whose micro-batches forward at most this many positions in all keeps every
    # scoring forward's graph and trains on it (each position forwarded once, not scored and then forwarded
    # again); above it only a single micro-batch does, so memory stays one micro-batch's graph. 0 = the latter
    one_pass_tokens: int = 16384

    def __post_init__(self) -> None:
        for name, kind in (
            ("critic", Critic),
            ("advantage", Advantage),
            ("is_correction", IsCorrection),
            ("prefix_kv", Prefix),
            ("train_dtype", TrainDtype),
            ("device", Device),
        ):
            try:
                object.__setattr__(self, name, kind(getattr(self, name)))
            except ValueError:
                raise ConfigError(
                    f"TrainerConfig.{name} must be {' or '.join(repr(k.value) for k in kind)}, "
                    f"got {getattr(self, name)!r}"
                ) from None
        check_bounds(self, "TrainerConfig")
        if self.discount_per not in ("turn", "token"):
            raise ConfigError(f"TrainerConfig.discount_per must be 'turn' or 'token', got {self.discount_per!r}")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ConfigError(f"TrainerConfig.gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.ppo_epochs < 1 or self.microbatch_tokens < 2 or self.grad_clip < 0:
            raise ConfigError(
                "TrainerConfig needs ppo_epochs >= 1, microbatch_tokens >= 2, grad_clip >= 0; got "
                f"ppo_epochs={self.ppo_epochs}, microbatch_tokens={self.microbatch_tokens}, grad_clip={self.grad_clip}"
            )
        self._merge_is_options()
        if self.loss.is_cap <= 0 or self.loss.clip_eps <= 0:
            raise ConfigError(f"LossConfig needs is_cap > 0 and clip_eps > 0, got {self.loss}")
        if self.loss.is_correction not in ("tis", "mis"):
            raise ConfigError(f"LossConfig.is_correction must be 'tis' or 'mis', got {self.loss.is_correction!r}")
        if not 0 <= self.loss.is_low < self.loss.is_high:
            raise ConfigError(
                f"masked IS needs 0 <= is_low < is_high, got [{self.loss.is_low}, {self.loss.is_high}]: "
                "set --is-low below --is-high"
            )

    def _merge_is_options(self) -> None:
        """The IS options (is_correction, is_cap, is_low, is_high) and ``loss``'s fields are one setting each: a
        value away from the default on either side is taken; set on both sides to different values is an error."""
        default, merged = ppo.LossConfig(), {}
        for name in ("is_correction", "is_cap", "is_low", "is_high"):
            opt, own, base = getattr(self, name), getattr(self.loss, name), getattr(default, name)
            opt = opt.value if isinstance(opt, enum.Enum) else opt
            if opt != base and own != base and opt != own:
                raise ConfigError(f"TrainerConfig.{name}={opt!r} and loss.{name}={own!r} disagree: set it in one place")
            merged[name] = opt if opt != base else own
        object.__setattr__(self, "loss", replace(self.loss, **merged))
        for name, value in merged.items():
            object.__setattr__(self, name, IsCorrection(value) if name == "is_correction" else value)


def torch_device(device: Device | str) -> torch.device:
    """The torch device the learner trains on (``--device``): the CPU, or this process's GPU (``LOCAL_RANK``'s
    under torchrun); ConfigError when torch sees no GPU."""
    if Device(device) == Device.CPU:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False); "
            "use --device cpu or a CUDA build of torch on a GPU host"
        )
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
