"""An actor process's settings (``python -m actors``); ``EpisodeOptions`` is shared with ``cluster up`` and ``eval``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sandbox_agent.agent.context import POLICIES
from sandbox_agent.agent.types import Reward
from t1async.config import like, setting
from t1async.protocol.sampling import SamplingParams
from t1async.sampler.settings import Engine, EngineSettings, SamplerKeys
from t1async.transport.auth import NatsClientSettings


@dataclass(frozen=True)
class EpisodeOptions:
    """How an actor runs its episodes; ``cluster up`` takes these too (its config includes these fields)."""

    concurrency: int = setting(4, "episodes per actor at once", ge=1, group="actors")
    max_turns: int = setting(300, "turns per episode at most", ge=1, group="actors")
    max_new_tokens: int = setting(
        SamplingParams.max_new_tokens, "tokens sampled per turn at most", ge=1, group="actors"
    )  # what a request asks for by default; cluster up and the eval loop set their own
    max_context: int = setting(8192, "context budget per episode, in tokens", ge=1, group="actors")
    context_policy: str = setting(
        "truncate-observations",
        "when the next input would not fit --max-context: truncate-observations (keeps the system prompt, the "
        "task and the last K turns whole, shortens older observations, drops the oldest turns if needed) or stop "
        "(end the episode with reason context)",
        choices=tuple(POLICIES),
        group="actors",
    )
    context_keep_turns: int = setting(8, "turns truncate-observations keeps whole", ge=0, metavar="K", group="actors")
    temperature: float = setting(1.0, "sampling temperature", ge=0, group="actors")
    group_size: int = setting(
        1,
        "run each drawn task K times, at once, as one group (the learner's --advantage grpo/rloo centres each on "
        "the others); 1: every episode draws its own task",
        ge=1,
        metavar="K",
        group="actors",
    )
    verify_every: int = setting(
        0,
        "run the verifier every N turns for a dense per-turn reward (default 0: only at the end)",
        ge=0,
        group="actors",
    )
    reward: Reward = setting(
        Reward.DENSE,
        "dense: a verified turn earns the change in tests passing (a per-command process reward with "
        "--verify-every 1; the rewards add up to the tests passed); binary: only the episode's last turn earns, "
        "1 if all tests pass at the end, else 0 (an outcome reward); turns: 1 for every turn that does not say "
        "DONE, whatever the tests say (a content-free baseline, not a reward to train with)",
        group="actors",
    )


@dataclass(frozen=True)
class ActorSettings(EpisodeOptions):
    """``python -m actors``'s settings: ``--config FILE.toml`` (what ``cluster up`` writes) and/or flags."""

    nats: str | None = setting(
        None, "NATS URL(s), comma-separated (default: $T1_NATS_URL)", metavar="URL", group="actor"
    )
    nats_creds: Path | None = like(NatsClientSettings, "nats_creds", group="actor")
    sampler_url: tuple[str, ...] = setting(
        (),
        "a sampler (SGLang or `python -m t1async.sampler serve`); repeat for several",
        metavar="URL",
        group="actor",
    )
    sampler_api_key: str | None = like(SamplerKeys, "sampler_api_key", group="actor")
    engine: Engine = like(EngineSettings, "engine", group="actor")
    tasks: Path | None = setting(
        None,
        "a directory of tasks (TB1/TB2 format), e.g. made by `python -m sandbox_agent synth --out DIR --n 200` "
        "(required)",
        metavar="DIR",
        group="actor",
    )
    split: Literal["train", "eval", "all"] = setting("train", "which tasks to draw", group="actor")
    episodes: int = setting(0, "stop after this many episodes (default 0: never)", ge=0, group="actor")
    command_timeout: float = setting(30.0, "seconds per shell command", gt=0, group="actor")
    model: Path | None = setting(None, "model dir whose tokenizer to use (default: shipped)", group="actor")
    system_prompt_file: Path | None = setting(
        None,
        "the agent's system prompt (default: the built-in one); a warm start's model dir has its own, "
        "system_prompt.txt, which cluster up passes here",
        metavar="FILE",
        group="actor",
    )
    work_dir: Path | None = setting(
        None,
        "where each episode's work dir (t1w-*) is made (default: the system temp dir); at start the actor removes "
        "the t1w-* dirs a killed predecessor left, so give each actor its own (cluster up: <run-dir>/work/<actor-id>)",
        metavar="DIR",
        group="actor",
    )
    actor_id: str = setting("", "this actor's name, unique across the cluster (default host-pid)", group="actor")
    seed: int = setting(0, "task-draw seed", group="actor")
    log_level: str | None = setting(None, "debug, info (default), warning", group="actor")
