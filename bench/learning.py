"""Does the whole loop learn? Warm start -> held-out evals -> N RL runs with the real cluster -> test evals.

    python -m bench.learning [--recipe learn] [--rl-steps 200] [--rl-timeout 1500] [--samples 4] [--seeds 3] [--json]

1. the warm start: ``t1async.recipes.warmstart`` builds the recipe's model once (seeded) and caches it;
2. the split, frozen first: a corpus of the preset's families (``--eval-corpus`` tasks, seed ``--seed``) in
   the run dir, split train / eval / test by a hash of each task's *content key* (the chore set, ...), so eval
   and test hold out whole keys; ``split.json`` in the run dir lists every task with its split and key and
   whether no eval or test key is among the RL tasks or the warm start's demonstrations (``split_disjoint``).
   A cached corpus (and the OOD one) is reused only when it is exactly the one asked for;
3. the warm start's best decoding: pass@1 at each of ``--temperatures`` on the eval split (the tuning set),
   the best chosen there; then on the test split at that temperature, greedily and at the training one;
4. ``--seeds N`` RL runs (``cluster up --preset learn --steps N --seed S``, S = ``--seed`` + i: nats-server
   with JetStream, the embedded sampler, the learner, actors in the bwrap sandbox; the train split only),
   each checkpoint evaluated on the test split greedily and at the training temperature;
5. out of distribution, before and after the first seed: the 11 default families (never trained on), and
   ``chores6`` (``--recombined-tasks``), the menu's chores six at a time in three replies: nothing in it is new
   but the combination (the same phrases and commands, one reply more than training ever asked for).

Episodes are seeded per task, sample and turn (greedy: one sample). Figures are means over content keys with
95% bootstrap CIs over keys, the differences paired; episodes that errored (sandbox, sampler, timeout,
verifier) are left out of them and counted (``errors``). The test split is reported once, last: per seed
greedy-after vs the best decoding before and T-after vs T-before, then the mean and spread over seeds.
Writes ``learning.png``, ``split.json`` and ``summary.json``; the last stdout line is JSON with
``best_decoding_before`` {temperature, pass1}, ``seeds`` [{pass1_before, pass1_after, ci95_diff {pass1,
tests}, tests_before, tests_after, at_train_temperature}], ``over_seeds``, ``split_disjoint``, ``ood``,
``ood_recombined``, ``errors``, ``checks`` and ``minutes_per_seed``.

Targets (each seed, test split): greedy pass@1 after >= the warm start's best + 10 points with the paired CI
excluding 0, the T = 1 CI excluding 0; mean tests >= 1.2x before; |Δlogp| <= 0.02 at every step;
<= 45 minutes of RL and evals per seed on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench._common import emit_json, print_grid
from bench.learning_runs import (
    DEFAULT_FAMILIES,
    RECOMBINED_FAMILIES,
    add_fold_arguments,
    ensure_corpus,
    eval_policy,
    held_tasks,
    run_rl,
)
from bench.learning_stats import best_decoding, compare, error_counts, learning_curve, pass1, plot, split_check, spread
from t1async.log import configure, get_logger

log = get_logger("bench.learning")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.learning", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="learn", help="warm-start recipe (default learn)")
    p.add_argument("--run-dir", type=Path, default=Path("runs/learning"))
    p.add_argument(
        "--eval-corpus", type=int, default=600, help="tasks in the corpus (~10%% eval, ~10%% test, by content key)"
    )
    p.add_argument("--samples", type=int, default=4, help="seeded episodes per held-out task at T > 0 (default 4)")
    p.add_argument("--rl-steps", type=int, default=200, help="learner steps of RL per seed (default 200)")
    p.add_argument(
        "--rl-timeout",
        type=float,
        default=1500.0,
        help="stop RL after this many seconds anyway (default 1500: with its two test evals a seed then fits the "
        "45 minutes of the target on 2 cores, where 200 steps take ~50)",
    )
    p.add_argument(
        "--seeds", type=int, default=3, help="independent RL runs (RL seeds --seed .. --seed+N-1; default 3)"
    )
    p.add_argument(
        "--temperatures",
        default="0,0.3,0.7,1.0",
        help="the warm start's decoding sweep, chosen on eval, reported on test (default 0,0.3,0.7,1.0)",
    )
    p.add_argument("--ood-tasks", type=int, default=220, help="default-family corpus for the OOD eval (0: skip)")
    p.add_argument(
        "--recombined-tasks",
        type=int,
        default=60,
        help="chores6 tasks for the recombination OOD eval, all of them (no run trains on the family; 0: skip)",
    )
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="corpus and eval seed, and the first RL seed")
    p.add_argument("--cluster-arg", action="append", default=[], help="extra flag for cluster up (repeatable)")
    p.add_argument("--json", action="store_true", help="(the last line is JSON anyway)")
    add_fold_arguments(p)
    args = p.parse_args(argv)
    if args.rescore:
        from bench.learning_folds import rescore

        return rescore(args.run_dir, p)
    if args.folds or args.baselines:  # folds, and RL against the baselines (bench/learning_folds.py)
        from bench.learning_folds import run_folds

        return run_folds(args, p)
    if args.rl_init != "warm" or args.reuse:
        p.error("--rl-init and --reuse belong to a folds run: give --folds N or --baselines too")
    try:
        temps = sorted({float(x) for x in args.temperatures.split(",") if x.strip()})
    except ValueError:
        p.error(f"--temperatures {args.temperatures!r}: expected numbers separated by commas, e.g. 0,0.3,0.7,1.0")
    if not temps or min(temps) < 0:
        p.error(f"--temperatures {args.temperatures!r}: give one or more temperatures >= 0")
    if args.seeds < 1:
        p.error(f"--seeds {args.seeds}: give 1 or more")
    if any(a.split("=")[0] == "--seed" for a in args.cluster_arg):
        p.error("--cluster-arg --seed: the RL seeds come from --seed and --seeds")
    configure(level="warning")
    from sandbox_agent.synth import corpus_entries
    from t1async.recipes.presets import preset_values
    from t1async.recipes.warmstart import build, get_recipe, system_prompt_of

    pv = preset_values("learn")
    train_t = float(pv["temperature"])
    ev = {
        "max_turns": pv["max_turns"],
        "max_new_tokens": pv["max_new_tokens"],
        "max_context": pv["max_context"],
        "concurrency": args.concurrency,
        "seed": args.seed,
    }
    recipe = get_recipe(args.recipe)
    run = args.run_dir
    run.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    warm = build(recipe)
    t_warm = time.perf_counter() - t0
    ev["system_prompt"] = system_prompt_of(warm)
    print(f"warm start: {warm} ({t_warm:.0f} s; {json.loads((warm / 'sft_metrics.json').read_text())})", flush=True)

    # -- the split, frozen before anything is measured: by content key, checked against the SFT corpus too
    # the preset's families (RL trains on them, the evals score them); the warm start's demonstrations may be of
    # another family of the same content keys (``learn``: ``choresome``, a demonstrator that stops early)
    families = tuple(pv["synth_families"])
    tasks_dir = run / ("tasks-" + "-".join(families))  # a corpus of other families gets its own dir
    table = ensure_corpus(tasks_dir, args.eval_corpus, args.seed, families)
    sft = corpus_entries(recipe.tasks, recipe.task_seed, list(recipe.families))
    check = split_check(table, sft)
    (run / "split.json").write_text(json.dumps({**check, "corpus": str(tasks_dir), "tasks": table}, indent=1) + "\n")
    print(f"split: {check['task_counts']} tasks, {check['keys']} content keys; disjoint {check['split_disjoint']}")
    if not check["split_disjoint"]:
        print(f"split: NOT disjoint by content: {check['leaks'] or check['wrong_split']}", file=sys.stderr)
    evals, tests = held_tasks(tasks_dir, table, "eval"), held_tasks(tasks_dir, table, "test")
    if not evals or not tests:
        raise SystemExit(f"--eval-corpus {args.eval_corpus}: no eval or no test task in {tasks_dir}; give more tasks")
    ood = []
    if args.ood_tasks:
        ood_table = ensure_corpus(run / "ood-tasks", args.ood_tasks, args.seed, DEFAULT_FAMILIES)
        ood = held_tasks(run / "ood-tasks", ood_table, "eval")
    recombined = []
    if args.recombined_tasks:
        rec_table = ensure_corpus(run / "recombined-tasks", args.recombined_tasks, args.seed, RECOMBINED_FAMILIES)
        recombined = held_tasks(run / "recombined-tasks", rec_table, None)
    print(
        f"held out: eval {len(evals)} tasks, test {len(tests)} tasks x {args.samples} samples (greedy: 1); "
        f"OOD: {len(ood)} tasks x 1; recombined OOD: {len(recombined)} tasks x 1",
        flush=True,
    )

    def policy_eval(model: Path, tasks: list, temperature: float, name: str, samples: int | None = None) -> list:
        k = 1 if temperature == 0 else (samples or args.samples)  # greedy: every sample would be the same
        t = time.perf_counter()
        rows = eval_policy(model, tasks, samples=k, out=run / f"{name}.jsonl", temperature=temperature, **ev)
        # the test split's figures are shown once, at the end, with their CIs
        score = "" if name.startswith("test") else f", pass@1 {pass1(rows):.1%}"
        print(f"{name}: {len(rows)} episodes{score}, {time.perf_counter() - t:.0f} s", flush=True)
        return rows

    # -- the warm start's best decoding: chosen on eval...
    all_rows: dict[str, list] = {}
    t1 = time.perf_counter()
    sweep = {}
    for temp in temps:
        all_rows[f"eval-before-T{temp:g}"] = rows = policy_eval(warm, evals, temp, f"eval-before-T{temp:g}")
        sweep[temp] = pass1(rows)
    best_t, best_eval = best_decoding(sweep)
    print(f"best decoding of the warm start on eval: T = {best_t:g} (pass@1 {best_eval:.1%})", flush=True)
    # ...and the warm start on test at it, greedily and at the training temperature (not looked at until now)
    before: dict[float, list] = {}
    for temp in sorted({best_t, 0.0, train_t}):
        before[temp] = all_rows[f"test-before-T{temp:g}"] = policy_eval(warm, tests, temp, f"test-before-T{temp:g}")
    ood_b = policy_eval(warm, ood, train_t, "ood-before", samples=1) if ood else []
    all_rows["ood-before"] = ood_b
    rec_b = policy_eval(warm, recombined, train_t, "recombined-before", samples=1) if recombined else []
    all_rows["recombined-before"] = rec_b
    t_before = time.perf_counter() - t1

    # -- N RL runs on the same frozen split, each evaluated on test greedily and at the training temperature
    seeds: list[dict] = []
    for i in range(args.seeds):
        rl_seed = args.seed + i
        rl_dir = run / f"rl-seed{rl_seed}"
        if rl_dir.exists():  # cluster up would resume an earlier run's checkpoints there
            print(f"rl: removing {rl_dir} from an earlier run", flush=True)
            shutil.rmtree(rl_dir)
        t2 = time.perf_counter()
        ckpt = run_rl(rl_dir, tasks_dir, args.rl_steps, ["--seed", str(rl_seed), *args.cluster_arg], args.rl_timeout)
        t_rl = time.perf_counter() - t2
        greedy = all_rows[f"test-after-s{rl_seed}-T0"] = policy_eval(ckpt, tests, 0.0, f"test-after-s{rl_seed}-T0")
        at_t = all_rows[f"test-after-s{rl_seed}-T{train_t:g}"] = policy_eval(
            ckpt, tests, train_t, f"test-after-s{rl_seed}-T{train_t:g}"
        )
        curve = learning_curve(rl_dir / "metrics.jsonl")
        dl = [r["mean_abs_dlogp"] for r in curve if np.isfinite(r["mean_abs_dlogp"])]
        entry = {
            "rl_seed": rl_seed,
            **compare(before[best_t], greedy),  # the target: greedy after vs the warm start's best decoding
            "temperature_before": best_t,
            "temperature_after": 0.0,
            "at_train_temperature": {"temperature": train_t, **compare(before[train_t], at_t)},
            "greedy_vs_greedy": compare(before[0.0], greedy),
            "rl_minutes": t_rl / 60.0,
            "minutes": (time.perf_counter() - t2) / 60.0,
            "rl_steps": len(curve),
            "max_abs_dlogp": max(dl) if dl else None,
            "checkpoint": str(ckpt),
            "curve": curve,
        }
        if ood and i == 0:
            ood_a = all_rows["ood-after"] = policy_eval(ckpt, ood, train_t, "ood-after", samples=1)
            entry["ood"] = compare(ood_b, ood_a)
        if recombined and i == 0:
            rec_a = all_rows["recombined-after"] = policy_eval(ckpt, recombined, train_t, "recombined-after", samples=1)
            entry["ood_recombined"] = compare(rec_b, rec_a)
        seeds.append(entry)
        print_grid(
            ["step", "reward/turn", "episodes", "resolved", "tests/ep", "|dlogp|"],
            [
                [
                    r["step"],
                    r["reward_per_turn"],
                    r["episodes"],
                    r["resolved_rate"],
                    r["tests_per_episode"],
                    f"{r['mean_abs_dlogp']:.4f}",
                ]
                for r in curve[:: max(1, len(curve) // 30)]
            ],
            title=f"\nlearning curve, RL seed {rl_seed} (train split; one row per {max(1, len(curve) // 30)} steps)",
        )

    summary = assemble(
        seeds=seeds,
        sweep=sweep,
        best_t=best_t,
        best_test=pass1(before[best_t]),
        train_t=train_t,
        check=check,
        errors=error_counts(all_rows),
        ood=seeds[0].get("ood"),
        ood_recombined=seeds[0].get("ood_recombined"),
    )
    summary.update(
        minutes_before=t_before / 60.0,
        warm_start_s=t_warm,
        samples=args.samples,
        eval_tasks=len(evals),
        test_tasks=len(tests),
        warm_start=str(warm),
        recipe=recipe.name,
        threads=os.cpu_count(),
    )
    report(summary)
    try:
        plot(
            seeds[0]["curve"],
            table_of(seeds[0], before[train_t]),
            run / "learning.png",
            held_title=f"test split, RL seed {seeds[0]['rl_seed']}, T = {train_t:g}",
        )
    except Exception as exc:  # a missing matplotlib must not lose the numbers
        print(f"no plot: {type(exc).__name__}: {exc}", file=sys.stderr)
    (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    emit_json({k: summary[k] for k in LAST_LINE})
    return 0


LAST_LINE = (
    "best_decoding_before",
    "seeds",
    "over_seeds",
    "split_disjoint",
    "ood",
    "ood_recombined",
    "errors",
    "checks",
    "minutes_per_seed",
)


def assemble(
    *,
    seeds: list[dict],
    sweep: dict[float, float],
    best_t: float,
    best_test: float,
    train_t: float,
    check: dict,
    errors: dict,
    ood: dict | None,
    ood_recombined: dict | None = None,
) -> dict:
    """The bench's summary from its parts (pure: tested without running it). ``seeds`` entries are
    ``compare``'s (greedy after vs the best decoding before) plus ``at_train_temperature``, ``rl_seed``,
    ``minutes``, ``max_abs_dlogp``; the last JSON line's ``seeds`` keeps the issue's fields of each."""
    keep = ("pass1_before", "pass1_after", "ci95_diff", "tests_before", "tests_after")
    short = [
        {
            "rl_seed": s["rl_seed"],
            **{k: s[k] for k in keep},
            "at_train_temperature": {k: s["at_train_temperature"][k] for k in ("temperature", *keep)},
        }
        for s in seeds
    ]
    t1 = [s["at_train_temperature"] for s in seeds]
    over = {
        "pass1_diff_greedy_vs_best": spread([s["diff"]["pass1"] for s in seeds]),
        "pass1_diff_at_train_temperature": spread([s["diff"]["pass1"] for s in t1]),
        "tests_ratio_at_train_temperature": spread([s["tests_after"] / max(s["tests_before"], 1e-9) for s in t1]),
    }
    dl = [s["max_abs_dlogp"] for s in seeds]
    checks = {
        "split_disjoint": bool(check["split_disjoint"]),
        "each_seed_greedy_ge_best_before_plus_10": all(s["pass1_after"] >= s["pass1_before"] + 0.10 for s in seeds),
        "each_seed_ci_pass1_excludes_0": all(s["ci95_diff"]["pass1"][0] > 0 for s in seeds),
        "each_seed_T_ci_pass1_excludes_0": all(s["ci95_diff"]["pass1"][0] > 0 for s in t1),
        "mean_tests_1.2x": over["tests_ratio_at_train_temperature"]["mean"] >= 1.2,
        "dlogp_le_0.02": all(d is not None and d <= 0.02 for d in dl),
        "minutes_per_seed_le_45": all(s["minutes"] <= 45 for s in seeds),
    }
    return {
        "best_decoding_before": {"temperature": best_t, "pass1": best_test, "eval_sweep": sweep},
        "train_temperature": train_t,
        "seeds": short,
        "seed_details": seeds,
        "over_seeds": over,
        "split_disjoint": bool(check["split_disjoint"]),
        "split": check,
        "ood": ood,
        "ood_recombined": ood_recombined,
        "errors": errors["total"],
        "errors_by_eval": errors["by_eval"],
        "checks": checks,
        "minutes_per_seed": [s["minutes"] for s in seeds],
    }


def table_of(seed: dict, before_rows: list) -> dict:
    """plot()'s before/after table at the training temperature for one seed (means only; no CIs drawn)."""
    t = seed["at_train_temperature"]
    nan = [float("nan")] * 2
    return {
        "before": {
            "pass1": {"mean": t["pass1_before"], "ci95": nan},
            "tests": {"mean": t["tests_before"], "ci95": nan},
        },
        "after": {"pass1": {"mean": t["pass1_after"], "ci95": nan}, "tests": {"mean": t["tests_after"], "ci95": nan}},
    }


