"""Smoke test of ``python -m bench.ingest``: it runs, checks both implementations agree, and ends with the
JSON line scripts read. Speed is measured by the bench, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_ingest_runs_and_prints_json_last():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.ingest",
            "--json",
            "--turns",
            "12",
            "--repeat",
            "1",
            "--layers",
            "2",
            "--topk",
            "2",
            "--fork-rate",
            "0.2",
            "--realign-rate",
            "0.2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    data = json.loads(last)
    assert {"tokens_per_s", "loop_tokens_per_s", "speedup"} <= set(data)
    assert data["tokens_per_s"] > 0 and data["loop_tokens_per_s"] > 0 and data["tokens"] > 0
    assert "outputs checked equal" in proc.stdout


def test_bench_ingest_help():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ingest", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "--turns" in proc.stdout
