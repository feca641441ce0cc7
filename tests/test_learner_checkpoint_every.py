"""``--checkpoint-every N`` (learner/service.py): a full checkpoint (trainer state, DCP model and AdamW) every
N steps, at the last step and at a stop; a push-only export (the model dir the samplers load) at the others.
A crash between checkpoints resumes from the last one and trains again the turns trained since (the journal
keeps them: it compacts only after a checkpoint)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import anyio

from t1async.learner.checkpoint import STATE_JSON, list_checkpoints, list_exports
from t1async.learner.service import Learner
from t1async.learner.settings import LearnerConfig
from t1async.learner.state import LearnerState
from t1async.transport import MemoryBroker, MemoryTransport
from t1async.transport.base import traj_subject
from tests.clean_episodes import episodes


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


async def _train(cfg: LearnerConfig, broker: MemoryBroker, stop_after: int | None = None) -> Learner:
    """Run a learner on one wave of 3 finished episodes per step; ``stop_after``: cancel it (a stop) once it
    trained that many steps, else it runs its ``steps``."""
    async with MemoryTransport(broker) as lt, MemoryTransport(broker) as pub:
        learner = Learner(cfg, lt, None)
        n = stop_after or cfg.steps
        async with anyio.create_task_group() as tg:

            async def feed() -> None:
                for k in range(n):
                    while learner.state.step < k:
                        await anyio.sleep(0.02)
                    for r in episodes(10 * k, 3, learner.policy_version):
                        await pub.publish(traj_subject(r.episode), r)
                if stop_after is not None:
                    while learner.state.step < stop_after:
                        await anyio.sleep(0.02)
                    tg.cancel_scope.cancel()

            tg.start_soon(feed)
            with anyio.fail_after(180):
                await learner.run()
            tg.cancel_scope.cancel()
    learner.journal.close()
    return learner


async def test_a_checkpoint_every_n_steps_and_at_the_last_exports_between(tmp_path, tiny_model):
    cfg = _config(tmp_path, tiny_model, steps=5)
    learner = await _train(cfg, MemoryBroker())
    root = cfg.checkpoints
    assert [c.policy_version for c in list_checkpoints(root)] == [2, 4, 5]
    assert [p.name for p in list_exports(root)] == ["v000001", "v000003"]
    assert all(not (p / STATE_JSON).exists() and (p / "config.json").is_file() for p in list_exports(root))
    states = sorted(p.name for p in root.glob("learner_state_v*.json"))
    assert states == [f"learner_state_v{v:06d}.json" for v in (2, 4, 5)]  # a state only beside a checkpoint
    assert learner.last_step["t_checkpoint_s"] > 0


async def test_a_crash_between_checkpoints_trains_its_turns_again(tmp_path, tiny_model, monkeypatch):
    """Killed after step 3 (no exit save, as with SIGKILL): the restart resumes from v2, and every turn step 3
    trained is still in the journal, untrained again."""
    cfg = _config(tmp_path, tiny_model, steps=0)
    broker = MemoryBroker()

    async def killed(self) -> None:  # noqa: ANN001 - SIGKILL runs no exit code
        return None

    with monkeypatch.context() as m:
        m.setattr(Learner, "_save_at_exit", killed)
        learner = await _train(cfg, broker, stop_after=3)
    assert learner.state.step == 3 and [c.policy_version for c in list_checkpoints(cfg.checkpoints)] == [2]
    at_v2 = LearnerState.load(cfg.checkpoints, 2)
    lost = {(ep, t) for ep, ts in learner.state.trained.items() for t in ts if not at_v2.was_trained(ep, t)}
    assert lost  # step 3 trained turns the v2 checkpoint does not hold

    again = Learner(replace(cfg, steps=0), MemoryTransport(broker), None)
    assert again.policy_version == 2 and again.resumed_from is not None
    again.ingest.replay()
    again.journal.close()
    assert lost <= set(again.untrained), sorted(lost - set(again.untrained))


async def test_a_stop_between_checkpoints_saves_one(tmp_path, tiny_model):
    """SIGTERM/SIGINT (the run cancelled) after step 3: a checkpoint of v3 is written on the way out."""
    cfg = _config(tmp_path, tiny_model, steps=0)
    learner = await _train(cfg, MemoryBroker(), stop_after=3)
    assert [c.policy_version for c in list_checkpoints(cfg.checkpoints)] == [2, learner.policy_version]
    assert learner.policy_version == 3
    assert (cfg.checkpoints / "learner_state_v000003.json").is_file()
