"""Actor liveness (design §7): an actor silent for the timeout is reported once; restarts give a grace period."""

from __future__ import annotations

import pytest

from t1async.credits.liveness import ActorLiveness, actor_of
from t1async.protocol import wire


def test_a_silent_actor_is_reported_once_and_a_live_one_never():
    now = [0.0]
    lv = ActorLiveness(15.0, clock=lambda: now[0])
    lv.owns("dead-abc", "dead")
    lv.owns("live-def", "live")
    for t in range(1, 40):
        now[0] = float(t)
        lv.seen("live")
        out = lv.silent()
        assert out == (["dead"] if t == 16 else []), (t, out)
    assert lv.episodes_of("dead") == ["dead-abc"] and "dead" in lv.released
    lv.seen("dead")  # it came back: it is live again (and could be released again later)
    assert "dead" not in lv.released
    lv.closed("dead-abc")
    assert lv.episodes_of("dead") == []


def test_after_a_restart_every_known_actor_gets_a_full_timeout():
    now = [100.0]
    lv = ActorLiveness(5.0, clock=lambda: now[0])
    lv.owns("a-1", "a")  # replayed from the journal at t=100
    now[0] = 1000.0
    lv.restart_clocks()
    now[0] = 1004.0
    assert lv.silent() == []
    now[0] = 1006.0
    assert lv.silent() == ["a"]


def test_episode_ids_name_their_actor_and_bad_settings_are_refused():
    assert actor_of("host-12-0123456789ab") == "host-12" and actor_of("solo") == "solo"
    with pytest.raises(ValueError, match="> 0"):
        ActorLiveness(0)
    hb = wire.Heartbeat("a1", 12.5)
    assert wire.records_equal(wire.decode(wire.encode(hb)), hb)


def test_a_restarted_actors_earlier_episodes_are_orphans_reported_once():
    lv = ActorLiveness(15.0, clock=lambda: 0.0)
    lv.owns("a-old", "a", created_at=100.0)
    lv.owns("a-new", "a", created_at=205.0)
    lv.owns("a-unknown", "a")  # no start record seen: never taken for an orphan
    lv.owns("b-old", "b", created_at=50.0)
    assert lv.orphaned("a", 0.0) == []  # an actor that does not say when it started
    assert lv.orphaned("a", 90.0) == []  # the process that created them is this one
    assert lv.orphaned("a", 200.0) == ["a-old"]
    assert lv.orphaned("a", 200.0) == []  # reported once
    assert lv.episodes_of("b") == ["b-old"]  # another actor's episodes are not touched


async def test_the_learner_ends_a_restarted_actors_orphans_without_waiting_for_silence(tmp_path):
    """An actor restarted under the same id keeps heartbeating, so silence never frees its dead process's
    episodes; before, they held the staleness bound until the silence timeout (150 s seen in bench.chaos).
    Its first heartbeat (a newer ``started_at``) ends them at once (seen failing on the old code)."""
    import anyio

    from t1async.learner.service import Learner
    from t1async.learner.settings import LearnerConfig
    from t1async.transport import MemoryBroker, MemoryTransport
    from t1async.transport.base import traj_subject

    cfg = LearnerConfig(run_dir=tmp_path / "run", batch_turns=64, actor_timeout=3600.0, metrics_every_s=60)
    broker = MemoryBroker()
    async with MemoryTransport(broker) as lt, MemoryTransport(broker) as pub:
        learner = Learner(cfg, lt, None)
        async with anyio.create_task_group() as tg:
            tg.start_soon(learner.run)
            for ep, created in (("a0-old", 100.0), ("a0-new", 300.0)):
                await pub.publish(traj_subject(ep), wire.StartRecord(ep, "a0", "task", 8, created))
            with anyio.fail_after(60):
                while {"a0-old", "a0-new"} - set(learner.liveness.owner):
                    await anyio.sleep(0.05)
                await pub.publish("t1.actor.a0", wire.Heartbeat("a0", 301.0, started_at=250.0))
                while "a0-old" in learner.liveness.owner:  # its abort end came back through the stream
                    await anyio.sleep(0.05)
            assert "a0-new" in learner.liveness.owner  # the new process's episode runs on
            tg.cancel_scope.cancel()
    learner.journal.close()
