"""Smoke test of ``python -m bench.r3flush``: it runs end to end on the real engine and ends with the JSON
line scripts read; the exact replay reproduces every sampled logprob, the old rows do not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_r3flush_runs_and_prints_json_last():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.r3flush", "--json", "--episodes", "2", "--turns", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    exact, old = data["exact"], data["old"]
    assert exact["tokens"] == old["tokens"] == 2 * 3 * 24
    assert exact["route_forks"] >= 1 and exact["rerouted_rows"] > 0 and old["route_forks"] == 0
    assert exact["stale_context_routes"] == 0 and old["stale_context_routes"] == 2 * 2  # each turn after an update
    assert exact["max_abs_dlogp"] < 1e-4 < old["max_abs_dlogp"]


def test_bench_r3flush_rejects_a_run_without_an_update():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.r3flush", "--turns", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--turns >= 2" in proc.stderr
