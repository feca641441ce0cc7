"""bench.learning's pieces without its hour of RL: the before/after comparison (by content key, errors
apart), the best decoding, the spread over seeds, the split check against the warm start's corpus, the
cached corpus that must match what is asked, and ``main`` end to end with the evals and RL stood in for (the
test split is what is reported, N seeds give N entries, the last line has the promised fields)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import bench.learning as bl
from bench.learning_stats import best_decoding, compare, error_counts, split_check, spread
from sandbox_agent.synth import corpus_entries
from sandbox_agent.synth.split import read_split_json


def row(key: str, resolved: bool, tests: int, *, task: str | None = None, **kw) -> dict:
    return {
        "task": task or f"t-{key}",
        "content_key": key,
        "resolved": resolved,
        "tests_passed": tests,
        "reason": "solved",
        **kw,
    }


def test_compare_pairs_by_content_key_and_leaves_errors_out():
    # key a has two tasks (two orders of one chore set): one item, not two
    before = [row("a", False, 1, task="t1"), row("a", False, 1, task="t2"), row("b", False, 2), row("c", True, 4)]
    after = [row("a", True, 4, task="t1"), row("a", True, 4, task="t2"), row("b", True, 4), row("c", True, 4)]
    after.append(row("b", False, 0, task="t-b2", reason="error", detail="sampler failed on turn 0: down"))
    c = compare(before, after)
    assert c["keys"] == 3
    assert c["pass1_before"] == pytest.approx(1 / 3) and c["pass1_after"] == pytest.approx(1.0)  # the error: no fail
    assert c["tests_before"] == pytest.approx(7 / 3) and c["tests_after"] == pytest.approx(4.0)
    assert c["diff"]["pass1"] == pytest.approx(2 / 3)
    lo, hi = c["ci95_diff"]["pass1"]
    assert 0 <= lo <= 2 / 3 <= hi <= 1


def test_best_decoding_prefers_the_lower_temperature_on_a_tie_and_skips_nan():
    assert best_decoding({0.0: 0.5, 0.3: 0.6, 0.7: 0.6, 1.0: 0.4}) == (0.3, 0.6)
    assert best_decoding({0.0: math.nan, 1.0: 0.2}) == (1.0, 0.2)
    with pytest.raises(ValueError, match="no temperature"):
        best_decoding({0.0: math.nan})


def test_spread_over_seeds():
    s = spread([0.1, 0.2, 0.3])
    assert s["mean"] == pytest.approx(0.2) and s["sd"] == pytest.approx(0.1) and (s["min"], s["max"]) == (0.1, 0.3)
    assert spread([0.4])["sd"] == 0.0


def test_error_counts_by_kind_and_by_eval():
    e = error_counts(
        {
            "x": [row("a", False, 0, reason="timeout"), row("b", True, 4)],
            "y": [row("a", False, 0, reason="error", detail="sandbox failed on turn 2: gone")],
        }
    )
    assert e["total"]["timeout"] == 1 and e["total"]["sandbox"] == 1 and e["total"]["episodes"] == 3
    assert e["by_eval"] == {"x": {"timeout": 1}, "y": {"sandbox": 1}}


def test_split_check_against_the_warm_starts_corpus():
    table = {
        t: {"split": s, "content_key": k, "family": f} for t, (s, k, f) in corpus_entries(300, 0, ["chores"]).items()
    }
    sft = corpus_entries(400, 1000, ["chores"])
    good = split_check(table, sft)
    assert good["split_disjoint"] and good["keys"]["eval"] > 0 and good["keys"]["test"] > 0
    assert good["sft_train_tasks"] == sum(1 for s, _, _ in sft.values() if s == "train")
    # an eval task relabelled train (as an id-hash split would): not its key's split
    tid = next(t for t, e in table.items() if e["split"] == "eval")
    bad = split_check({**table, tid: {**table[tid], "split": "train"}}, sft)
    assert not bad["split_disjoint"] and bad["wrong_split"] == [tid]
    # a demonstration of an eval key (a warm start built on another split): a leak
    key = table[tid]["content_key"]
    bad = split_check(table, {**sft, "demo": ("train", key, "chores")})
    assert not bad["split_disjoint"] and bad["leaks"] == {key: ["eval", "train"]}


def test_a_cached_corpus_of_another_size_is_regenerated(tmp_path):
    """The bench reused a cached OOD dir of 12 tasks when 24 were asked (seen failing on the old code, which
    generated only when the dir held no task)."""
    root = tmp_path / "ood"
    bl.ensure_corpus(root, 6, 0, ["text", "csv"])
    table = bl.ensure_corpus(root, 12, 0, ["text", "csv"])
    assert len(table) == 12 and len(list(root.glob("*/task.yaml"))) == 12
    stamp = (root / "split.json").stat().st_mtime_ns
    assert bl.ensure_corpus(root, 12, 0, ["text", "csv"]) == table  # the same ask: reused, not rewritten
    assert (root / "split.json").stat().st_mtime_ns == stamp
    table2 = bl.ensure_corpus(root, 12, 1, ["text", "csv"])  # another seed: other tasks
    assert set(table2) != set(table) and len(list(root.glob("*/task.yaml"))) == 12


def test_main_reports_the_test_split_per_seed(tmp_path, monkeypatch, capsys):
    """The whole bench with its evals and RL stood in for: the warm start resolves the tasks of even content
    keys at T <= 0.3 and nothing at T = 1; every RL checkpoint resolves everything greedily."""
    from t1async.recipes import warmstart

    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "sft_metrics.json").write_text("{}")
    monkeypatch.setattr(warmstart, "build", lambda recipe: warm)
    seen: list[tuple[str, str, float, int]] = []

    def fake_eval(model, tasks, *, samples, temperature, out, **kw):
        split = {t.split for t in tasks}
        assert len(split) == 1
        # the learn preset's tasks (all four chores tested), not the warm start's demonstrator's (choresome)
        assert {t.family for t in tasks} == {"chores"}
        seen.append((Path(model).name, split.pop(), temperature, samples))
        rows = []
        for t in tasks:
            for s in range(samples):
                even = int(t.content_key.rsplit(":", 1)[1].split("+")[0]) % 2 == 0
                ok = Path(model).name != "warm" or (even and temperature <= 0.3)
                rows.append(
                    {"task": t.id, "content_key": t.content_key, "sample": s, "family": t.family, "resolved": ok}
                    | {"tests_passed": 4 if ok else 1, "reason": "solved", "verify_status": "ok"}
                )
        return rows

    def fake_rl(run_dir, tasks, steps, extra, timeout_s):
        assert extra[:2] == ["--seed", str(len([x for x in seen if x[0].startswith("ck")]) // 2)]
        ck = run_dir / "ck"
        ck.mkdir(parents=True)
        return ck

    plots: list[dict] = []
    monkeypatch.setattr(bl, "eval_policy", fake_eval)
    monkeypatch.setattr(bl, "run_rl", fake_rl)
    monkeypatch.setattr(bl, "plot", lambda curve, table, path, **kw: plots.append(kw))
    argv = ["--run-dir", str(tmp_path / "run"), "--eval-corpus", "300", "--seeds", "2", "--ood-tasks", "0"]
    assert bl.main([*argv, "--recombined-tasks", "0"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(bl.LAST_LINE) <= set(last)
    # the sweep ran on eval only; test saw the warm start at the best T (0: ties go low), greedily and at T = 1
    assert [(m, s, t) for m, s, t, _ in seen[:4]] == [("warm", "eval", t) for t in (0.0, 0.3, 0.7, 1.0)]
    assert {(m, s, t) for m, s, t, _ in seen[4:6]} == {("warm", "test", 0.0), ("warm", "test", 1.0)}
    assert [(m, s, t) for m, s, t, _ in seen[6:]] == [("ck", "test", 0.0), ("ck", "test", 1.0)] * 2
    assert all(k == 1 for _, _, t, k in seen if t == 0.0) and all(k == 4 for _, _, t, k in seen if t > 0)
    assert last["best_decoding_before"]["temperature"] == 0.0
    assert 0.2 < last["best_decoding_before"]["pass1"] < 0.8
    assert last["split_disjoint"] is True and last["ood"] is None
    assert len(last["seeds"]) == 2
    for s in last["seeds"]:
        assert s["pass1_after"] == 1.0 and s["pass1_before"] == last["best_decoding_before"]["pass1"]
        assert set(s["ci95_diff"]) == {"pass1", "tests"} and s["ci95_diff"]["pass1"][0] > 0
        assert s["at_train_temperature"]["pass1_before"] == 0.0
    assert last["errors"]["episodes"] > 0 and not any(n for k, n in last["errors"].items() if k != "episodes")
    split = json.loads((tmp_path / "run" / "split.json").read_text())
    assert split["split_disjoint"] and split["tasks"] == read_split_json(tmp_path / "run" / "tasks-chores")
    # learning.png's before/after bars are the test split's at T = 1 (it said "held-out eval split")
    assert plots == [{"held_title": "test split, RL seed 0, T = 1"}]


def test_main_evaluates_the_recombined_family_before_and_after_the_first_seed(tmp_path, monkeypatch, capsys):
    """chores6 (six chores, three replies) is out of distribution by combination only: every one of its tasks,
    whatever its split, is evaluated once with the warm start and once after RL seed 0, at the training T."""
    from t1async.recipes import warmstart

    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "sft_metrics.json").write_text("{}")
    monkeypatch.setattr(warmstart, "build", lambda recipe: warm)
    seen: list[tuple[str, str, float, int, int]] = []

    def fake_eval(model, tasks, *, samples, temperature, out, **kw):
        (family,) = {t.family for t in tasks}
        seen.append((Path(model).name, family, temperature, samples, len(tasks)))
        after = Path(model).name != "warm"
        return [
            {"task": t.id, "content_key": t.content_key, "sample": 0, "family": t.family, "resolved": after}
            | {"tests_passed": 6 if after else 4, "reason": "solved", "verify_status": "ok"}
            for t in tasks
        ]

    def fake_rl(run_dir, tasks, steps, extra, timeout_s):
        (run_dir / "ck").mkdir(parents=True)
        return run_dir / "ck"

    monkeypatch.setattr(bl, "eval_policy", fake_eval)
    monkeypatch.setattr(bl, "run_rl", fake_rl)
    monkeypatch.setattr(bl, "plot", lambda *a, **kw: None)
    argv = ["--run-dir", str(tmp_path / "run"), "--eval-corpus", "300", "--seeds", "2", "--ood-tasks", "0"]
    assert bl.main([*argv, "--recombined-tasks", "30", "--temperatures", "1"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [s for s in seen if s[1] == "chores6"] == [("warm", "chores6", 1.0, 1, 30), ("ck", "chores6", 1.0, 1, 30)]
    rec = last["ood_recombined"]
    assert (rec["pass1_before"], rec["pass1_after"], rec["tests_before"], rec["tests_after"]) == (0.0, 1.0, 4.0, 6.0)
    assert rec["ci95_diff"]["pass1"][0] > 0
    splits = {e["split"] for e in read_split_json(tmp_path / "run" / "recombined-tasks").values()}
    assert "train" in splits  # all of the family, train split too: no run trains on it


def test_compare_arms_splits_the_held_out_keys_and_names_a_bad_file(tmp_path, capsys):
    """``python -m bench.compare_arms``: two eval files, the held-out keys compared apart; a file that is not
    an eval file gets exit 2 and a line naming it."""
    from bench.compare_arms import main

    before = [row("choresn:n2:a", False, 1), row("choresn:n3:b", False, 2), row("choresn:n5:c", True, 4)]
    after = [row("choresn:n2:a", True, 3), row("choresn:n3:b", True, 3), row("choresn:n5:c", False, 1)]
    b, a = tmp_path / "b.jsonl", tmp_path / "a.jsonl"
    b.write_text("".join(json.dumps(r) + "\n" for r in before))
    a.write_text("".join(json.dumps(r) + "\n" for r in after))
    assert main([str(b), str(a), "--held-out", "choresn:n5:"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["in"]["keys"] == 2 and out["in"]["diff"]["pass1"] == pytest.approx(1.0)
    assert out["in"]["diff"]["tests"] == pytest.approx(1.5)
    assert out["held_out"]["keys"] == 1 and out["held_out"]["diff"]["tests"] == pytest.approx(-3.0)
    assert main([str(b), str(a), "--held-out", ""]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["in"]["keys"] == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task": "x"}\n')
    assert main([str(b), str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert main([str(b), str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps(row("zzz", True, 1)) + "\n")
    assert main([str(b), str(other), "--held-out", ""]) == 2
    assert "share no content key" in capsys.readouterr().err


def test_run_rl_refuses_to_hand_on_the_checkpoint_of_a_run_that_failed(tmp_path, monkeypatch):
    """A cluster up that fails on its own (here after v1, as a failed push check does) is not RL's policy: the
    bench stops and quotes the error, where it used to score v1 as the arm's "after 40 steps"."""
    import subprocess
    import sys

    from bench import learning_runs
    from t1async.learner.checkpoint import save_checkpoint
    from tests.segments import tiny

    run_dir = tmp_path / "rl"
    save_checkpoint(run_dir / "checkpoints", tiny(), None, policy_version=1, step=1)
    real = subprocess.Popen
    code = {"rc": 1}

    def fake_cluster(argv, **kw):  # the command line is cluster up's; what runs prints as a failing one would
        assert argv[1:4] == ["-m", "t1async.cluster", "up"] and "--steps" in argv
        script = f"print('error: the sampler does not serve the weights pushed as v1'); raise SystemExit({code['rc']})"
        return real([sys.executable, "-c", script], **kw)

    monkeypatch.setattr(learning_runs.subprocess, "Popen", fake_cluster)
    with pytest.raises(SystemExit, match=r"failed \(exit 1\) before its 40 steps; its last checkpoint is version 1"):
        learning_runs.run_rl(run_dir, tmp_path / "tasks", 40, [], 600)
    with pytest.raises(SystemExit, match="does not serve the weights pushed as v1"):
        learning_runs.run_rl(run_dir, tmp_path / "tasks", 40, [], 600)
    code["rc"] = 0  # a run that finished hands on its last checkpoint
    assert learning_runs.run_rl(run_dir, tmp_path / "tasks", 1, [], 600).name == "v000001"


