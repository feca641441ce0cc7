"""bench.baselines and bench.learning_folds' pure parts: pass@k by key, DONE masked by re-sampling before the
oracle's turn count, the content-free reward, the best baseline and a fold's JSON entry, and the fold recipes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.baselines import DoneMasked, best_of, oracle_command_turns, pass_at_ks
from bench.learning_folds import by_group, fold_entry, targets
from sandbox_agent.agent.types import AgentConfig, Reward
from sandbox_agent.synth import generate
from sandbox_agent.tasks.task import load_task
from t1async.protocol.sampling import SamplingParams
from t1async.recipes.warmstart import get_recipe
from tests.scripted_episode import ByteTok, ScriptedSampler, bash, episode


def row(task: str, key: str, resolved: bool, **kw) -> dict:
    return {"task": task, "content_key": key, "resolved": resolved, "tests_passed": int(resolved), "reason": "x", **kw}


def test_pass_at_k_by_key():
    rows = [row("a", "A", i == 0) for i in range(4)] + [row("b", "B", False) for _ in range(4)]
    got = pass_at_ks(rows, [1, 2, 4, 5])
    assert got[1]["mean"] == pytest.approx(0.125) and got[4]["mean"] == pytest.approx(0.5)  # key A 1/4 then 1
    assert got[2]["mean"] == pytest.approx((1 - 3 / 6) / 2) and 5 not in got and got[1]["keys"] == 2


async def test_done_is_resampled_before_the_oracle_turn_count_and_kept_after():
    tok = ByteTok()
    inner = ScriptedSampler(tok, ["DONE", "DONE", bash("touch a"), "DONE"])
    masked = DoneMasked(inner, tok, {"t1": 1}, tries=4)
    p = SamplingParams(max_new_tokens=64, seed=5)
    first = await masked.generate([1, 2], p, rid="eval-t1-s0")  # turn 0 < 1: DONE twice re-sampled
    assert "touch a" in tok.decode(list(first.output_ids)) and masked.resampled == 2
    assert [c["params"].seed for c in inner.calls] == [5, 5 + 7919, 5 + 2 * 7919]
    second = await masked.generate([1, 2], p, rid="eval-t1-s0")  # turn 1: DONE stands
    assert "DONE" in tok.decode(list(second.output_ids)) and masked.resampled == 2
    other = DoneMasked(ScriptedSampler(tok, ["DONE"]), tok, {"t1": 3}, tries=2)
    await other.generate([1], p, rid="eval-t1-s1")
    assert other.kept_done == 1  # still DONE after its tries: kept, and counted


def test_oracle_command_turns(tmp_path):
    t = load_task(generate(tmp_path, 1, seed=0, families=["choresn"])[0])
    assert oracle_command_turns(t) == t.extra["max_turns"] - 1 == math.ceil(t.instruction.count("\n") / 2)


async def test_the_content_free_reward_pays_every_turn_but_done():
    replies = [bash("touch t0"), bash("echo unrelated"), "DONE"]
    res, turns, _, _, _ = await episode(replies, config=AgentConfig(verify_every=1, reward=Reward.TURNS))
    assert [t.reward for t in turns] == [1.0, 1.0, 0.0]
    dense, dturns, _, _, _ = await episode(replies, config=AgentConfig(verify_every=1))
    assert [t.reward for t in dturns] != [1.0, 1.0, 0.0]


def test_best_of_and_a_folds_entry():
    assert best_of({"sweep": 0.2, "mask": 0.5, "sft": float("nan"), "rft": 0.5}) == ("mask", 0.5)
    assert best_of({"x": float("nan")})[0] == "none"
    keys = [f"choresn:n{2 + i % 2}:{i}" for i in range(6)] + ["choresn:n5:9"]
    base = {
        "sweep": [row(f"t{i}", k, False) for i, k in enumerate(keys)],
        "mask": [row(f"t{i}", k, i < 2) for i, k in enumerate(keys)],
    }
    after = [row(f"t{i}", k, True) for i, k in enumerate(keys)]
    e = fold_entry(fold=3, folds=3, after=after, baselines=base, ood_prefixes=("choresn:n5:",))
    assert e["untouched"] and e["best_baseline"] == "mask" and e["pass1_after"] == 1.0
    assert e["best_baseline_pass1"] == pytest.approx(2 / 6) and e["keys"] == 6  # the OOD key apart
    lo, hi = e["ci95_diff_by_key"]
    assert 0 < lo <= 4 / 6 <= hi and e["p_by_key"] == pytest.approx(2 / 16)  # 4 keys up, 2 unchanged
    assert e["ood"]["pass1_before"] == 0.0 and e["ood"]["pass1_after"] == 1.0 and e["ood"]["keys"] == 1
    assert e["ood"]["best_baseline_pass1"] == 0.0 and e["ood"]["before"] == "sweep"
    # RL from the sft baseline's model (--rl-init sft): the OOD rise is against sft, where it started
    sft_ood = [*base["sweep"][:-1], row("t6", "choresn:n5:9", True)]
    e = fold_entry(
        fold=0, folds=3, after=after, baselines={**base, "sft": sft_ood}, ood_prefixes=("choresn:n5:",), init="sft"
    )
    assert e["ood"]["before"] == "sft" and e["ood"]["pass1_before"] == 1.0 and e["ood"]["ci95_diff_by_key"] == [0, 0]
    t = targets([{**e, "minutes": 10.0}])
    assert t["each_fold_beats_best_baseline_by_10"] and t["each_fold_ci_by_key_above_0"]
    assert t["minutes_per_fold_le_45"]
    # a fold that reused its baselines (--reuse) paid only for the rest: its minutes are not a fold's cost
    assert targets([{**e, "minutes": 12.0, "reused": ["sft"]}])["minutes_per_fold_le_45"] is None
    assert not targets([{**e, "minutes": 12.0, "reused": ["sft"]}, {**e, "minutes": 60.0}])["minutes_per_fold_le_45"]
    assert fold_entry(fold=0, folds=3, after=after, baselines=base, ood_prefixes=())["keys"] == 7  # none apart
    assert not fold_entry(fold=0, folds=3, after=after, baselines=base, ood_prefixes=())["untouched"]


def test_a_folds_recipe_is_its_own_build_and_the_default_keeps_its_hash():
    from dataclasses import replace

    r = get_recipe("choresn")
    assert "fold" not in r.to_dict()
    assert replace(r, fold=0, folds=3).digest() != r.digest() != replace(r, fold=1, folds=3).digest()
    assert get_recipe("choresn-full").families == ("choresn",) and r.families == ("choresnsome",)


def test_by_group_says_per_number_of_chores_what_each_policy_does():
    rows = [
        row("a", "choresn:n2:1+2", True, tests_total=3, turns=2),
        row("b", "choresn:n2:1+2", False, tests_total=3, turns=3),  # key 1+2: half resolved
        row("c", "choresn:n2:3+4", False, tests_total=3, turns=2),
        row("d", "choresn:n5:0+1+2+4+8", True, tests_total=6, turns=4),
        row("e", "choresn:n5:0+1+2+4+8", True, reason="error", error="sampler down"),  # left out
    ]
    g = by_group(rows)
    assert list(g) == ["choresn:n2", "choresn:n5"]
    assert g["choresn:n2"]["keys"] == 2 and g["choresn:n2"]["pass1"] == pytest.approx(0.25)
    assert g["choresn:n2"]["tests"] == pytest.approx((1 / 3 + 0 + 0) / 3) and g["choresn:n2"]["turns"] == pytest.approx(
        7 / 3
    )
    assert g["choresn:n5"] == {"keys": 1, "pass1": 1.0, "tests": pytest.approx(1 / 6), "turns": 4.0}


def test_rescore_rebuilds_a_folds_summary_from_its_rows_alone(tmp_path, capsys):
    """``bench.learning --rescore``: the stored episode rows give the same headline as the run, plus by_group."""
    import argparse
    import json

    from bench.learning_folds import rescore

    keys = [f"choresn:n3:{i}" for i in range(6)]
    fr = tmp_path / "fold1"
    fr.mkdir()

    def write(name: str, rows: list) -> list:
        (fr / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return rows

    ood = [row("t9", "choresn:n5:9", True)]  # one held-out key, resolved by RL and by sft, not by the warm start
    after = write("test-rl-T0.jsonl", [*(row(f"t{i}", k, i < 4, turns=3) for i, k in enumerate(keys)), *ood])
    base = {
        "sweep": write(
            "test-warm-T1.jsonl",
            [*(row(f"t{i}", k, i < 1, turns=2) for i, k in enumerate(keys)), row("t9", "choresn:n5:9", False)],
        ),
        "sft": write("test-sft-T0.jsonl", [*(row(f"t{i}", k, i < 2, turns=3) for i, k in enumerate(keys)), *ood]),
    }
    rec = {"fold": 1, "untouched": False, "minutes": 61.5, "warm_start": "W", "rl": {"init": "sft"}}
    (fr / "summary.json").write_text(json.dumps(rec))
    (tmp_path / "fold0").mkdir()  # a fold without a summary.json: never taken for the untouched one
    (tmp_path / "fold0" / "test-rl-T0.jsonl").write_text((fr / "test-rl-T0.jsonl").read_text())
    assert rescore(tmp_path, argparse.ArgumentParser()) == 0
    zero, got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["folds"]
    assert zero["fold"] == 0 and not zero["untouched"] and "sft" not in zero["baselines"]
    want = fold_entry(fold=1, folds=0, after=after, baselines=base, ood_prefixes=("choresn:n5:",), init="sft")
    assert (
        got["best_baseline"] == "sft" == want["best_baseline"] and got["ci95_diff_by_key"] == want["ci95_diff_by_key"]
    )
    assert got["minutes"] == 61.5 and got["warm_start"] == "W" and not got["untouched"]
    assert got["ood"]["before"] == "sft" and got["ood"]["pass1_before"] == 1.0  # RL's init, from its rl.init
    assert got["by_group"]["rl"]["choresn:n3"]["pass1"] == pytest.approx(4 / 6)
    assert set(got["by_group"]) == {"rl", "sweep", "sft"}
    assert json.loads((fr / "summary.json").read_text())["by_group"] == got["by_group"]
    assert got["eval_pass1"] == {}  # no eval rows here
    write("eval-rl-T0.jsonl", [row("e0", keys[0], True), row("e1", keys[1], False)])
    rescore(tmp_path, argparse.ArgumentParser())
    out = capsys.readouterr().out
    got = json.loads(out.strip().splitlines()[-1])["folds"][1]
    assert got["eval_pass1"]["rl"]["mean"] == 0.5  # an RL arm scored on eval after the run, read by --rescore
    assert "rl 50.0%" in out  # and the table shows it, where settings are chosen
    with pytest.raises(SystemExit):
        rescore(tmp_path / "nothing", argparse.ArgumentParser())


def test_reuse_takes_only_the_arms_this_run_would_make_the_same_way(tmp_path):
    """``--reuse``: an earlier fold's rows are taken where the split and warm start match, and its RL arms only
    from the same RL (revision, init, steps, cluster args); a fold from before ``fold.json`` gives no RL arm (its
    RL sampled under the wrong system prompt). Another split or warm start refuses, saying why."""
    import json

    from bench.learning_folds import RL_REV, reusable

    table = [{"id": "t0", "split": "test", "content_key": "choresn:n3:1+2+3"}]
    old = tmp_path / "old" / "fold1"
    old.mkdir(parents=True)
    (old / "split.json").write_text(json.dumps({"split_disjoint": True, "tasks": table}))
    names = ["test-warm-T1.jsonl", "test-warm-passk.jsonl", "test-sft-T0.jsonl", "test-contentfree-T0.jsonl"]
    for name in [*names, "test-rl-T0.jsonl"]:
        (old / name).write_text(json.dumps(row("t0", "choresn:n3:1+2+3", True)) + "\n")
    ck = "/runs/fold1/rl/checkpoints/v000040"
    (old / "summary.json").write_text(json.dumps({"fold": 1, "warm_start": "/w", "checkpoint": ck}))
    warm40 = {"rev": RL_REV, "init": "warm", "steps": 40, "cluster_arg": []}
    rec, got = reusable(tmp_path / "old", "fold1", table, Path("/w"), warm40)
    assert set(got) == {"sweep", "passk", "sft"} and rec["checkpoint"] == ck  # no fold.json: no RL arm
    assert got["sweep"].name == "test-warm-T1.jsonl"
    # a newer fold says how it made its RL arms in fold.json
    (old / "fold.json").write_text(json.dumps({"warm_start": "/w", "rl": warm40}))
    rec, got = reusable(tmp_path / "old", "fold1", table, Path("/w"), warm40)
    assert set(got) == {"sweep", "passk", "sft", "contentfree", "rl"} and got["rl"].name == "test-rl-T0.jsonl"
    changes = (
        ("init", "sft"),
        ("steps", 200),
        ("cluster_arg", ["--advantage=rloo"]),
        ("preset", {"advantage": "rloo"}),
    )
    others = [{**warm40, k: v} for k, v in changes]
    for other in [*others, {**warm40, "rev": RL_REV - 1}]:
        assert set(reusable(tmp_path / "old", "fold1", table, Path("/w"), other)[1]) == {"sweep", "passk", "sft"}
    (old / "fold.json").write_text(json.dumps({"warm_start": "/w", "rl": {k: warm40[k] for k in warm40 if k != "rev"}}))
    assert "rl" not in reusable(tmp_path / "old", "fold1", table, Path("/w"), warm40)[1]  # before RL_REV 2
    with pytest.raises(SystemExit, match="warm start"):
        reusable(tmp_path / "old", "fold1", table, Path("/other"), warm40)
    with pytest.raises(SystemExit, match="split is not this run's"):
        reusable(tmp_path / "old", "fold1", [{**table[0], "split": "eval"}], Path("/w"), warm40)
    with pytest.raises(SystemExit, match="no .*split.json"):
        reusable(tmp_path / "old", "fold2", table, Path("/w"), warm40)


def test_reuse_refuses_a_fold_whose_warm_start_had_other_weights(tmp_path):
    """One recipe, the same cache name, another model: rebuilt on another machine, a fold's warm start and its SFT
    model were other weights, and SFT's pass@1 on the fold moved by up to 9 points. ``--reuse`` compared only the
    warm start's path, so it would have mixed the two builds' rows; it now compares ``fold.json``'s
    ``warm_weights`` (a fold recorded before them is taken as before: nothing says otherwise)."""
    import json

    from bench.learning_folds import RL_REV, reusable, stale_rows

    table = [{"id": "t0", "split": "test", "content_key": "choresn:n3:1+2+3"}]
    old = tmp_path / "old" / "fold1"
    old.mkdir(parents=True)
    (old / "split.json").write_text(json.dumps({"split_disjoint": True, "tasks": table}))
    (old / "test-sft-T0.jsonl").write_text(json.dumps(row("t0", "choresn:n3:1+2+3", True)) + "\n")
    sft40 = {"rev": RL_REV, "init": "sft", "steps": 40, "cluster_arg": []}
    (old / "fold.json").write_text(json.dumps({"warm_start": "/w", "rl": sft40}))
    assert set(reusable(tmp_path / "old", "fold1", table, Path("/w"), sft40, weights="aaaa")[1]) == {"sft"}
    (old / "fold.json").write_text(json.dumps({"warm_start": "/w", "warm_weights": "aaaa", "rl": sft40}))
    assert set(reusable(tmp_path / "old", "fold1", table, Path("/w"), sft40, weights="aaaa")[1]) == {"sft"}
    with pytest.raises(SystemExit, match="had weights aaaa, this run's has bbbb"):
        reusable(tmp_path / "old", "fold1", table, Path("/w"), sft40, weights="bbbb")
    assert stale_rows(old, table, Path("/w"), sft40, weights="bbbb") == ["test-sft-T0.jsonl"]
    assert stale_rows(old, table, Path("/w"), sft40, weights="aaaa") == []


def test_weights_digest_reads_the_weight_bytes(tmp_path):
    """Two model dirs of one config and seed have one digest; a changed weight changes it; a dir without
    weights is an error that says so."""
    import torch

    from t1async.model.moe import MoETransformer
    from t1async.model.weights import default_config, save_pretrained, weights_digest

    cfg = default_config()
    a, b = tmp_path / "a", tmp_path / "b"
    torch.manual_seed(0)
    save_pretrained(MoETransformer(cfg), a)
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    save_pretrained(model, b)
    assert weights_digest(a) == weights_digest(b) and len(weights_digest(a)) == 16
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-3
    save_pretrained(model, b)
    assert weights_digest(a) != weights_digest(b)
    with pytest.raises(Exception, match="no weights"):
        weights_digest(tmp_path)


def test_the_rl_record_holds_the_presets_values():
    """learn-choresn's RL moved from ``turn`` to ``rloo`` in the preset, not in a flag: a run's RL record holds the
    preset's values, so an RL arm made under the old preset (no ``preset`` in its record) is not reused."""
    import argparse

    from bench.learning_folds import rl_record

    args = argparse.Namespace(rl_init="sft", rl_steps=40, cluster_arg=[], preset="learn-choresn")
    rec = rl_record(args)
    assert rec["preset"]["advantage"] == "rloo" and rec["preset"]["group_size"] == "4"
    assert (rec["preset"]["kl_ref_coef"], rec["preset"]["prefix_kv"]) == ("1.0", "exact")  # anchored: 2026-12-07
    assert rl_record(argparse.Namespace(**{**vars(args), "preset": "learn"}))["preset"]["advantage"] == "turn"


