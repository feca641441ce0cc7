"""The agent turn loop: one episode, token-in/token-out (design §5), against the Sampler seam.

Every turn's input is built from exact IDs: the previous turn's full input, its sampled output IDs, the
bridge that closes the assistant turn (``tokenizer.bridge_ids(output)``), the observation message encoded
on its own (``tokenizer.message_ids``) and the generation prompt. Earlier text is never re-encoded, so every
boundary is CLEAN. Routing is asked only for rows no earlier turn covered (design §3):
``routed_experts_start_len`` is 0 on the first turn, then the previous full sequence length - 1.

When the next input would not fit ``max_context_tokens``, the context policy (``sandbox_agent.agent.context``,
``AgentConfig.context``) compacts the history, again from exact IDs, or stops the episode ("context"). A
compacted input shares only a prefix with the previous sequence: that boundary is a FORK, the turn says so
(``TurnResult.compacted``), and routing is asked from the end of that shared prefix, so the sampler routes
every position of the new context that earlier turns did not.

Its config and records (``AgentConfig``, ``TurnResult``, ``EpisodeResult``) are types.py. The loop
reads as its seams: ``_sample``, ``_respond`` (parse, ``_act``), ``_next_input`` (with the context
policy), ``_verify_turn``, then the turn is streamed (``on_turn``); ``_finish`` makes the result.

Rewards (design §8, ``AgentConfig.reward``): dense (the default), when a turn is verified (every
``verify_every`` turns, and always on the turn that ends the episode) its ``reward`` is the change in the
number of passing tests; otherwise 0. If the episode stops before a turn could carry the final verification
(wall time ran out while sampling, a sampler error), that change is ``EpisodeResult.unstreamed_reward``, so
the streamed rewards plus it always add up to ``EpisodeResult.tests_passed``. Binary: every turn earns 0 but
the final verification, which earns 1 if the task is resolved (on the last turn, else as the unstreamed
reward), so the rewards add up to ``EpisodeResult.resolved``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import anyio
import numpy as np

from sandbox_agent.agent.actions import SYSTEM_PROMPT, Action, format_observation, parse_action
from sandbox_agent.agent.context import ContextPolicy, History, make_policy
from sandbox_agent.agent.types import (
    AgentConfig,
    ChatTokenizerLike,
    EpisodeResult,
    OnTurn,
    Reward,
    TurnGate,
    TurnResult,
    VerifyFn,
)
from sandbox_agent.sandbox import ExecResult, Sandbox
from sandbox_agent.tasks.verifier import VerifyResult
from t1async.log import get_logger
from t1async.protocol.errors import SamplerError, SandboxError
from t1async.protocol.sampling import Generation, Sampler, SamplingParams, common_prefix_len
from t1async.protocol.wire import EndReason

__all__ = [
    "initial_messages",
    "prompt_ids",
    "render_turns_ids",
    "run_agent",
    "turn_suffix_ids",
]
log = get_logger("sandbox_agent.agent.loop")


def initial_messages(instruction: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": instruction.strip()}]


def prompt_ids(tokenizer: ChatTokenizerLike, instruction: str, system_prompt: str = SYSTEM_PROMPT) -> list[int]:
    """The first turn's input: the chat template over the system prompt and the instruction."""
    return list(tokenizer.render(initial_messages(instruction, system_prompt), add_generation_prompt=True))


def turn_suffix_ids(
    tokenizer: ChatTokenizerLike, output_ids: Sequence[int], observation: str, role: str = "user"
) -> list[int]:
    """What follows a turn's exact output IDs in the next input: the bridge that closes the assistant turn,
    the observation message encoded on its own, and the generation prompt. Never merges with the output."""
    return (
        list(tokenizer.bridge_ids(output_ids))
        + list(tokenizer.message_ids(role, observation))
        + list(tokenizer.generation_prompt_ids())
    )


