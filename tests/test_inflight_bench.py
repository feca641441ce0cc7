"""Smoke test of ``python -m bench.inflight --quick``: it runs end to end on a real embedded sampler and ends
with the JSON line scripts read; with retract every token decoded after an update replays exactly and no
request is aborted, in_place mixes policies, abort aborts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_inflight_quick_runs_and_prints_json_last():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.inflight", "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(data) == {"mismatch", "aborted", "updates", "by_mode", "engine"} and data["engine"] == "embedded"
    assert set(data["by_mode"]) == {"retract", "in_place", "abort"}
    retract, in_place, abort = (data["by_mode"][m] for m in ("retract", "in_place", "abort"))
    assert data["updates"] == retract["updates"] == 10 and data["aborted"] == retract["aborted"] == 0
    assert retract["tokens_after_update"] > 0 and data["mismatch"] == retract["mismatch"] <= 1e-4
    assert in_place["aborted"] == 0 and in_place["mismatch"] > 1e-3  # new weights over old KV
    assert abort["aborted"] > 0 and abort["tokens_after_update"] == 0


def test_bench_inflight_rejects_an_unknown_mode():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.inflight", "--modes", "retract,freeze"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "retract, in_place, abort" in proc.stderr


def test_bench_inflight_takes_a_transformers_checkpoint(tmp_path):
    """``--model DIR``: the pushes and the replay run on a Qwen3-MoE transformers wrote (one dense layer)."""
    pytest.importorskip("transformers")
    from t1async.testing.models import transformers_qwen3_dir

    d = transformers_qwen3_dir(tmp_path / "qwen3")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.inflight", "--quick", "--modes", "retract", "--json", "--model", str(d)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["updates"] == 10 and data["aborted"] == 0 and data["mismatch"] <= 1e-4
