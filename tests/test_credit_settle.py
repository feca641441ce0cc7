"""Every delivered turn is settled exactly once, and settling releases its credit (design §7): the ledger
stays bounded by the work in flight whatever is never trained, and a silent actor's credits come back."""

from __future__ import annotations

import random

import pytest

from t1async.credits.ledger import CreditLedger, SettleReason


def test_a_stuck_credit_does_not_pin_the_ledger_over_a_long_run():
    """One delivered turn is never settled; 3,000 steps later the ledger holds that credit and the work in
    flight, not every credit granted since (the old grant-order deque held ~48k here)."""
    B, eta = 16, 1
    led = CreditLedger(max_staleness=eta, batch_turns=B, lease_s=1e9)
    rng = random.Random(0)
    now, ep = 0.0, 0
    sizes = []
    reasons = [r for r in SettleReason if r is not SettleReason.TRAINED]
    for step in range(3000):
        batch = []
        while (g := led.try_grant("a", f"e{ep}", 1, now, turn=0)) is not None:
            assert g.granted == 1
            led.on_delivered(f"e{ep}", 0, now)
            batch.append((f"e{ep}", 0))
            ep += 1
        if step == 0:
            stuck = batch.pop(0)  # delivered, never settled
        assert led.can_train(led.policy_version), step
        due = set(led.due(led.policy_version))
        assert step == 0 or stuck in due  # past its deadline: due at every step, but it pins nothing else
        rng.shuffle(batch)
        k = len(batch) // 10  # a tenth is settled for another reason (realign, poison, ...)
        for key in batch[:k]:
            assert led.settle([key], reasons[step % len(reasons)]) == 1
        led.settle(batch[k:], "trained")
        assert led.settle(batch, "trained") == 0, "a second settle of a turn is a no-op"
        led.on_version(led.policy_version + 1)
        sizes.append(led.size)
        now += 1.0
    assert led.stats.granted > 40_000
    assert max(sizes[100:]) <= 1 + (eta + 1) * B, max(sizes)
    assert led.size == 1 and led.due(led.policy_version) == [stuck]
    assert all(led.stats.settled[r] > 0 for r in SettleReason)
    assert sum(led.stats.settled.values()) == led.stats.delivered - 1


def test_untrained_settles_give_capacity_back_and_trained_ones_do_not():
    led = CreditLedger(max_staleness=0, batch_turns=2, lease_s=100.0)
    assert led.try_grant("a", "e", 2, 0.0, turn=0).granted == 2
    led.on_delivered("e", 0, 1.0)
    led.on_delivered("e", 1, 1.0)
    assert led.try_grant("a", "e", 1, 1.0) is None
    led.settle([("e", 0)], "realign_dropped")
    assert led.accepted == 1 and led.available == 1  # the dropped turn's capacity is free again
    led.settle([("e", 1)], "trained")
    assert led.accepted == 1 and led.available == 1  # a trained turn keeps counting until the next version
    with pytest.raises(ValueError, match="not one of"):
        led.settle([("e", 2)], "lost")


def test_a_silent_actors_running_credits_are_released_at_once():
    led = CreditLedger(max_staleness=0, batch_turns=4, lease_s=180.0)
    led.try_grant("dead", "d1", 2, 0.0, turn=0)
    led.try_grant("live", "l1", 2, 0.0, turn=0)
    assert not led.can_train(0) and led.available == 0
    led.on_delivered("d1", 0, 1.0)  # the dead actor delivered one turn before it died
    for t in range(2):
        led.on_delivered("l1", t, 1.0)
    assert not led.can_train(0)  # d1's second credit is still running
    assert led.release_actor("dead") == 1 and led.stats.released == 1
    assert led.can_train(0) and sorted(led.due(0)) == [("d1", 0), ("l1", 0), ("l1", 1)]
    assert led.available == 1  # the released credit is free without waiting 180 s
    assert led.on_delivered("d1", 1, 2.0) is None and led.stats.unadmitted == 1  # too late: unadmitted


