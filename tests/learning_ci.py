"""Learning in CI, in prime-rl's style: the REAL loop (nats-server with JetStream, the embedded sampler, the
learner with credits and R3, an actor in the bwrap sandbox, all started by ``cluster up``) trains the
``micro`` warm start on the one-command ``touch4`` family (sandbox_agent/synth/micro.py: four files to
create, one test each) and the reward per trained turn (tests passed by the one command) must rise:

- the mean over the last steps > the mean over the first steps + a margin;
- the last steps' mean >= a threshold;
- mean |Δlogp| between sampler and learner on same-version tokens (``mismatch``) <= a bound;
- the learner SIGKILLed mid-run and the cluster started again on the same run dir resumes from its
  checkpoint and its steps stay above the threshold.

The warm start is built once (seeded, cached; ``python -m t1async.learner.warmstart --recipe micro``).

NOT IN THE SUITE YET (the file is not named test_*.py, so pytest does not collect it): the reward does not
rise yet. Run it by name:

    .venv/bin/python -m pytest -q tests/learning_ci.py

Seen on 2026-12-01 (reward per turn, tests of 4, 16 turns a step, README "Learning in CI"): the old warm start
(backticked names) was at chance and RL was flat or collapsed; on the 240-step warm start (greedy 4.00 and
3.33 of 4 at T = 1 on 64 tasks), lr 5e-5, ``--critic detached``: 3.25 3.62 3.19 3.62 3.00 ... 3.44 3.06
3.12 3.50 over 30 steps (first 5: 3.34, last 5: 3.26): stable, no rise. The mismatch on same-version
tokens (eta 0) is ~1e-7.

Since then (README "Learning"): with ``--advantage turn`` the ``learn`` preset does learn, but slowly: held-out
pass@1 +0.9 points after 80 steps at lr 3e-5 and +17.3 after 200 steps at lr 5e-5 (~31 minutes). A step moves
this size of policy little, so ~2 minutes of RL on 2 cores (~10 steps) is not yet enough to assert a rise
that never flakes; this file stays out of the suite until a micro-family moves in that budget.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from sandbox_agent.synth import generate
from t1async.cluster.state import ClusterState
from t1async.learner.checkpoint import latest_checkpoint
from t1async.learner.warmstart import build, get_recipe

pytestmark = pytest.mark.slow

KILL_AT = 20  # the learner is SIGKILLed once it has published this version...
RESUME_TO = 28  # ...and the restarted cluster trains on to this step
FIRST, LAST = 5, 5  # steps averaged at the start and at the end of the first run
MARGIN = 0.3  # tests passed per turn, of 4
THRESHOLD = 3.0  # the warm start samples 3.33 of 4 at T = 1: a collapse falls far below
MISMATCH_BOUND = 0.02


def up_argv(run: Path, tasks: Path, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "t1async.cluster",
        "up",
        "--plain",
        "--run-dir",
        str(run),
        "--tasks",
        str(tasks),
        "--warm-start",
        "micro",
        "--steps",
        str(steps),
        "--seed",
        "0",
        "--actors",
        "1",
        "--concurrency",
        "8",
        "--max-turns",
        "1",
        "--max-new-tokens",
        "40",
        "--max-context",
        "1024",
        "--verify-every",
        "1",
        "--temperature",
        "1.0",
        "--batch-turns",
        "16",
        "--max-staleness",
        "0",
        "--lr",
        "5e-5",
        "--critic",
        "detached",
        "--sampler-max-batch",
        "16",
        "--prefix-cache-tokens",
        "0",
    ]


def steps_of(run: Path, offset: int = 0) -> dict[int, dict]:
    """The learner's per-step numbers from metrics.jsonl past ``offset`` bytes (the last record of each step)."""
    out: dict[int, dict] = {}
    f = run / "metrics.jsonl"
    for line in f.read_bytes()[offset:].decode(errors="replace").splitlines() if f.is_file() else []:
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue
        if m.get("component") == "learner" and m.get("step", 0) >= 1 and m.get("turns"):
            out[int(m["step"])] = m
    return out


def reward(m: dict) -> float:
    return m["reward_sum"] / m["turns"]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the supervisor stops every component it started
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_rl_raises_the_reward_and_a_resumed_run_keeps_it(tmp_path, repo_env):
    build(get_recipe("micro"), threads=1)  # cached after the first run
    tasks = tmp_path / "tasks"
    generate(tasks, 300, seed=0, families=["touch4"])
    run = tmp_path / "run"
    log = open(tmp_path / "up-1.log", "w")
    proc = subprocess.Popen(up_argv(run, tasks, 10 * RESUME_TO), env=repo_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, (
                f"cluster up exited {proc.returncode}: {(tmp_path / 'up-1.log').read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, f"no version {KILL_AT} in 900 s: {sorted(steps_of(run))}"
            ck = latest_checkpoint(run / "checkpoints")
            if ck is not None and ck.version >= KILL_AT:
                break
            time.sleep(1.0)
        learner = ClusterState.load(run).components["learner"].pid
        os.kill(learner, signal.SIGKILL)
        proc.wait(120)  # a dying component ends the cluster
    finally:
        stop(proc)
        log.close()
    first = steps_of(run)
    killed_at = max(first)
    assert killed_at >= KILL_AT
    r = [reward(first[s]) for s in sorted(first)]
    early, late = float(np.mean(r[:FIRST])), float(np.mean(r[-LAST:]))
    curve = " ".join(f"{x:.2f}" for x in r)
    assert late > early + MARGIN, (
        f"reward did not rise: first {FIRST} steps {early:.2f}, last {LAST} {late:.2f}; {curve}"
    )
    assert late >= THRESHOLD, f"final reward {late:.2f} < {THRESHOLD}; {curve}"
    mm = [first[s]["mismatch"] for s in first if first[s].get("mismatch_tokens")]
    assert mm and float(np.mean(mm)) <= MISMATCH_BOUND, (
        f"mean mismatch {np.mean(mm) if mm else None} > {MISMATCH_BOUND}"
    )

    # the learner was SIGKILLed: the same run dir, started again, resumes from its last checkpoint
    offset = (run / "metrics.jsonl").stat().st_size
    log = open(tmp_path / "up-2.log", "w")
    proc = subprocess.Popen(up_argv(run, tasks, RESUME_TO), env=repo_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        rc = proc.wait(900)
    finally:
        stop(proc)
        log.close()
    assert rc == 0, (tmp_path / "up-2.log").read_text()[-3000:]
    second = steps_of(run, offset)
    assert second and min(second) > killed_at and max(second) == RESUME_TO, sorted(second)  # resumed, not restarted
    resumed = [reward(second[s]) for s in sorted(second)]
    assert float(np.mean(resumed)) >= THRESHOLD, f"resumed run fell to {np.mean(resumed):.2f}: {resumed}"
