"""``TrainerConfig.value_lr``: the value head learns at its own rate, through the learner CLI and cluster up."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from t1async.learner.trainer import Trainer
from t1async.learner.trainer_config import TrainerConfig
from t1async.protocol.errors import ConfigError
from tests.segments import CFG, sampled_segment, tiny


def _segments(model):
    toks = np.random.default_rng(5).integers(0, CFG.vocab_size, size=60)
    return [
        sampled_segment(model, toks, range(30, 60), reward=4.0),
        sampled_segment(model, toks[:40], range(20, 40), reward=0.0, episode="b"),
    ]


def _moves(cfg: TrainerConfig, steps: int = 1) -> tuple[float, float, list[float]]:
    """(largest trunk move, largest value-head move, value mean per step) over ``steps`` steps."""
    torch.manual_seed(0)
    model = tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model, cfg)
    values = [trainer.step(_segments(model), s).value_mean for s in range(steps)]
    moved = {n: float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters()}
    trunk = max(v for n, v in moved.items() if not n.startswith("value_head"))
    head = max(v for n, v in moved.items() if n.startswith("value_head"))
    return trunk, head, values


def test_the_value_head_steps_at_value_lr_and_the_policy_at_lr():
    # AdamW's first step moves each parameter with a gradient by about its group's lr (m / sqrt(v) = sign)
    trunk, head, _ = _moves(TrainerConfig(lr=1e-4, value_lr=1e-2, critic="detached"))
    assert trunk == pytest.approx(1e-4, rel=0.05)
    assert head == pytest.approx(1e-2, rel=0.05)
    trunk0, head0, _ = _moves(TrainerConfig(lr=1e-4, critic="detached"))  # unset: one rate for both
    assert trunk0 == pytest.approx(1e-4, rel=0.05) and head0 == pytest.approx(1e-4, rel=0.05)


def test_a_faster_value_head_tracks_the_returns():
    # returns here are 4 and 0 (mean ~2 over loss tokens); a fresh head starts near 0
    cfg = TrainerConfig(lr=1e-5, critic="detached", normalize_advantages=True, value_clip=None)
    *_, slow = _moves(cfg, steps=12)
    *_, fast = _moves(TrainerConfig(**{**cfg.__dict__, "value_lr": 3e-2}), steps=12)
    assert abs(slow[-1] - slow[0]) < 0.05  # at the policy's rate the head barely moves
    assert fast[-1] > fast[0] + 0.5  # at its own rate it climbs toward the returns


def test_value_lr_survives_a_checkpoint_and_bad_values_are_refused(tmp_path):
    torch.manual_seed(0)
    model = tiny()
    trainer = Trainer(model, TrainerConfig(lr=1e-4, value_lr=3e-3, critic="detached"))
    trainer.step(_segments(model), 0)
    saved = trainer.save(tmp_path / "ck", policy_version=1)
    again = Trainer(tiny(), TrainerConfig(lr=1e-4, value_lr=3e-3, critic="detached"))
    again.load(saved.path)
    assert [g["lr"] for g in again.optimizer.param_groups] == [1e-4, 3e-3]
    assert again.steps == 1
    with pytest.raises(ConfigError, match="value_lr must be > 0"):
        TrainerConfig(value_lr=0.0)


def test_cluster_up_value_lr_reaches_the_learner(tmp_path):
    from t1async.cluster.config import from_args
    from tests.clusterargs import learner_argv, learner_toml, serve_args

    argv = learner_argv(tmp_path / "a", "--value-lr", "0.003")
    assert learner_toml(argv)["value_lr"] == 0.003  # in the learner's --config file, not re-spelled as a flag
    assert serve_args(argv).value_lr == 0.003
    unset = learner_argv(tmp_path / "b")
    assert "value_lr" not in learner_toml(unset) and serve_args(unset).value_lr is None  # the learner's default
    with pytest.raises(ConfigError, match="--value-lr must be > 0"):
        from_args(argparse.Namespace(run_dir=tmp_path, value_lr=-1.0))