def render_turns_ids(
    tokenizer: ChatTokenizerLike,
    instruction: str,
    turns: Sequence[tuple[str, str]],
    *,
    system_prompt: str = SYSTEM_PROMPT,
    observation_role: str = "user",
) -> tuple[np.ndarray, np.ndarray]:
    """Token IDs and loss mask of a scripted episode (e.g. ``runner.oracle_turns``) for warm-start SFT,
    built exactly as ``run_agent`` builds its inputs. Each assistant text is encoded on its own and closed
    with the end-of-turn token (in the loss, as the sampler would emit it); the rest is masked out."""
    ids = prompt_ids(tokenizer, instruction, system_prompt)
    mask = [False] * len(ids)
    for k, (text, observation) in enumerate(turns):
        out = list(tokenizer.encode(text)) + [tokenizer.end_of_turn_id]
        ids += out
        mask += [True] * len(out)
        if k + 1 < len(turns):
            suffix = turn_suffix_ids(tokenizer, out, observation, observation_role)
            ids += suffix
            mask += [False] * len(suffix)
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool)


async def _act(
    action: Action, sandbox: Sandbox, cfg: AgentConfig, deadline: float
) -> tuple[str, ExecResult | None, str]:
    """Run the action's command, if any: (observation, exec result, sandbox failure or "")."""
    if action.kind != "bash":
        return action.error, None, ""
    timeout = max(min(cfg.command_timeout_s, deadline - anyio.current_time()), 0.001)
    try:
        res = await sandbox.exec(action.command, timeout=timeout)
    except SandboxError as exc:
        return f"[sandbox error: {exc}]", None, str(exc)
    observation = format_observation(
        res.output,
        res.exit_code,
        timed_out=res.timed_out,
        truncated=res.truncated,
        timeout_s=timeout,
        max_chars=cfg.max_observation_chars,
        note=action.note,
    )
    return observation, res, ""


@dataclass
class _Loop:
    """The mutable state of one episode's turn loop."""

    input_ids: list[int]
    history: History
    deadline: float
    rid: str = "episode"
    paused_s: float = 0.0  # time the sampler held the episode before sampling (credits), not on the wall clock
    routed_start: int = 0  # the first position no earlier turn's routing covered (design §3)
    compacted: bool = False  # this turn's input is a compaction (a FORK by construction)
    last_passed: int = 0
    last_verify: VerifyResult | None = None
    verified_last_turn: bool = False


async def _sample(
    sampler: Sampler, st: _Loop, cfg: AgentConfig, params: SamplingParams, k: int, rid: str
) -> tuple[Generation | None, EndReason | None, str]:
    """Sample turn ``k``: (generation, None, "") or (None, stop reason, detail)."""
    try:
        if isinstance(sampler, TurnGate):  # outside the wall clock: a paused episode is not spending the agent's time
            t0 = anyio.current_time()
            await sampler.wait_turn()
            st.paused_s += anyio.current_time() - t0
            st.deadline += anyio.current_time() - t0
        with anyio.move_on_after(st.deadline - anyio.current_time()):
            return (
                await sampler.generate(
                    st.input_ids,
                    params,
                    routed_experts_start_len=st.routed_start if cfg.request_routing else None,
                    rid=f"{rid}/{k}",
                ),
                None,
                "",
            )
    except SamplerError as exc:
        return None, EndReason.ERROR, f"sampler failed on turn {k}: {exc}"
    return None, EndReason.TIMEOUT, f"wall time ran out while sampling turn {k}"


async def _respond(
    gen: Generation, out: list[int], tokenizer: ChatTokenizerLike, sandbox: Sandbox, cfg: AgentConfig, st: _Loop, k: int
) -> tuple[Action, str, str, ExecResult | None, EndReason | None, str]:
    """Parse the output and run its action: (action, kind, observation, exec result, stop, detail)."""
    if gen.finish == "abort":
        return Action("invalid"), "none", "", None, EndReason.ABORTED, f"sampler aborted turn {k}"
    action = parse_action(tokenizer.decode(out, skip_special_tokens=False))
    observation, res, failure = await _act(action, sandbox, cfg, st.deadline)
    if failure:
        return action, action.kind, observation, res, EndReason.ERROR, f"sandbox failed on turn {k}: {failure}"
    if action.done:
        return action, action.kind, "", res, EndReason.SOLVED, ""
    return action, action.kind, observation, res, None, ""