def test_run_rl_scores_the_newest_version_an_export_too_and_refuses_a_short_run(tmp_path, monkeypatch, capsys):
    """The learner writes a full checkpoint every --checkpoint-every steps; one SIGKILLed mid-step (after the
    supervisor's grace, seen on a stop under load) leaves only push-only exports after the last. The bench scores
    the newest version, export or checkpoint, where the old code said "no checkpoint" (exports only, seen) or
    scored the last full checkpoint, up to 9 versions older. A run that stopped short of its steps, and not by
    --rl-timeout, is refused, where the old code scored it as "after N steps"."""
    import subprocess
    import sys

    from bench import learning_runs
    from t1async.learner.checkpoint import save_checkpoint
    from tests.segments import tiny

    run_dir, tasks = tmp_path / "rl", tmp_path / "tasks"
    model = tiny()
    for v in (1, 2, 3):
        save_checkpoint(run_dir / "checkpoints", model, None, policy_version=v, step=v, full=False)
    real = subprocess.Popen
    script = {"s": "raise SystemExit(0)"}

    def fake_cluster(argv, **kw):
        return real([sys.executable, "-c", script["s"]], **kw)

    monkeypatch.setattr(learning_runs.subprocess, "Popen", fake_cluster)
    with pytest.raises(SystemExit, match=r"stopped \(exit 0\) at version 3, before its 40 steps and not by"):
        learning_runs.run_rl(run_dir, tasks, 40, [], 600)
    assert learning_runs.run_rl(run_dir, tasks, 3, [], 600).name == "v000003"  # exports only: the newest
    save_checkpoint(run_dir / "checkpoints", model, None, policy_version=4, step=4)  # a full one, then an export
    save_checkpoint(run_dir / "checkpoints", model, None, policy_version=5, step=5, full=False)
    assert learning_runs.run_rl(run_dir, tasks, 5, [], 600).name == "v000005"
    script["s"] = "import time; time.sleep(120)"  # still training when --rl-timeout ends it: scored, and said so
    capsys.readouterr()
    assert learning_runs.run_rl(run_dir, tasks, 40, [], 0.5).name == "v000005"
    assert "(version 5, 5 of the 40 steps asked (--rl-timeout))" in capsys.readouterr().out
