"""bench.staleness's summary of one η from a run's metrics.jsonl: throughput over the learner's steps, the
stale-masked tokens, the actors' credit waits, and the overlap bound. (The bench itself runs the real loop;
here its arithmetic is checked on records written out by hand.)"""

from __future__ import annotations

import pytest

from bench._overlap import summarise


def learner(t, step, turns, t_step_s, **kw):
    return {
        "component": "learner",
        "subject": "t1.metrics.learner",
        "t": t,
        "step": step,
        "turns_trained": turns,
        "t_step_s": t_step_s,
        "max_staleness": 0,
        **kw,
    }


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


def test_warmup_steps_are_left_out_of_the_timing():
    recs = [
        learner(10.0, 1, 8, 1.0, tokens=100),
        learner(20.0, 2, 16, 4.0, t_step_wall_s=4.5, tokens=200),
        learner(30.0, 3, 24, 2.0, tokens=300),
        learner(34.0, 4, 40, 3.0, t_step_wall_s=3.5, tokens=500),
    ]
    r = summarise(recs, 0, slots=1, warmup_steps=2)
    assert r["turns_per_s"] == pytest.approx(24 / 14)  # from the end of step 2 to the end of step 4
    assert r["t_train_s"] == pytest.approx(2.0 + 3.5)  # steps 3 and 4, their whole wall time where reported
    assert r["t_sample_s"] == pytest.approx(14 - 5.5)
    assert r["tokens_per_turn"] == pytest.approx((300 + 500) / 24)
    with pytest.raises(ValueError, match="same step"):
        summarise(recs, 0, slots=1, warmup_steps=4)


def test_too_short_a_run_says_so():
    with pytest.raises(ValueError, match="fewer than two steps"):
        summarise([learner(1.0, 1, 8, 1.0)], 0, slots=1)
    with pytest.raises(ValueError, match="same step"):
        summarise([learner(1.0, 1, 8, 1.0), learner(2.0, 1, 8, 1.0)], 0, slots=1)


def _up_cfg(*argv: str):
    import argparse
    from pathlib import Path

    from t1async.cluster.config import from_args
    from t1async.cluster.flags import add_up_arguments
    from tests.clusterargs import bare

    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", type=Path, default=None)
    add_up_arguments(p)
    return from_args(p.parse_args(bare(argv)))


