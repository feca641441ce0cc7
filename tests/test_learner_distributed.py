"""The N-rank learner (learner/distributed.py, learner/ranks.py) with real ranks: rank 0 is this test
process, rank 1 a real ``python -m t1async.learner.ranks`` child, over a real gloo group. One step over 2
ranks gives the weights one rank gives; checkpoints move between N=2 and N=1; a dead rank fails loudly."""

from __future__ import annotations

import copy
import os
import signal

import numpy as np
import pytest
import torch
from test_trainer import sampled_segment, tiny

from t1async.learner.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from t1async.learner.distributed import DistributedTrainer, RankFailedError, balance
from t1async.learner.ranks import Ranks, RanksConfig
from t1async.learner.trainer import Trainer
from t1async.learner.trainer_config import TrainerConfig

# several micro-batches per rank, and a different number on each rank
TCFG = TrainerConfig(lr=1e-2, microbatch_tokens=64, ppo_epochs=2)


def segments(model, n: int = 7, seed: int = 0, policy_version: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = int(rng.integers(12, 40))
        toks = rng.integers(5, 4000, size=t).tolist()
        loss = range(t // 2, t)
        out.append(
            sampled_segment(
                model, toks, loss, reward=float(rng.normal()), policy_version=policy_version, episode=f"e{i}"
            )
        )
    return out


# Adam's first steps move a weight by ~lr * g / (|g| + eps) whatever |g| is, so a weight whose gradient is near 0
# amplifies the float difference of summing the gradient over two ranks instead of one. atol 1e-5 (0.1% of
# lr 1e-2) failed on 1 of 131,072 weights by 1.5e-5 under load; 1e-4 (1% of a step) still catches a rank whose
# gradient is left out of the sum (seen: 5783 weights off, by up to 0.034).
WEIGHT_ATOL = 1e-2 * TCFG.lr


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=WEIGHT_ATOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture
def ranks2():
    ranks = Ranks(RanksConfig(nproc=2, stop_timeout_s=10))
    holder: dict = {}
    yield ranks, holder
    ranks.close(holder.get("trainer"))
    assert all(p.poll() is not None for p in ranks.procs)


def test_balance_splits_by_tokens():
    parts = balance([100, 10, 10, 10, 90, 5], 2)
    loads = [sum([100, 10, 10, 10, 90, 5][i] for i in p) for p in parts]
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert max(loads) - min(loads) <= 10, loads
    assert balance([7], 3) == [[0], [], []]  # fewer segments than ranks: a rank may get none


def test_two_ranks_step_like_one_rank(ranks2):
    ranks, holder = ranks2
    torch.manual_seed(0)
    base = tiny()
    segs = segments(base)
    one = Trainer(copy.deepcopy(base), TCFG)
    m1 = one.step(segs, 0)
    two = holder["trainer"] = ranks.start(Trainer(copy.deepcopy(base), TCFG))
    assert isinstance(two, DistributedTrainer) and two.world == 2
    m2 = two.step(segs, 0)
    changed = max(float((p - q).detach().abs().max()) for p, q in zip(base.parameters(), two.model.parameters()))
    assert changed > 1e-3  # the step moved the weights, so the comparison below means something
    assert_same_weights(one.model, two.model)
    assert (m2.segments, m2.tokens, m2.loss_tokens, m2.turns) == (m1.segments, m1.tokens, m1.loss_tokens, m1.turns)
    for k in ("loss", "policy_loss", "value_loss", "clip_frac", "grad_norm", "mean_abs_dlogp", "adv_mean", "adv_std"):
        assert getattr(m2, k) == pytest.approx(getattr(m1, k), rel=1e-4, abs=1e-6), k
    assert m2.routing_compared == m1.routing_compared and m2.staleness_hist == m1.staleness_hist
    # a second step: rank 1's weights and optimizer state stayed the same as rank 0's
    segs2 = segments(one.model, seed=1, policy_version=1)
    one.step(segs2, 1)
    two.step(segs2, 1)
    assert_same_weights(one.model, two.model)
    # one segment for two ranks: rank 1 trains nothing, yet takes the same optimizer step
    seg3 = segments(one.model, n=1, seed=4, policy_version=2)
    m1, m2 = one.step(seg3, 2), two.step(seg3, 2)
    assert_same_weights(one.model, two.model)
    assert m2.loss == pytest.approx(m1.loss, rel=1e-4, abs=1e-6)


def test_checkpoints_move_between_two_ranks_and_one(ranks2, tmp_path):
    ranks, holder = ranks2
    torch.manual_seed(1)
    base = tiny()
    two = holder["trainer"] = ranks.start(Trainer(copy.deepcopy(base), TCFG))
    two.step(segments(base), 0)
    ck = save_checkpoint(tmp_path / "ck", two.model, two.optimizer, policy_version=1, step=two.steps)
    # N=2 -> N=1: a plain trainer resumes from it and steps like the 2-rank trainer goes on
    one = Trainer(tiny(), TCFG)
    load_checkpoint(ck.path, one.model, one.optimizer)
    one.steps = ck.step
    assert_same_weights(one.model, two.model)
    segs = segments(two.model, seed=2, policy_version=1)
    one.step(segs, 1)
    two.step(segs, 1)
    assert_same_weights(one.model, two.model)
    # N=1 -> N=2: the 2-rank trainer loads a 1-rank checkpoint; rank 0 sends it to rank 1 with the next step
    ck1 = save_checkpoint(tmp_path / "ck1", one.model, one.optimizer, policy_version=2, step=one.steps)
    two.load(latest_checkpoint(tmp_path / "ck1").path)
    two._resync = True
    segs = segments(one.model, seed=3, policy_version=2)
    one.step(segs, 2)
    two.step(segs, 2)
    assert_same_weights(one.model, two.model)
    assert two.steps == one.steps == ck1.step + 1


def test_a_dead_rank_fails_the_learner(ranks2):
    import anyio

    ranks, holder = ranks2
    base = tiny()
    two = holder["trainer"] = ranks.start(Trainer(copy.deepcopy(base), TCFG))
    two.step(segments(base, n=3), 0)
    os.kill(ranks.procs[0].pid, signal.SIGKILL)
    ranks.procs[0].wait(30)
    with pytest.raises(RankFailedError, match="rank 1"):
        anyio.run(ranks.watch)
    with pytest.raises(RankFailedError):
        two.step(segments(base, n=3), 1)


def test_a_failed_step_fails_on_every_rank_and_the_next_resyncs(ranks2, tmp_path):
    """Rank 0 raises in its second PPO epoch, after every rank took the first epoch's optimizer step. Rank 1
    learns of it at the gradient meeting (no hang), rank 0 is restored from the checkpoint (as the service
    does), and the next step re-sends rank 0's weights: rank 1's stepped ones must not leak into it."""
    ranks, holder = ranks2
    torch.manual_seed(2)
    base = tiny()
    two = holder["trainer"] = ranks.start(Trainer(copy.deepcopy(base), TCFG))
    ck = save_checkpoint(tmp_path / "ck", two.model, two.optimizer, policy_version=0, step=0)
    calls = {"n": 0}
    real = two._optimizer_step

    def second_epoch_fails() -> float:
        calls["n"] += 1
        if calls["n"] == 2:
            raise FloatingPointError("injected")
        return real()

    two._optimizer_step = second_epoch_fails  # type: ignore[method-assign]
    segs = segments(base)
    with pytest.raises(FloatingPointError, match="injected"):
        two.step(segs, 0)
    del two._optimizer_step
    two.load(ck.path)
    one = Trainer(tiny(), TCFG)
    load_checkpoint(ck.path, one.model, one.optimizer)
    one.step(segs, 0)
    two.step(segs, 0)
    assert_same_weights(one.model, two.model)


def test_ranks_that_never_join_fail_in_one_line(monkeypatch):
    monkeypatch.setattr("sys.executable", "/bin/false")  # rank 1 exits at once with code 1
    ranks = Ranks(RanksConfig(nproc=2, join_timeout_s=3))
    try:
        with pytest.raises(RankFailedError, match=r"did not join within 3 s \(exit code by pid.*: \{\d+: 1\}"):
            ranks.start(Trainer(tiny(), TCFG))
    finally:
        ranks.close(None)
    assert ranks.procs == [] and not ranks.joined


def test_two_ranks_share_the_steps_turn_baseline(ranks2):
    """advantage="turn" centres each turn on the mean of the WHOLE step's turns with its number: rank 1 gets rank
    0's baseline, so 2 ranks step like 1 (a per-rank mean would centre each rank's share on its own rewards)."""
    ranks, holder = ranks2
    cfg = TrainerConfig(lr=1e-2, microbatch_tokens=64, advantage="turn")
    torch.manual_seed(0)
    base = tiny()
    segs = segments(base)
    one = Trainer(copy.deepcopy(base), cfg)
    m1 = one.step(segs, 0)
    two = holder["trainer"] = ranks.start(Trainer(copy.deepcopy(base), cfg))
    m2 = two.step(segs, 0)
    assert_same_weights(one.model, two.model)
    assert m2.adv_mean == pytest.approx(m1.adv_mean, abs=1e-6) and m2.adv_std == pytest.approx(m1.adv_std, rel=1e-4)
