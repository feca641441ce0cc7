"""``learner serve --weight-sync distributed`` as processes: a real nats-server, a real embedded sampler
process, the learner process and an actor process; weights go learner -> sampler over a gloo group on
127.0.0.1, never through the sampler reading a checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import numpy as np
import pytest

from sandbox_agent.synth import generate
from t1async.model.weights import default_model_dir
from t1async.protocol.sampling import SamplingParams
from t1async.sampler.client import SGLangClient
from t1async.sampler.launch import launch_sampler
from tests.clusterargs import up_argv

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 230, 7, 64, 301, 12]


def spawn(argv: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", *argv], stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.kill(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def events(log: Path, name: str) -> list[dict]:
    out = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    return [e for e in out if e.get("event") == name]


async def wait_exit(p: subprocess.Popen, log: Path, timeout_s: float) -> None:
    with anyio.fail_after(timeout_s):
        while p.poll() is None:
            await anyio.sleep(0.3)
    assert p.returncode == 0, log.read_text()[-3000:]


async def test_learner_process_pushes_over_gloo_and_resyncs_after_restart(tmp_path, repo_env, nats_server):
    tasks, run, logs = tmp_path / "tasks", tmp_path / "run", tmp_path / "logs"
    generate(tasks, 6, seed=3)
    logs.mkdir()
    url = nats_server.url
    roots = (tmp_path, default_model_dir().parent)
    async with (
        launch_sampler(port=0, log_path=logs / "sampler.log", allowed_weight_roots=roots) as surl,
        SGLangClient([surl]) as client,
    ):

        async def sample() -> tuple[np.ndarray, np.ndarray, int]:
            g = await client.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0, seed=1))
            return g.output_ids, g.logprobs, g.policy_version

        learner_argv = [
            "t1async.learner",
            "serve",
            "--nats",
            url,
            "--sampler-url",
            surl,
            "--run-dir",
            str(run),
            "--batch-turns",
            "4",
            "--max-staleness",
            "1",
            "--steps",
            "2",
            "--lr",
            "1e-2",
            "--weight-sync",
            "distributed",
            "--weight-bucket-mb",
            "4",
        ]
        learner = spawn(learner_argv, logs / "learner.log", repo_env)
        actor = spawn(
            [
                "actors",
                "--nats",
                url,
                "--sampler-url",
                surl,
                "--tasks",
                str(tasks),
                "--split",
                "all",
                "--concurrency",
                "2",
                "--max-turns",
                "3",
                "--max-new-tokens",
                "24",
                "--actor-id",
                "a1",
            ],
            logs / "a1.log",
            repo_env,
        )
        try:
            await wait_exit(learner, logs / "learner.log", 300)
        finally:
            stop(actor)
            stop(learner)
        pushed = events(logs / "learner.log", "learner.weights_pushed")
        assert [e["policy_version"] for e in pushed] == [1, 2] and all(e["buckets"] > 1 for e in pushed), pushed
        assert not events(logs / "sampler.log", "sampler.weights_updated")  # nothing went through the disk path
        assert len(events(logs / "sampler.log", "sampler.weights_received")) >= 2 * pushed[0]["buckets"]
        ids2, lp2, v2 = await sample()
        assert v2 == 2
        ckpt = run / "checkpoints" / "v000002"
        # back to the shipped weights, then restart the learner: it re-syncs the sampler over a new group
        await client.update_weights_from_disk(str(default_model_dir()), 0)
        ids0, lp0, _ = await sample()
        assert not (np.array_equal(ids0, ids2) and np.allclose(lp0, lp2))
        again = spawn(learner_argv, logs / "learner2.log", repo_env)
        try:
            await wait_exit(again, logs / "learner2.log", 180)
        finally:
            stop(again)
        assert [e["path"] for e in events(logs / "learner2.log", "learner.samplers_synced")] == ["distributed"]
        ids3, lp3, v3 = await sample()
        assert v3 == 2 and np.array_equal(ids2, ids3)
        np.testing.assert_allclose(lp2, lp3, rtol=0, atol=1e-6)
        # and the checkpoint the learner wrote holds those same weights
        await client.update_weights_from_disk(str(ckpt), 5)
        ids4, lp4, v4 = await sample()
        assert v4 == 5 and np.array_equal(ids2, ids4)
        np.testing.assert_allclose(lp2, lp4, rtol=0, atol=1e-6)
        info = httpx.get(surl + "/get_model_info", timeout=10).json()  # the live version (SGLang's too)
        assert info["weight_version"] == "5"


def test_cluster_up_with_distributed_weight_sync(tmp_path, repo_env):
    run = tmp_path / "run"
    argv = [
        *up_argv(run),
        "--steps",
        "2",
        "--batch-turns",
        "4",
        "--actors",
        "1",
        "--max-turns",
        "3",
        "--max-new-tokens",
        "24",
        "--weight-sync",
        "distributed",
        "--weight-bucket-mb",
        "4",
        "--duration",
        "400",
        "--plain",
    ]
    out = subprocess.run(argv, env=repo_env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "learner finished" in out.stdout
    pushed = events(run / "logs" / "learner.log", "learner.weights_pushed")
    assert [e["policy_version"] for e in pushed] == [1, 2] and all(e["path"] == "distributed" for e in pushed), pushed
    assert not events(run / "logs" / "sampler.log", "sampler.weights_updated")  # nothing through the disk path
    bad = subprocess.run(
        [*argv[:4], "--run-dir", str(tmp_path / "bad"), "--weight-bucket-mb", "0"],
        env=repo_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "--weight-bucket-mb must be > 0, got 0.0" in bad.stderr + bad.stdout