def test_a_run_dir_holding_another_runs_rows_is_refused_before_they_mix(tmp_path):
    """A folds run writing into a fold dir that holds test rows of another split, warm start or RL would keep
    them beside its own, under its own ``fold.json``, and a later ``--reuse`` would take such a stale binary arm
    (sampled under the wrong prompt) as this run's. ``stale_rows`` names them; a resumed run of the same kind has
    none."""
    import json

    from bench.learning_folds import RL_REV, stale_rows

    table = [{"id": "t0", "split": "test", "content_key": "choresn:n3:1+2+3"}]
    fr = tmp_path / "run" / "fold0"
    fr.mkdir(parents=True)
    sft40 = {"rev": RL_REV, "init": "sft", "steps": 40, "cluster_arg": []}
    assert stale_rows(fr, table, Path("/w"), sft40) == []  # a new dir
    for name in ("test-sft-T0.jsonl", "test-binary-T0.jsonl"):
        (fr / name).write_text(json.dumps(row("t0", "choresn:n3:1+2+3", True)) + "\n")
    assert stale_rows(fr, table, Path("/w"), sft40) == ["test-binary-T0.jsonl", "test-sft-T0.jsonl"]  # no split
    (fr / "split.json").write_text(json.dumps({"split_disjoint": True, "tasks": table}))
    (fr / "fold.json").write_text(json.dumps({"warm_start": "/w", "rl": {**sft40, "cluster_arg": ["--reward=x"]}}))
    assert stale_rows(fr, table, Path("/w"), sft40) == ["test-binary-T0.jsonl"]  # another RL's arm
    assert stale_rows(fr, table, Path("/other"), sft40) == ["test-binary-T0.jsonl", "test-sft-T0.jsonl"]
    (fr / "fold.json").write_text(json.dumps({"warm_start": "/w", "rl": sft40}))
    assert stale_rows(fr, table, Path("/w"), sft40) == []  # the same run, resumed


