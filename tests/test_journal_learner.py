"""The real learner service keeps its journal bounded: segments of settled episodes go, a restart still
replays what is not settled, and an old run's journal.bin is taken over."""

from __future__ import annotations

from dataclasses import replace

import anyio

from t1async.ingest.journal import read_journal
from t1async.learner.service import Learner
from t1async.learner.settings import LearnerConfig
from t1async.transport import MemoryBroker, MemoryTransport
from t1async.transport.base import traj_subject
from tests.clean_episodes import episodes


async def test_a_long_run_keeps_the_journal_bounded_and_a_restart_replays_the_unsettled(tmp_path, tiny_model):
    steps = 12
    cfg = LearnerConfig(
        run_dir=tmp_path / "run",
        model=tiny_model,
        batch_turns=4,
        steps=steps,
        metrics_every_s=60,
        journal_file_bytes=4096,
        lr=1e-4,
        checkpoint_every=1,  # the journal compacts after each full checkpoint: here after each step
    )
    broker = MemoryBroker()
    sizes: list[int] = []
    async with MemoryTransport(broker) as lt, MemoryTransport(broker) as pub:
        learner = Learner(cfg, lt, None)
        async with anyio.create_task_group() as tg:

            async def feed():  # one wave of 3 finished episodes per step, sampled by the version it serves
                for k in range(steps):
                    while learner.state.step < k:
                        await anyio.sleep(0.02)
                    sizes.append(learner.journal.size_bytes())
                    # the first wave also starts an episode that never ends: it must survive every compaction
                    extra = episodes(1000, 1, 0, end=False) if k == 0 else []
                    for r in episodes(10 * k, 3, learner.policy_version) + extra:
                        await pub.publish(traj_subject(r.episode), r)

            tg.start_soon(feed)
            with anyio.fail_after(180):
                await learner.run()
            tg.cancel_scope.cancel()
    learner.journal.close()
    wave = sizes[1] - sizes[0]
    assert wave > 4096  # each wave rolls over at least one segment
    # settled waves' segments go; the first one stays, pinned by the running episode: no growth
    assert max(sizes) < 3 * wave + 3 * 4096, sizes
    assert learner.metrics()["journal_files"] <= 5
    replayed: dict[str, set] = {}
    for r in read_journal(tmp_path / "run" / "learner" / "journal"):
        replayed.setdefault(r.episode, set()).add(getattr(r, "turn", "end"))
    assert replayed.pop("e1000") == {0, 1, 2, 3} and len(replayed) < 3 * steps / 2
    # no half episode: whatever else replays is whole (it shares a kept segment), and trained already
    assert all(turns == {0, 1, 2, 3, "end"} for turns in replayed.values()), replayed

    again = Learner(replace(cfg, steps=0), MemoryTransport(broker), None)
    again.ingest.replay()
    again.journal.close()
    # the learner stops after its last step, which may have taken only part of the last wave (on a loaded machine
    # the step starts while the wave is still arriving): those turns, and nothing trained, are all there is to redo
    last_wave = {f"e{10 * (steps - 1) + i}" for i in range(3)}
    assert "e1000" in again.assembler.open and set(again.assembler.open) <= {"e1000"} | last_wave
    redo = [k for k in again.untrained if k[0] != "e1000"]
    assert all(k[0] in last_wave and not learner.state.was_trained(*k) for k in redo), redo
