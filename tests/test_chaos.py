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
