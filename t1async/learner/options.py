"""The trainer's settings that the learner's CLI and ``cluster up`` expose, declared once (light to import):
``TrainerConfig`` extends them, ``learner serve``'s settings and ``cluster up``'s config include them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from t1async.config import setting


class Advantage(enum.StrEnum):
    GAE = "gae"  # critic-based GAE over the episode (ppo.segment_advantages)
    TURN = "turn"  # each turn's reward minus the step's mean for its turn number (ppo.turn_baseline)


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
CRITICS = tuple(c.value for c in Critic)


@dataclass(frozen=True)
class TrainerOptions:
    lr: float = setting(1e-4, "learning rate", gt=0, group="learner")
    # "turn": no critic and no credit from later turns: a dense per-turn reward (design §8) already says what the
    # turn did
    advantage: Advantage = setting(
        Advantage.GAE,
        "gae: critic-based GAE over the episode; turn: each turn's own reward minus the step's mean reward of "
        "turns with the same number, no critic",
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
    critic: Critic = setting(
        Critic.SHARED,
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
