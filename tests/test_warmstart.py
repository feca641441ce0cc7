"""The learn recipe's pieces: the easy families (real sandbox), the cached seeded warm-start build, the
``--preset learn`` settings, and bench.learning's curve and paired-difference arithmetic."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from bench.learning_stats import column, learning_curve
from sandbox_agent.agent.runner import check_tasks
from sandbox_agent.synth import EXTRA_FAMILIES, FAMILIES, generate
from sandbox_agent.tasks.task import load_task, load_tasks
from t1async.cluster.config import from_args
from t1async.cluster.flags import add_up_arguments
from t1async.eval.stats import paired_diff
from t1async.learner.settings import SFTConfig
from t1async.model.config import MoEConfig
from t1async.protocol.errors import ConfigError
from t1async.recipes import warmstart


async def test_easy_families_oracle_resolves_and_null_does_not(tmp_path):
    paths = generate(tmp_path, len(EXTRA_FAMILIES), seed=3, families=list(EXTRA_FAMILIES))
    rows = await check_tasks([load_task(p) for p in paths], concurrency=4)
    assert {r.task_id.split("-")[1] for r in rows} == set(EXTRA_FAMILIES)
    for r in rows:
        # the weaker demonstrators (touchsome, choresome, cdchoresome, cdchoresfew) do k of the four and their
        # tasks test those k; chores6 (bench.learning's recombination OOD family) asks for six
        # the content families (choresn, observe, chain) ask for n chores, n varies, and one more test guards
        # against doing what was not asked: the null passes that guard, and only that
        family = r.task_id.split("-")[1]
        weaker = family in {"touchsome", "choresome", "cdchoresome", "cdchoresfew"}
        content = family in {"choresn", "choresnsome", "observe", "chain"}
        n = 6 if family == "chores6" else r.oracle.total if weaker or content else 4
        assert r.ok and r.oracle.passed == r.oracle.total == n and 1 <= n <= 13, (r.task_id, r.oracle.detail[-500:])
        guards = {k for k, ok in r.null.tests.items() if ok}
        assert r.null.total == n and not r.null.resolved, r.task_id
        assert guards == (
            {g for g in guards if g.endswith(("::test_not_asked", "::test_others_kept"))} if content else set()
        )
        assert len(guards) == (1 if content else 0), (r.task_id, guards)


def test_easy_families_stay_out_of_the_default_corpus(tmp_path):
    assert not set(EXTRA_FAMILIES) & set(FAMILIES)
    fams = {load_task(p).family for p in generate(tmp_path, 2 * len(FAMILIES), seed=1)}
    assert fams == set(FAMILIES)


def _tiny_recipe(steps: int = 3) -> warmstart.Recipe:
    model = MoEConfig(d_model=32, n_layers=1, n_heads=2, n_experts=4, top_k=2, d_ff=32, seed=7)
    return warmstart.Recipe(
        name="t",
        model=model,
        families=("mkfile",),
        tasks=6,
        task_seed=5,
        sft=SFTConfig(steps=steps, lr=1e-3, warmup_steps=1, batch_tokens=2048, seed=0),
    )


def test_recipe_digest_names_every_setting():
    a = _tiny_recipe()
    assert a.digest() == _tiny_recipe().digest()
    assert a.digest() != _tiny_recipe(steps=4).digest()
    assert warmstart.get_recipe("learn").digest() != a.digest()
    with pytest.raises(ConfigError, match="unknown warm-start recipe 'nope'; known: learn"):
        warmstart.get_recipe("nope")


def test_build_is_cached_and_loadable(tmp_path):
    from t1async.model.weights import load_pretrained

    r = _tiny_recipe()
    assert not warmstart.is_built(r, tmp_path)
    d = warmstart.build(r, tmp_path, concurrency=2, threads=1)
    assert d == warmstart.cache_dir(r, tmp_path) and warmstart.is_built(r, tmp_path)
    m = json.loads((d / "sft_metrics.json").read_text())
    assert m["demos"] >= 1 and m["loss_after"] < m["loss_before"]
    assert json.loads((d / "recipe.json").read_text())["sft"]["steps"] == 3
    model = load_pretrained(d)
    assert model.cfg.d_model == 32
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert warmstart.build(r, tmp_path) == d  # found, not rebuilt
    assert (d / "model.safetensors").stat().st_mtime_ns == stamp
    assert not list(d.parent.glob(".tmp-*"))


def _cfg(*argv: str):
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", type=Path, default=None)  # cluster up's own flag (not a setting of add_up_arguments)
    add_up_arguments(p)
    return from_args(p.parse_args(list(argv)))


def test_preset_learn_sets_defaults_and_flags_win(tmp_path):
    from t1async.cluster import components

    c = _cfg("--preset", "learn", "--run-dir", str(tmp_path))
    assert c.warm_start == "learn" and c.synth_families == ("chores",) and c.verify_every == 1
    assert components.model_dir(c) == warmstart.cache_dir(warmstart.get_recipe("learn"))
    # the RL settings bench.learning measured (docs/results.md, "Learning"): per-turn advantages, lr 5e-5
    assert (c.advantage, c.lr, c.critic, c.value_lr) == ("turn", 5e-5, "detached", 3e-3)
    argv = next(list(s.argv) for s in components.specs(c, "nats://127.0.0.1:1") if s.name == "learner")
    from tests.clusterargs import serve_args

    learner = serve_args(argv)  # what the learner reads from the --config file cluster up wrote
    assert (learner.advantage, learner.lr, learner.critic, learner.value_lr) == ("turn", 5e-5, "detached", 3e-3)
    assert _cfg("--preset", "learn", "--lr", "1e-6", "--max-turns", "9").lr == 1e-6
    assert _cfg("--preset", "learn", "--advantage", "gae").advantage == "gae"
    toml = tmp_path / "c.toml"
    toml.write_text("max-turns = 4\n")
    assert _cfg("--preset", "learn", "--config", str(toml)).max_turns == 4
    with pytest.raises(ConfigError, match="--synth-families bogus: unknown"):
        _cfg("--synth-families", "mkfile,bogus")


def test_bare_cluster_up_runs_the_learn_preset_unless_the_run_names_its_own(tmp_path):
    """A newcomer's bare ``cluster up`` trains the ``quickstart`` recipe (a weak warm start whose reward RL
    raises); a run that names its own model, sampler, tasks or warm start gets no recipe's settings it did not
    ask for; ``--preset none`` is the bare shipped model."""
    bare = _cfg("--run-dir", str(tmp_path))
    assert (bare.preset, bare.warm_start, bare.max_turns, bare.synth_families) == (
        "quickstart",
        "micro",
        1,
        ("touch4",),
    )
    none = _cfg("--run-dir", str(tmp_path), "--preset", "none")
    assert (none.preset, none.warm_start, none.synth_families) == ("none", "", ())
    assert none.max_turns > 4
    from t1async.model.weights import default_model_dir

    model = default_model_dir()
    for own in (
        ("--model", str(model)),
        ("--tasks", str(tmp_path)),
        ("--sampler-url", "http://127.0.0.1:1"),
        ("--warm-start-steps", "5"),
        ("--warm-start", "credit"),
    ):
        c = _cfg("--run-dir", str(tmp_path), *own)
        assert c.preset == "none" and c.max_turns == none.max_turns, own
    toml = tmp_path / "own.toml"
    toml.write_text(f'model = "{model}"\n')  # named in the file, not a flag: the same
    assert _cfg("--run-dir", str(tmp_path), "--config", str(toml)).preset == "none"
    assert _cfg("--run-dir", str(tmp_path), "--preset", "learn", "--tasks", str(tmp_path)).warm_start == "learn"


def test_cluster_tasks_use_the_preset_families(tmp_path):
    from t1async.cluster import components

    c = _cfg("--preset", "learn", "--run-dir", str(tmp_path), "--synth-tasks", "4")
    d = components.ensure_tasks(c)
    assert sorted({t.family for t in load_tasks(d)}) == ["chores"]


def test_learning_curve_and_paired_diff(tmp_path):
    lines = [
        {"component": "actor", "subject": "a0", "t": 1.0, "episodes_done": 4, "resolved": 1, "tests_passed": 8},
        {"component": "learner", "step": 1, "t": 2.0, "reward_sum": 4.0, "turns": 16, "mean_abs_dlogp": 0.01},
        {"component": "learner", "step": 1, "t": 2.5, "reward_sum": 4.0, "turns": 16, "mean_abs_dlogp": 0.01},
        {"component": "actor", "subject": "a0", "t": 3.0, "episodes_done": 6, "resolved": 3, "tests_passed": 16},
        {"component": "learner", "step": 2, "t": 4.0, "reward_sum": 8.0, "turns": 16, "mean_abs_dlogp": 0.02},
    ]
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    c = learning_curve(f)
    assert [r["step"] for r in c] == [1, 2]
    assert c[0]["reward_per_turn"] == 0.25 and c[0]["resolved_rate"] == 0.25 and c[0]["episodes"] == 4
    assert c[1]["resolved_rate"] == 1.0 and c[1]["tests_per_episode"] == 4.0
    before = {f"t{i}": (0.0, 1.0) for i in range(20)}
    after = {f"t{i}": (1.0 if i % 2 else 0.0, 2.0) for i in range(20)}
    d = paired_diff(column(before, 0), column(after, 0))
    assert d["mean"] == 0.5 and 0.2 < d["ci95"][0] < 0.5 < d["ci95"][1] < 0.8
    assert paired_diff(column(before, 1), column(after, 1)) == {"mean": 1.0, "ci95": [1.0, 1.0], "tasks": 20}


def test_eval_cli_says_when_the_system_prompt_file_is_missing(tmp_path, capsys):
    from t1async.eval.__main__ import main
    from t1async.model.weights import default_model_dir

    model = default_model_dir()  # passes the model-dir check, which comes first
    with pytest.raises(SystemExit):
        main(["--model", str(model), "--tasks", str(tmp_path), "--system-prompt-file", str(tmp_path / "nope.txt")])
    assert f"--system-prompt-file {tmp_path / 'nope.txt'}: no such file" in capsys.readouterr().err


def test_actor_argv_carries_the_warm_starts_prompt(tmp_path):
    from t1async.cluster import components

    c = _cfg("--preset", "learn", "--run-dir", str(tmp_path))
    from actors.__main__ import build_parser, settings

    actors = [s for s in components.specs(c, "nats://127.0.0.1:1") if s.name.startswith("actor-")]
    want = warmstart.cache_dir(warmstart.get_recipe("learn")) / warmstart.PROMPT_FILE
    p = build_parser()
    parsed = [settings(p.parse_args(s.argv[s.argv.index("actors") + 1 :]), p) for s in actors]
    assert parsed and all(a.system_prompt_file == want for a in parsed)
    assert [a.actor_id for a in parsed] == [f"actor-{i}" for i in range(len(actors))]


def test_a_model_dir_handed_over_by_path_brings_its_prompt_to_the_actors_and_the_eval(tmp_path):
    """``cluster up --warm-start= --model DIR`` (what bench.learning's folds run, RL from a fold's warm start or
    SFT model): the actors and the in-loop eval prompt the policy as DIR was trained (its system_prompt.txt).
    They got the agent's default prompt before (327 tokens the policy never saw); a dir without the file
    still gets the default."""
    from actors.__main__ import build_parser, settings
    from t1async.cluster import components
    from t1async.config import add_arguments, resolve
    from t1async.eval.loop import LoopSettings
    from t1async.model.weights import default_model_dir

    model = tmp_path / "warm"
    shutil.copytree(default_model_dir(), model)
    (model / warmstart.PROMPT_FILE).write_text("Reply with one command.")
    tasks = tmp_path / "tasks"
    (tasks / "t0").mkdir(parents=True)
    (tasks / "t0" / "task.yaml").write_text("")

    def prompts(model_dir: Path) -> tuple[set, object]:
        c = _cfg(
            "--warm-start=",
            "--model",
            str(model_dir),
            "--tasks",
            str(tasks),
            "--eval-every",
            "5",
            "--run-dir",
            str(tmp_path / "run"),
        )
        specs = {s.name: list(s.argv) for s in components.specs(c, "nats://127.0.0.1:1")}
        p = build_parser()
        got = {
            settings(p.parse_args(a[a.index("actors") + 1 :]), p).system_prompt_file
            for n, a in specs.items()
            if n.startswith("actor-")
        }
        ep = argparse.ArgumentParser()
        add_arguments(ep, LoopSettings)
        ev = resolve(LoopSettings, ep.parse_args(specs["eval"][specs["eval"].index("t1async.eval.loop") + 1 :]))
        return got, ev.system_prompt_file

    assert prompts(model) == ({model / warmstart.PROMPT_FILE}, model / warmstart.PROMPT_FILE)
    assert prompts(default_model_dir()) == ({None}, None)


def test_easy_family_names_are_the_same_tokens_in_instruction_and_command():
    """Each command argument is, token for token, a run of the instruction's tokens: the v1 families put names
    in backticks, which the tokenizer splits differently (``sage``: ``s|age`` in the instruction, `` s|age`` in
    the command), so copying a name was re-tokenizing it, and the warm start resolved 0% at temperature 1."""
    from sandbox_agent.synth import make_task
    from t1async.model.tokenizer import ChatTokenizer
    from t1async.model.weights import default_model_dir

    tok = ChatTokenizer.load(default_model_dir())
    for fam in ("mkfile", "copy"):
        for i in range(20):
            _, spec = make_task(fam, 0, i)
            instr = tok.encode(spec.instruction)
            for line in spec.solution.splitlines():
                for arg in line.split()[1:]:
                    if arg[0].isalpha():
                        ids = tok.encode(" " + arg)
                        assert any(instr[j : j + len(ids)] == ids for j in range(len(instr))), (fam, i, arg)


def test_copy_pretraining_examples_and_new_fields_keep_old_hashes():
    from t1async.recipes.sft import copy_examples

    ex = copy_examples(50, 4096, frozenset({0, 1}), seed=3, min_len=4, max_len=9, pool=[0, 1, 7, 8, 9])
    for e in ex:
        n = len(e.tokens) // 2
        assert 4 <= n <= 9 and list(e.tokens[:n]) == list(e.tokens[n:]) and set(e.tokens) <= {7, 8, 9}
        assert not e.loss_mask[: n + 1].any() and e.loss_mask[n + 1 :].all()  # the repeat, after its first token
    assert [list(e.tokens) for e in ex] == [
        list(e.tokens)
        for e in copy_examples(50, 4096, frozenset({0, 1}), seed=3, min_len=4, max_len=9, pool=[0, 1, 7, 8, 9])
    ]
    with pytest.raises(ConfigError, match="pool of at least 2"):
        copy_examples(1, 4096, frozenset({0}), pool=[0, 5])
    r = _tiny_recipe()
    d = r.to_dict()  # recipes built before data_version/copy_steps existed keep their hash (their cache dir)
    assert "data_version" not in d and "copy_steps" not in d["sft"]
    import dataclasses

    r2 = dataclasses.replace(r, data_version=2, sft=dataclasses.replace(r.sft, copy_steps=5))
    assert r2.to_dict()["data_version"] == 2 and r2.to_dict()["sft"]["copy_steps"] == 5 and r2.digest() != r.digest()


async def test_chores_doing_the_whole_menu_passes_no_test(tmp_path):
    """Each chores test also checks an unrequested chore was not done, so a policy that runs every menu
    command (ignoring the instruction) earns nothing; the oracle (only the four asked) earns 4 of 4."""
    from sandbox_agent.synth.chores import MENU

    paths = generate(tmp_path, 3, seed=11, families=["chores"])
    for p in paths:
        (p / "solution.sh").write_text("#!/bin/bash\n" + "\n".join(m[1] for m in MENU) + "\n")
    rows = await check_tasks([load_task(p) for p in paths], concurrency=3)
    assert [(r.oracle.passed, r.oracle.total) for r in rows] == [(0, 4)] * 3


def test_bench_learning_sigterm_stops_its_cluster(tmp_path):
    """A SIGTERMed bench.learning stops the `cluster up` it started (before, the child kept running)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "bench.py"
    script.write_text(f"""
import subprocess, sys
sys.path.insert(0, {os.getcwd()!r})
import bench.learning_runs as bl
orig = subprocess.Popen
bl.subprocess.Popen = lambda argv, **kw: orig(["/bin/sh", "-c", "echo $$ > {tmp_path}/child.pid; exec sleep 300"], **kw)
(open("{tmp_path}/ready", "w").close())
bl.run_rl(__import__("pathlib").Path("{tmp_path}/rl"), __import__("pathlib").Path("{tmp_path}"), 1, [], 600)
""")
    bench = subprocess.Popen([sys.executable, str(script)])
    pid_file = tmp_path / "child.pid"
    for _ in range(600):
        if pid_file.is_file() and pid_file.read_text().strip():
            break
        time.sleep(0.1)
    child = int(pid_file.read_text())
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=60) != 0
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("cluster up (the stand-in child) outlived the SIGTERMed bench")
