"""One episode as the actor runs it: ``start``, a ``turn`` per turn as it happens, and always an ``end``."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import anyio

from actors.records import TurnEncoder
from sandbox_agent.agent.runner import run_episode
from sandbox_agent.agent.types import AgentConfig, ChatTokenizerLike, TurnResult
from sandbox_agent.sandbox.backend import SandboxBackend
from sandbox_agent.tasks.task import Task
from t1async.credits.client import CreditClient, CreditedSampler
from t1async.log import get_logger
from t1async.protocol.errors import T1Error
from t1async.protocol.sampling import Sampler
from t1async.protocol.wire import EndReason, EndRecord, StartRecord
from t1async.transport.base import Transport, traj_subject

log = get_logger("actors.episode")


@dataclass
class EpisodeStats:
    """What an actor has done so far (for its metrics)."""

    running: int = 0
    done: int = 0
    turns: int = 0
    tokens: int = 0
    resolved: int = 0
    tests_passed: int = 0
    tests_total: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    compactions: int = 0  # inputs compacted by the context policy (each a FORK)
    empty_outputs: int = 0  # samples that returned no tokens (not streamed; credit and reward carried)
    sample_s: float = 0.0  # summed over turns: waiting for the sampler (credit wait included)
    exec_s: float = 0.0  # summed over turns: running the action in the sandbox


@dataclass(frozen=True)
class EpisodeContext:
    actor: str
    transport: Transport
    sampler: Sampler
    credits: CreditClient
    tokenizer: ChatTokenizerLike
    backend: SandboxBackend
    agent: AgentConfig
    work_root: Path | None = None


def new_episode_id(actor: str) -> str:
    return f"{actor}-{uuid.uuid4().hex[:12]}"


async def run_one(task: Task, ctx: EpisodeContext, stats: EpisodeStats, *, episode: str | None = None) -> EndRecord:
    """Run ``task`` once as ``episode`` (default: a fresh id), streaming its records. Whatever happens, an
    ``end`` record is published."""
    episode = episode or new_episode_id(ctx.actor)
    subject = traj_subject(episode)
    encoder = TurnEncoder(episode)
    sampler = CreditedSampler(ctx.sampler, ctx.credits, episode)
    end: EndRecord | None = None
    turns = 0

    async def on_turn(t: TurnResult) -> None:
        nonlocal turns
        stats.sample_s += t.t_sample_s
        stats.exec_s += t.t_exec_s
        if len(t.output_ids) == 0:  # no turn on the wire: its credit and reward carry to the next turn
            encoder.skip(t)
            stats.empty_outputs += 1
            log.warning(
                "turn.empty",
                episode=episode,
                turn=t.turn,
                finish=t.finish,
                reward_carried=t.reward,
                hint="the sampler returned no tokens; not streamed, its credit pays for the next sample",
            )
            return
        rec = encoder.encode(t)
        if t.last:  # the learner trains the episode's last turn as done even if it is cut before the end record
            rec = replace(rec, last=True)
        stats.compactions += rec.compacted
        await ctx.transport.publish(subject, rec)
        turns += 1
        stats.turns += 1
        stats.tokens += len(rec.output_ids) + len(rec.input_delta)
        log.debug(
            "turn.published",
            episode=episode,
            turn=t.turn,
            policy_version=rec.policy_version,
            keep=rec.keep,
            delta=len(rec.input_delta),
            out=len(rec.output_ids),
            reward=rec.reward,
        )

    stats.running += 1
    try:
        await ctx.transport.publish(subject, StartRecord(episode, ctx.actor, task.id, ctx.agent.max_turns, time.time()))
        log.info("episode.start", episode=episode, task=task.id)
        try:
            res = await run_episode(
                task,
                sampler=sampler,
                tokenizer=ctx.tokenizer,
                backend=ctx.backend,
                config=ctx.agent,
                on_turn=on_turn,
                rid=episode,
                work_root=ctx.work_root,
            )
            end = EndRecord(
                episode,
                turns,
                EndReason(res.reason),
                res.tests_passed,
                res.tests_total,
                res.resolved,
                res.detail[:1000],
                res.unstreamed_reward + encoder.carried_reward,
                compactions=res.compactions,
            )
        except T1Error as exc:  # task setup, sandbox, transport: the episode failed, the actor goes on
            log.warning("episode.failed", episode=episode, task=task.id, error=str(exc))
            end = EndRecord(episode, turns, EndReason.ERROR, 0, 0, False, f"{type(exc).__name__}: {exc}"[:1000])
        except Exception as exc:  # a bug must not make an episode vanish: record it, keep the actor alive
            log.exception("episode.crashed", episode=episode, task=task.id)
            end = EndRecord(episode, turns, EndReason.ERROR, 0, 0, False, f"{type(exc).__name__}: {exc}"[:1000])
        return end
    finally:
        stats.running -= 1
        final = end or EndRecord(episode, turns, EndReason.ABORTED, 0, 0, False, "actor stopped")
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            try:
                await ctx.transport.publish(subject, final)
            except T1Error as exc:
                log.error("episode.end_lost", episode=episode, error=str(exc))
        stats.done += 1
        stats.reasons[final.reason.value] = stats.reasons.get(final.reason.value, 0) + 1
        stats.resolved += int(final.resolved)
        stats.tests_passed += final.tests_passed
        stats.tests_total += final.tests_total
        log.info(
            "episode.end",
            episode=episode,
            task=task.id,
            reason=final.reason.value,
            turns=final.turns,
            passed=final.tests_passed,
            total=final.tests_total,
            resolved=final.resolved,
        )
