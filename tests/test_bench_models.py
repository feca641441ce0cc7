"""Every bench that runs a model takes ``--model DIR``: here a Qwen3-MoE that transformers wrote (one dense layer,
4 experts), which none of our code built, through ``bench.weights`` and ``bench.learner_ranks``; a bad dir is
one line and exit 2 before anything starts (``bench.staleness`` starts a whole cluster otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
transformers = pytest.importorskip("transformers")  # a dev dependency: it writes the checkpoint


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from t1async.testing.models import transformers_qwen3_dir

    return transformers_qwen3_dir(tmp_path_factory.mktemp("qwen3"))


def bench(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_bench_weights_pushes_that_checkpoint(qwen3: Path) -> None:
    p = bench("bench.weights", "--model", str(qwen3), "--repeats", "1", "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    n = sum(t.numel() for t in transformers.AutoModelForCausalLM.from_pretrained(qwen3).parameters())
    assert list(res["configs"]) == [str(qwen3)] and res["params"] == n + 65  # + our value head (hidden 64 + bias)
    assert res["disk_s"] > 0 and res["distributed_s"] > 0


def test_bench_learner_ranks_trains_that_checkpoint(qwen3: Path) -> None:
    argv = ["--ranks", "1", "--model", str(qwen3), "--segments", "2", "--seq-len", "64", "--json"]
    p = bench("bench.learner_ranks", *argv)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["model"] == str(qwen3) and res["configs"]["1"]["step_s"] > 0


@pytest.mark.parametrize("name", ["bench.staleness", "bench.weights", "bench.learner_ranks", "bench.inflight"])
def test_a_bad_model_dir_is_one_line_and_exit_2(name: str, tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    p = bench(name, "--model", str(tmp_path / "m"), timeout=120)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1 and "is not a model dir" in err[0] and "config.json" in err[0], err
