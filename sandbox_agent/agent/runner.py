"""Running a task end to end: work dir, setup, a policy (LLM agent, oracle or do-nothing), verification.

- ``run_episode``: the LLM agent loop (``loop.run_agent``) on a fresh work dir; what the actor calls.
- ``run_policy``: a scripted policy (``OracleAgent`` runs the task's solution, ``NullAgent`` does nothing),
  then verification; what ``python -m sandbox_agent run-task`` calls.
- ``oracle_turns``: the oracle solution rendered as agent turns ``(assistant text, observation)``, with
  real observations from the sandbox, for warm-start SFT.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import anyio

from sandbox_agent.agent.actions import format_observation
from sandbox_agent.agent.loop import run_agent
from sandbox_agent.agent.types import AgentConfig, ChatTokenizerLike, EpisodeResult, OnTurn
from sandbox_agent.images.buildfail import BuildFailure
from sandbox_agent.sandbox import ExecResult, Sandbox
from sandbox_agent.sandbox.backend import BwrapBackend, SandboxBackend, require_backend
from sandbox_agent.tasks.task import Task, populate_workdir
from sandbox_agent.tasks.verifier import VerifierConfig, VerifyResult, share_read_only, verify
from t1async.log import get_logger
from t1async.protocol.errors import T1Error
from t1async.protocol.sampling import Sampler

log = get_logger("sandbox_agent.agent.runner")

SETUP_MOUNT = "/t1setup"
WORK_PREFIX = "t1w-"  # every episode's work dir (and its ``.mnt`` sibling) is named so
SOLUTION_MOUNT = "/solution"


class TaskSetupError(T1Error):
    """A task's setup.sh failed: the task is broken, not the agent."""


@contextlib.asynccontextmanager
async def prepared_workdir(
    task: Task, backend: SandboxBackend, *, work_root: Path | None = None, keep: bool = False
) -> AsyncIterator[Path]:
    """A fresh work dir holding the task's environment files, after its setup.sh ran; removed after."""
    require_backend(task, backend)
    wd = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{_safe(task.id)}-", dir=work_root))
    try:
        async with contextlib.AsyncExitStack() as stack:
            await _prepare(task, backend, wd, stack)
            yield wd
    finally:
        if not keep:
            shutil.rmtree(wd, ignore_errors=True)
            shutil.rmtree(f"{wd}.mnt", ignore_errors=True)


async def _prepare(task: Task, backend: SandboxBackend, wd: Path, stack: contextlib.AsyncExitStack) -> None:
    """Environment files, the Dockerfile's COPYs (bwrap) or the episode's container, then setup.sh."""
    populate_workdir(task, wd)
    # the task's Dockerfile COPYs (bwrap), or nothing (an image has them)
    await anyio.to_thread.run_sync(backend.prepare, task, wd)
    # one container for the whole episode (every session runs in it), or nothing (bwrap)
    await stack.enter_async_context(backend.episode(task, wd))
    if task.setup_script is not None:
        with tempfile.TemporaryDirectory(prefix="t1s-") as tmp:
            shutil.copy2(task.setup_script, Path(tmp) / "setup.sh")
            share_read_only(Path(tmp))
            async with backend.open(task, wd, ro_binds=((tmp, SETUP_MOUNT),)) as sb:
                res = await sb.exec(f"bash {SETUP_MOUNT}/setup.sh", timeout=120.0)
            if res.exit_code != 0 or res.timed_out:
                raise TaskSetupError(
                    f"task {task.id}: setup.sh failed (exit {res.exit_code}, timed out {res.timed_out}): "
                    f"{res.output[-1000:]}"
                )


def _safe(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in s)[:40]


