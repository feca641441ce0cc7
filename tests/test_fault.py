"""Faults in a real loop: an actor is SIGKILLed and the learner is SIGKILLed and restarted mid-run. Every
turn that reached the stream is durably taken by the learner, and no turn is trained twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from sandbox_agent.synth import generate
from t1async import wire
from t1async.learner.journal import read_journal
from t1async.learner.state import LearnerState
from t1async.sampler.launch import launch_sampler
from t1async.transport import NatsTransport

pytestmark = pytest.mark.slow


def spawn(argv: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *argv], stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)  # fmt: skip


def stop(p: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if p.poll() is None:
        os.kill(p.pid, sig)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def journal_turns(run: Path) -> set[tuple[str, int]]:
    return {(r.episode, r.turn) for r in read_journal(run / "learner" / "journal") if isinstance(r, wire.TurnRecord)}


async def read_stream_turns(url: str) -> set[tuple[str, int]]:
    """Every turn record in T1_TRAJ, read by a fresh durable consumer from the start."""
    got: set[tuple[str, int]] = set()
    async with NatsTransport(url) as t, t.consume("audit") as batches:
        while True:
            with anyio.move_on_after(3) as idle:
                batch = await batches.__anext__()
            if idle.cancelled_caught:
                return got
            got |= {(d.record.episode, d.record.turn) for d in batch if isinstance(d.record, wire.TurnRecord)}
            await batch.ack()


async def test_killed_actor_and_restarted_learner_lose_nothing(tmp_path, repo_env, nats_server):
    tasks = tmp_path / "tasks"
    generate(tasks, 12, seed=5)
    run = tmp_path / "run"
    logs = tmp_path / "logs"
    logs.mkdir()
    url = nats_server.url
    procs: list[subprocess.Popen] = []
    steps: list[int] = []
    async with launch_sampler(port=0, log_path=logs / "sampler.log") as sampler_url:

        def learner() -> subprocess.Popen:
            p = spawn(["t1async.learner", "serve", "--nats", url, "--sampler-url", sampler_url, "--run-dir", str(run),
                       "--batch-turns", "4", "--max-staleness", "1", "--lease", "15"], logs / "learner.log", repo_env)  # fmt: skip
            procs.append(p)
            return p

        def actor(name: str) -> subprocess.Popen:
            p = spawn(["actors", "--nats", url, "--sampler-url", sampler_url, "--tasks", str(tasks), "--split", "all",
                       "--concurrency", "2", "--max-turns", "5", "--max-new-tokens", "24", "--actor-id", name],
                      logs / f"{name}.log", repo_env)  # fmt: skip
            procs.append(p)
            return p

        async def wait_step(n: int) -> None:
            with anyio.fail_after(150):
                while not steps or steps[-1] < n:
                    await anyio.sleep(0.2)

        try:
            async with NatsTransport(url) as t, t.subscribe("t1.metrics.learner") as msgs, anyio.create_task_group() as tg:

                async def watch() -> None:
                    async for m in msgs:
                        steps.append(m.record.step)

                tg.start_soon(watch)
                first = learner()
                a0, a1 = actor("a0"), actor("a1")
                await wait_step(1)
                stop(a1, signal.SIGKILL)  # mid-episode: its open episodes never get an `end`
                await wait_step(2)
                stop(first, signal.SIGKILL)
                resumed_from = LearnerState.load(run / "checkpoints").step
                assert resumed_from >= 2
                steps.clear()
                second = learner()
                await wait_step(resumed_from + 2)
                stop(a0)  # SIGTERM: its open episodes end as "aborted"
                in_stream = await read_stream_turns(url)
                with anyio.fail_after(60):  # the running learner takes what is left on the stream
                    while not in_stream <= journal_turns(run):
                        await anyio.sleep(0.5)
                stop(second)
                tg.cancel_scope.cancel()
        finally:
            for p in procs:
                stop(p, signal.SIGKILL)

    events = [json.loads(x) for x in (logs / "learner.log").read_text().splitlines() if x.startswith("{")]
    ready = [e for e in events if e.get("event") == "learner.ready"]
    assert len(ready) == 2 and ready[0]["resumed"] is None
    assert ready[1]["resumed"].endswith(f"v{resumed_from:06d}"), "the second learner resumed from the first's checkpoint"
    journaled = journal_turns(run)
    assert in_stream and in_stream <= journaled, f"lost: {sorted(in_stream - journaled)[:5]}"
    assert any(ep.startswith("a1-") for ep, _ in in_stream), "the killed actor's turns reached the stream"
    state = LearnerState.load(run / "checkpoints")
    trained = {(ep, t) for ep, ts in state.trained.items() for t in ts}
    assert state.turns_trained == len(trained), "a turn was trained twice"
    assert trained <= journaled and any(ep.startswith("a1-") for ep, _ in trained)