def test_rl_init_and_reuse_outside_a_folds_run_are_refused(capsys):
    from bench.learning import main

    for argv in (["--rl-init", "sft"], ["--reuse", "/tmp/x"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "belong to a folds run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--baselines", "sft", "--rl-init", "cold"])
    assert "invalid choice: 'cold'" in capsys.readouterr().err


def test_a_reused_arm_brings_its_eval_rows_and_eval_pass1_reads_them(tmp_path):
    """``--reuse`` copies an arm's eval rows with its test rows (the sweep's as ``eval-warm-*``), and the fold's
    ``eval_pass1`` scores each arm's greedy eval rows by key, leaving errored episodes out. Seen failing on the old
    code: there is no ``take_arm`` or ``eval_pass1``, and an RL arm was never scored on eval."""
    import json

    from bench.learning_folds import eval_pass1, take_arm

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()

    def write(name: str, rows: list) -> Path:
        (old / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return old / name

    keys = [f"choresn:n3:{i}" for i in range(4)]
    rl = write("test-rl-T0.jsonl", [row("t0", keys[0], True)])
    write(
        "eval-rl-T0.jsonl",
        [
            *(row(f"e{i}", k, i < 3) for i, k in enumerate(keys)),
            {**row("e9", "k9", True), "reason": "error", "detail": "sampler failed: 503"},
        ],
    )
    write("eval-sft-T0.jsonl", [row(f"e{i}", k, i < 1) for i, k in enumerate(keys)])
    write("eval-sft-T1.jsonl", [row("e0", keys[0], True)])
    sweep = write("test-warm-T1.jsonl", [row("t0", keys[0], False)])
    write("eval-warm-T0.jsonl", [row("e0", keys[0], False)])
    assert take_arm(rl, "rl", new) == ["test-rl-T0.jsonl", "eval-rl-T0.jsonl"]
    assert take_arm(sweep, "sweep", new) == ["test-warm-T1.jsonl", "eval-warm-T0.jsonl"]
    assert take_arm(new / "test-rl-T0.jsonl", "rl", new) == []  # its own dir: nothing to copy
    got = eval_pass1(new)
    assert set(got) == {"rl", "warm"}  # sft was not taken, so its eval rows are not here
    assert got["rl"]["mean"] == pytest.approx(3 / 4) and got["rl"]["keys"] == 4  # the errored episode left out
    assert got["warm"]["mean"] == 0.0
    take_arm(old / "eval-sft-T0.jsonl", "sft", new)  # any test file: sft's eval rows at T 0 and T 1 come along
    assert eval_pass1(new)["sft"]["mean"] == pytest.approx(1 / 4) and (new / "eval-sft-T1.jsonl").is_file()


def test_a_fold_records_the_machine_it_ran_on():
    """``fold.json``'s ``machine``: where a fold's rows came from (one recipe on two machines scored apart)."""
    import torch

    from bench.learning_folds import machine

    m = machine()
    assert m["torch"] == torch.__version__ and m["threads"] == torch.get_num_threads()
    assert len(m["cpu_flags"]) == 16 and m["isa"] and m["host"]