async def run_episode(
    task: Task,
    *,
    sampler: Sampler,
    tokenizer: ChatTokenizerLike,
    backend: SandboxBackend | None = None,
    config: AgentConfig = AgentConfig(),
    verifier: VerifierConfig = VerifierConfig(),
    on_turn: OnTurn | None = None,
    rid: str | None = None,
    work_root: Path | None = None,
) -> EpisodeResult:
    """One LLM-agent episode of ``task`` in a fresh work dir. Raises TaskNeedsImageError / TaskSetupError.
    A task's own ``max_turns`` (task.yaml, e.g. a synth family's oracle turn count) caps the agent's."""
    backend = backend or BwrapBackend()
    if isinstance(task.extra.get("max_turns"), int) and 0 < task.extra["max_turns"] < config.max_turns:
        config = replace(config, max_turns=task.extra["max_turns"])
    async with prepared_workdir(task, backend, work_root=work_root) as wd:
        async with backend.open(task, wd) as sb:

            async def _verify() -> VerifyResult:
                result = await verify(task, wd, backend, verifier)
                await backend.reclaim(sb, wd)  # the verifier's session took the work dir over
                return result

            return await run_agent(
                instruction=task.instruction,
                sampler=sampler,
                tokenizer=tokenizer,
                sandbox=sb,
                verify=_verify,
                config=config,
                wall_time_s=task.agent_timeout_s,
                on_turn=on_turn,
                rid=rid or task.id,
            )


# --------------------------------------------------------------------------------- scripted policies


class Policy(Protocol):
    name: str

    def ro_binds(self, task: Task, tmp: Path) -> tuple[tuple[str, str], ...]: ...

    async def act(self, task: Task, sandbox: Sandbox) -> ExecResult | None: ...


class NullAgent:
    """Does nothing: the floor every task's tests must fail."""

    name = "null"

    def ro_binds(self, task: Task, tmp: Path) -> tuple[tuple[str, str], ...]:
        return ()

    async def act(self, task: Task, sandbox: Sandbox) -> ExecResult | None:
        return None


class OracleAgent:
    """Runs the task's own solution script (bound read-only at /solution), cwd = the work dir."""

    name = "oracle"

    def ro_binds(self, task: Task, tmp: Path) -> tuple[tuple[str, str], ...]:
        if task.solution is None:
            raise T1Error(f"task {task.id} has no solution script (solution.sh or solution/solve.sh)")
        d = tmp / "solution"
        if task.format == "tb2":  # solution/ may hold helper files next to solve.sh
            shutil.copytree(task.solution.parent, d)
        else:
            d.mkdir()
            shutil.copy2(task.solution, d / task.solution.name)
        return ((str(d), SOLUTION_MOUNT),)

    async def act(self, task: Task, sandbox: Sandbox) -> ExecResult | None:
        assert task.solution is not None
        return await sandbox.exec(f"bash {SOLUTION_MOUNT}/{task.solution.name}", timeout=task.agent_timeout_s)


@dataclass(frozen=True)
class PolicyRun:
    task_id: str
    policy: str
    verify: VerifyResult
    act: ExecResult | None
    wall_s: float


async def run_policy(
    task: Task,
    policy: Policy,
    *,
    backend: SandboxBackend | None = None,
    verifier: VerifierConfig = VerifierConfig(),
    work_root: Path | None = None,
) -> PolicyRun:
    backend = backend or BwrapBackend()
    t0 = time.monotonic()
    async with prepared_workdir(task, backend, work_root=work_root) as wd:
        with tempfile.TemporaryDirectory(prefix="t1p-") as tmp:
            binds = policy.ro_binds(task, Path(tmp))
            share_read_only(Path(tmp))
            async with backend.open(task, wd, ro_binds=binds) as sb:
                act = await policy.act(task, sb)
                # verified with the agent's session still open, as in run_episode and Terminal-Bench: what
                # the agent left running (a server it started) is there for the tests
                result = await verify(task, wd, backend, verifier)
    log.info(
        "policy.run", task=task.id, policy=policy.name, passed=result.passed, total=result.total, status=result.status
    )
    return PolicyRun(task.id, policy.name, result, act, time.monotonic() - t0)


@dataclass(frozen=True)
class TaskCheck:
    """A task's oracle and do-nothing runs: a usable task resolves with its oracle and not with nothing."""

    task_id: str
    oracle: VerifyResult
    null: VerifyResult
    unbuilt: BuildFailure | None = None  # the task's image did not build: neither ran (not a bad task)

    @property
    def ok(self) -> bool:
        o, n = self.oracle, self.null
        return self.unbuilt is None and o.status == "ok" and o.resolved and n.status == "ok" and not n.resolved


