"""``learner serve --nproc 2`` and ``cluster up --learner-procs 2`` as real processes (nats-server, the
embedded sampler, actors in bubblewrap, torchrun's launcher starting rank 0 and rank 1 over gloo): steps
complete, weights are published, and no rank outlives the learner, whether it is stopped (SIGTERM/SIGINT)
or one of its ranks dies; restarted, it resumes from its last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from t1async.procs import pid_alive
from tests.clusterargs import stop_cluster, up_argv


def events(log: Path, name: str) -> list[dict]:
    if not log.is_file():
        return []
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written
    return [e for e in out if e.get("event") == name]


async def wait_for(fn, timeout_s: float, what: str):  # noqa: ANN001, ANN201
    with anyio.fail_after(timeout_s):
        while not (v := fn()):
            await anyio.sleep(0.2)
    return v


def cluster_up(
    tmp_path: Path, run: Path, env: dict, *, procs: int, steps: int, sync: str = "disk", extra: tuple[str, ...] = ()
) -> None:
    """A short ``cluster up`` on ``run`` with a ``procs``-rank learner until ``steps`` steps; must finish."""
    argv = [
        *up_argv(run),
        "--steps",
        str(steps),
        "--batch-turns",
        "6",
        "--actors",
        "1",
        "--concurrency",
        "2",
        "--max-turns",
        "4",
        "--max-new-tokens",
        "24",
        "--synth-tasks",
        "10",
        "--learner-procs",
        str(procs),
        "--weight-sync",
        sync,
        "--duration",
        "400",
        "--plain",
        *extra,
    ]
    with open(tmp_path / "up.out", "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=420)
        finally:
            stop_cluster(proc, run, 60)
    text = (tmp_path / "up.out").read_text()
    assert proc.returncode == 0 and "cluster stopped: learner finished" in text, text[-3000:]


async def test_cluster_up_with_a_two_rank_learner(tmp_path, repo_env):
    run = tmp_path / "run"
    # the weights go over torch.distributed too (only rank 0 is in the samplers' group); the slow test below
    # covers the disk path with 2 ranks. The KL anchor's reference is sharded like the policy: each rank reads
    # its own rows of both (learner.rank_loaded, twice a rank)
    anchor = ("--kl-ref-coef", "0.5", "--prefix-kv", "exact")
    cluster_up(tmp_path, run, repo_env, procs=2, steps=2, sync="distributed", extra=anchor)
    log = run / "logs" / "learner.log"
    assert [e["nproc"] for e in events(log, "learner.ranks_joined")] == [2]
    loaded = sorted(e["rank"] for e in events(log, "learner.rank_loaded"))
    assert loaded == [0, 0, 1, 1], events(log, "learner.rank_loaded")
    steps = events(log, "learner.dist_step")
    assert [e["ranks"] for e in steps] == [2, 2] and all(len(e["tokens"]) == 2 for e in steps), steps
    assert all(len(e["busy_s"]) == 2 and min(e["busy_s"]) > 0 for e in steps), steps
    assert [e["policy_version"] for e in events(log, "learner.step")] == [1, 2]
    assert (run / "checkpoints" / "v000002" / "model.safetensors.index.json").is_file()  # sharded, every rank
    assert [(e["path"], e["policy_version"]) for e in events(log, "learner.weights_pushed")] == [
        ("distributed", 1),
        ("distributed", 2),
    ]
    updated = events(run / "logs" / "sampler.log", "engine.weights_updated")  # applied from the received tensors
    assert [(e["path"], str(e["weight_version"])) for e in updated] == [("(tensors)", "1"), ("(tensors)", "2")], updated
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert {m.get("learner_ranks") for m in metrics if m["component"] == "learner"} == {2}
    pids = rank_pids(log)
    assert len(pids) == 3 and events(log, "learner.rank_stopped") and not any(pid_alive(p) for p in pids)


@pytest.mark.slow
async def test_cluster_resumes_across_rank_counts(tmp_path, repo_env):
    """The checkpoints are N-free: 1 rank trains v1, 2 ranks resume from it to v3, 1 rank resumes to v4."""
    run = tmp_path / "run"
    log = run / "logs" / "learner.log"
    for procs, steps in ((1, 1), (2, 3), (1, 4)):
        cluster_up(tmp_path, run, repo_env, procs=procs, steps=steps)
    ready = events(log, "learner.ready")
    assert [e["policy_version"] for e in ready] == [0, 1, 3]
    assert [e["resumed"] and Path(e["resumed"]).name for e in ready] == [None, "v000001", "v000003"]
    assert [e["policy_version"] for e in events(log, "learner.step")] == [1, 2, 3, 4]
    assert [e["step"] for e in events(log, "learner.dist_step")] == [2, 3]  # the 2-rank run's steps
    updated = events(run / "logs" / "sampler.log", "sampler.weights_updated")
    assert [str(e["weight_version"]) for e in updated][-1] == "4"


def rank_pids(log: Path) -> list[int]:
    """The launcher's, rank 0's and rank 1's pids, as they logged them."""
    launcher = [e["launcher_pid"] for e in events(log, "learner.ranks_starting")]
    return (
        launcher[-1:]
        + [e["pid"] for e in events(log, "learner.ranks_joined")][-1:]
        + [e["pid"] for e in events(log, "learner.rank_ready")][-1:]
    )


