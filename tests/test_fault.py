"""Faults in a real loop: an actor is SIGKILLed and the learner is SIGKILLed and restarted mid-run. Every
turn that reached the stream is durably taken by the learner, no turn is trained twice, and the restarted
learner goes on from the version it last pushed (its full checkpoints are 10 steps apart)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from sandbox_agent.synth import generate
from t1async.credits.settle import trained_counts
from t1async.ingest.journal import read_journal
from t1async.learner.checkpoint import list_checkpoints, list_exports
from t1async.learner.state import LearnerState
from t1async.protocol import wire
from t1async.sampler.launch import launch_sampler
from t1async.transport import NatsTransport

pytestmark = pytest.mark.slow


def spawn(argv: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", *argv], stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


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
    async with launch_sampler(port=0, log_path=logs / "sampler.log", allowed_weight_roots=(tmp_path,)) as sampler_url:

        def learner() -> subprocess.Popen:
            p = spawn(
                [
                    "t1async.learner",
                    "serve",
                    "--nats",
                    url,
                    "--sampler-url",
                    sampler_url,
                    "--run-dir",
                    str(run),
                    "--batch-turns",
                    "4",
                    "--max-staleness",
                    "1",
                    "--lease",
                    "15",
                ],
                logs / "learner.log",
                repo_env,
            )
            procs.append(p)
            return p

        def actor(name: str) -> subprocess.Popen:
            p = spawn(
                [
                    "actors",
                    "--nats",
                    url,
                    "--sampler-url",
                    sampler_url,
                    "--tasks",
                    str(tasks),
                    "--split",
                    "all",
                    "--concurrency",
                    "2",
                    "--max-turns",
                    "5",
                    "--max-new-tokens",
                    "24",
                    "--actor-id",
                    name,
                    "--work-dir",  # a SIGKILLed actor's episode dirs stay here, not in the system temp dir
                    str(tmp_path / "work" / name),
                ],
                logs / f"{name}.log",
                repo_env,
            )
            procs.append(p)
            return p

        async def wait_step(n: int) -> None:
            with anyio.fail_after(150):
                while not steps or steps[-1] < n:
                    await anyio.sleep(0.2)

        try:
            async with (
                NatsTransport(url) as t,
                t.subscribe("t1.metrics.learner") as msgs,
                t.subscribe("t1.traj.*") as trajs,
                anyio.create_task_group() as tg,
            ):
                a1_published = anyio.Event()

                async def watch() -> None:
                    async for m in msgs:
                        steps.append(m.record.step)

                async def watch_a1() -> None:
                    async for m in trajs:
                        if isinstance(m.record, wire.TurnRecord) and m.record.episode.startswith("a1-"):
                            a1_published.set()
                            return

                tg.start_soon(watch)
                tg.start_soon(watch_a1)
                first = learner()
                a0, a1 = actor("a0"), actor("a1")
                await wait_step(1)
                with anyio.fail_after(150):  # a step can be all a0's turns: kill a1 only once it has published
                    await a1_published.wait()
                stop(a1, signal.SIGKILL)  # mid-episode: its open episodes never get an `end`
                await wait_step(2)
                stop(first, signal.SIGKILL)
                # the newest version whose weights are complete on disk (pushed): an export, as the default
                # --checkpoint-every 10 wrote no full checkpoint yet; a step killed mid-save left none
                pushed = [int(p.name[1:]) for p in list_exports(run / "checkpoints")]
                pushed += [c.policy_version for c in list_checkpoints(run / "checkpoints")]
                resumed_from = max(pushed, default=0)
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
    assert ready[1]["resumed"].endswith(f"v{resumed_from:06d}") and ready[1]["policy_version"] == resumed_from, (
        "the second learner goes on from the version the first pushed last"
    )
    replayed = [e for e in events if e.get("event") == "learner.resume_replayed"]
    assert [(e["policy_version"], e["max_abs_dw"]) for e in replayed] == [(resumed_from, 0.0)], replayed
    journaled = journal_turns(run)
    assert in_stream and in_stream <= journaled, f"lost: {sorted(in_stream - journaled)[:5]}"
    assert any(ep.startswith("a1-") for ep, _ in in_stream), "the killed actor's turns reached the stream"
    state = LearnerState.load(run / "checkpoints")
    # the independent record: each step's trained set, written before the step ran (a crashed step's line is
    # superseded by the resumed learner's line for the same version)
    counted, counts = trained_counts(run, state.policy_version)
    assert sorted(counted) == list(range(state.policy_version))
    twice = sorted(k for k, c in counts.items() if c > 1)
    assert not twice, f"trained twice: {twice[:5]}"
    trained = set(counts)
    assert trained == {(ep, t) for ep, ts in state.trained.items() for t in ts}
    assert trained <= journaled and any(ep.startswith("a1-") for ep, _ in trained)


async def test_a_killed_actor_at_eta0_releases_its_credits_and_training_resumes(tmp_path, repo_env, nats_server):
    """η = 0: a SIGKILLed actor's credits (granted or held) would stop the training order until their 180 s
    lease ran out. It stops heartbeating; after --actor-timeout (15 s) the learner releases its credits and
    ends its open episodes as aborted, and training resumes well within 30 s of the kill."""
    tasks = tmp_path / "tasks"
    generate(tasks, 12, seed=7)
    run, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    url = nats_server.url
    procs: list[subprocess.Popen] = []
    steps: list[tuple[float, int]] = []
    last: dict = {}
    async with launch_sampler(port=0, log_path=logs / "sampler.log", allowed_weight_roots=(tmp_path,)) as sampler_url:

        def actor(name: str, concurrency: int) -> subprocess.Popen:
            p = spawn(
                [
                    "actors",
                    "--nats",
                    url,
                    "--sampler-url",
                    sampler_url,
                    "--tasks",
                    str(tasks),
                    "--split",
                    "all",
                    "--concurrency",
                    str(concurrency),
                    "--max-turns",
                    "30",
                    "--max-new-tokens",
                    "16",
                    "--actor-id",
                    name,
                    "--work-dir",  # a SIGKILLed actor's episode dirs stay here, not in the system temp dir
                    str(tmp_path / "work" / name),
                ],
                logs / f"{name}.log",
                repo_env,
            )
            procs.append(p)
            return p

        async def wait_step(n: int, timeout: float) -> None:
            with anyio.fail_after(timeout):
                while not steps or steps[-1][1] < n:
                    await anyio.sleep(0.2)

        try:
            async with (
                NatsTransport(url) as t,
                t.subscribe("t1.metrics.learner") as msgs,
                anyio.create_task_group() as tg,
            ):

                async def watch() -> None:
                    async for m in msgs:
                        steps.append((time.monotonic(), m.record.step))
                        last.update(m.record.values)

                tg.start_soon(watch)
                procs.append(
                    spawn(
                        [
                            "t1async.learner",
                            "serve",
                            "--nats",
                            url,
                            "--sampler-url",
                            sampler_url,
                            "--run-dir",
                            str(run),
                            "--batch-turns",
                            "2",
                            "--max-staleness",
                            "0",
                        ],
                        logs / "learner.log",
                        repo_env,
                    )
                )
                actor("a0", 1)
                a1 = actor("a1", 3)  # most of the η = 0 capacity is a1's at any moment
                await wait_step(2, 180)
                stop(a1, signal.SIGKILL)
                killed_at, at_kill = time.monotonic(), steps[-1][1]
                await wait_step(at_kill + 2, 60)  # a step in flight at the kill, then one more
                resumed_after = next(ts for ts, st in steps if st >= at_kill + 2) - killed_at
                with anyio.fail_after(30):
                    while last.get("actors_timed_out", 0) < 1:
                        await anyio.sleep(0.2)
                tg.cancel_scope.cancel()
        finally:
            for p in procs:
                stop(p, signal.SIGKILL if p is not procs[0] else signal.SIGTERM)
    assert resumed_after < 30, f"training resumed {resumed_after:.0f} s after the kill"
    events = [json.loads(x) for x in (logs / "learner.log").read_text().splitlines() if x.startswith("{")]
    silent = [e for e in events if e.get("event") == "learner.actor_silent"]
    assert [e["actor"] for e in silent] == ["a1"], silent
    assert silent[0]["credits_released"] + silent[0]["episodes_aborted"] >= 1
    recs = list(read_journal(run / "learner" / "journal"))
    started = {r.episode for r in recs if isinstance(r, wire.StartRecord) and r.actor == "a1"}
    ends = {r.episode: r for r in recs if isinstance(r, wire.EndRecord)}
    assert started and started <= set(ends), f"a1 episodes left open: {sorted(started - set(ends))[:3]}"
    aborted = [ends[ep] for ep in started if ends[ep].detail.startswith("the learner ended it")]
    assert len(aborted) == silent[0]["episodes_aborted"] >= 1
    assert all(e.reason == wire.EndReason.ABORTED for e in aborted)
