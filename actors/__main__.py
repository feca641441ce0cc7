"""``python -m actors``: one actor process running many concurrent episodes against one NATS.

    python -m actors --nats nats://127.0.0.1:4222 --sampler-url http://127.0.0.1:30000 \\
        --tasks runs/latest/tasks --concurrency 8

Start as many as you like, on as many hosts: each needs a distinct --actor-id (default: host-pid).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import replace
from pathlib import Path

import anyio

from actors.actor import ActorConfig, run_actor
from sandbox_agent.agent_types import AgentConfig
from sandbox_agent.context import POLICIES, ContextConfig
from t1async.log import configure, get_logger
from t1async.model.tokenizer import ChatTokenizer
from t1async.protocol.errors import T1Error
from t1async.protocol.sampling import SamplingParams
from t1async.sampler.client import SGLangClient
from t1async.transport import NatsTransport


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m actors",
        description="Run one rollout actor: concurrent sandboxed shell episodes that sample token-in from "
        "SGLang-compatible samplers and stream every turn to the learner over NATS JetStream.",
    )
    p.add_argument(
        "--nats", default=os.environ.get("T1_NATS_URL"), help="NATS URL(s), comma-separated (default: $T1_NATS_URL)"
    )
    p.add_argument(
        "--sampler-url",
        action="append",
        default=[],
        metavar="URL",
        help="a sampler (SGLang or `python -m t1async.sampler serve`); repeat for several",
    )
    p.add_argument(
        "--tasks",
        type=Path,
        required=True,
        help="a directory of tasks (TB1/TB2 format), e.g. made by `python -m sandbox_agent synth --out DIR --n 200`",
    )
    p.add_argument(
        "--split", choices=("train", "eval", "all"), default="train", help="which tasks to draw (default train)"
    )
    p.add_argument("--concurrency", type=int, default=4, help="episodes run at once (default 4)")
    p.add_argument("--episodes", type=int, default=0, help="stop after this many episodes (default 0: never)")
    p.add_argument("--max-turns", type=int, default=300, help="turns per episode at most (default 300)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens sampled per turn at most (default 256)")
    p.add_argument("--max-context", type=int, default=8192, help="context budget in tokens (default 8192)")
    p.add_argument(
        "--context-policy",
        choices=tuple(POLICIES),
        default="truncate-observations",
        help="when the next input would not fit --max-context: truncate-observations (default; keeps the "
        "system prompt, the task and the last K turns whole, shortens older observations, drops the oldest "
        "turns if needed) or stop (end the episode with reason context)",
    )
    p.add_argument(
        "--context-keep-turns",
        type=int,
        default=8,
        metavar="K",
        help="turns truncate-observations keeps whole (default 8)",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument(
        "--verify-every",
        type=int,
        default=0,
        help="run the verifier every N turns for a dense per-turn reward (default 0: only at the end)",
    )
    p.add_argument("--command-timeout", type=float, default=30.0, help="seconds per shell command (default 30)")
    p.add_argument("--model", type=Path, default=None, help="model dir whose tokenizer to use (default: shipped)")
    p.add_argument(
        "--system-prompt-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="the agent's system prompt (default: the built-in one); a warm start's model dir has its "
        "own, system_prompt.txt, which cluster up passes here",
    )
    p.add_argument(
        "--actor-id",
        default=f"{socket.gethostname().split('.')[0]}-{os.getpid()}",
        help="this actor's name, unique across the cluster (default host-pid)",
    )
    p.add_argument("--seed", type=int, default=0, help="task-draw seed")
    p.add_argument("--log-level", default=None, help="debug, info (default), warning")
    return p


def validate(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if not args.nats:
        p.error(
            "no NATS: pass --nats nats://HOST:PORT or set T1_NATS_URL (a local cluster: python -m t1async.cluster up)"
        )
    if not args.sampler_url:
        p.error("no sampler: pass --sampler-url http://HOST:PORT (start one: python -m t1async.sampler serve)")
    for name in ("concurrency", "max_turns", "max_new_tokens", "max_context"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.context_keep_turns < 0:
        p.error(f"--context-keep-turns must be >= 0, got {args.context_keep_turns}")
    if any(c in args.actor_id for c in ".*> "):
        p.error(f"--actor-id {args.actor_id!r} may not contain '.', '*', '>' or spaces (it names NATS subjects)")


async def amain(args: argparse.Namespace) -> int:
    log = get_logger("actors")
    tokenizer = ChatTokenizer.load(args.model)
    agent = AgentConfig(
        max_turns=args.max_turns,
        max_context_tokens=args.max_context,
        verify_every=args.verify_every,
        command_timeout_s=args.command_timeout,
        context=ContextConfig(policy=args.context_policy, keep_last=args.context_keep_turns),
        sampling=SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop_token_ids=tuple(tokenizer.eos_ids)
        ),
    )
    if args.system_prompt_file is not None:
        if not args.system_prompt_file.is_file():
            raise T1Error(f"--system-prompt-file {args.system_prompt_file}: no such file")
        agent = replace(agent, system_prompt=args.system_prompt_file.read_text())
    config = ActorConfig(
        actor_id=args.actor_id,
        tasks_dir=args.tasks,
        concurrency=args.concurrency,
        split=args.split,
        episodes=args.episodes,
        seed=args.seed,
    )
    async with NatsTransport(args.nats) as transport, SGLangClient(args.sampler_url) as sampler:
        async with anyio.create_task_group() as tg:
            if len(args.sampler_url) > 1:  # take a dead sampler out, and back when healthy at the current weights
                tg.start_soon(sampler.monitor)
            stats = await run_actor(config, transport=transport, sampler=sampler, tokenizer=tokenizer, agent=agent)
            tg.cancel_scope.cancel()
    log.info("actors.exit", episodes=stats.done, turns=stats.turns)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    validate(args, p)
    configure(args.log_level)
    try:
        return anyio.run(amain, args, backend=os.environ.get("T1_BACKEND", "trio"))
    except KeyboardInterrupt:
        return 130
    except T1Error as exc:
        print(f"actors: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
