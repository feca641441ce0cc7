"""Actor and learner together in one process: real sandboxes, real model and trainer, in-memory NATS and
sampler (the cluster test runs the same code over real NATS and the embedded SGLang server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from t1async.credits.settle import trained_counts
from t1async.learner.service import Learner
from t1async.learner.settings import LearnerConfig
from t1async.model.tokenizer import ChatTokenizer
from t1async.protocol import wire
from t1async.transport import MemoryBroker, MemoryTransport
from tests.loops import VersionedMemorySampler, run_loop


@pytest.mark.parametrize("eta", [0, 1])
async def test_loop_trains_versions_within_staleness(tmp_path, tiny_model, eta):
    broker = MemoryBroker()
    tok = ChatTokenizer.load()
    from t1async.model.config import MoEConfig as C

    cfg = C.load(tiny_model / "config.json")
    sampler = VersionedMemorySampler(
        vocab_size=cfg.vocab_size,
        num_layers=cfg.n_layers,
        topk=cfg.top_k,
        num_experts=cfg.n_experts,
        eos_token_id=tok.end_of_turn_id,
        seed=eta,
    )
    seen: list = []
    learner = await run_loop(tmp_path, tiny_model, eta=eta, steps=3, broker=broker, sampler=sampler, seen=seen)
    assert learner.policy_version == 3 and sampler.weight_version == 3
    assert 0 <= learner.hist.max <= eta and learner.hist.total > 0
    assert learner.stale_masked_tokens == 0
    policies = [r.policy_version for r in seen if isinstance(r, wire.PolicyRecord)]
    assert policies == [1, 2, 3]
    turns = [r for r in seen if isinstance(r, wire.TurnRecord)]
    assert turns and all(
        r.routing is not None and r.routing.experts.shape[1:] == (cfg.n_layers, cfg.top_k) for r in turns
    )
    metrics = [r for r in seen if isinstance(r, wire.MetricsRecord) and r.component == "learner"]
    assert metrics[-1].values["max_staleness"] <= eta and metrics[-1].values["drift"]["fork"] == 0
    assert learner.state.turns_trained >= 3 * 4
    assert_trained_once(tmp_path / "run", learner)


def assert_trained_once(run: Path, learner: Learner) -> None:
    """Every step's trained set (written before the step ran, from the segments the trainer got) has each
    turn at most once, and the steps together are exactly what the final checkpoint's state says."""
    steps, counts = trained_counts(run, learner.state.policy_version)
    assert sorted(steps) == list(range(learner.state.policy_version)), sorted(steps)
    twice = sorted(k for k, c in counts.items() if c > 1)
    assert not twice, f"trained twice: {twice[:5]}"
    assert set(counts) == {(ep, t) for ep, ts in learner.state.trained.items() for t in ts}
    assert all(r["max_staleness"] <= learner.cfg.max_staleness for r in steps.values())


async def test_restart_resumes_without_loss_or_retraining(tmp_path, tiny_model):
    broker = MemoryBroker()
    tok = ChatTokenizer.load()
    from t1async.model.config import MoEConfig as C

    cfg = C.load(tiny_model / "config.json")
    sampler = VersionedMemorySampler(
        vocab_size=cfg.vocab_size,
        num_layers=cfg.n_layers,
        topk=cfg.top_k,
        num_experts=cfg.n_experts,
        eos_token_id=tok.end_of_turn_id,
    )
    first = await run_loop(tmp_path, tiny_model, eta=1, steps=2, broker=broker, sampler=sampler, seen=[])
    trained_first = {(ep, t) for ep, ts in first.state.trained.items() for t in ts}
    second = await run_loop(tmp_path, tiny_model, eta=1, steps=4, broker=broker, sampler=sampler, seen=[])
    assert second.resumed_from is not None and second.resumed_from.policy_version == 2 and second.policy_version == 4
    trained_second = {(ep, t) for ep, ts in second.state.trained.items() for t in ts}
    assert trained_first <= trained_second
    # every turn the learner journaled and had trained before the restart was not trained again
    assert_trained_once(tmp_path / "run", second)
    assert second.state.turns_trained == len(trained_second)
    # the TensorBoard curves (t1async.curves), read back from the event files: one point per version, the resumed
    # learner's steps continuing the first one's
    from t1async.curves import read_scalars

    curves = read_scalars(tmp_path / "run" / "tensorboard" / "learner")
    assert [s for s, _ in curves["train/loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in curves["train/reward_per_turn"]] == [1, 2, 3, 4]
    assert all(v >= 0 for _, v in curves["train/mean_abs_dlogp"]) and "drift/clean" in curves


def test_a_state_without_its_checkpoint_is_not_resumed(tmp_path, tiny_model):
    """A crash between saving the learner state and its checkpoint leaves a state whose trained turns never
    reached any weights: a fresh learner must not skip them."""
    from t1async.learner.state import LearnerState

    LearnerState().after_step(1, 1, [("ep", 0), ("ep", 1)]).save(tmp_path / "run" / "checkpoints")
    learner = Learner(LearnerConfig(run_dir=tmp_path / "run", model=tiny_model), MemoryTransport(), None)
    learner.journal.close()
    assert learner.policy_version == 0 and not learner.state.was_trained("ep", 0) and learner.resumed_from is None


def test_an_actor_empties_its_work_dir_of_what_a_killed_predecessor_left(tmp_path):
    """A SIGKILLed actor cannot remove its open episodes' work dirs; its restart, on the same --work-dir, does."""
    from actors.actor import _fresh

    work = tmp_path / "work" / "actor-0"
    (work / "t1w-task-abc" / "sub").mkdir(parents=True)
    (work / "t1w-task-abc.mnt").mkdir()
    (work / "t1w-stray.txt").write_text("x")
    (work / "notes.txt").write_text("a user's")  # not an episode's: kept (--work-dir /tmp must be safe)
    assert _fresh(work) == work and [p.name for p in work.iterdir()] == ["notes.txt"]
    assert _fresh(None) is None
