"""Smoke test of ``python -m bench.sandbox``: it runs and ends with the JSON line scripts read. Speed is
measured by the bench, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_sandbox_bwrap_runs_and_prints_json_last() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.sandbox", "--execs", "20", "--starts", "1", "--backend", "bwrap"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"bwrap_start_ms", "bwrap_exec_p50_ms", "bwrap_exec_p99_ms", "bwrap_verify_ms", "exec_p50_ms"} <= set(data)
    assert 0 < data["bwrap_exec_p50_ms"] <= data["bwrap_exec_p99_ms"]
