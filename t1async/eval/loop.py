"""The held-out eval inside the RL loop (``cluster up --eval-every N``): one more cluster component.

    python -m t1async.eval.loop --nats URL --tasks DIR --run-dir RUN --every N [--model DIR] [...]
    python -m t1async.eval.loop --config FILE.toml      # what ``cluster up`` does (flags still win)

It follows ``t1.policy``: when the learner publishes a version that is a multiple of N, it copies that
checkpoint into ``<run-dir>/eval/v<version>/model`` (the learner prunes old checkpoints), starts an embedded
sampler of its own on it (the actors' samplers are not touched, and the eval sees exactly that version), runs
``t1async.eval.run_eval`` on the eval split of ``--tasks`` (seeded per task and sample: every version is
scored on the same episodes' seeds) and publishes the summary on ``t1.metrics.eval`` (pass@1, mean tests
passed, their 95% CIs, tasks, minutes): ``cluster up`` writes it into ``metrics.jsonl`` and shows it on its
``eval`` line. The curves go to TensorBoard in ``<run-dir>/tensorboard/eval`` at step = version, the episodes to
``<run-dir>/eval/v<version>.jsonl``. With ``--model`` the starting policy (version 0) is scored first.

"Spare capacity": one eval at a time, at low CPU priority; versions published while one runs are not
queued, the newest due version is evaluated next.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import anyio

from t1async.config import add_arguments, like, resolve, setting
from t1async.eval.run import EvalConfig
from t1async.log import configure, get_logger
from t1async.protocol import wire
from t1async.protocol.errors import ConfigError, T1Error
from t1async.signals import cancel_on_stop
from t1async.transport.auth import NatsClientSettings

log = get_logger("t1async.eval.loop")


@dataclass(frozen=True, kw_only=True)
class LoopSettings(EvalConfig):
    """``python -m t1async.eval.loop``'s settings: ``--config FILE.toml`` (what ``cluster up`` writes) and/or
    flags (flags win); what ``run_loop`` evaluates, and how (its ``EvalConfig``)."""

    concurrency: int = 2  # spare capacity: fewer than python -m t1async.eval's
    max_new_tokens: int = 128  # cluster up's default (UpConfig), which it passes anyway
    run_dir: Path = setting(help="where eval/ and tensorboard/eval go (required)", metavar="DIR")
    tasks: Path = setting(help="task dir; its eval split is scored (required)", metavar="DIR")
    every: int = setting(help="score every N-th policy version (required)", ge=1)
    model: Path | None = setting(
        None, "the starting policy: scored first as version 0 (default: start at the first due version)"
    )
    nats: str | None = setting(None, "NATS URL the learner publishes t1.policy on (required)", metavar="URL")
    nats_creds: Path | None = like(NatsClientSettings, "nats_creds")
    log_level: str = setting("info", "log level")


def held_out(tasks: Path) -> list:
    from sandbox_agent.tasks.task import load_tasks

    held = [t for t in load_tasks(tasks) if t.split == "eval"]
    if not held:
        raise T1Error(f"--tasks {tasks}: no task of the eval split (the held-out ~10%); give more tasks")
    return held


async def evaluate(cfg: LoopSettings, model: Path, policy_version: int, tasks: list) -> dict:
    """Score ``model`` on ``tasks``; the summary record's values."""
    from t1async.eval.run import run_eval
    from t1async.eval.stats import scored, split_errors, summarise, task_scores
    from t1async.model.tokenizer import ChatTokenizer
    from t1async.sampler.client import SGLangClient
    from t1async.sampler.launch import launch_sampler

    tok = ChatTokenizer.load(model)
    t0 = time.monotonic()
    out = cfg.run_dir / "eval"
    out.mkdir(parents=True, exist_ok=True)
    async with (
        launch_sampler(
            model, seed=cfg.seed, prefix_cache_tokens=0, log_path=out / f"sampler-v{policy_version}.log"
        ) as url,
        SGLangClient([url]) as c,
    ):
        rows = await run_eval(tasks, c, tok, cfg, jsonl=out / f"v{policy_version}.jsonl")
    counted, unbuilt = scored(rows)  # tasks whose image did not build are counted apart, not as fails
    counted, errors = split_errors(counted)  # so are episodes that errored (sandbox, sampler, timeout, ...)
    if not counted:
        raise T1Error(
            f"nothing to score: {len(unbuilt)} eval tasks did not build their image, "
            f"{sum(errors.values())} episodes errored ({errors}); see {out / f'v{policy_version}.jsonl'}"
        )
    s = summarise(task_scores(counted), seed=cfg.seed)
    return {
        "pass1": s["pass@1"]["mean"],
        "pass1_lo": s["pass@1"]["ci95"][0],
        "pass1_hi": s["pass@1"]["ci95"][1],
        "tests_mean": s["tests"]["mean"],
        "tests_lo": s["tests"]["ci95"][0],
        "tests_hi": s["tests"]["ci95"][1],
        "tests_frac": s["tests_frac"]["mean"],
        "tasks": s["tasks"],
        "episodes": s["episodes"],
        "image_build_failed": len(unbuilt),
        "episode_errors": sum(errors.values()),
        "eval_minutes": (time.monotonic() - t0) / 60.0,
    }


