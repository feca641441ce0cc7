"""Run a policy on a task set: every (task, sample) one episode of the real agent loop in the real sandbox.

    rows = await run_eval(tasks, sampler, tokenizer, EvalConfig(samples=4, concurrency=8), jsonl=path)

Each episode is ``sandbox_agent.agent.runner.run_episode`` (work dir, setup, the token-in agent loop, the task's
verifier) with the sampler wrapped in ``SeededSampler``: turn ``t`` of sample ``s`` of task ``T`` asks for
``sampling_seed = episode_seed(seed, T, s, t)``, so the same weights, tasks and seed give the same episodes on
a sampler that honours SGLang's ``sampling_seed`` (the embedded one draws each request's tokens from its own
seeded generator, whatever else is in the batch). Each finished episode is appended to the JSONL file at
once (nothing is lost if the run stops), and ``rows`` come back sorted by (task, sample).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

import anyio

from actors.settings import EpisodeOptions
from sandbox_agent.agent.runner import run_episode
from sandbox_agent.agent.types import AgentConfig, TurnResult
from sandbox_agent.images.build import image_build_error
from sandbox_agent.images.buildfail import IMAGE_BUILD_FAILED
from sandbox_agent.sandbox.backend import BwrapBackend, SandboxBackend
from sandbox_agent.tasks.task import Task
from t1async.config import check_bounds, like, setting
from t1async.eval.stats import episode_error
from t1async.log import get_logger
from t1async.protocol.errors import T1Error
from t1async.protocol.sampling import Generation, Sampler, SamplingParams

log = get_logger("t1async.eval")


MAX_COMMAND_CHARS = 400  # of each turn's command, in the JSONL


@dataclass(frozen=True)
class EvalConfig:
    """How ``run_eval`` runs a policy: every task ``samples`` times, ``concurrency`` at once, seeded; each episode
    the agent loop of ``agent()``. ``python -m t1async.eval`` (``EvalSettings``) and the eval in the loop
    (``LoopSettings``) extend it with where the policy and the tasks come from."""

    samples: int = setting(1, "episodes per task, K; pass@k for k <= K", ge=1)
    concurrency: int = like(EpisodeOptions, "concurrency", group="episodes", help="episodes at once")
    seed: int = setting(0, "sampling seed: episodes are seeded per (task, sample, turn)")
    max_turns: int = like(EpisodeOptions, "max_turns", 20, group="episodes")
    max_new_tokens: int = like(EpisodeOptions, "max_new_tokens", group="episodes")
    max_context: int = like(EpisodeOptions, "max_context", group="episodes")
    temperature: float = like(EpisodeOptions, "temperature", group="episodes", help="sampling temperature (0 = greedy)")
    system_prompt_file: Path | None = setting(
        None,
        "the agent's system prompt (default: the built-in one); a warm start trained with its own has it in its "
        "model dir as system_prompt.txt",
        metavar="FILE",
    )

    def agent(self) -> AgentConfig:
        """The agent loop of each episode: no routing requested (an eval trains on nothing)."""
        sampling = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature)
        agent = AgentConfig(
            max_turns=self.max_turns, max_context_tokens=self.max_context, request_routing=False, sampling=sampling
        )
        if self.system_prompt_file is not None:  # e.g. a warm start's system_prompt.txt (t1async.recipes.warmstart)
            agent = replace(agent, system_prompt=Path(self.system_prompt_file).read_text())
        return agent

    def __post_init__(self) -> None:
        check_bounds(self)  # constructed in code too, not only resolved from flags


def episode_seed(seed: int, task: str, sample: int, turn: int) -> int:
    """The sampling seed of one turn: a hash of (eval seed, task id, sample, turn), in [0, 2^31)."""
    h = hashlib.sha256(f"{seed}/{task}/{sample}/{turn}".encode()).digest()
    return int.from_bytes(h[:4], "big") & 0x7FFFFFFF


class SeededSampler:
    """A Sampler that gives each request of one episode its own seed (``episode_seed``), by call order."""

    def __init__(self, inner: Sampler, seed: int, task: str, sample: int) -> None:
        self.inner, self.seed, self.task, self.sample = inner, seed, task, sample
        self.calls = 0

    async def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        routed_experts_start_len: int | None = None,
        rid: str | None = None,
    ) -> Generation:
        s = episode_seed(self.seed, self.task, self.sample, self.calls)
        self.calls += 1
        return await self.inner.generate(
            input_ids, replace(params, seed=s), routed_experts_start_len=routed_experts_start_len, rid=rid
        )

    async def aclose(self) -> None:  # the inner sampler is the caller's
        return None


class _Bar:
    """A one-line progress bar on a terminal (nothing otherwise): episodes done, resolved, elapsed."""

    def __init__(self, total: int, out: IO[str] | None) -> None:
        self.total, self.out, self.done, self.resolved = total, out, 0, 0
        self.t0 = time.monotonic()

    def advance(self, resolved: bool) -> None:
        self.done += 1
        self.resolved += int(resolved)
        if self.out is None:
            return
        frac = self.done / max(self.total, 1)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        self.out.write(
            f"\reval [{bar}] {self.done}/{self.total} episodes, {self.resolved} resolved, "
            f"{time.monotonic() - self.t0:5.0f}s"
        )
        self.out.flush()

    def close(self) -> None:
        if self.out is not None:
            self.out.write("\n")
            self.out.flush()


async def run_one(
    task: Task,
    sample: int,
    sampler: Sampler,
    tokenizer,
    agent: AgentConfig,
    seed: int,
    backend: SandboxBackend,
    work_root: Path | None = None,
) -> dict:
    """One episode as a JSON-able row (its turns summarised)."""
    steps: list[dict] = []
    digest = hashlib.sha256()
    versions: set[int] = set()

    async def on_turn(t: TurnResult) -> None:
        digest.update(t.output_ids.astype("<i4").tobytes())
        versions.add(int(t.policy_version))
        steps.append(
            {
                "turn": t.turn,
                "out": hashlib.sha256(t.output_ids.astype("<i4").tobytes()).hexdigest()[:8],
                "action": t.action_kind,
                "command": t.action_text[:MAX_COMMAND_CHARS],
                "exit_code": t.exit_code,
                "tokens": int(len(t.output_ids)),
                "reward": float(t.reward),
            }
        )

    row = {
        "task": task.id,
        "family": task.family,
        "split": task.split,
        "content_key": task.content_key,
        "sample": sample,
        "seed": episode_seed(seed, task.id, sample, 0),
        "backend": backend.name,
    }
    t0 = time.monotonic()
    seeded = SeededSampler(sampler, seed, task.id, sample)
    try:
        res = await run_episode(
            task,
            sampler=seeded,
            tokenizer=tokenizer,
            backend=backend,
            config=agent,
            on_turn=on_turn,
            rid=f"eval-{task.id}-s{sample}",
            work_root=work_root,
        )
        row.update(
            reason=res.reason,
            resolved=bool(res.resolved),
            tests_passed=int(res.tests_passed),
            tests_total=int(res.tests_total),
            turns=int(res.turns),
            detail=res.detail[:500],
            verify_status=res.verify.status if res.verify is not None else "ok",
        )
    except T1Error as exc:  # a broken task (setup failed, needs an image) or sandbox: a failed episode, said why
        log.warning("eval.episode_failed", task=task.id, sample=sample, error=str(exc))
        # an image that did not build is no episode of the policy: the summaries count it apart (stats.scored)
        row.update(
            reason=IMAGE_BUILD_FAILED if image_build_error(exc) is not None else "error",
            resolved=False,
            tests_passed=0,
            tests_total=0,
            turns=len(steps),
            detail=f"{type(exc).__name__}: {exc}"[:500],
        )
    row["error"] = episode_error(row)  # None: an outcome of the policy; else why not (counted apart)
    row.update(
        wall_s=round(time.monotonic() - t0, 3),
        output_digest=digest.hexdigest()[:16],
        policy_versions=sorted(versions),
        steps=steps,
    )
    return row


async def run_eval(
    tasks: Sequence[Task],
    sampler: Sampler,
    tokenizer,
    cfg: EvalConfig,
    *,
    backend: SandboxBackend | None = None,
    jsonl: Path | None = None,
    progress: IO[str] | None = None,
    work_root: Path | None = None,
    on_episode: Callable[[dict], None] | None = None,
    agent: AgentConfig | None = None,
) -> list[dict]:
    """Every task ``cfg.samples`` times, ``cfg.concurrency`` at once, each episode the agent loop of ``agent``
    (default ``cfg.agent()``); rows sorted by (task, sample)."""
    backend = backend or BwrapBackend()
    agent = agent or cfg.agent()
    jobs = [(t, s) for s in range(cfg.samples) for t in tasks]  # sample 0 of every task first
    rows: list[dict] = []
    bar = _Bar(len(jobs), progress)
    sink = open(jsonl, "a", encoding="utf-8") if jsonl is not None else None
    nxt = iter(range(len(jobs)))

    async def worker() -> None:
        for i in nxt:
            task, sample = jobs[i]
            row = await run_one(task, sample, sampler, tokenizer, agent, cfg.seed, backend, work_root)
            rows.append(row)
            if sink is not None:
                sink.write(json.dumps(row) + "\n")
                sink.flush()
            if on_episode is not None:
                on_episode(row)
            bar.advance(row["resolved"])

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(min(cfg.concurrency, len(jobs))):
                tg.start_soon(worker)
    finally:
        bar.close()
        if sink is not None:
            sink.close()
    return sorted(rows, key=lambda r: (r["task"], r["sample"]))


def progress_stream() -> IO[str] | None:
    """stderr when it is a terminal (the bar redraws in place), else None."""
    return sys.stderr if sys.stderr.isatty() else None
