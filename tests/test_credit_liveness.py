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
