"""``--kl-ref-coef``: a KL penalty that anchors the policy to RL's initial weights (the reference model). The
loss term's value and gradient, a trainer held nearer its start than without it, the reference kept at the
initial weights when a learner resumes from a checkpoint, and the settings it refuses."""

from __future__ import annotations

import argparse
import copy
from dataclasses import replace

import pytest
import torch

from t1async.learner import ppo
from t1async.learner.checkpoint import list_checkpoints
from t1async.learner.service import Learner
from t1async.learner.settings import LearnerConfig
from t1async.learner.trainer import Trainer
from t1async.learner.trainer_config import TrainerConfig
from t1async.model.weights import load_pretrained
from t1async.protocol.errors import ConfigError
from t1async.transport import MemoryBroker, MemoryTransport
from tests.loops import train_waves
from tests.segments import sampled_segment, tiny

EXACT = {"prefix_kv": "exact"}


def _terms(logp: torch.Tensor, ref: torch.Tensor | None, coef: float) -> ppo.LossTerms:
    cfg = TrainerConfig(kl_ref_coef=coef, value_coef=0.0, **EXACT)
    zeros = torch.zeros_like(logp)
    mask = torch.ones_like(logp, dtype=torch.bool)
    return ppo.ppo_loss(logp, logp.detach(), logp.detach(), zeros, zeros, zeros, zeros, mask, cfg, ref_logp=ref)


def test_the_kl_term_is_k3_and_pulls_the_log_probs_towards_the_reference():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5, -0.9]])
    t = _terms(logp, ref, 0.5)
    d = ref - logp.detach()
    assert float(t.kl_ref.detach()) == pytest.approx(float((d.exp() - d - 1).mean()))
    assert float(t.kl_ref.detach()) > 0 and float(t.loss.detach()) == pytest.approx(0.5 * float(t.kl_ref.detach()))
    t.loss.backward()
    g = logp.grad[0]
    # descent (against the gradient) moves each log-prob towards the reference's: up where it is below, down
    # where it is above, not at all where they agree
    assert g[0] == 0.0 and g[1] < 0 and g[2] > 0
    same = _terms(ref.clone().requires_grad_(True), ref, 0.5)
    assert float(same.kl_ref.detach()) == 0.0 and float(same.loss.detach()) == 0.0
    assert float(_terms(logp.detach(), None, 0.5).kl_ref) == 0.0  # no reference: no term


def _run(coef: float, steps: int = 6) -> tuple[float, list[float]]:
    """A policy pushed to make one reply likelier for ``steps`` steps; returns how far that reply's log-prob
    rose and the steps' ``kl_ref``."""
    torch.manual_seed(0)
    model = tiny()
    trainer = Trainer(model, TrainerConfig(lr=3e-3, kl_ref_coef=coef, **EXACT))
    if coef > 0:
        trainer.set_reference(copy.deepcopy(model))
    good, bad = [5, 6, 7, 100, 101], [5, 6, 7, 200, 201]
    before = trainer.score([sampled_segment(model, good, [3, 4], reward=0.0)])[0][0][3]
    kls = []
    for _ in range(steps):
        segs = [sampled_segment(model, good, [3, 4], reward=1.0), sampled_segment(model, bad, [3, 4], reward=-1.0)]
        kls.append(trainer.step(segs, policy_version=0).kl_ref)
    after = trainer.score([sampled_segment(model, good, [3, 4], reward=0.0)])[0][0][3]
    return float(after - before), kls


def test_the_penalty_holds_the_policy_nearer_its_start():
    free, free_kl = _run(0.0)
    held, held_kl = _run(10.0)
    assert free_kl == [0.0] * 6  # off: not computed
    assert held_kl[0] == pytest.approx(0.0, abs=1e-9)  # step 0: the policy is the reference
    assert all(k > 0 for k in held_kl[1:])
    assert free > 0.5 and 0 < held < free * 0.5, (free, held)


def test_settings_it_refuses_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="--kl-ref-coef needs --prefix-kv exact"):
        TrainerConfig(kl_ref_coef=0.1)
    TrainerConfig(kl_ref_coef=0.1, prefix_kv_max_age=0)  # reuse with nothing kept is the exact step
    with pytest.raises(ConfigError, match="kl_ref_coef is 0"):
        Trainer(tiny(), TrainerConfig()).set_reference(tiny())
    from t1async.cluster.config import from_args

    # the N-rank learner shards the reference like the policy (tests/test_learner_distributed.py)
    from_args(argparse.Namespace(run_dir=tmp_path, kl_ref_coef=0.1, prefix_kv="exact", learner_procs=2)).check()


def test_cluster_up_passes_the_coefficient_to_the_learner(tmp_path):
    from tests.clusterargs import learner_argv, serve_args

    args = serve_args(learner_argv(tmp_path / "a", "--kl-ref-coef", "0.05", "--prefix-kv", "exact"))
    assert (args.kl_ref_coef, args.prefix_kv) == (0.05, "exact")
    assert serve_args(learner_argv(tmp_path / "b")).kl_ref_coef == 0.0


async def test_a_resumed_learner_anchors_to_the_initial_weights_not_its_checkpoint(tmp_path, tiny_model):
    cfg = LearnerConfig(
        run_dir=tmp_path / "run",
        model=tiny_model,
        batch_turns=4,
        steps=2,
        checkpoint_every=2,
        metrics_every_s=60,
        tensorboard=False,
        lr=1e-3,
        kl_ref_coef=0.1,
        **EXACT,
    )
    first = await train_waves(cfg, MemoryBroker())
    assert [c.policy_version for c in list_checkpoints(cfg.checkpoints)] == [2]
    assert first.last_step["kl_ref"] > 0  # the second step's policy had moved off the reference
    again = Learner(replace(cfg, steps=4), MemoryTransport(MemoryBroker()), None)
    assert again.policy_version == 2 and again.trainer.ref is not None
    initial = load_pretrained(tiny_model).state_dict()
    ref, policy = again.trainer.ref.state_dict(), again.model.state_dict()
    assert all(torch.equal(initial[k], ref[k]) for k in initial)
    assert any(not torch.equal(initial[k], policy[k]) for k in initial)
    again.journal.close()