def report(summary: dict) -> None:
    """The tables: the eval sweep, then the test split (reported once, last), the spread, errors, targets."""

    def ci(c: list[float], pct: bool) -> str:
        return f"[{c[0]:+.1%}, {c[1]:+.1%}]" if pct else f"[{c[0]:+.2f}, {c[1]:+.2f}]"

    def cells(c: dict) -> list[str]:  # a compare(): pass@1 before, after, CI; tests before, after, CI
        p, t = c["ci95_diff"]["pass1"], c["ci95_diff"]["tests"]
        return [f"{c['pass1_before']:.1%}", f"{c['pass1_after']:.1%}", ci(p, True)] + [
            f"{c['tests_before']:.2f}",
            f"{c['tests_after']:.2f}",
            ci(t, False),
        ]

    bd = summary["best_decoding_before"]
    print_grid(
        ["temperature", "warm start pass@1 (eval split)"],
        [[f"{t:g}", f"{p:.1%}"] for t, p in sorted(bd["eval_sweep"].items())],
        title="\nthe warm start's decoding sweep, on the eval split (the tuning set)",
    )
    rows = []
    for s in summary["seed_details"]:
        for label, c in (
            (f"greedy vs best T={s['temperature_before']:g}", s),
            (f"T={summary['train_temperature']:g} vs T={summary['train_temperature']:g}", s["at_train_temperature"]),
        ):
            rows.append([s["rl_seed"], label, *cells(c)])
    for name, key in (("OOD", "ood"), ("OOD chores6", "ood_recombined")):
        o = summary.get(key)
        if o:
            rows.append([name, "seed 0, T=train", *cells(o)])
    print_grid(
        ["RL seed", "decoding", "pass@1 before", "after", "diff 95% CI", "tests before", "after", "diff 95% CI"],
        rows,
        title=f"\nTEST split (content keys never trained on; reported once): {summary['test_tasks']} tasks, CIs over "
        "content keys",
    )
    o = summary["over_seeds"]
    print(
        "over seeds: "
        + "; ".join(
            f"{k} mean {v['mean']:+.3f} sd {v['sd']:.3f} [{v['min']:+.3f}, {v['max']:+.3f}]" for k, v in o.items()
        )
    )
    errs = {k: n for k, n in summary["errors"].items() if n and k != "episodes"}
    print(f"episode errors (not counted as failures): {errs or 'none'} of {summary['errors']['episodes']} episodes")
    print("targets: " + ", ".join(f"{k} {'OK' if v else 'MISSED'}" for k, v in summary["checks"].items()), flush=True)


if __name__ == "__main__":
    # Ctrl-C or SIGTERM during an eval ends it with the event signals.stopped and exit status 130/143, once its
    # episodes' sandboxes and work dirs are removed; the rows written so far stay in --run-dir (a folds run
    # resumes with --reuse RUN_DIR)
    sys.exit(main())
