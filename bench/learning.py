"""Does the whole loop learn? Warm start -> held-out eval -> RL with the real cluster -> the same eval again.

    python -m bench.learning [--recipe learn] [--rl-steps 300] [--samples 4] [--json]

1. the warm start: ``t1async.recipes.warmstart`` builds the recipe's model once (seeded) and caches it;
2. a corpus of the recipe's families (``--eval-corpus`` tasks, seed 0) is written into the run dir; its eval
   split (a hash of the task id, ~10%) is never drawn by the actors;
3. eval before: ``t1async.eval.run_eval`` with the embedded sampler on the warm start, ``--samples`` seeded
   episodes per held-out task (seeded per task, sample and turn);
4. RL: ``python -m t1async.cluster up --preset learn --steps N`` on that corpus: nats-server with JetStream,
   the embedded sampler, the learner (PPO, credits, R3), actors in the bwrap sandbox; the train split only;
5. eval after: the learner's last checkpoint, the same tasks, the same seeds;
6. out of distribution, no target: the 11 default families (never trained on), before and after.

Prints the learning curve (per learner step: reward per trained turn, the share of episodes ending at that
policy version that resolved, mean |Δlogp| between sampler and learner), the before/after table with 95%
bootstrap CIs over tasks (the differences are paired: the same tasks resampled for both), writes
``learning.png`` and ``summary.json`` into the run dir; the last stdout line is JSON with ``pass1_before``,
``pass1_after``, ``reward_before``, ``reward_after`` (mean tests passed per episode), ``ci95_diff`` and
``minutes`` (evals + RL, not the cached warm start).

Targets: pass@1 after >= before + 10 points, mean tests >= 1.2x before, both diffs' CIs exclude
0, mean |Δlogp| <= 0.02 at every step, ``minutes`` <= 60 on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench._common import emit_json, print_grid
from bench.learning_stats import column, learning_curve, per_task, plot
from t1async.eval.stats import mean_ci, paired_diff
from t1async.log import configure, get_logger
from t1async.signals import handlers

log = get_logger("bench.learning")
DEFAULT_FAMILIES = ("files", "text", "csv", "json", "archive", "perms", "git", "scripts", "find", "logs", "env")


def eval_policy(
    model: Path,
    tasks: list,
    *,
    samples: int,
    seed: int,
    max_turns: int,
    max_new_tokens: int,
    max_context: int,
    concurrency: int,
    out: Path,
    system_prompt: str | None,
    temperature: float = 1.0,
) -> list[dict]:
    """Every task ``samples`` seeded episodes on the embedded sampler over ``model``; the episode rows."""
    import anyio

    from sandbox_agent.agent_types import AgentConfig
    from t1async.eval.run import EvalConfig, progress_stream, run_eval
    from t1async.model.tokenizer import ChatTokenizer
    from t1async.protocol.sampling import SamplingParams
    from t1async.sampler.client import SGLangClient
    from t1async.sampler.launch import launch_sampler

    tok = ChatTokenizer.load(model)
    agent = AgentConfig(
        max_turns=max_turns,
        max_context_tokens=max_context,
        request_routing=False,
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature),
    )
    if system_prompt is not None:  # the prompt the warm start was trained with (the actors use it too)
        agent = replace(agent, system_prompt=system_prompt)
    cfg = EvalConfig(samples=samples, concurrency=concurrency, seed=seed, agent=agent)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")

    async def go() -> list[dict]:
        async with launch_sampler(model, seed=seed, prefix_cache_tokens=0) as url, SGLangClient([url]) as c:
            return await run_eval(tasks, c, tok, cfg, jsonl=out, progress=progress_stream())

    return anyio.run(go, backend="trio")


def run_rl(run_dir: Path, tasks: Path, steps: int, extra: Sequence[str], timeout_s: float) -> Path:
    """The real cluster (``cluster up --preset learn``) for ``steps`` learner steps; the last checkpoint."""
    from t1async.learner.checkpoint import latest_checkpoint

    argv = [
        sys.executable,
        "-m",
        "t1async.cluster",
        "up",
        "--preset",
        "learn",
        "--tasks",
        str(tasks),
        "--run-dir",
        str(run_dir),
        "--steps",
        str(steps),
        "--plain",
        *extra,
    ]
    print("rl: " + " ".join(argv[1:]), flush=True)
    with open(run_dir.parent / "cluster-up.log", "w") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT)
        # SIGTERM to the bench becomes SystemExit, so the finally below stops the cluster (a killed bench left
        # `cluster up` and its components running)
        try:
            with handlers({signal.SIGTERM: lambda *_: sys.exit(143)}):
                rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"rl: stopping after {timeout_s:.0f} s (--rl-timeout)", flush=True)
        finally:
            if proc.poll() is None:
                proc.terminate()  # the supervisor stops every component it started
                proc.wait(timeout=120)
        rc = proc.returncode
    ck = latest_checkpoint(run_dir / "checkpoints")
    if ck is None:
        raise SystemExit(
            f"rl: cluster up exited {rc} with no checkpoint in {run_dir / 'checkpoints'}; see "
            f"{run_dir.parent / 'cluster-up.log'} and {run_dir / 'logs'}"
        )
    print(f"rl: cluster up exited {rc}; last checkpoint {ck.path} (version {ck.policy_version})", flush=True)
    return Path(ck.path)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.learning", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="learn", help="warm-start recipe (default learn)")
    p.add_argument("--run-dir", type=Path, default=Path("runs/learning"))
    p.add_argument("--eval-corpus", type=int, default=600, help="tasks in the corpus (~10%% are the eval split)")
    p.add_argument("--samples", type=int, default=4, help="seeded episodes per held-out task (default 4)")
    p.add_argument("--rl-steps", type=int, default=300, help="learner steps of RL (default 300)")
    p.add_argument(
        "--rl-timeout", type=float, default=3300.0, help="stop RL after this many seconds anyway (default 3300)"
    )
    p.add_argument("--ood-tasks", type=int, default=220, help="default-family corpus for the OOD eval (0: skip)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cluster-arg", action="append", default=[], help="extra flag for cluster up (repeatable)")
    p.add_argument("--json", action="store_true", help="(the last line is JSON anyway)")
    args = p.parse_args(argv)
    configure(level="warning")
    from sandbox_agent.synth import generate
    from sandbox_agent.tasks import load_task
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
    recipe = get_recipe(args.recipe)
    run = args.run_dir
    run.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    warm = build(recipe)
    t_warm = time.perf_counter() - t0
    ev["system_prompt"] = system_prompt_of(warm)
    print(f"warm start: {warm} ({t_warm:.0f} s; {json.loads((warm / 'sft_metrics.json').read_text())})", flush=True)
    tasks_dir = run / ("tasks-" + "-".join(recipe.families))  # a recipe of other families gets its own corpus
    if not any(tasks_dir.glob("*/task.yaml")):
        generate(tasks_dir, args.eval_corpus, seed=args.seed, families=list(recipe.families))
    held = [
        t
        for t in (load_task(d) for d in sorted(tasks_dir.iterdir()) if (d / "task.yaml").is_file())
        if t.split == "eval"
    ]
    ood = []
    if args.ood_tasks:
        ood_dir = run / "ood-tasks"
        if not any(ood_dir.glob("*/task.yaml")):
            generate(ood_dir, args.ood_tasks, seed=args.seed, families=list(DEFAULT_FAMILIES))
        ood = [
            t
            for t in (load_task(d) for d in sorted(ood_dir.iterdir()) if (d / "task.yaml").is_file())
            if t.split == "eval"
        ]
    print(f"held-out: {len(held)} tasks x {args.samples} samples; OOD: {len(ood)} tasks x 1", flush=True)
    t1 = time.perf_counter()
    rows_b = eval_policy(warm, held, samples=args.samples, out=run / "eval-before.jsonl", **ev)
    print(f"eval before: {time.perf_counter() - t1:.0f} s", flush=True)
    rl_dir = run / "rl"
    if rl_dir.exists():  # cluster up would resume an earlier run's checkpoints there: RL starts from the warm start
        print(f"rl: removing {rl_dir} from an earlier run", flush=True)
        shutil.rmtree(rl_dir)
    t2 = time.perf_counter()
    ckpt = run_rl(rl_dir, tasks_dir, args.rl_steps, args.cluster_arg, args.rl_timeout)
    t_rl = time.perf_counter() - t2
    t3 = time.perf_counter()
    rows_a = eval_policy(ckpt, held, samples=args.samples, out=run / "eval-after.jsonl", **ev)
    print(f"eval after: {time.perf_counter() - t3:.0f} s", flush=True)
    minutes = (time.perf_counter() - t1) / 60.0
    ood_b = ood_a = []
    if ood:
        ood_b = eval_policy(warm, ood, samples=1, out=run / "ood-before.jsonl", **ev)
        ood_a = eval_policy(ckpt, ood, samples=1, out=run / "ood-after.jsonl", **ev)
    b, a = per_task(rows_b), per_task(rows_a)
    table = {
        w: {"pass1": mean_ci(list(column(s, 0).values())), "tests": mean_ci(list(column(s, 1).values()))}
        for w, s in (("before", b), ("after", a))
    }
    diff = {k: paired_diff(column(b, i), column(a, i)) for i, k in enumerate(("pass1", "tests"))}
    curve = learning_curve(rl_dir / "metrics.jsonl")
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
            for r in curve
        ],
        title="\nlearning curve (RL, train split)",
    )

    def fmt(f: dict, pct: bool) -> str:
        m, (lo, hi) = f["mean"], f["ci95"]
        return f"{m:.1%} [{lo:.1%}, {hi:.1%}]" if pct else f"{m:.2f} [{lo:.2f}, {hi:.2f}]"

    print_grid(
        ["", "pass@1", "mean tests passed (of 4)"],
        [
            ["before (warm start)", fmt(table["before"]["pass1"], True), fmt(table["before"]["tests"], False)],
            ["after RL", fmt(table["after"]["pass1"], True), fmt(table["after"]["tests"], False)],
            ["after - before (paired)", fmt(diff["pass1"], True), fmt(diff["tests"], False)],
        ],
        title=f"\nheld-out eval split: {len(b)} tasks x {args.samples} seeded samples",
    )
    fam = {}
    for name, rows in (("before", rows_b), ("after", rows_a), ("ood_before", ood_b), ("ood_after", ood_a)):
        by: dict[str, list[dict]] = {}
        for r in rows:
            by.setdefault(r["family"], []).append(r)
        fam[name] = {
            f: {
                "resolved": float(np.mean([r["resolved"] for r in rs])),
                "tests": float(np.mean([r["tests_passed"] for r in rs])),
                "episodes": len(rs),
            }
            for f, rs in sorted(by.items())
        }

    def fam_row(label: str, b: dict, a: dict) -> list:
        return [label, b["resolved"], a.get("resolved", float("nan")), b["tests"], a.get("tests", float("nan"))]

    rows = [fam_row(f, fam["before"][f], fam["after"].get(f, {})) for f in fam["before"]]
    rows += [fam_row(f"OOD {f}", fam["ood_before"][f], fam["ood_after"].get(f, {})) for f in fam["ood_before"]]
    print_grid(
        ["family", "resolved before", "after", "tests before", "after"],
        rows,
        title="\nper family (OOD: default families, never trained on, no target)",
    )
    dl = [r["mean_abs_dlogp"] for r in curve if np.isfinite(r["mean_abs_dlogp"])]
    tb, ta = table["before"]["tests"]["mean"], table["after"]["tests"]["mean"]
    checks = {
        "pass1_up_10_points": diff["pass1"]["mean"] >= 0.10,
        "tests_1.2x": ta >= 1.2 * tb and ta > tb,
        "ci_pass1_excludes_0": diff["pass1"]["ci95"][0] > 0,
        "ci_tests_excludes_0": diff["tests"]["ci95"][0] > 0,
        "dlogp_le_0.02": bool(dl) and max(dl) <= 0.02,
        "minutes_le_60": minutes <= 60,
    }
    print("\ntargets: " + ", ".join(f"{k} {'OK' if v else 'MISSED'}" for k, v in checks.items()), flush=True)
    try:
        plot(curve, table, run / "learning.png")
    except Exception as exc:  # a missing matplotlib must not lose the numbers
        print(f"no plot: {type(exc).__name__}: {exc}", file=sys.stderr)
    summary = {
        "pass1_before": table["before"]["pass1"]["mean"],
        "pass1_after": table["after"]["pass1"]["mean"],
        "reward_before": tb,
        "reward_after": ta,
        "ci95_diff": {"pass1": diff["pass1"]["ci95"], "tests": diff["tests"]["ci95"]},
        "diff": diff,
        "table": table,
        "families": fam,
        "checks": checks,
        "minutes": minutes,
        "rl_minutes": t_rl / 60.0,
        "warm_start_s": t_warm,
        "rl_steps": len(curve),
        "max_abs_dlogp": max(dl) if dl else None,
        "mean_abs_dlogp": float(np.mean(dl)) if dl else None,
        "held_out_tasks": len(b),
        "samples": args.samples,
        "curve": curve,
        "checkpoint": str(ckpt),
        "warm_start": str(warm),
        "recipe": recipe.name,
        "threads": os.cpu_count(),
    }
    (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    emit_json(
        {
            k: summary[k]
            for k in (
                "pass1_before",
                "pass1_after",
                "reward_before",
                "reward_after",
                "ci95_diff",
                "minutes",
                "max_abs_dlogp",
                "rl_steps",
                "held_out_tasks",
            )
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