def test_up_pins_sampler_and_learner_to_their_cpus(tmp_path):
    """`cluster up --sampler-cpus/--learner-cpus` (what bench.staleness uses to keep sampling and training on
    separate cores) runs each under taskset, and the pinned process really sees only that CPU."""
    import os
    import subprocess
    import sys

    from t1async.cluster import components

    cpu = str(min(os.sched_getaffinity(0)))
    cfg = _up_cfg("--run-dir", str(tmp_path), "--sampler-cpus", cpu, "--learner-cpus", cpu)
    by_name = {s.name: list(s.argv) for s in components.specs(cfg, "nats://127.0.0.1:1")}
    for name in ("sampler", "learner"):
        assert by_name[name][:3] == ["taskset", "-c", cpu], by_name[name]
    assert not by_name["actor-0"][0].endswith("taskset")  # actors run anywhere
    probe = by_name["learner"][:3] + [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    assert subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip() == f"[{cpu}]"
    # `cluster up` pinned to one CPU itself (as bench.staleness runs it) may still put the learner on another
    last = max(range(os.cpu_count() or 1))
    inner = [
        sys.executable,
        "-c",
        "import sys; from t1async.cluster.cpus import parse_cpus; "
        f"print(sorted(parse_cpus('{last}', '--learner-cpus')))",
    ]
    out = subprocess.run(["taskset", "-c", cpu, *inner], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"[{last}]"
    unpinned = {s.name: list(s.argv) for s in components.specs(_up_cfg("--run-dir", str(tmp_path)), "nats://x:1")}
    assert unpinned["learner"][0] == sys.executable


def test_bad_cpu_lists_are_one_line_errors(tmp_path):
    from t1async.protocol.errors import ConfigError

    with pytest.raises(ConfigError, match="--sampler-cpus 'x': not a CPU list; give e.g. 0"):
        _up_cfg("--run-dir", str(tmp_path), "--sampler-cpus", "x")
    with pytest.raises(ConfigError, match=r"--learner-cpus '4096': CPUs \[4096\] are not on this machine"):
        _up_cfg("--run-dir", str(tmp_path), "--learner-cpus", "4096")


def test_sampler_idle_from_its_own_busy_accounting():
    from bench._overlap import sampler_idle

    # (wall time, busy_s, uptime_s): outside the window [10, 20] the sampler was idle; inside, busy 6 s of 8
    samples = [(5.0, 0.0, 1.0), (11.0, 1.0, 7.0), (15.0, 4.0, 11.0), (19.0, 7.0, 15.0), (25.0, 7.0, 21.0)]
    assert sampler_idle(samples, 10.0, 20.0) == pytest.approx(1 - 6.0 / 8.0)
    assert sampler_idle(samples, 0.0, 30.0) == pytest.approx(1 - 7.0 / 20.0)
    assert sampler_idle(samples[:1], 0.0, 30.0) is None  # one reading says nothing


def test_overlap_sets_async_beside_the_bound():
    from bench._overlap import overlap

    sync = {
        "eta": 0,
        "turns_per_s": 1.0,
        "t_sample_s": 30.0,
        "t_train_s": 20.0,
        "overlap_bound": 50.0 / 30.0,
        "sampler_idle": 0.5,
    }
    fast = {"eta": 4, "turns_per_s": 1.5, "sampler_idle": 0.1}
    ov = overlap([sync, {"eta": 1, "turns_per_s": 1.2, "sampler_idle": 0.3}, fast])
    assert ov["eta_async"] == 4 and ov["async_over_sync"] == pytest.approx(1.5)
    assert ov["of_bound"] == pytest.approx(1.5 / (50 / 30)) and ov["targets_met"]  # 0.9 of the bound, idle 10%
    assert not overlap([sync, {**fast, "turns_per_s": 1.3}])["targets_met"]  # 0.78 of the bound
    assert not overlap([sync, {**fast, "sampler_idle": 0.2}])["targets_met"]  # the sampler idles too much
    assert ov["sampler_idle_floor"] == 0  # sampling was the slower side
    slow_learner = {**sync, "t_sample_s": 10.0, "t_train_s": 40.0, "overlap_bound": 50.0 / 40.0}
    assert overlap([slow_learner, fast])["sampler_idle_floor"] == pytest.approx(0.75)
    assert overlap([sync]) == {}  # nothing async to compare


def test_learner_pid_and_cpu_seconds_from_proc(tmp_path):
    import json
    import os
    import time

    from bench._overlap import component_pid, cpu_s

    assert component_pid(tmp_path, "learner") is None  # before cluster up wrote its state
    (tmp_path / "cluster.json").write_text(json.dumps({"components": {"learner": {"pid": os.getpid()}}}))
    assert component_pid(tmp_path, "learner") == os.getpid()
    before = cpu_s(os.getpid())
    t = time.process_time()
    while time.process_time() - t < 0.3:  # burn CPU: the counter must move (clock ticks: 10 ms)
        pass
    assert before is not None and cpu_s(os.getpid()) > before
    assert cpu_s(2**22 + 12345) is None  # no such process


def test_why_names_each_measured_reason():
    from bench._overlap import overlap, why

    base = {"tokens_per_turn": 276.0, "train_s_per_ktok": 1.36, "learner_cpu_share": 0.95}
    sync = {
        **base,
        "eta": 0,
        "turns_per_s": 1.44,
        "t_sample_s": 112.0,
        "t_train_s": 132.0,
        "overlap_bound": 244 / 132,
        "sampler_idle": 0.63,
    }
    slow = {
        **base,
        "eta": 4,
        "turns_per_s": 1.66,
        "sampler_idle": 0.35,
        "tokens_per_turn": 343.0,
        "train_s_per_ktok": 1.76,
        "learner_cpu_share": 0.32,
    }
    lines = why([sync, slow], overlap([sync, slow]))
    assert len(lines) == 4, lines
    assert "must idle >= 15%" in lines[0] and "1.24x the tokens per turn" in lines[1]
    assert "1.29x as long" in lines[2] and "at η=4 the learner ran only 32%" in lines[3]
    fine = {**slow, "turns_per_s": 1.44 * 1.8, "sampler_idle": 0.1, "tokens_per_turn": 276.0, "train_s_per_ktok": 1.36}
    sync_fast_sampler = {**sync, "t_sample_s": 132.0, "t_train_s": 112.0, "overlap_bound": 244 / 132}
    assert why([sync_fast_sampler, fine], overlap([sync_fast_sampler, fine])) == []  # targets met: nothing to say


def test_main_prints_the_overlap_and_the_json_line(tmp_path, monkeypatch, capsys):
    """main() on rows as run_one returns them (the loop itself is the bench's real work, minutes long)."""
    import json

    import bench.staleness as bs

    row = {
        "max_staleness": 0,
        "stale_masked_tokens": 0,
        "steps": 9,
        "turns_trained": 288,
        "staleness_hist": {},
        "credit_waits": 10,
        "credit_wait_s": 5.0,
        "credit_wait_mean_s": 0.5,
        "credit_wait_p99_s": 2.0,
        "credit_wait_max_s": 3.0,
        "credit_wait_share": 0.5,
        "mismatch": 0.0,
        "policy_shift": 0.0,
        "tokens_per_turn": 276.0,
        "train_s_per_ktok": 1.36,
        "t_train_s": 132.0,
        "t_sample_s": 112.0,
        "t_first": 0.0,
        "t_last": 244.0,
        "overlap_bound": 244 / 132,
        "learner_cpu_share": 0.36,
    }
    rows = {
        0: {**row, "eta": 0, "turns_per_s": 1.44, "sampler_idle": 0.63},
        4: {**row, "eta": 4, "turns_per_s": 1.66, "sampler_idle": None, "max_staleness": 2},
    }
    monkeypatch.setattr(bs, "run_one", lambda eta, args, root: rows[eta])
    assert bs.main(["--etas", "0,4", "--out", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr().out
    assert "1.85x" in out and "1.15x" in out and "why not: at η=0 the learner ran only 36%" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["async_over_sync"] == pytest.approx(1.66 / 1.44) and result["sampler_idle_async"] is None
    assert not result["targets_met"] and result["staleness_ok"] and (tmp_path / "staleness.png").is_file()
