"""The actor and learner loop in one process, for tests: real sandboxes, real model and trainer, in-memory
NATS and sampler (``run_loop``), and the in-memory sampler with the weight-update call the learner makes
(``VersionedMemorySampler``), and a learner fed waves of finished episodes (``train_waves``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from actors.actor import run_actor
from actors.settings import ActorSettings
from sandbox_agent.agent.types import AgentConfig
from sandbox_agent.synth import generate
from t1async.learner.service import Learner
from t1async.learner.settings import LearnerConfig
from t1async.model.tokenizer import ChatTokenizer
from t1async.protocol import wire
from t1async.protocol.sampling import SamplingParams
from t1async.sampler.memory import MemorySampler
from t1async.transport import MemoryBroker, MemoryTransport
from t1async.transport.base import traj_subject
from tests.clean_episodes import episodes


class VersionedMemorySampler(MemorySampler):
    """The in-memory sampler, with the weight-update call the learner makes."""

    async def update_weights_from_disk(self, path: str, policy_version: int) -> None:
        self.weight_version = int(policy_version)


async def run_loop(
    tmp_path: Path,
    model: Path,
    *,
    eta: int,
    steps: int,
    broker: MemoryBroker,
    sampler: VersionedMemorySampler,
    seen: list,
    ends: int = 0,
) -> Learner:
    """The actor and learner over ``broker`` until the learner's ``steps`` steps, and until ``ends`` episodes
    have ended (their EndRecords in ``seen``): the learner can finish on an episode's last turns before the
    verifier's result is published, so a test of the ends waits for them rather than for luck."""
    tasks = tmp_path / "tasks"
    if not tasks.exists():
        generate(tasks, 6, seed=3)
    tok = ChatTokenizer.load()
    lcfg = LearnerConfig(
        run_dir=tmp_path / "run",
        model=model,
        max_staleness=eta,
        batch_turns=4,
        steps=steps,
        lease=30.0,
        metrics_every_s=0.2,
        lr=1e-3,
    )
    agent = AgentConfig(
        max_turns=3,
        max_context_tokens=4096,
        command_timeout_s=5.0,
        sampling=SamplingParams(max_new_tokens=24, stop_token_ids=tuple(tok.eos_ids)),
    )
    async with MemoryTransport(broker) as lt, MemoryTransport(broker) as at, MemoryTransport(broker) as mt:
        learner = Learner(lcfg, lt, sampler)
        async with mt.subscribe("t1.>") as sub, anyio.create_task_group() as tg:
            finished, barrier, ended = anyio.Event(), anyio.Event(), anyio.Event()

            async def watch():
                n_ends = 0
                if ends <= 0:
                    ended.set()
                async for m in sub:
                    if m.subject == "t1.test.barrier":
                        barrier.set()  # delivery is in order: every record published before it is in `seen`
                    else:
                        seen.append(m.record)
                        n_ends += isinstance(m.record, wire.EndRecord)
                        if n_ends >= ends:
                            ended.set()

            async def run_learner(*, task_status=anyio.TASK_STATUS_IGNORED):
                await learner.run(task_status=task_status)  # returns after `steps` steps (lcfg.steps)
                finished.set()

            tg.start_soon(watch)
            await tg.start(run_learner)
            actor_scope = anyio.CancelScope()

            async def actor():
                with actor_scope:
                    await run_actor(
                        ActorSettings(actor_id="a1", tasks=tasks, concurrency=3, split="all"),
                        transport=at,
                        sampler=sampler,
                        tokenizer=tok,
                        agent=agent,
                    )

            tg.start_soon(actor)
            with anyio.fail_after(240):
                await finished.wait()
                await ended.wait()
                await lt.publish("t1.test.barrier", wire.Heartbeat("test", 0.0))
                await barrier.wait()
            actor_scope.cancel()
            tg.cancel_scope.cancel()
    learner.journal.close()
    return learner


async def train_waves(
    cfg: LearnerConfig,
    broker: MemoryBroker,
    stop_after: int | None = None,
    more: Callable[[int, int], list[Any]] | None = None,
) -> Learner:
    """Run a learner on one wave of 3 finished episodes per step (from the step it starts at); ``stop_after``:
    cancel it (a stop) once it trained that many steps, else it runs its ``steps``. ``more(k, version)``: more
    records for wave k."""
    async with MemoryTransport(broker) as lt, MemoryTransport(broker) as pub:
        learner = Learner(cfg, lt, None)
        n = stop_after or cfg.steps
        async with anyio.create_task_group() as tg:

            async def feed() -> None:
                for k in range(learner.state.step, n):
                    while learner.state.step < k:
                        await anyio.sleep(0.02)
                    extra = more(k, learner.policy_version) if more else []
                    for r in episodes(10 * k, 3, learner.policy_version) + extra:
                        await pub.publish(traj_subject(r.episode), r)
                if stop_after is not None:
                    while learner.state.step < stop_after:
                        await anyio.sleep(0.02)
                    tg.cancel_scope.cancel()

            tg.start_soon(feed)
            with anyio.fail_after(180):
                await learner.run()
            tg.cancel_scope.cancel()
    learner.journal.close()
    return learner