def snapshot(src: Path, dest: Path) -> Path:
    """A private copy of a checkpoint's model files (the learner keeps only its last few checkpoints)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("optimizer*", "trainer*", "*.tmp"))
    return dest


class _Due(TypedDict):
    """The newest policy version to evaluate (None: none yet), its weights and learner step."""

    policy_version: int | None
    path: str | None
    step: int


async def run_loop(cfg: LoopSettings, transport) -> None:
    """Until cancelled: evaluate every due policy version, newest first, one at a time."""
    from t1async.curves import Curves

    tasks = held_out(cfg.tasks)
    curves = Curves(cfg.run_dir / "tensorboard" / "eval")
    due: _Due = {"policy_version": None, "path": None, "step": 0}
    if cfg.model is not None:
        due.update({"policy_version": 0, "path": str(cfg.model), "step": 0})
    wake = anyio.Event()
    done = -1

    async def follow() -> None:
        nonlocal wake
        async with transport.subscribe("t1.policy") as msgs:
            async for m in msgs:
                rec = m.record
                if (
                    isinstance(rec, wire.PolicyRecord)
                    and rec.policy_version % cfg.every == 0
                    and rec.policy_version > done
                ):
                    due.update({"policy_version": rec.policy_version, "path": rec.weights, "step": rec.step})
                    wake.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            log.info("eval_loop.ready", every=cfg.every, tasks=len(tasks), baseline=cfg.model is not None)
            while True:
                if due["policy_version"] is None or due["policy_version"] <= done:
                    wake = anyio.Event()
                    await wake.wait()
                    continue
                policy_version, path, step = int(due["policy_version"]), Path(str(due["path"])), int(due["step"])
                done = policy_version
                try:
                    model = (
                        snapshot(path, cfg.run_dir / "eval" / f"v{policy_version}" / "model")
                        if policy_version
                        else path
                    )
                    values = await evaluate(cfg, model, policy_version, tasks)
                except (OSError, T1Error) as exc:  # a pruned checkpoint, a sampler that would not start: next one
                    log.warning("eval_loop.failed", policy_version=policy_version, error=f"{type(exc).__name__}: {exc}")
                    continue
                curves.scalars(
                    policy_version, {f"eval/{k}": v for k, v in values.items()}
                )  # on disk before it is announced
                await transport.publish("t1.metrics.eval", wire.MetricsRecord("eval", step, policy_version, values))
                log.info(
                    "eval_loop.scored", policy_version=policy_version, **{k: round(v, 4) for k, v in values.items()}
                )
    finally:
        curves.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m t1async.eval.loop", description=__doc__.split("\n\n")[0])
    add_arguments(p, LoopSettings)
    try:
        settings: LoopSettings = resolve(LoopSettings, p.parse_args(argv))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if settings.nats is None:
        print("error: no --nats URL (a flag or the nats key of --config)", file=sys.stderr)
        return 2
    configure(level=settings.log_level)
    nats = settings.nats
    try:
        os.nice(10)  # spare capacity: the actors, sampler and learner come first
    except OSError:
        pass

    async def amain() -> None:
        from t1async.transport.nats import NatsTransport
        from t1async.transport.natsio import NatsConfig

        async with (
            NatsTransport(config=NatsConfig(url=nats, creds=settings.nats_creds)) as t,
            anyio.create_task_group() as tg,
        ):
            await tg.start(cancel_on_stop, tg.cancel_scope)
            await run_loop(settings, t)
            tg.cancel_scope.cancel()

    try:
        anyio.run(amain, backend="trio")
    except T1Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
