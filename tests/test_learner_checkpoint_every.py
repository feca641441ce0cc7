"""``--checkpoint-every N`` (learner/service.py): a full checkpoint (trainer state, DCP model and AdamW) every
N steps, at the last step and at a stop; a push-only export (the model dir the samplers load) at the others.
A crash between checkpoints resumes from the last one and trains the recorded steps since again
(learner/stepinputs.py), up to the newest version it pushed: no version goes back, no turn is trained twice
or lost."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from t1async.credits.settle import trained_counts
from t1async.ingest.journal import read_journal
from t1async.learner.checkpoint import STATE_JSON, list_checkpoints, list_exports
from t1async.learner.service import Learner
from t1async.learner.settings import LearnerConfig
from t1async.learner.stepinputs import recorded_steps
from t1async.model.weights import load_pretrained
from t1async.protocol import wire
from t1async.testing.episodes import Sizes, make_episode
from t1async.transport import MemoryBroker, MemoryTransport
from tests.loops import train_waves


def _config(tmp_path: Path, model: Path, steps: int) -> LearnerConfig:
    return LearnerConfig(
        run_dir=tmp_path / "run",
        model=model,
        batch_turns=4,
        steps=steps,
        checkpoint_every=2,
        metrics_every_s=60,
        journal_file_bytes=4096,
        tensorboard=False,
        lr=1e-4,
    )


async def test_a_checkpoint_every_n_steps_and_at_the_last_exports_between(tmp_path, tiny_model):
    cfg = _config(tmp_path, tiny_model, steps=5)
    learner = await train_waves(cfg, MemoryBroker())
    root = cfg.checkpoints
    assert [c.policy_version for c in list_checkpoints(root)] == [2, 4, 5]
    assert [p.name for p in list_exports(root)] == ["v000001", "v000003"]
    assert all(not (p / STATE_JSON).exists() and (p / "config.json").is_file() for p in list_exports(root))
    states = sorted(p.name for p in root.glob("learner_state_v*.json"))
    assert states == [f"learner_state_v{v:06d}.json" for v in (2, 4, 5)]  # a state only beside a checkpoint
    assert learner.last_step["t_checkpoint_s"] > 0


async def _killed(self) -> None:  # noqa: ANN001 - SIGKILL runs no exit code
    return None


async def test_a_crash_between_checkpoints_resumes_at_the_version_pushed(tmp_path, tiny_model, monkeypatch):
    """checkpoint_every=10, killed after 3 steps or so (no exit save, as with SIGKILL; a step under way when
    the kill came finishes): no full checkpoint yet, the samplers were pushed vN. The restart trains the N
    recorded steps again from the initial weights and goes on at vN with the weights of the vN export to the
    last bit (the old code went back to v0); every turn is then trained exactly once."""
    cfg = replace(_config(tmp_path, tiny_model, steps=0), checkpoint_every=10)
    broker = MemoryBroker()
    with monkeypatch.context() as m:
        m.setattr(Learner, "_save_at_exit", _killed)
        first = await train_waves(cfg, broker, stop_after=3)
    root = cfg.checkpoints
    n = first.policy_version
    assert n >= 3 and list_checkpoints(root) == []
    assert [p.name for p in list_exports(root)] == [f"v{v:06d}" for v in range(n - 2, n + 1)]  # keep: 3
    pushed = shutil.copytree(root / f"v{n:06d}", tmp_path / "pushed")  # the restart replaces it by a checkpoint

    with capture_logs() as logs:
        again = Learner(cfg, MemoryTransport(broker), None)
    assert again.policy_version == n and again.state.step == n and again.trainer.steps == n
    assert again.state.trained == first.state.trained
    want = load_pretrained(pushed).state_dict()
    got = again.model.state_dict()
    assert want.keys() == got.keys()
    off = [k for k in want if not torch.equal(want[k], got[k])]
    assert not off, f"not bit-equal to the v{n} export: {off[:3]}"
    done = [e for e in logs if e["event"] == "learner.resume_replayed"]
    assert [(e["checkpoint_version"], e["steps"], e["max_abs_dw"], e["differ"]) for e in done] == [(0, n, 0.0, 0)]
    assert [c.policy_version for c in list_checkpoints(root)] == [n] and recorded_steps(again.inputs_dir) == []
    again.ingest.replay()
    again.journal.close()
    journaled = {
        (r.episode, r.turn) for r in read_journal(cfg.run_dir / "learner" / "journal") if isinstance(r, wire.TurnRecord)
    }
    trained = {(ep, t) for ep, ts in first.state.trained.items() for t in ts}
    assert not trained & set(again.untrained), "reopened a turn trained into the weights"

    last = await train_waves(replace(cfg, steps=n + 2), broker)  # two more steps, on new episodes
    assert last.policy_version == n + 2
    counted, counts = trained_counts(cfg.run_dir, n + 2)
    assert sorted(counted) == list(range(n + 2))
    assert [k for k, c in counts.items() if c != 1] == []
    assert trained < set(counts) and set(counts) == {(ep, t) for ep, ts in last.state.trained.items() for t in ts}
    assert journaled <= set(counts) | set(again.untrained), "a journaled turn neither trained nor waiting"


def _long_turn(k: int, policy_version: int) -> list:
    """Turn ``k`` of episode e1000 (12 clean turns, no end), its start record with turn 0: an episode that stays
    open across the steps, one turn a step."""
    case = make_episode(
        np.random.default_rng(1000),
        ["clean"] * 12,
        episode="e1000",
        with_end=False,
        sizes=Sizes(prompt=(20, 40), output=(4, 8), observation=(2, 6), vocab=300),
        layers=2,
        topk=2,
        num_experts=4,
    )
    turns = [r for r in case.records if isinstance(r, wire.TurnRecord)]
    starts = [r for r in case.records if not isinstance(r, wire.TurnRecord)] if k == 0 else []
    return starts + [replace(turns[k], policy_version=policy_version)]


@pytest.mark.parametrize("prefix_kv", ["exact", "reuse"])
async def test_a_crash_after_a_checkpoint_replays_from_it(tmp_path, tiny_model, monkeypatch, prefix_kv):
    """checkpoint_every=4, killed after step 5 or so with an episode open across the v4 checkpoint: the restart
    loads v4 (weights and AdamW state) and trains the steps since again. With --prefix-kv exact that is bit-equal
    to the newest export, and under reuse too: a full checkpoint clears the kept keys/values (Trainer.save), so
    the replay forwards what the killed process forwarded (before, reuse differed by ~1e-4: kept keys from
    before v4 that the replay forwarded afresh)."""
    cfg = replace(_config(tmp_path, tiny_model, steps=0), prefix_kv=prefix_kv, checkpoint_every=4)
    broker = MemoryBroker()
    with monkeypatch.context() as m:
        m.setattr(Learner, "_save_at_exit", _killed)
        first = await train_waves(cfg, broker, stop_after=5, more=_long_turn)
    n = first.policy_version
    c = max(cp.policy_version for cp in list_checkpoints(cfg.checkpoints))
    assert c == 4 < n < 8  # a step under way at the kill finishes
    with capture_logs() as logs:
        again = Learner(cfg, MemoryTransport(broker), None)
    again.journal.close()
    assert again.policy_version == n and again.state.trained == first.state.trained
    done = [e for e in logs if e["event"] == "learner.resume_replayed"]
    assert [(e["checkpoint_version"], e["steps"], e["beyond"]) for e in done] == [(4, n - 4, 0)]
    assert not [e for e in logs if e["event"] == "learner.resume_replay_differs"]
    assert (done[0]["max_abs_dw"], done[0]["differ"]) == (0.0, 0)


async def test_a_failed_step_between_checkpoints_restores_its_version(tmp_path, tiny_model, monkeypatch):
    """A step that raises may have stepped the weights: they go back to its version through the newest
    checkpoint and the steps recorded since (with no checkpoint of that version the old code left them as
    the failed step did)."""
    cfg = replace(_config(tmp_path, tiny_model, steps=0), checkpoint_every=10)
    with monkeypatch.context() as m:  # no checkpoint at the exit either
        m.setattr(Learner, "_save_at_exit", _killed)
        learner = await train_waves(cfg, MemoryBroker(), stop_after=2)
    v = learner.policy_version
    assert v >= 2 and list_checkpoints(cfg.checkpoints) == []
    before = {k: t.clone() for k, t in learner.model.state_dict().items()}
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(1.0)  # what a step that raised after its optimizer step leaves

    async def quiet() -> None:  # its transport is closed: the metrics go nowhere
        return None

    monkeypatch.setattr(learner, "_publish_metrics", quiet)
    with capture_logs() as logs:
        await learner._step_failed([], v, RuntimeError("the step raised after its optimizer step"))
    assert [e["source"] for e in logs if e["event"] == "learner.weights_restored"] == [
        f"{cfg.model} + {v} recorded steps"
    ]
    got = learner.model.state_dict()
    assert all(torch.equal(before[k], got[k]) for k in before)


async def test_a_stop_between_checkpoints_saves_one(tmp_path, tiny_model):
    """SIGTERM/SIGINT (the run cancelled) after step 3: a checkpoint of v3 is written on the way out."""
    cfg = _config(tmp_path, tiny_model, steps=0)
    learner = await train_waves(cfg, MemoryBroker(), stop_after=3)
    assert [c.policy_version for c in list_checkpoints(cfg.checkpoints)] == [2, learner.policy_version]
    assert learner.policy_version == 3
    assert (cfg.checkpoints / "learner_state_v000003.json").is_file()
