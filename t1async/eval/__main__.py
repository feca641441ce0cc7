"""``python -m t1async.eval``: evaluate a policy on a task set with the real agent loop and sandbox.

    python -m t1async.eval --model DIR --tasks runs/latest/tasks --split eval --samples 4 --concurrency 8
    python -m t1async.eval --sampler-url http://HOST:30000 --tasks DIR --families csv,json --json

``--model`` starts the embedded sampler on that model dir; ``--sampler-url`` (repeatable) uses running
SGLang-compatible samplers. Prints a progress bar (on a terminal), a per-task table, pass@1 (pass@k for
K > 1) and mean tests passed with 95% bootstrap CIs, overall and per family; writes ``episodes.jsonl`` (every
episode, as it finishes), ``summary.json`` and ``eval.png`` under ``--out``. With ``--json`` the summary is
the last stdout line. Tasks whose image did not build are no episode of the policy: they are left out of
every figure and counted apart (``image_build_failed``, ``unbuilt_tasks``); exit 3 if no task built.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio

from sandbox_agent.images.buildfail import IMAGE_BUILD_FAILED
from sandbox_agent.sandbox.backend import SandboxBackend, pick_backend
from sandbox_agent.tasks.task import Task, load_tasks
from t1async.config import add_arguments, like, resolve, setting
from t1async.eval.report import plot, print_report
from t1async.eval.run import EvalConfig, progress_stream, run_eval
from t1async.eval.stats import by_family, scored, split_errors, summarise, task_scores
from t1async.log import configure, get_logger
from t1async.model.modeldir import check_model_dir
from t1async.protocol.errors import ConfigError, SamplerError, T1Error
from t1async.protocol.sampling import Sampler
from t1async.sampler.settings import Dtype, SamplerKeys, SamplerSettings

log = get_logger("t1async.eval")
EXIT_IMAGE_BUILD_FAILED = 3  # no task could build its image (sandbox_agent's run-task uses the same code)


@dataclass(frozen=True)
class EvalSettings(EvalConfig):
    """``python -m t1async.eval``'s settings: ``--config FILE.toml`` and/or flags (flags win); how the episodes
    run is its ``EvalConfig``, which ``run_eval`` takes."""

    model: Path | None = setting(None, "model dir: start the embedded sampler on it (or --sampler-url)")
    sampler_url: tuple[str, ...] = setting(
        (), "a running SGLang-compatible sampler; repeat for several (or --model)", metavar="URL"
    )
    sampler_api_key: str | None = like(SamplerKeys, "sampler_api_key")
    tasks: Path | None = setting(None, "a directory of tasks (Terminal-Bench 1/2 format; required)", metavar="DIR")
    backend: Literal["auto", "bwrap", "container"] = setting(
        "auto",
        "sandbox: bwrap, containers (podman; tasks with their own image), or auto (default: bwrap when no "
        "selected task has an image of its own, else containers)",
    )
    split: Literal["eval", "test", "train", "all"] = setting("eval", "which tasks")
    families: str = setting("", "comma-separated task families (default: all)")
    dtype: Dtype = like(SamplerSettings, "dtype")
    prefix_cache_tokens: int | None = like(
        SamplerSettings,
        "prefix_cache_tokens",
        help="the embedded sampler's prefix cache in tokens (default: the sampler's own; 0 = off)",
    )
    tokenizer: Path | None = setting(
        None, "model dir whose tokenizer to use with --sampler-url (default: the shipped one)"
    )
    out: Path = setting(Path("runs/eval"), "where episodes.jsonl, summary.json, eval.png go")
    json: bool = setting(False, "print the summary as one JSON object on the last stdout line")
    log_level: str = setting("warning", "debug, info, warning")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m t1async.eval",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    add_arguments(p, EvalSettings)
    return p


def select_tasks(
    root: Path, split: str, families: str, backend: str = "auto"
) -> tuple[list[Task], list[str], SandboxBackend]:
    """The tasks to run, one line per task left out because the backend cannot run it, and the backend."""
    tasks = load_tasks(root)
    if split != "all":
        tasks = [t for t in tasks if t.split == split]
    if families:
        want = {f.strip() for f in families.split(",") if f.strip()}
        known = {t.family for t in tasks}
        if want - known:
            raise T1Error(f"--families names {sorted(want - known)}, not among this task set's {sorted(known)}")
        tasks = [t for t in tasks if t.family in want]
    b = pick_backend(backend, tasks)

    def why(t: Task) -> str:
        refusal = getattr(b, "refusal", None)
        return (refusal(t) if refusal is not None else None) or f"needs image {t.docker_image!r}"

    skipped = [f"{t.id} ({b.name} backend): {why(t)}" for t in tasks if not b.supports(t)]
    return [t for t in tasks if b.supports(t)], skipped, b


@asynccontextmanager
async def open_sampler(args: EvalSettings) -> AsyncIterator[Sampler]:
    from t1async.sampler.client import SGLangClient

    if args.model is not None:
        from t1async.sampler.launch import launch_sampler

        opts: dict[str, Any] = {"dtype": args.dtype, "seed": args.seed}
        if args.prefix_cache_tokens is not None:
            opts["prefix_cache_tokens"] = args.prefix_cache_tokens
        async with launch_sampler(args.model, **opts) as url, SGLangClient([url]) as c:
            yield c
    else:
        # eval trains on no logprob: SGLang's temperature-scaled ones are fine (sampler/client.py)
        async with SGLangClient(list(args.sampler_url), api_key=args.sampler_api_key, train_logprobs=False) as c:
            down = [u for u, ok in (await c.health()).items() if not ok]
            if down:
                raise SamplerError(
                    f"no healthy sampler at {', '.join(down)} (GET /health failed); start one "
                    "(python -m t1async.sampler serve) or fix --sampler-url"
                )
            yield c


async def amain(args: EvalSettings, tasks: list[Task], backend: SandboxBackend) -> dict:
    from t1async.model.tokenizer import ChatTokenizer

    tok = ChatTokenizer.load(args.model if args.model is not None else args.tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "episodes.jsonl"
    jsonl.write_text("")
    t0 = time.monotonic()
    async with open_sampler(args) as sampler:
        rows = await run_eval(tasks, sampler, tok, args, backend=backend, jsonl=jsonl, progress=progress_stream())
    ks = list(range(1, args.samples + 1))
    reasons: dict[str, int] = {}
    for r in rows:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    counted, unbuilt = scored(rows)
    counted, errors = split_errors(counted)  # episodes that errored: counted by kind, not as the policy's fails
    apart = {
        IMAGE_BUILD_FAILED: len(unbuilt),
        "unbuilt_tasks": unbuilt,
        "errors": errors,
        "error_episodes": sum(errors.values()),
    }
    if not counted:
        return {"tasks": 0, "episodes": 0, "reasons": reasons, **apart, "out": str(args.out)}
    scores = task_scores(counted)
    overall = summarise(scores, k_values=ks, seed=args.seed)
    fams = by_family(scores, k_values=ks, seed=args.seed)
    print_report(scores, overall, fams, ks, sys.stdout)
    src = str(args.model) if args.model is not None else ",".join(args.sampler_url)
    plot(
        overall,
        fams,
        args.out / "eval.png",
        f"{src}: {overall['tasks']} tasks x {args.samples} samples, split {args.split}, seed {args.seed}",
    )
    return {
        "pass1": overall["pass@1"]["mean"],
        "pass1_ci95": overall["pass@1"]["ci95"],
        "tests_mean": overall["tests"]["mean"],
        "tests_ci95": overall["tests"]["ci95"],
        "tests_frac": overall["tests_frac"]["mean"],
        "resolved_rate": overall["resolved_rate"],
        "pass_at_k": {k: overall[k]["mean"] for k in overall if k.startswith("pass@")},
        "tasks": overall["tasks"],
        "episodes": overall["episodes"],
        "samples": args.samples,
        "seed": args.seed,
        "split": args.split,
        "source": src,
        "backend": backend.name,
        "reasons": reasons,
        **apart,
        "overall": overall,
        "families": fams,
        "minutes": (time.monotonic() - t0) / 60.0,
        "out": str(args.out),
    }


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    try:
        args: EvalSettings = resolve(EvalSettings, p.parse_args(argv))
    except ConfigError as exc:
        p.error(str(exc))
    configure(level=args.log_level)
    if args.tasks is None:
        p.error("the following arguments are required: --tasks")
    if args.model is None and not args.sampler_url:
        p.error("no policy: pass --model DIR (starts the embedded sampler) or --sampler-url URL (a running one)")
    if args.model is not None and args.sampler_url:
        p.error("--model starts a sampler, --sampler-url uses running ones: give one of them")
    if args.model is not None:
        try:
            check_model_dir(args.model, "--model")
        except ConfigError as exc:
            p.error(f"{exc} (e.g. a checkpoint dir or the out dir of `python -m t1async.learner sft`)")
    if args.system_prompt_file is not None and not args.system_prompt_file.is_file():
        p.error(f"--system-prompt-file {args.system_prompt_file}: no such file")
    if not args.tasks.is_dir():
        p.error(
            f"--tasks {args.tasks} is not a directory; make one with `python -m sandbox_agent synth --out DIR --n 60`"
        )
    try:
        tasks, skipped, backend = select_tasks(args.tasks, args.split, args.families, args.backend)
    except (T1Error, ValueError) as exc:
        p.error(str(exc))
    for line in skipped:
        print(f"skipped {line}", file=sys.stderr)
    if not tasks:
        p.error(
            f"no runnable tasks in {args.tasks} for --split {args.split}"
            + (f" --families {args.families}" if args.families else "")
        )
    try:
        summary = anyio.run(amain, args, tasks, backend, backend="trio")
    except SamplerError as exc:
        print(f"python -m t1async.eval: error: {exc}", file=sys.stderr)
        return 2
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    o = summary
    if o[IMAGE_BUILD_FAILED]:
        print(
            f"warning: {o[IMAGE_BUILD_FAILED]} task(s) could not build their image, not counted: "
            f"{', '.join(o['unbuilt_tasks'][:10])}; `python -m sandbox_agent run-task DIR --json` says why",
            file=sys.stderr,
        )
    if not o["tasks"]:
        print("python -m t1async.eval: error: no task could be run (none built its image)", file=sys.stderr)
        if args.json:
            print(json.dumps(summary), flush=True)
        return EXIT_IMAGE_BUILD_FAILED
    print(
        f"\npass@1 {o['pass1']:.1%} [{o['pass1_ci95'][0]:.1%}, {o['pass1_ci95'][1]:.1%}]  tests passed "
        f"{o['tests_mean']:.2f} [{o['tests_ci95'][0]:.2f}, {o['tests_ci95'][1]:.2f}]  over {o['tasks']} tasks x "
        f"{o['samples']} samples in {o['minutes']:.1f} min; episodes in {args.out / 'episodes.jsonl'}"
    )
    if o["error_episodes"]:
        kinds = ", ".join(f"{k} {n}" for k, n in o["errors"].items() if n)
        print(
            f"warning: {o['error_episodes']} more episodes errored ({kinds}) and are not counted in the figures "
            "above; their `error` and `detail` in episodes.jsonl say why",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
