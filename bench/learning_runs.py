"""The pieces of ``bench.learning`` its variants share (``bench.learning_folds``, ``bench.reward_modes``): the
corpus, held-out evals of a policy, and one RL run through ``cluster up``."""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.baselines import BASELINES
from t1async.log import get_logger
from t1async.signals import handlers, run_until_stop

log = get_logger("bench.learning")


DEFAULT_FAMILIES = ("files", "text", "csv", "json", "archive", "perms", "git", "scripts", "find", "logs", "env")
RECOMBINED_FAMILIES = ("chores6",)  # the trained skills in a new combination (sandbox_agent/synth/chores.py)


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
    from t1async.eval.run import EvalConfig, progress_stream, run_eval
    from t1async.model.tokenizer import ChatTokenizer
    from t1async.sampler.client import SGLangClient
    from t1async.sampler.launch import launch_sampler

    tok = ChatTokenizer.load(model)
    cfg = EvalConfig(
        samples=samples,
        concurrency=concurrency,
        seed=seed,
        max_turns=max_turns,
        max_new_tokens=max_new_tokens,
        max_context=max_context,
        temperature=temperature,
    )
    agent = cfg.agent()
    if system_prompt is not None:  # the prompt the warm start was trained with (the actors use it too)
        agent = replace(agent, system_prompt=system_prompt)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")

    async def go() -> list[dict]:
        async with launch_sampler(model, seed=seed, prefix_cache_tokens=0) as url, SGLangClient([url]) as c:
            return await run_eval(tasks, c, tok, cfg, jsonl=out, progress=progress_stream(), agent=agent)

    return run_until_stop(go)  # SIGTERM: the episodes' sandboxes and work dirs are removed first


