"""The rollout actor: many concurrent episodes, one task each, streaming turns to the learner.

    async with open_actor_deps(...):          # transport, sampler client (owned by the caller)
        await run_actor(config, deps)        # ActorSettings; runs until `episodes` are done, or cancelled

Every episode asks ``t1.credit`` before each turn, samples token-in (with logprobs and routing), executes
the action in its sandbox and publishes the ``turn`` record right away (actors/episode.py).
"""

from __future__ import annotations

import itertools
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.abc

from actors.episode import EpisodeContext, EpisodeStats, new_episode_id, run_one
from actors.settings import ActorSettings
from sandbox_agent.agent.runner import WORK_PREFIX
from sandbox_agent.agent.types import AgentConfig, ChatTokenizerLike
from sandbox_agent.sandbox.backend import AutoBackend, SandboxBackend
from sandbox_agent.tasks.task import Task, load_tasks
from t1async.credits.client import CreditClient
from t1async.learner.groups import grouped_episode_id
from t1async.log import get_logger
from t1async.protocol.errors import ConfigError
from t1async.protocol.sampling import Sampler
from t1async.protocol.wire import Heartbeat, MetricsRecord
from t1async.transport.base import Transport

log = get_logger("actors.actor")


METRICS_EVERY_S = 2.0  # t1.metrics.actor.<id>
HEARTBEAT_EVERY_S = 3.0  # t1.actor.<id>: the learner releases an actor silent for --actor-timeout


def load_task_pool(tasks_dir: Path, split: str, backend: SandboxBackend | None = None) -> list[Task]:
    if not tasks_dir.is_dir():
        raise ConfigError(
            f"task directory {tasks_dir} does not exist: make one with "
            f"`python -m sandbox_agent synth --out {tasks_dir} --n 200`"
        )
    backend = backend or AutoBackend()  # bwrap where it reproduces a task exactly, else a container
    tasks = [t for t in load_tasks(tasks_dir) if split == "all" or t.split == split]
    tasks = [t for t in tasks if backend.supports(t)]
    if not tasks:
        raise ConfigError(
            f"no runnable {split!r} tasks under {tasks_dir} (tasks that need a container image are "
            f"skipped when podman or their base image is missing: `python -m sandbox_agent list "
            f"{tasks_dir}` says why)"
        )
    return tasks


def _fresh(work_dir: Path | None) -> Path | None:
    """``work_dir`` made, and emptied of episode work dirs (``t1w-*``): an episode's work dir is removed when the
    episode ends, even cancelled, but a SIGKILLed actor leaves its open ones, which its restart (same
    ``--work-dir``) removes here."""
    if work_dir is None:
        return None
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
        left = sorted(work_dir.glob(f"{WORK_PREFIX}*"))  # only episode work dirs: never a user's other files
        for p in left:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    except OSError as exc:
        raise ConfigError(
            f"--work-dir {work_dir}: cannot make or empty it ({exc}); pass a directory this actor owns"
        ) from exc
    if left:
        log.info("actor.work_dir_emptied", work_dir=str(work_dir), removed=len(left))
    return work_dir


async def run_actor(
    config: ActorSettings,
    *,
    transport: Transport,
    sampler: Sampler,
    tokenizer: ChatTokenizerLike,
    agent: AgentConfig,
    backend: SandboxBackend | None = None,
    task_status: anyio.abc.TaskStatus[EpisodeStats] = anyio.TASK_STATUS_IGNORED,
) -> EpisodeStats:
    """Run ``config``'s episodes (``config.episodes`` of them, or until cancelled): the settings of
    ``python -m actors``, whose ``--tasks`` and ``--actor-id`` it needs; ``agent`` says how each episode runs."""
    if config.tasks is None or not config.actor_id:
        raise ConfigError(
            f"run_actor needs tasks and actor_id (--tasks, --actor-id), got {config.tasks}, {config.actor_id!r}"
        )
    backend = backend or AutoBackend()
    tasks = load_task_pool(config.tasks, config.split, backend)
    rng = random.Random(config.seed)
    order = itertools.count()
    credits = CreditClient(transport, config.actor_id)
    ctx = EpisodeContext(
        config.actor_id, transport, sampler, credits, tokenizer, backend, agent, work_root=_fresh(config.work_dir)
    )
    stats = EpisodeStats()
    t0 = time.monotonic()
    log.info(
        "actor.start",
        actor=config.actor_id,
        tasks=len(tasks),
        concurrency=config.concurrency,
        split=config.split,
        episodes=config.episodes or "unbounded",
        group_size=config.group_size,
    )

    def draws() -> Iterator[tuple[Task, str]]:
        """(task, episode id) in the order the workers take them: a group's K members are consecutive, so with
        --concurrency >= K they run at once and reach the learner in the same steps."""
        while True:
            task = rng.choice(tasks)
            if config.group_size == 1:
                yield task, new_episode_id(config.actor_id)
                continue
            group = new_episode_id(config.actor_id)
            for k in range(config.group_size):
                yield task, grouped_episode_id(group, k)

    drawn = draws()

    async def worker() -> None:
        while config.episodes == 0 or next(order) < config.episodes:
            task, episode = next(drawn)
            await run_one(task, ctx, stats, episode=episode)

    async def metrics() -> None:
        while True:
            await anyio.sleep(METRICS_EVERY_S)
            await publish_metrics()

    async def publish_metrics() -> None:
        el = max(time.monotonic() - t0, 1e-9)
        values = {
            "episodes_running": stats.running,
            "episodes_done": stats.done,
            "turns": stats.turns,
            "tokens": stats.tokens,
            "turns_per_s": stats.turns / el,
            "tokens_per_s": stats.tokens / el,
            "resolved": stats.resolved,
            "tests_passed": stats.tests_passed,
            "tests_total": stats.tests_total,
            **credits.wait_stats(),
            "reasons": dict(stats.reasons),
            "sample_s": stats.sample_s,
            "exec_s": stats.exec_s,
            "slots": config.concurrency,
            "compactions": stats.compactions,
            "empty_outputs": stats.empty_outputs,
        }
        await transport.publish(f"t1.metrics.actor.{config.actor_id}", MetricsRecord("actor", 0, 0, values))

    started_at = time.time()  # before any episode of this process is created: the learner's restart test

    async def heartbeat() -> None:
        """A sign of life: the learner grants credits only to a live actor (design §7). ``started_at`` tells
        it when this process began, so a restarted actor's orphaned episodes are closed at its first beat."""
        while True:
            try:
                beat = Heartbeat(config.actor_id, time.time(), started_at)
                await transport.publish(f"t1.actor.{config.actor_id}", beat)
            except Exception as exc:  # NATS reconnecting: the next beat retries; the learner's timeout is ~5 beats
                log.warning("actor.heartbeat_failed", actor=config.actor_id, error=str(exc))
            await anyio.sleep(HEARTBEAT_EVERY_S)

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        tg.start_soon(metrics)
        task_status.started(stats)
        async with anyio.create_task_group() as workers:
            for _ in range(config.concurrency):
                workers.start_soon(worker)
        tg.cancel_scope.cancel()
    await publish_metrics()
    log.info("actor.done", actor=config.actor_id, episodes=stats.done, turns=stats.turns)
    return stats
