"""Dense process reward against a binary end-of-episode reward, on the same policy, tasks and budget.

    python -m bench.reward_modes [--warm-start credit|credit-early|credit-sparse|credit-rare] [--rl-steps 40]
        [--samples 2] [--json]

1. the ``--warm-start`` policy (``t1async.recipes.warmstart``, cached): ``credit``, the ``learn`` recipe's SFT on
   ``cdchoresome``, a demonstrator that does the ``cd`` and then only the first k of the four chores, or
   ``credit-early`` and ``credit-sparse``, the same SFT stopped sooner (450 and 330 of its 600 steps), which
   seldom do all four, or ``credit-rare``, the same SFT on ``cdchoresfew``, a demonstrator that never does all
   four (so a binary reward is 0 unless the policy goes beyond its demonstrations);
2. a ``cdchores`` corpus (``--eval-corpus`` tasks, seed 0, every chore tested), split by content key
   (directory and chore set). The held-out tasks are its eval split; the bench checks that no eval key is in a
   train task or among the warm start's demonstrations (``split.json``), and refuses to run if one is;
3. eval before (``bench.learning_runs.eval_policy``, ``--samples`` seeded episodes per task);
4. for each of ``--rewards`` (default dense, binary): ``cluster up --preset learn --warm-start W
   --reward R`` for ``--rl-steps`` learner steps (the same turns per step, so the same budget), then the same
   eval on its last checkpoint.

Prints the table (pass@1 and mean tests passed by content key, 95% cluster bootstrap CIs over keys; each
run's paired difference from before, and dense - binary paired, with the sign-flip p over keys) and the
learning curves; the last stdout line is JSON with
``before``, ``after`` (reward -> pass1/tests), ``diff`` (reward -> paired diff from before), ``dense_minus_binary``,
``held_out_tasks``, ``rl_steps`` and ``minutes``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench._common import emit_json, print_grid
from bench.learning_runs import ensure_corpus, eval_policy, held_tasks, run_rl
from bench.learning_stats import column, keys_of, learning_curve, per_task, split_check
from t1async.eval.stats import by_key_ci, paired_by_key, split_errors
from t1async.log import configure

RECIPE = "credit"
FAMILY = "cdchores"


def held_out_corpus(run: Path, n: int, seed: int, sft: dict[str, tuple[str, str, str]]) -> tuple[Path, list]:
    """The ``cdchores`` corpus of ``n`` tasks (split by content key: directory and chore set) and its eval
    split, checked disjoint by content from itself and from the warm start's demonstrations ``sft``
    (``corpus_entries`` of its recipe); ``split.json`` in ``run`` says so."""
    tasks_dir = run / "tasks"
    table = ensure_corpus(tasks_dir, n, seed, (FAMILY,))
    check = split_check(table, sft)
    (run / "split.json").write_text(json.dumps({**check, "corpus": str(tasks_dir), "tasks": table}, indent=1) + "\n")
    if not check["split_disjoint"]:
        raise SystemExit(f"split: NOT disjoint by content: {check['leaks'] or check['wrong_split']}")
    return tasks_dir, held_tasks(tasks_dir, table, "eval")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reward_modes", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, default=Path("runs/reward-modes"))
    p.add_argument("--eval-corpus", type=int, default=600, help="cdchores tasks in the corpus (default 600)")
    p.add_argument("--samples", type=int, default=2, help="seeded episodes per held-out task (default 2)")
    p.add_argument(
        "--warm-start",
        default=RECIPE,
        choices=("credit", "credit-early", "credit-sparse", "credit-rare"),
        help="the policy both rewards start from: credit (resolves ~21%% of held-out tasks), credit-early (the "
        "same SFT stopped at 450 steps: ~15%%), credit-sparse (at 330 steps: ~4%%, so the binary reward is mostly 0) "
        "or credit-rare (on a demonstrator that never does all four chores)",
    )
    p.add_argument("--rl-steps", type=int, default=40, help="learner steps of RL per reward (default 40)")
    p.add_argument("--rl-timeout", type=float, default=1800.0, help="stop each RL run after this many seconds")
    p.add_argument("--rewards", default="dense,binary", help="comma-separated --reward values (default both)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cluster-arg", action="append", default=[], help="extra flag for cluster up (repeatable)")
    p.add_argument("--json", action="store_true", help="(the last line is JSON anyway)")
    args = p.parse_args(argv)
    rewards = [r for r in args.rewards.split(",") if r]
    from sandbox_agent.agent.types import Reward

    bad = [r for r in rewards if r not in {x.value for x in Reward}]
    if bad or not rewards:
        p.error(f"--rewards {args.rewards!r}: name some of {', '.join(x.value for x in Reward)}")
    configure(level="warning")
    from sandbox_agent.synth import corpus_entries
    from t1async.recipes.presets import preset_values
    from t1async.recipes.warmstart import build, get_recipe, system_prompt_of

    pv = preset_values("learn")
    ev = {
        "max_turns": pv["max_turns"],
        "max_new_tokens": pv["max_new_tokens"],
        "max_context": pv["max_context"],
        "concurrency": args.concurrency,
        "seed": args.seed,
        "temperature": pv["temperature"],
    }
    recipe = get_recipe(args.warm_start)
    run = args.run_dir
    run.mkdir(parents=True, exist_ok=True)
    warm = build(recipe)
    ev["system_prompt"] = system_prompt_of(warm)
    sft = corpus_entries(recipe.tasks, recipe.task_seed, list(recipe.families))
    tasks_dir, held = held_out_corpus(run, args.eval_corpus, args.seed, sft)
    print(f"held-out by content: {len(held)} tasks x {args.samples} samples", flush=True)
    t0 = time.perf_counter()
    rows = {"before": eval_policy(warm, held, samples=args.samples, out=run / "eval-before.jsonl", **ev)}
    curves = {}
    for r in rewards:
        rl_dir = run / r / "rl"
        if rl_dir.exists():
            shutil.rmtree(rl_dir)
        rl_dir.parent.mkdir(parents=True, exist_ok=True)
        extra = ["--warm-start", args.warm_start, "--reward", r, "--seed", str(args.seed), *args.cluster_arg]
        ckpt = run_rl(rl_dir, tasks_dir, args.rl_steps, extra, args.rl_timeout)
        rows[r] = eval_policy(ckpt, held, samples=args.samples, out=run / r / "eval-after.jsonl", **ev)
        curves[r] = learning_curve(rl_dir / "metrics.jsonl")
    minutes = (time.perf_counter() - t0) / 60.0
    # by content key (the directory and chore set): a key's tasks are one held-out item, so the CIs resample
    # keys (t1async.eval.stats.by_key_ci, paired_by_key with its sign-flip p over keys), not tasks
    key_of = keys_of(*rows.values())
    scores = {k: per_task(split_errors(v)[0]) for k, v in rows.items()}
    table = {
        k: {"pass1": by_key_ci(column(s, 0), key_of), "tests": by_key_ci(column(s, 1), key_of)}
        for k, s in scores.items()
    }
    diff = {
        r: {
            m: paired_by_key(column(scores["before"], i), column(scores[r], i), key_of)
            for i, m in enumerate(("pass1", "tests"))
        }
        for r in rewards
    }
    dmb = None
    if {"dense", "binary"} <= set(rewards):
        dmb = {
            m: paired_by_key(column(scores["binary"], i), column(scores["dense"], i), key_of)
            for i, m in enumerate(("pass1", "tests"))
        }

    def fmt(f: dict, pct: bool) -> str:
        m, (lo, hi) = f["mean"], f["ci95"]
        return f"{m:.1%} [{lo:.1%}, {hi:.1%}]" if pct else f"{m:.2f} [{lo:.2f}, {hi:.2f}]"

    grid = [["before (warm start)", fmt(table["before"]["pass1"], True), fmt(table["before"]["tests"], False)]]
    for r in rewards:
        grid.append([f"after RL, --reward {r}", fmt(table[r]["pass1"], True), fmt(table[r]["tests"], False)])
        grid.append([f"  {r} - before (paired)", fmt(diff[r]["pass1"], True), fmt(diff[r]["tests"], False)])
    if dmb is not None:
        grid.append(["dense - binary (paired)", fmt(dmb["pass1"], True), fmt(dmb["tests"], False)])
    for r, d in [*diff.items(), *([("dense - binary", dmb)] if dmb else [])]:
        print(
            f"{r}: sign-flip p over {d['pass1']['keys']} keys: pass@1 {d['pass1']['p']:.4f}, "
            f"tests {d['tests']['p']:.4f}"
        )
    print_grid(
        ["", "pass@1", "mean tests passed (of 4)"],
        grid,
        title=f"\nheld out by content: {len(held)} tasks x {args.samples} seeded samples; learner steps reached: "
        + ", ".join(f"{r} {len(c)}" for r, c in curves.items()),
    )
    for r, curve in curves.items():
        print(
            f"{r}: reward/turn per step "
            + " ".join(f"{c['reward_per_turn']:.2f}" for c in curve)
            + "; resolved "
            + " ".join(f"{c['resolved_rate']:.2f}" for c in curve),
            flush=True,
        )
    summary = {
        "warm_start": args.warm_start,
        "before": table["before"],
        "after": {r: table[r] for r in rewards},
        "diff": diff,
        "dense_minus_binary": dmb,
        "held_out_tasks": len(held),
        "samples": args.samples,
        "rl_steps": {r: len(c) for r, c in curves.items()},
        "curves": curves,
        "minutes": minutes,
    }
    (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    emit_json(
        {
            k: summary[k]
            for k in (
                "warm_start",
                "before",
                "after",
                "diff",
                "dense_minus_binary",
                "held_out_tasks",
                "rl_steps",
                "minutes",
            )
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