def _next_input(
    tokenizer: ChatTokenizerLike, st: _Loop, cfg: AgentConfig, policy: ContextPolicy, out: list[int], observation: str
) -> tuple[list[int] | None, str]:
    """The next turn's input from exact IDs (sets ``st.routed_start`` and ``st.compacted``), or (None, why)
    when it cannot fit ``max_context`` and the context policy gives up."""
    suffix = turn_suffix_ids(tokenizer, out, observation, cfg.observation_role)
    st.history.add(out, observation, suffix)
    seq = st.input_ids + out
    nxt = seq + suffix
    # an output with no tokens is never streamed (a wire turn samples at least one token): the rows its
    # request covered are asked again with the next one, and a compaction before it belongs to the next turn
    covered = len(seq) - 1 if out else st.routed_start
    st.routed_start, st.compacted = covered, st.compacted and not out
    limit = cfg.max_context_tokens - cfg.min_new_tokens
    if len(nxt) <= limit:
        return nxt, ""
    compacted = policy.compact(st.history, limit, min(limit, int(cfg.max_context_tokens * cfg.context.compact_to)))
    if compacted is None:
        return None, f"{len(nxt)} tokens of {cfg.max_context_tokens} used (context policy {policy.name})"
    # the routing of a position depends only on the tokens up to it: rows the sampler already sent for the
    # shared prefix stay valid, every later position of the new context must be routed again
    lcp = common_prefix_len(np.asarray(compacted, dtype=np.int64), np.asarray(seq, dtype=np.int64))
    st.routed_start, st.compacted = min(lcp, covered), True
    log.info(
        "agent.compacted",
        rid=st.rid,
        policy=policy.name,
        before=len(nxt),
        after=len(compacted),
        shared=lcp,
        turns_dropped=st.history.dropped,
        compactions=st.history.compactions,
    )
    return compacted, ""


async def _verify_turn(
    st: _Loop, verify: VerifyFn, cfg: AgentConfig, k: int, stop: EndReason | None
) -> tuple[int | None, float, EndReason | None, str]:
    """Verify when the episode stops or every ``verify_every`` turns: (tests passed, reward, stop, detail)."""
    periodic = cfg.verify_every > 0 and (k + 1) % cfg.verify_every == 0
    if stop is None and not periodic:
        return None, 0.0, None, ""
    st.last_verify = await verify()
    reward = float(st.last_verify.passed - st.last_passed)
    st.last_passed = st.last_verify.passed
    detail = ""
    if stop is None and cfg.stop_when_resolved and st.last_verify.resolved:
        stop, detail = EndReason.SOLVED, f"tests resolved at turn {k}"
    if cfg.reward == Reward.BINARY:  # only the episode's final verification pays, 1 if resolved
        reward = float(st.last_verify.resolved) if stop is not None else 0.0
    return st.last_verify.passed, reward, stop, detail


