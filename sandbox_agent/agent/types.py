"""The agent loop's typed surface (loop.py runs the loop): its config (``AgentConfig``), what it streams
each turn (``TurnResult``) and returns (``EpisodeResult``), and the protocols it calls (the chat tokenizer,
an optional turn gate, the verifier and the ``on_turn`` hook). All import from ``sandbox_agent.agent.loop`` too.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from sandbox_agent.agent.actions import SYSTEM_PROMPT
from sandbox_agent.agent.context import ContextConfig
from sandbox_agent.tasks.verifier import VerifyResult
from t1async.protocol.sampling import SamplingParams
from t1async.protocol.wire import EndReason, Finish


class ChatTokenizerLike(Protocol):
    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]: ...
    def message_ids(self, role: str, content: str) -> list[int]: ...
    def generation_prompt_ids(self) -> list[int]: ...
    def bridge_ids(self, output_ids: Sequence[int]) -> list[int]: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    @property
    def end_of_turn_id(self) -> int: ...

    @property
    def eos_ids(self) -> Sequence[int]: ...


class Reward(enum.StrEnum):
    """What a turn earns (design §8). ``DENSE``: a verified turn's reward is the change in the number of passing
    tests, so an episode's rewards add up to the tests passed at its end (with ``verify_every=1``, a
    per-command process reward). ``BINARY``: every turn earns 0 but the episode's last, which earns 1 if all
    tests pass at the end, else 0 (an outcome reward, whatever ``verify_every`` says). ``TURNS``: content-free,
    1 for every turn that does not say DONE, whatever the tests say (a baseline: RL that only learns to go on,
    bench.learning --baselines contentfree)."""

    DENSE = "dense"
    BINARY = "binary"
    TURNS = "turns"


@dataclass(frozen=True)
class AgentConfig:
    max_turns: int = 300
    max_context_tokens: int = 32768
    wall_time_s: float | None = None  # None: the task's agent timeout (time held back by credits is not counted)
    verify_every: int = 0  # 0: verify only when the episode ends
    reward: Reward = Reward.DENSE
    sampling: SamplingParams = field(
        default_factory=lambda: SamplingParams(max_new_tokens=1024)
    )  # no stop ids: the tokenizer's end-of-turn and eos
    system_prompt: str = SYSTEM_PROMPT
    observation_role: str = "user"
    max_observation_chars: int = 8192
    command_timeout_s: float = 60.0  # per command; never past the episode's wall time
    min_new_tokens: int = 16  # stop for "context" when fewer tokens than this are left to generate
    stop_when_resolved: bool = True  # a periodic verification that resolves the task ends the episode
    request_routing: bool = True
    context: ContextConfig = field(default_factory=ContextConfig)  # what to do when the history outgrows max_context


@dataclass(frozen=True)
class TurnResult:
    turn: int
    input_ids: np.ndarray  # int32, the full input of this turn
    output_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32
    finish: Finish
    policy_version: int
    routing: np.ndarray | None
    routing_start: int
    action_kind: str  # "bash" | "done" | "invalid" | "none" (aborted sample)
    action_text: str  # the command run ("" if none)
    observation: str  # what the model is shown next ("" on the last turn of a done)
    exit_code: int | None
    timed_out: bool
    truncated: bool
    tests_passed: int | None  # None: not verified this turn
    reward: float  # dense: change in tests passed since the last verification (0 if not verified); see Reward
    t_sample_s: float
    t_exec_s: float
    last: bool = False
    compacted: bool = False  # this turn's input was compacted by the context policy (a FORK)
    output_versions: np.ndarray | None = None  # int32: each output token's policy version (None: policy_version)


@dataclass(frozen=True)
class EpisodeResult:
    """How an episode ended. ``reason``: "solved" = the agent declared the task done (or a periodic
    verification found it resolved); ``resolved`` says whether the tests agree. "max_turns", "context",
    "timeout" (wall time), "error" (sampler or sandbox failure, see ``detail``), "aborted" (the sampler
    aborted the request)."""

    turns: int
    reason: EndReason
    tests_passed: int
    tests_total: int
    resolved: bool
    verify: VerifyResult | None
    detail: str = ""
    unstreamed_reward: float = 0.0
    wall_s: float = 0.0
    compactions: int = 0  # inputs the context policy compacted
    paused_s: float = 0.0  # time the sampler held the episode before sampling (credits), not on the wall clock


@runtime_checkable
class TurnGate(Protocol):
    """A sampler that may make an episode wait before each sample (``t1async.credits.client.CreditedSampler``: the
    learner's credits) offers ``wait_turn()``. The agent awaits it before sampling and adds the wait to its
    wall-time deadline: backpressure pauses the episode, it is not the agent's time."""

    async def wait_turn(self) -> None: ...


OnTurn = Callable[[TurnResult], Awaitable[None]]
VerifyFn = Callable[[], Awaitable[VerifyResult]]
