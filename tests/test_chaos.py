"""The short chaos run: a real cluster (3 NATS nodes, 2 samplers, 2 actors) takes 4 seeded faults, and its
history, read from the stream and the run dir, shows nothing lost, nothing trained twice, no process left.
``python -m bench.chaos --minutes 15`` is the long version."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# the bench waits for the first step (a cold start builds nothing: the shipped model), then 4 faults each
# followed by its recovery (at most 240 s each), then the audit and the stop
TIMEOUT_S = 900 + 4 * (30 + 240) + 400


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.skipif(os.geteuid() != 0, reason="the disk-full fault mounts a tmpfs: root (CI runs as root)")
def test_four_faults_lose_nothing_and_leave_nothing(tmp_path, repo_env):
    argv = [sys.executable, "-m", "bench.chaos", "--minutes", "3", "--faults", "4", "--seed", "1"]
    argv += ["--kinds", "kill_learner,kill_nats,disk_full,poison", "--gap", "15,25", "--json"]
    argv += ["--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(argv, env=repo_env, capture_output=True, text=True, timeout=TIMEOUT_S - 30)
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), f"no JSON line: {proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1])
    summary = {k: result.get(k) for k in ("faults", "recovered", "turns_acked", "turns_lost", "trained_twice", "leaks")}
    assert result["faults"] == 4 and sorted(f["kind"] for f in result["fault_log"]) == sorted(
        ["kill_learner", "kill_nats", "disk_full", "poison"]
    ), summary
    assert result["turns_acked"] > 0 and result["turns_lost"] == 0, (summary, result.get("lost_examples"))
    assert result["trained_twice"] == 0 and result["leaks"] == 0, (summary, result.get("leaked"))
    # every fault recovered (a step within the bench's 240 s limit); how fast (its target, <= 60 s) is a
    # speed on a noisy shared machine: the bench reports it (docs/results.md), the test does not assert it
    assert result["recovered"] == 4, result["fault_log"]
    assert result["max_staleness"] <= result["eta"] and result["version_went_back"] == 0, summary


async def test_the_audit_read_outlasts_a_503_and_resumes_where_it_stopped(tmp_path):
    """The audit's read of T1_TRAJ, on a real nats-server, sees JetStream answer 503 once mid-read (CI saw one
    after ``kill_nats``: the old read raised it and the bench printed no JSON). It drops the consumer, makes a new
    one from the next sequence, and still returns every turn."""
    import asyncio

    import anyio
    import nats
    import numpy as np
    from nats.js.errors import ServiceUnavailableError

    from bench.chaos import read_turns
    from t1async.protocol import wire
    from t1async.transport.natsd import NatsServer

    def turn(ep: str, t: int) -> bytes:
        ids = np.arange(4, dtype=np.int32)
        return wire.encode(
            wire.TurnRecord(
                episode=ep, turn=t, policy_version=0, keep=0, input_delta=ids, input_len=4,
                input_digest=wire.digest_ids(ids), output_ids=ids, output_logprobs=np.zeros(4, np.float32),
                finish=wire.Finish.STOP, routing=None, reward=0.0, tests_passed=-1, t_sample_s=0.0, t_exec_s=0.0,
            )
        )  # fmt: skip

    starts: list[int] = []

    class Flaky:  # the real consumer, but its second fetch is answered 503
        def __init__(self, sub):
            self.sub, self.calls = sub, 0

        async def fetch(self, n, timeout):
            self.calls += 1
            if self.calls == 1:
                return await self.sub.fetch(2, timeout=timeout)
            if self.calls == 2 and len(starts) == 1:
                raise ServiceUnavailableError(code=503, description="no responders")
            return await self.sub.fetch(n, timeout=timeout)

        async def unsubscribe(self):
            await self.sub.unsubscribe()

    class Js:
        def __init__(self, js):
            self.js = js

        async def stream_info(self, name):
            return await self.js.stream_info(name)

        async def pull_subscribe(self, subject, durable, stream, config):
            starts.append(config.opt_start_seq)
            return Flaky(await self.js.pull_subscribe(subject, durable=durable, stream=stream, config=config))

    async def body(url: str) -> set[tuple[str, int]]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            await js.add_stream(name="T1_TRAJ", subjects=["t1.traj.>"])
            for i in range(5):
                await js.publish(f"t1.traj.e{i % 2}", turn(f"e{i % 2}", i // 2))
            await js.publish("t1.traj.junk", b"not a record")
            return await read_turns(Js(js), deadline_s=60, pause_s=0.01)
        finally:
            await nc.close()

    async with NatsServer.start(tmp_path / "store") as srv:
        got = await anyio.to_thread.run_sync(asyncio.run, body(srv.url))
    assert got == {("e0", 0), ("e1", 0), ("e0", 1), ("e1", 1), ("e0", 2)}
    assert starts == [1, 3]  # the second consumer starts after the two messages the first one delivered
