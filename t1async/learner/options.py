"""The trainer's settings that the learner's CLI and ``cluster up`` expose, declared once (light to import):
``TrainerConfig`` extends them, ``learner serve``'s settings and ``cluster up``'s config include them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from t1async.config import setting


class Advantage(enum.StrEnum):
    GAE = "gae"  # critic-based GAE over the episode (ppo.segment_advantages)
    TURN = "turn"  # each turn's reward minus the step's mean for its turn number (ppo.turn_baseline)
    GRPO = "grpo"  # each turn's return-to-go minus its task group's mean at that turn number (ppo.StepBaseline)
    RLOO = "rloo"  # the same, leave-one-out: minus the mean of the group's other episodes


class IsCorrection(enum.StrEnum):
    TIS = "tis"  # truncated importance sampling: w = pi_prox / pi_behav capped at --is-cap
    MIS = "mis"  # masked importance sampling: tokens whose w leaves [--is-low, --is-high] are dropped


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
class TrainerOptions:
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
        "the tokens whose w leaves [--is-low, --is-high]",
        group="learner",
    )
    is_cap: float = setting(2.0, "tis: the cap of the importance weight", gt=0, group="learner")
    is_low: float = setting(0.5, "mis: the lowest importance weight kept", ge=0, group="learner")
    is_high: float = setting(2.0, "mis: the highest importance weight kept", gt=0, group="learner")
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