def serve(tmp_path: Path, url: str, env: dict) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "learner.log"
    argv = [
        sys.executable,
        "-m",
        "t1async.learner",
        "serve",
        "--nats",
        url,
        "--run-dir",
        str(tmp_path / "run"),
        "--nproc",
        "2",
    ]
    proc = subprocess.Popen(argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_stopped_learner_stops_its_ranks(tmp_path, repo_env, nats_server, sig):
    proc, log = serve(tmp_path, nats_server.url, repo_env)
    try:
        await wait_for(lambda: events(log, "learner.ready"), 120, "the learner ready")
        pids = rank_pids(log)
        assert len(pids) == 3 and all(pid_alive(p) for p in pids)
        os.kill(proc.pid, sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, -sig), log.read_text()[-2000:]
    assert events(log, "learner.rank_stopped"), "rank 1 was told to stop, not killed"
    assert not any(pid_alive(p) for p in pids)


async def test_a_dead_rank_stops_the_learner_and_a_restart_resumes(tmp_path, repo_env, nats_server):
    """Rank 1 SIGKILLed: one line naming it, exit 2, no rank left behind; run again, the learner resumes from
    the last checkpoint (v1, written by one rank: checkpoints load at any number of ranks)."""
    from t1async.learner.state import LearnerState
    from t1async.learner.trainer import Trainer
    from t1async.model.weights import default_model_dir, load_pretrained

    ckpts = tmp_path / "run" / "checkpoints"
    Trainer(load_pretrained(default_model_dir())).save(ckpts, 1)
    LearnerState(policy_version=1, step=1).save(ckpts)
    proc, log = serve(tmp_path, nats_server.url, repo_env)
    try:
        await wait_for(lambda: events(log, "learner.ready"), 120, "the learner ready")
        pids = rank_pids(log)
        os.kill(pids[2], signal.SIGKILL)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    line = f"error: learner rank 1 (pid {pids[2]}) exited with code -9; the learner stops (restart it: it resumes"
    assert proc.returncode == 2 and line in text, text[-3000:]
    assert [x for x in text.splitlines() if x.startswith("error:")] == [x for x in text.splitlines() if line in x]
    assert not any(pid_alive(p) for p in pids)
    proc, log = serve(tmp_path, nats_server.url, repo_env)  # restarted (cluster up's supervisor does it too)
    try:
        ready = await wait_for(lambda: events(log, "learner.ready")[1:], 120, "the restarted learner ready")
        assert ready[0]["policy_version"] == 1 and Path(ready[0]["resumed"]).name == "v000001"
        pids = rank_pids(log)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and not any(pid_alive(p) for p in pids)
