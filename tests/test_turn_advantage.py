"""``TrainerConfig.advantage = "turn"``: each turn's tokens get the turn's own reward minus the step's mean reward of
turns with the same turn number (ppo.turn_baseline / ppo.turn_advantages), through the learner and cluster up."""

from __future__ import annotations

import argparse
import copy

import numpy as np
import pytest
import torch

from t1async.ingest.tito import Segment
from t1async.learner import ppo
from t1async.learner.trainer import Trainer
from t1async.learner.trainer_config import TrainerConfig
from t1async.protocol.errors import ConfigError
from tests.segments import CFG, advantages_fed_to_the_loss, tiny, two_turn_segment


def test_each_turn_is_centred_on_the_mean_of_its_turn_number():
    toks = np.random.default_rng(1).integers(0, CFG.vocab_size, size=30)
    model = tiny()
    a = two_turn_segment(model, toks, (2.0, 0.0), "a")
    b = two_turn_segment(model, toks, (0.0, 2.0), "b")
    c = two_turn_segment(model, toks, (1.0, 1.0), "c")
    base = ppo.turn_baseline([a, b, c])
    assert base == {0: pytest.approx(1.0), 1: pytest.approx(1.0)}
    adv = ppo.turn_advantages(a.loss_mask, a.turn_ids, a.turn_ends, a.turn_rewards, base)
    # a's first turn did better than the other first turns, its second worse: no credit flows between them
    assert np.allclose(adv[10:15], 1.0) and np.allclose(adv[20:25], -1.0)
    assert np.all(adv[~a.loss_mask] == 0)
    # GAE with a fresh critic would give the first turn the whole episode's return (2 + 0) instead
    gae, _ = ppo.segment_advantages(
        a.loss_mask, np.zeros(len(toks) + 1), a.turn_ends, a.turn_rewards, True, gamma=1.0, lam=1.0
    )
    assert np.allclose(gae[10:15], 2.0)


def test_a_turn_with_no_loss_tokens_is_left_out_and_a_lone_turn_number_gets_zero():
    toks = np.random.default_rng(2).integers(0, CFG.vocab_size, size=30)
    model = tiny()
    a = two_turn_segment(model, toks, (3.0, 5.0), "a")
    lm = a.loss_mask.copy()
    lm[20:25] = False  # turn 1's output was discarded (REALIGN): context, not loss
    a2 = Segment(**{**a.__dict__, "loss_mask": lm})
    b = two_turn_segment(model, toks, (1.0, 0.0), "b")
    base = ppo.turn_baseline([a2, b])
    assert base[0] == pytest.approx(2.0) and base[1] == pytest.approx(0.0)  # a2's turn 1 is not averaged in
    adv_b = ppo.turn_advantages(b.loss_mask, b.turn_ids, b.turn_ends, b.turn_rewards, base)
    assert np.allclose(adv_b[10:15], -1.0) and np.allclose(adv_b[20:25], 0.0)  # b's turn 1 is alone: no baseline


def test_the_trainer_feeds_the_centred_turn_rewards_to_the_loss(monkeypatch):
    toks = np.random.default_rng(3).integers(0, CFG.vocab_size, size=30)
    base = tiny()
    segs = [
        two_turn_segment(base, toks, (2.0, 0.0), "a"),
        two_turn_segment(base, toks, (0.0, 2.0), "b"),
    ]
    cfg = TrainerConfig(advantage="turn", normalize_advantages=False, microbatch_tokens=40)
    adv, calls = advantages_fed_to_the_loss(monkeypatch, copy.deepcopy(base), cfg, segs)
    assert calls == 2  # one micro-batch each: the baseline is the step's, not the micro-batch's
    assert sorted(np.round(adv, 4).tolist()) == [-1.0] * 10 + [1.0] * 10
    with pytest.raises(ConfigError, match="advantage must be 'gae' or 'turn' or 'grpo' or 'rloo'"):
        TrainerConfig(advantage="ppo")


def test_turn_advantages_raise_a_better_first_turn_whatever_the_second_did():
    torch.manual_seed(0)
    model = tiny()
    toks = np.random.default_rng(4).integers(0, CFG.vocab_size, size=30)
    good, bad = toks.copy(), toks.copy()
    bad[10:15] = (bad[10:15] + 7) % CFG.vocab_size  # a different first reply

    def logp_turn0(seq) -> float:
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.from_numpy(np.asarray(seq, dtype=np.int64)[None])).logits[0].float(), -1)
        return float(sum(lp[p - 1, int(seq[p])] for p in range(10, 15)))

    before = logp_turn0(good)
    trainer = Trainer(model, TrainerConfig(lr=3e-3, advantage="turn"))
    for _ in range(6):
        # the good first reply is followed by a poor second turn: under GAE its tokens would share that blame
        segs = [two_turn_segment(model, good, (2.0, 0.0), "g"), two_turn_segment(model, bad, (0.0, 2.0), "b")]
        trainer.step(segs, 0)
    assert logp_turn0(good) > before + 0.1


def test_cluster_up_advantage_reaches_the_learner(tmp_path):
    from t1async.cluster.config import from_args
    from tests.clusterargs import learner_argv, learner_toml, serve_args

    argv = learner_argv(tmp_path / "a", "--advantage", "turn")
    assert learner_toml(argv)["advantage"] == "turn" and "--advantage" not in argv
    assert serve_args(argv).advantage == "turn"
    assert serve_args(learner_argv(tmp_path / "b")).advantage == "gae"  # the default
    with pytest.raises(ConfigError, match="--advantage must be one of gae, turn, grpo, rloo"):
        from_args(argparse.Namespace(run_dir=tmp_path, advantage="ppo"))
