"""TensorBoard curves (t1async.curves): what is written is what reads back; non-numbers never become points."""

from __future__ import annotations

import math

from t1async.curves import Curves, learner_scalars, read_scalars


def test_scalars_read_back_by_step(tmp_path):
    c = Curves(tmp_path / "tensorboard")
    c.scalars(1, {"a": 0.5, "b": 2, "skip_nan": math.nan, "skip_inf": math.inf, "skip_str": "x", "skip_bool": True})
    c.scalars(2, {"a": 0.75})
    c.close()
    got = read_scalars(tmp_path / "tensorboard")
    assert set(got) == {"a", "b"}
    assert got["a"] == [(1, 0.5), (2, 0.75)] and got["b"] == [(1, 2.0)]


def test_learner_scalars_from_a_step_and_its_metrics():
    step = {"reward_sum": 6.0, "turns": 4, "loss": 0.1, "mismatch": 0.01, "mismatch_tokens": 0, "mean_abs_dlogp": 0.02}
    metrics = {
        "reward_mean": 1.5,
        "resolved_rate": 0.25,
        "max_staleness": 1,
        "turns_per_s": 3.0,
        "drift": {"clean": 7, "realign": 1, "fork": 0},
    }
    out = learner_scalars(step, metrics)
    assert out["train/reward_per_turn"] == 1.5 and out["episodes/resolved_rate"] == 0.25
    assert "train/mismatch" not in out  # measured over no token: no point
    assert out["drift/realign"] == 1 and out["staleness/max"] == 1 and out["throughput/turns_per_s"] == 3.0


def test_no_event_files_reads_empty(tmp_path):
    assert read_scalars(tmp_path) == {}