async def check_tasks(
    tasks: list[Task],
    *,
    backend: SandboxBackend | None = None,
    concurrency: int = 2,
    verifier: VerifierConfig = VerifierConfig(),
) -> list[TaskCheck]:
    """Run the oracle and the do-nothing agent on every task, ``concurrency`` at a time (in task order)."""
    backend = backend or BwrapBackend()
    out: dict[int, TaskCheck] = {}
    limit = anyio.CapacityLimiter(concurrency)

    async def one(i: int, t: Task) -> None:
        from sandbox_agent.images.build import image_build_error

        async with limit:
            try:
                o = await run_policy(t, OracleAgent(), backend=backend, verifier=verifier)
                n = await run_policy(t, NullAgent(), backend=backend, verifier=verifier)
            except Exception as exc:  # an image that does not build is counted apart; anything else is raised
                err = image_build_error(exc)
                if err is None:
                    raise
                none = VerifyResult.failed("error", str(err))
                out[i] = TaskCheck(t.id, none, none, BuildFailure(err.step, err.host, err.cause))
                return
        out[i] = TaskCheck(t.id, o.verify, n.verify)

    async with anyio.create_task_group() as tg:
        for i, t in enumerate(tasks):
            tg.start_soon(one, i, t)
    return [out[i] for i in range(len(tasks))]


# ------------------------------------------------------------------------------ oracle as SFT turns

_SET_E = ("set -e", "set -eu", "set -euo pipefail", "set -eo pipefail", "set -ex", "set -o errexit")


def solution_chunks(script: str, max_chunks: int = 40) -> list[str]:
    """Split a solution script into syntactically complete chunks at blank lines (checked with bash -n).

    The shebang and ``set -e``-style lines are dropped (in a persistent shell they would end the session
    on the first failing command).
    """
    lines = [ln for ln in script.splitlines() if not ln.startswith("#!") and ln.strip() not in _SET_E]
    paras: list[str] = []
    cur: list[str] = []
    for ln in lines:
        if ln.strip() == "" and cur:
            paras.append("\n".join(cur))
            cur = []
        elif ln.strip() or cur:
            cur.append(ln)
    if cur:
        paras.append("\n".join(cur))
    chunks: list[str] = []
    pending = ""
    for p in paras:
        pending = f"{pending}\n\n{p}" if pending else p
        if _bash_ok(pending):
            if pending.strip() and not all(x.strip().startswith("#") for x in pending.splitlines() if x.strip()):
                chunks.append(pending)
                pending = ""
    if pending:
        if chunks:
            chunks[-1] = f"{chunks[-1]}\n\n{pending}"
        else:
            chunks.append(pending)
    while len(chunks) > max_chunks:
        chunks[-2:] = [f"{chunks[-2]}\n\n{chunks[-1]}"]
    return chunks


def _bash_ok(text: str) -> bool:
    return subprocess.run(["bash", "-n"], input=text.encode(), capture_output=True).returncode == 0


def render_command(command: str) -> str:
    return f"```bash\n{command}\n```"


async def oracle_turns(
    task: Task, *, backend: SandboxBackend | None = None, max_observation_chars: int = 8192
) -> tuple[list[tuple[str, str]], VerifyResult]:
    """The oracle solution as agent turns, with real observations, and the verification after it.

    Returns ``([(assistant_text, observation), ...], verify_result)``; the final turn is ``("DONE", "")``.
    Render them with the agent's system prompt and ``initial_messages(task.instruction)`` for SFT.
    """
    backend = backend or BwrapBackend()
    if task.solution is None:
        raise T1Error(f"task {task.id} has no solution script")
    chunks = solution_chunks(task.solution.read_text(encoding="utf-8"))
    turns: list[tuple[str, str]] = []
    async with prepared_workdir(task, backend) as wd:
        async with backend.open(task, wd) as sb:
            for c in chunks:
                res = await sb.exec(c, timeout=task.agent_timeout_s)
                obs = format_observation(
                    res.output,
                    res.exit_code,
                    timed_out=res.timed_out,
                    truncated=res.truncated,
                    max_chars=max_observation_chars,
                )
                turns.append((render_command(c), obs))
        turns.append(("DONE", ""))
        result = await verify(task, wd, backend)
    return turns, result
