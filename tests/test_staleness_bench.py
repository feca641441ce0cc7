"""bench.staleness's summary of one η from a run's metrics.jsonl: throughput over the learner's steps, the
stale-masked tokens, the actors' credit waits, and the overlap bound. (The bench itself runs the real loop;
here its arithmetic is checked on records written out by hand.)"""

from __future__ import annotations

import pytest

from bench.staleness import summarise


def learner(t, step, turns, t_step_s, **kw):
    return {"component": "learner", "subject": "t1.metrics.learner", "t": t, "step": step, "turns_trained": turns,
            "t_step_s": t_step_s, "max_staleness": 0, **kw}  # fmt: skip


def actor(name, t, **kw):
    return {"component": "actor", "subject": f"t1.metrics.actor.{name}", "t": t, **kw}


def test_summary_of_one_eta():
    recs = [
        learner(0.0, 0, 0, 0.0),  # before any step: not a throughput sample
        actor("a0", 0.0, credit_waits=0, credit_wait_s=0.0),
        learner(10.0, 1, 8, 1.0),
        actor("a1", 5.0, credit_waits=3, credit_wait_s=1.5, credit_wait_p99_s=0.9, credit_wait_max_s=1.0),
        learner(20.0, 2, 16, 4.0),
        learner(30.0, 3, 24, 2.0, stale_masked_tokens=5, mismatch=0.003, policy_shift=0.02, max_staleness=1),
        learner(40.0, 3, 24, 2.0, stale_masked_tokens=5),  # a periodic record after the last step: not timed
        actor("a0", 40.0, credit_waits=10, credit_wait_s=2.5, credit_wait_p99_s=0.5, credit_wait_max_s=0.6),
        actor("a1", 40.0, credit_waits=6, credit_wait_s=2.0, credit_wait_p99_s=0.9, credit_wait_max_s=1.2),
    ]
    r = summarise(recs, 1, slots=2)
    assert r["turns_per_s"] == pytest.approx(16 / 20)  # 16 turns between the first and the last step
    assert r["stale_masked_tokens"] == 5 and r["max_staleness"] == 1 and r["steps"] == 3
    assert r["credit_waits"] == 16 and r["credit_wait_s"] == pytest.approx(4.5)
    assert r["credit_wait_mean_s"] == pytest.approx(4.5 / 16)
    assert r["credit_wait_p99_s"] == 0.9 and r["credit_wait_max_s"] == 1.2
    assert r["credit_wait_share"] == pytest.approx(4.5 / (2 * 40.0))
    assert (r["mismatch"], r["policy_shift"]) == (0.003, 0.02)
    assert r["t_train_s"] == pytest.approx(6.0) and r["t_sample_s"] == pytest.approx(14.0)  # steps 2 and 3
    assert r["overlap_bound"] == pytest.approx(20.0 / 14.0)


def test_too_short_a_run_says_so():
    with pytest.raises(ValueError, match="fewer than two steps"):
        summarise([learner(1.0, 1, 8, 1.0)], 0, slots=1)
    with pytest.raises(ValueError, match="same step"):
        summarise([learner(1.0, 1, 8, 1.0), learner(2.0, 1, 8, 1.0)], 0, slots=1)