async def run_agent(
    *,
    instruction: str,
    sampler: Sampler,
    tokenizer: ChatTokenizerLike,
    sandbox: Sandbox,
    verify: VerifyFn,
    config: AgentConfig = AgentConfig(),
    wall_time_s: float = 900.0,
    on_turn: OnTurn | None = None,
    rid: str = "episode",
) -> EpisodeResult:
    """Run one episode in an open sandbox. ``verify`` runs the task's tests over the sandbox's work dir."""
    cfg = config
    t_start = time.monotonic()
    first = prompt_ids(tokenizer, instruction, cfg.system_prompt)
    st = _Loop(
        first,
        History(tokenizer, first, cfg.observation_role),
        anyio.current_time() + (cfg.wall_time_s or wall_time_s),
        rid,
    )
    policy = make_policy(cfg.context)
    stop_ids = cfg.sampling.stop_token_ids or tuple(sorted({tokenizer.end_of_turn_id, *tokenizer.eos_ids}))
    reason: EndReason = EndReason.MAX_TURNS
    detail = ""
    turns = 0
    for k in range(cfg.max_turns):
        budget = cfg.max_context_tokens - len(st.input_ids)
        if budget < cfg.min_new_tokens:
            reason, detail = EndReason.CONTEXT, f"{len(st.input_ids)} tokens of {cfg.max_context_tokens} used"
            break
        params = replace(cfg.sampling, max_new_tokens=min(cfg.sampling.max_new_tokens, budget), stop_token_ids=stop_ids)
        # -- sample
        t0 = time.monotonic()
        gen, stop, detail = await _sample(sampler, st, cfg, params, k, rid)
        if gen is None:
            assert stop is not None
            reason = stop
            break
        t_sample = time.monotonic() - t0
        out = [int(t) for t in gen.output_ids]
        seq_len = len(st.input_ids) + len(out)
        # -- act
        t1 = time.monotonic()
        action, kind, observation, res, stop, detail = await _respond(gen, out, tokenizer, sandbox, cfg, st, k)
        t_exec = time.monotonic() - t1
        # -- the next input (compacted by the context policy when it would not fit)
        input_ids, compacted = st.input_ids, st.compacted
        next_ids: list[int] | None = None
        if stop is None:
            if k + 1 >= cfg.max_turns:
                stop = EndReason.MAX_TURNS
            else:
                next_ids, why = _next_input(tokenizer, st, cfg, policy, out, observation)
                if next_ids is None:
                    stop, detail = EndReason.CONTEXT, why
                elif anyio.current_time() >= st.deadline:
                    stop, detail = EndReason.TIMEOUT, f"wall time ran out after turn {k}"
        # -- verify, then stream the turn
        tests_passed, reward, stop, vdetail = await _verify_turn(st, verify, cfg, k, stop)
        if cfg.reward == Reward.TURNS:  # content-free: a turn that does not say DONE earns 1, the tests aside
            reward = float(not action.done)
        detail = vdetail or detail
        turns = k + 1
        if on_turn is not None:
            await on_turn(
                TurnResult(
                    turn=k,
                    input_ids=np.asarray(input_ids, dtype=np.int32),
                    output_ids=np.asarray(out, dtype=np.int32),
                    logprobs=np.asarray(gen.logprobs, dtype=np.float32),
                    finish=gen.finish,
                    policy_version=gen.policy_version,
                    routing=gen.routing,
                    routing_start=gen.routing_start,
                    action_kind=kind,
                    action_text=action.command,
                    observation=observation,
                    exit_code=res.exit_code if res else None,
                    timed_out=bool(res and res.timed_out),
                    truncated=bool(res and res.truncated),
                    tests_passed=tests_passed,
                    reward=reward,
                    t_sample_s=t_sample,
                    t_exec_s=t_exec,
                    last=stop is not None,
                    compacted=compacted,
                    output_versions=gen.output_versions,
                )
            )
        log.debug("agent.turn", rid=rid, turn=k, action=kind, tokens=seq_len, tests_passed=tests_passed)
        st.verified_last_turn = tests_passed is not None
        if stop is not None:
            reason = stop
            break
        assert next_ids is not None
        st.input_ids = next_ids
    return await _finish(st, verify, cfg, rid, turns, reason, detail, t_start)


async def _finish(
    st: _Loop, verify: VerifyFn, cfg: AgentConfig, rid: str, turns: int, reason: EndReason, detail: str, t_start: float
) -> EpisodeResult:
    """The episode's result; verifies once more if the last turn could not carry the final verification."""
    unstreamed = 0.0
    last_verify = st.last_verify
    if not st.verified_last_turn or last_verify is None:
        last_verify = await verify()
        unstreamed = float(last_verify.passed - st.last_passed)
        if cfg.reward == Reward.BINARY:  # no streamed turn carried the final verification: its 1 or 0 goes here
            unstreamed = float(last_verify.resolved)
        elif cfg.reward == Reward.TURNS:  # every turn was paid when it was taken
            unstreamed = 0.0
    result = EpisodeResult(
        turns=turns,
        reason=reason,
        tests_passed=last_verify.passed,
        tests_total=last_verify.total,
        resolved=last_verify.resolved,
        verify=last_verify,
        detail=detail,
        unstreamed_reward=unstreamed,
        wall_s=time.monotonic() - t_start,
        compactions=st.history.compactions,
        paused_s=st.paused_s,
    )
    log.info(
        "agent.episode_end",
        rid=rid,
        turns=turns,
        reason=reason,
        passed=result.tests_passed,
        total=result.tests_total,
        resolved=result.resolved,
        compactions=result.compactions,
        paused_s=round(result.paused_s, 3),
    )
    return result
