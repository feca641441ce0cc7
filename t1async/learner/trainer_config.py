"""The trainer's settings, declared once (``TrainerConfig``; light to import: no torch): the flags of ``learner
serve`` and ``cluster up``, the TOML keys of their ``--config`` files, and what ``learner.trainer.Trainer`` reads.
The fields with ``cli=False`` are set by code only (tests, benches, recipes): neither flags nor TOML keys."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from t1async.config import check_bounds, setting
from t1async.protocol.errors import ConfigError

if TYPE_CHECKING:
    import torch


class Advantage(enum.StrEnum):
    GAE = "gae"  # critic-based GAE over the episode (ppo.segment_advantages)
    TURN = "turn"  # each turn's reward minus the step's mean for its turn number (ppo.turn_baseline)
    GRPO = "grpo"  # each turn's return-to-go minus its task group's mean at that turn number (ppo.StepBaseline)
    RLOO = "rloo"  # the same, leave-one-out: minus the mean of the group's other episodes


class AdvantageSigns(enum.StrEnum):
    KEPT = "kept"  # the advantages as computed
    RANDOM = "random"  # a control: each (episode, turn)'s advantage gets a fair coin's sign (ppo.StepBaseline.sign)


class IsCorrection(enum.StrEnum):
    TIS = "tis"  # truncated importance sampling: w = pi_prox / pi_behav capped at --is-cap
    MIS = "mis"  # masked importance sampling: tokens whose w leaves [--is-low, --is-high] are dropped
    NONE = "none"  # no correction: w = 1, the sampler/learner mismatch is ignored (an ablation, not a default)


class Prefix(enum.StrEnum):
    EXACT = "exact"  # every cut re-forwards its episode's whole context (exact gradient; O(n) per step)
    REUSE = "reuse"  # an open episode's kept keys/values stand in for its history (learner.prefixkv)


class Critic(enum.StrEnum):
    SHARED = "shared"  # the value loss trains the trunk with the policy
    DETACHED = "detached"  # the value head reads detached hidden states: its loss trains the head only


class TrainDtype(enum.StrEnum):
    FLOAT32 = "float32"  # everything in fp32
    BFLOAT16 = "bfloat16"  # forward and backward under bf16 autocast; weights, gradients and AdamW state in fp32


class Device(enum.StrEnum):
    CPU = "cpu"
    CUDA = "cuda"  # this process's GPU (LOCAL_RANK's with --nproc > 1); untested: no GPU ran here


ADVANTAGES = tuple(a.value for a in Advantage)
IS_CORRECTIONS = tuple(c.value for c in IsCorrection)
CRITICS = tuple(c.value for c in Critic)
PREFIXES = tuple(p.value for p in Prefix)


@dataclass(frozen=True)
class TrainerConfig:
    """The settings of one PPO step, checked when built."""

    lr: float = setting(1e-4, "learning rate", gt=0, group="learner")
    # "turn": no critic and no credit from later turns: a dense per-turn reward (design §8) already says what the
    # turn did
    advantage: Advantage = setting(
        Advantage.GAE,
        "gae: critic-based GAE over the episode; turn: each turn's own reward minus the step's mean reward of "
        "turns with the same number, no critic; grpo / rloo: each turn's return-to-go (--gamma across turns) minus "
        "the mean of the other episodes of its task group (actors --group-size K) at that turn number (rloo: "
        "leave-one-out), no critic",
        group="learner",
    )
    # a control, not a method: if RL at random signs does as well as at the computed ones, the step's signal is
    # lost in its noise (it is not: docs/results.md, 2026-12-06 19:50)
    advantage_signs: AdvantageSigns = setting(
        AdvantageSigns.KEPT,
        "kept: the advantages as computed; random: a control that gives each (episode, turn)'s advantage a fair "
        "coin's sign (turn, grpo and rloo), so the policy moves as far but in no learned direction",
        group="learner",
    )
    gamma: float = setting(1.0, "discount across turns (gae, grpo, rloo)", ge=0, le=1, group="learner")
    lam: float = setting(0.95, "GAE lambda across turns", ge=0, le=1, group="learner")
    ppo_epochs: int = setting(
        1,
        "optimizer steps per batch; from the second the PPO ratio differs from 1 and its clip binds",
        ge=1,
        group="learner",
    )
    is_correction: IsCorrection = setting(
        IsCorrection.TIS,
        "off-policy correction of the weight w = pi_learner / pi_sampler: tis truncates w at --is-cap; mis drops "
        "the tokens whose w leaves [--is-low, --is-high]; none takes w = 1 (ignores the mismatch: an ablation)",
        group="learner",
    )
    is_cap: float = setting(2.0, "tis: the cap of the importance weight", gt=0, group="learner")
    is_low: float = setting(0.5, "mis: the lowest importance weight kept", ge=0, group="learner")
    is_high: float = setting(2.0, "mis: the highest importance weight kept", gt=0, group="learner")
    # an anchor to RL's start: at the preset's budget every estimator drifted below the SFT model it started from
    # on eval, and a random-sign control showed the drift is the step's own noise (docs/results.md, 2026-12-06)
    kl_ref_coef: float = setting(
        0.0,
        "weight of a KL penalty to the reference model (the learner's initial weights, --model: the warm start or "
        "SFT model RL starts from), per loss token, k3 estimate of KL(pi || ref) with its gradient; 0: off. "
        "Needs --prefix-kv exact; at --learner-procs N the reference is sharded like the policy",
        ge=0,
        group="learner",
    )
    # T1's "aggressive warm start" of the critic: a fresh head predicts ~0 while returns average >1, so GAE's
    # first advantages are returns against one global baseline; a least-squares fit on the first steps' rollouts
    # gives it the returns' structure before the policy moves (learner/critic.py)
    critic_warmup: int = setting(
        0,
        "refit the value head by least squares on the returns of the first N steps' rollouts (all of them so "
        "far), before each of those steps computes its advantages; 0: off",
        ge=0,
        group="learner",
    )
    # a fresh head at the policy's RL lr barely moves: on the chores warm start at lr 3e-5 its mean stayed ~0.05
    # over 40 steps while returns averaged 1.6, so every advantage was a return against one global baseline
    value_lr: float | None = setting(
        None,
        "the value head's own learning rate (default: --lr; a fresh head needs more, e.g. 100x)",
        gt=0,
        group="learner",
    )
    # "detached": the critic neither moves the policy's weights nor shrinks its step. On the touch4 warm start at
    # lr 2e-4 the shared critic's gradient (returns 0-4, values ~0) set the trunk's update and the policy
    # collapsed to invalid replies in 9 steps; detached it did not (docs/results.md, "Learning in CI")
    # detached by default: the learn preset's (a shared critic collapsed the policy, above), and with
    # --prefix-kv reuse a shared critic's value loss would lose its path through the kept keys and values (on
    # the shipped model the step's gradient fell to cosine 0.3-0.86 of the exact one; detached 0.93-0.98)
    critic: Critic = setting(
        Critic.DETACHED,
        "shared: the value loss trains the trunk with the policy; detached: it trains the value head only, whose "
        "gradient is clipped on its own",
        group="learner",
    )
    replay: bool = setting(
        True, "R3 routing replay: force the recorded experts in the training forward", group="learner"
    )
    train_dtype: TrainDtype = setting(
        TrainDtype.FLOAT32,
        "float32, or bfloat16: the training forward and backward under bf16 autocast, with fp32 master weights "
        "(the weights, gradients and AdamW state stay fp32; checkpoints and pushes are fp32)",
        group="learner",
    )
    device: Device = setting(
        Device.CPU,
        "where the learner trains: cpu, or cuda (the GPU of this process, LOCAL_RANK's with --nproc > 1; "
        "untested, no GPU ran in our tests)",
        group="learner",
    )
    prefix_kv: Prefix = setting(
        Prefix.REUSE,
        "reuse: a cut of an open episode forwards only its new positions, attending to the keys and values kept "
        "from its earlier cuts (no gradient through them; at most --prefix-kv-max-age versions old; a cut with "
        "none kept forwards its long context once without gradient first), so the cost per trained token stays "
        "flat as episodes grow; exact: re-forward the whole context at every cut, with the full gradient",
        group="learner",
    )
    prefix_kv_max_age: int = setting(
        64,
        "with --prefix-kv reuse: kept keys and values older than this many policy versions are recomputed (the "
        "context forwarded once more, without gradient); 0: nothing kept, the exact step",
        ge=0,
        group="learner",
    )

    # set by code only (cli=False): neither flags nor TOML keys
    weight_decay: float = setting(0.0, "AdamW weight decay", ge=0, cli=False)
    betas: tuple[float, float] = setting((0.9, 0.95), "AdamW betas", cli=False)
    grad_clip: float = setting(1.0, "max global grad norm; 0 = off", ge=0, cli=False)
    discount_per: str = setting(
        "turn",
        "turn: gamma/lam apply across turns only; token: classic token GAE",
        choices=("turn", "token"),
        cli=False,
    )
    normalize_advantages: bool = setting(True, "normalize the step's advantages", cli=False)
    clip_eps: float = setting(0.2, "PPO ratio clip against the proximal policy", gt=0, cli=False)
    clip_eps_high: float | None = setting(None, "asymmetric upper clip (DAPO's clip higher); None: clip_eps", cli=False)
    value_coef: float = setting(0.5, "the value loss's weight", cli=False)
    value_clip: float | None = setting(
        0.2, "PPO value clipping around the step's starting values; None: off", cli=False
    )
    entropy_coef: float = setting(0.0, "the entropy bonus's weight", cli=False)
    microbatch_tokens: int = setting(16384, "padded B x T per forward", ge=2, cli=False)
    # recompute each block in the backward pass instead of keeping its activations (~72 KB a token with the
    # shipped model; kept instead: each block's input, 0.5 KB a token a layer): one more forward per pass
    checkpoint_blocks: bool = setting(True, "recompute each block in the backward pass", cli=False)
    prefix_kv_tokens: int = setting(
        1 << 18, "positions of kept keys/values over all open episodes (learner.prefixkv)", ge=0, cli=False
    )
    # with reuse (max age > 0): a cut with nothing kept and at least this many positions before its first trained
    # one forwards them once without gradient first (learner.prefixkv "primed"); 0 = never
    prefix_kv_prime_tokens: int = setting(
        256, "positions before a cut past which it is primed; 0 = never", ge=0, cli=False
    )
    # with one PPO epoch: a step whose micro-batches forward at most this many positions in all keeps every
    # scoring forward's graph and trains on it (each position forwarded once, not scored and then forwarded
    # again); above it only a single micro-batch does, so memory stays one micro-batch's graph. 0 = the latter
    one_pass_tokens: int = setting(
        16384, "the most positions a step trains on its scoring forwards' graph", ge=0, cli=False
    )

    def __post_init__(self) -> None:
        for name, kind in (
            ("critic", Critic),
            ("advantage", Advantage),
            ("advantage_signs", AdvantageSigns),
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
        check_bounds(self, type(self).__name__)
        if self.discount_per not in ("turn", "token"):
            raise ConfigError(f"TrainerConfig.discount_per must be 'turn' or 'token', got {self.discount_per!r}")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ConfigError(f"TrainerConfig.gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.ppo_epochs < 1 or self.microbatch_tokens < 2 or self.grad_clip < 0:
            raise ConfigError(
                "TrainerConfig needs ppo_epochs >= 1, microbatch_tokens >= 2, grad_clip >= 0; got "
                f"ppo_epochs={self.ppo_epochs}, microbatch_tokens={self.microbatch_tokens}, grad_clip={self.grad_clip}"
            )
        if not 0 <= self.is_low < self.is_high:
            raise ConfigError(
                f"masked IS needs 0 <= is_low < is_high, got [{self.is_low}, {self.is_high}]: "
                "set --is-low below --is-high"
            )
        if self.kl_ref_coef > 0 and self.prefix_kv == Prefix.REUSE and self.prefix_kv_max_age > 0:
            raise ConfigError(
                "--kl-ref-coef needs --prefix-kv exact: with reuse a cut forwards only its new positions against the "
                "policy's kept keys and values, and the reference model has none of its own"
            )
        if self.advantage_signs == AdvantageSigns.RANDOM and self.advantage == Advantage.GAE:
            raise ConfigError(
                "--advantage-signs random is a control for the critic-free baselines: use it with --advantage "
                "turn, grpo or rloo (gae's advantages vary within a turn)"
            )


def torch_device(device: Device | str) -> torch.device:
    """The torch device the learner trains on (``--device``): the CPU, or this process's GPU (``LOCAL_RANK``'s
    under torchrun); ConfigError when torch sees no GPU."""
    import torch

    if Device(device) == Device.CPU:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False); "
            "use --device cpu or a CUDA build of torch on a GPU host"
        )
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