def add_fold_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of the folds-and-baselines run (``bench.learning_folds``)."""
    g = p.add_argument_group("folds and baselines (bench/learning_folds.py)")
    g.add_argument("--preset", default="learn", help="cluster up preset RL runs (default learn; learn-choresn)")
    g.add_argument(
        "--folds",
        type=int,
        default=0,
        help="salt the split into N folds, each with its own warm start and RL seed, plus one untouched fold run "
        "last and reported apart (0: the single split as before)",
    )
    g.add_argument("--only-folds", default="", help="run only these folds (comma-separated; N is the untouched one)")
    g.add_argument("--baselines", default="", help="comma-separated, of " + ",".join(BASELINES))
    g.add_argument(
        "--rl-init",
        choices=("warm", "sft"),
        default="warm",
        help="what RL (and the RL baselines contentfree and binary) starts from: the fold's warm start, or the "
        "model of the sft baseline, SFT on the full demonstrations (default warm)",
    )
    g.add_argument(
        "--reuse",
        type=Path,
        default=None,
        metavar="DIR",
        help="take each arm's test rows from DIR, an earlier folds run of the same folds and corpus, where this run "
        "would make them the same way (the same split, and the same warm start by its weights, not only its "
        "name; for RL and the RL baselines the same --rl-init, --rl-steps, --cluster-arg and preset values, and "
        "never an RL arm run before the system prompt fix of 2026-12-06), and run only the rest; DIR may be "
        "--run-dir itself (resume)",
    )
    g.add_argument("--passk", type=int, default=16, help="samples a test task for pass@k, k = 1..N (default 16)")
    g.add_argument("--rft-samples", type=int, default=4, help="RFT: warm-start samples per train task (default 4)")
    g.add_argument("--rft-tasks", type=int, default=0, help="RFT: train tasks sampled (0: all)")
    g.add_argument("--rft-steps", type=int, default=200, help="RFT: fine-tuning steps (default 200)")
    g.add_argument("--warm-tasks", type=int, default=0, help="override the recipe's task count (smoke runs)")
    g.add_argument("--warm-sft-steps", type=int, default=0, help="override the recipe's SFT steps (smoke runs)")
    g.add_argument(
        "--rescore",
        action="store_true",
        help="run nothing: score the folds already in --run-dir again from their episode rows (fold*/test-*.jsonl), "
        "e.g. after a new figure was added; each fold's minutes and paths are kept from its summary.json",
    )


def run_rl(
    run_dir: Path, tasks: Path, steps: int, extra: Sequence[str], timeout_s: float, *, preset: str = "learn"
) -> Path:
    """The real cluster (``cluster up --preset PRESET``) for ``steps`` learner steps; the model dir of the newest
    version it reached (``newest_policy``)."""

    argv = [
        sys.executable,
        "-m",
        "t1async.cluster",
        "up",
        "--preset",
        preset,
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
    log_path = run_dir.parent / f"cluster-up-{run_dir.name}.log"
    timed_out = False
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT)
        # SIGTERM to the bench becomes SystemExit, so the finally below stops the cluster (a killed bench left
        # `cluster up` and its components running)
        try:
            with handlers({signal.SIGTERM: lambda *_: sys.exit(143)}):
                rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            print(f"rl: stopping after {timeout_s:.0f} s (--rl-timeout)", flush=True)
        finally:
            if proc.poll() is None:
                proc.terminate()  # the supervisor stops every component it started
                proc.wait(timeout=120)
        rc = proc.returncode
    ck = newest_policy(run_dir / "checkpoints")
    where = f"see {log_path} and {run_dir / 'logs'}"
    if rc != 0 and not timed_out:
        # a run that failed on its own is not "after RL": scoring its last checkpoint (v1, say) as the arm's
        # policy put a one-step model in the table under the name of a 40-step one
        got = f"its last checkpoint is version {ck[1]}" if ck else "it left no checkpoint"
        raise SystemExit(
            f"rl: cluster up failed (exit {rc}) before its {steps} steps; {got}, and nothing was scored. "
            f"{_last_error(log_path)}{where}"
        )
    if ck is None:
        raise SystemExit(f"rl: cluster up exited {rc} with no checkpoint in {run_dir / 'checkpoints'}; {where}")
    path, version = ck
    if version < steps and not timed_out:  # stopped by a signal or its --duration: not the arm's policy either
        raise SystemExit(
            f"rl: cluster up stopped (exit {rc}) at version {version}, before its {steps} steps and not by "
            f"--rl-timeout, and nothing was scored; {where}"
        )
    short = f", {version} of the {steps} steps asked (--rl-timeout)" if version < steps else ""
    print(f"rl: cluster up exited {rc}; last checkpoint {path} (version {version}{short})", flush=True)
    return path


def newest_policy(root: Path) -> tuple[Path, int] | None:
    """The model dir and version of the newest policy under a run's checkpoints: a full checkpoint, or a
    push-only export (the weights the samplers were given). The learner writes a full checkpoint only every
    --checkpoint-every steps, at the last step, and at a stop when it is given the time; a stop that ends it
    mid-step (the supervisor's SIGKILL after its grace, as --rl-timeout's stop can) leaves exports newer than the
    last full checkpoint, or only exports."""
    from t1async.learner.checkpoint import latest_checkpoint, list_exports

    ck = latest_checkpoint(root)
    ex = list_exports(root)
    if ex and (ck is None or int(ex[-1].name[1:]) > ck.policy_version):
        return ex[-1], int(ex[-1].name[1:])
    return (Path(ck.path), ck.policy_version) if ck else None


def _last_error(log_path: Path) -> str:
    """The last line of ``cluster up``'s output that says ``error``, quoted, or nothing."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    hit = [ln.strip() for ln in lines if "error" in ln.lower()]
    return f"Its last error line: {hit[-1]!r}. " if hit else ""


def ensure_corpus(
    root: Path, n: int, seed: int, families: Sequence[str], *, fold: int | None = None, folds: int = 0
) -> dict[str, dict]:
    """The corpus ``generate(root, n, seed, families, fold=, folds=)`` writes, reused only when
    ``root/split.json`` lists exactly its tasks, splits and keys and every task dir is there; regenerated
    otherwise (a cached dir of another size or seed was reused before). Its ``split.json`` table."""
    from sandbox_agent.synth import corpus_entries, generate
    from sandbox_agent.synth.split import read_split_json
    from t1async.protocol.errors import ConfigError

    want = {
        t: {"split": s, "content_key": k, "family": f}
        for t, (s, k, f) in corpus_entries(n, seed, list(families), fold=fold, folds=folds).items()
    }
    try:
        have: dict[str, dict] | None = read_split_json(root)
    except ConfigError:
        have = None
    if have != want or not all((root / t / "task.yaml").is_file() for t in want):
        if root.exists():
            print(f"corpus: {root} is not {n} tasks of seed {seed} of this split: regenerating", flush=True)
            shutil.rmtree(root)
        generate(root, n, seed=seed, families=list(families), fold=fold, folds=folds)
        have = read_split_json(root)
    return have


def held_tasks(root: Path, table: dict[str, dict], split: str | None) -> list:
    """The tasks of ``table`` in ``split`` (None: all of them, for a family no run trains on), loaded."""
    from sandbox_agent.tasks.task import load_task

    return [load_task(root / t) for t, e in sorted(table.items()) if split is None or e["split"] == split]