def test_a_turn_uses_the_credit_asked_for_it_else_the_oldest():
    led = CreditLedger(max_staleness=1, batch_turns=4, lease_s=100.0)
    led.try_grant("a", "e", 1, 0.0, turn=7)
    led.try_grant("a", "e", 1, 0.0, turn=8)
    t = led.on_delivered("e", 8, 1.0)
    assert t is not None and t.turn == 8 and led.running == 1
    # an actor that skipped an empty output delivers turn 7 with the credit it asked for its next sample
    assert led.on_delivered("e", 6, 1.0).turn == 6 and led.running == 0
    assert led.on_delivered("e", 7, 1.0) is None and led.stats.unadmitted == 1


# ------------------------------------------------------------------------------------------ assembler


def _turn(ep, t, inp, out, *, prev=None, digest=None):
    import numpy as np

    from t1async.protocol import wire
    from t1async.protocol.sampling import common_prefix_len

    inp = np.asarray(inp, np.int32)
    keep = common_prefix_len(inp, np.asarray(prev, np.int32)) if prev is not None else 0
    return wire.TurnRecord(
        episode=ep,
        turn=t,
        policy_version=0,
        keep=keep,
        input_delta=inp[keep:],
        input_len=len(inp),
        input_digest=digest or wire.digest_ids(inp),
        output_ids=np.asarray(out, np.int32),
        output_logprobs=np.full(len(out), -0.5, np.float32),
        finish=wire.Finish.STOP,
        routing=None,
        reward=0.0,
        tests_passed=-1,
        t_sample_s=0.0,
        t_exec_s=0.0,
    )


def test_the_assembler_names_every_turn_that_will_never_reach_a_segment():
    from t1async.ingest.assembly import Assembler
    from t1async.ingest.episode import AssemblerConfig
    from t1async.protocol import wire

    asm = Assembler(AssemblerConfig(max_pending_turns=2))
    asm.add(_turn("e", 0, [1, 2], [10, 11]))
    asm.add(_turn("e", 1, [1, 2, 10, 11, 5], [20, 21], prev=[1, 2, 10, 11]))
    # turn 2 discards turn 1's whole output (a REALIGN): turn 1 is never trained
    asm.add(_turn("e", 2, [1, 2, 10, 11, 5, 6], [30], prev=[1, 2, 10, 11, 5, 20, 21]))
    assert asm.drain_dropped("e") == [("e", 1, "realign_dropped")] and asm.drain_dropped() == []
    # an input that does not match the assembled sequence (digest lies): untrainable
    asm.add(_turn("e", 3, [1, 2, 10, 11, 5, 6, 30, 7], [40], prev=[1, 2, 10, 11, 5, 6, 30], digest=b"x" * 16))
    assert asm.drain_dropped() == [("e", 3, "abandoned")]
    segs = asm.end(wire.EndRecord("e", 4, wire.EndReason.SOLVED, 1, 1, True))
    assert segs == [] or all(3 not in s.turn_numbers for s in segs)
    asm.add(_turn("e", 4, [1], [2]))  # after the episode's end
    # an episode whose gap never fills is abandoned with its buffered turns
    for t in (2, 3, 4):
        asm.add(_turn("f", t, [1], [2]))
    assert sorted(asm.drain_dropped()) == [
        ("e", 4, "abandoned"),
        ("f", 2, "abandoned"),
        ("f", 3, "abandoned"),
        ("f", 4, "abandoned"),
    ]


def test_an_end_releases_only_the_credits_its_turns_will_never_use():
    """Records can arrive after their episode's end: an end for 2 turns releases the credit asked for turn 2
    (never sampled, or its output was empty), not those of turns 0 and 1 still on their way."""
    led = CreditLedger(max_staleness=0, batch_turns=4, lease_s=100.0)
    for t in range(3):
        led.try_grant("a", "e", 1, 0.0, turn=t)
    assert led.release_episode("e", from_turn=2) == 1 and led.running == 2
    assert led.on_delivered("e", 1, 1.0).turn == 1 and led.on_delivered("e", 0, 1.0).turn == 0
    assert led.stats.unadmitted == 0
