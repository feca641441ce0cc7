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

from actors.settings import ActorSettings
from sandbox_agent.agent.types import AgentConfig
from t1async.config import add_arguments, resolve


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m actors",
        description="Run one rollout actor: concurrent sandboxed shell episodes that sample token-in from "
        "SGLang-compatible samplers and stream every turn to the learner over NATS JetStream. Settings come "
        "from --config FILE.toml (keys named as the flags; cluster up writes one) and flags, flags winning.",
    )
    add_arguments(p, ActorSettings)
    return p


def settings(args: argparse.Namespace, p: argparse.ArgumentParser) -> ActorSettings:
    """The settings (defaults < --config FILE.toml < flags), checked; a bad one exits with a usage error."""
    from t1async.protocol.errors import ConfigError

    try:
        cfg: ActorSettings = resolve(ActorSettings, args)
    except ConfigError as exc:
        p.error(str(exc))
    if not cfg.nats and os.environ.get("T1_NATS_URL"):
        cfg = replace(cfg, nats=os.environ["T1_NATS_URL"])
    if not cfg.actor_id:
        cfg = replace(cfg, actor_id=f"{socket.gethostname().split('.')[0]}-{os.getpid()}")
    if not cfg.nats:
        p.error(
            "no NATS: pass --nats nats://HOST:PORT or set T1_NATS_URL (a local cluster: python -m t1async.cluster up)"
        )
    if not cfg.sampler_url:
        p.error("no sampler: pass --sampler-url http://HOST:PORT (start one: python -m t1async.sampler serve)")
    if cfg.tasks is None:
        p.error("no tasks: pass --tasks DIR (make one: python -m sandbox_agent synth --out DIR)")
    if any(c in cfg.actor_id for c in ".*> "):
        p.error(f"--actor-id {cfg.actor_id!r} may not contain '.', '*', '>' or spaces (it names NATS subjects)")
    return cfg


def agent_config(args: ActorSettings, stop_token_ids: tuple[int, ...]) -> AgentConfig:
    """How each of this actor's episodes runs (its ``EpisodeOptions``, the system prompt file read)."""
    from sandbox_agent.agent.context import ContextConfig
    from t1async.protocol.errors import T1Error
    from t1async.protocol.sampling import SamplingParams

    agent = AgentConfig(
        max_turns=args.max_turns,
        max_context_tokens=args.max_context,
        verify_every=args.verify_every,
        reward=args.reward,
        command_timeout_s=args.command_timeout,
        context=ContextConfig(policy=args.context_policy, keep_last=args.context_keep_turns),
        sampling=SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop_token_ids=stop_token_ids
        ),
    )
    if args.system_prompt_file is not None:
        if not args.system_prompt_file.is_file():
            raise T1Error(f"--system-prompt-file {args.system_prompt_file}: no such file")
        agent = replace(agent, system_prompt=args.system_prompt_file.read_text())
    return agent


async def amain(args: ActorSettings) -> int:
    import anyio

    from actors.actor import run_actor
    from t1async.log import get_logger
    from t1async.model.tokenizer import ChatTokenizer
    from t1async.sampler.engines import sampler_client
    from t1async.signals import cancel_on_stop
    from t1async.transport import NatsConfig, NatsTransport

    log = get_logger("actors")
    assert args.nats and args.tasks is not None  # settings() made sure
    tokenizer = ChatTokenizer.load(args.model)
    agent = agent_config(args, tuple(tokenizer.eos_ids))
    async with (
        NatsTransport(config=NatsConfig(url=args.nats, creds=args.nats_creds)) as transport,
        sampler_client(args.engine, args.sampler_url, model_dir=args.model, api_key=args.sampler_api_key) as sampler,
    ):
        stats = None
        async with anyio.create_task_group() as tg:
            # SIGTERM (the supervisor, `cluster down`) cancels the episodes: their sandboxes and work dirs go
            await tg.start(cancel_on_stop, tg.cancel_scope)
            if len(args.sampler_url) > 1:  # take a dead sampler out, and back when healthy at the current weights
                tg.start_soon(sampler.monitor)
            stats = await run_actor(args, transport=transport, sampler=sampler, tokenizer=tokenizer, agent=agent)
            tg.cancel_scope.cancel()
    if stats is None:  # stopped by a signal
        log.info("actors.stopped", actor=args.actor_id)
        return 0
    log.info("actors.exit", episodes=stats.done, turns=stats.turns)
    return 0


def main(argv: list[str] | None = None) -> int:
    import anyio

    from t1async.log import configure
    from t1async.protocol.errors import T1Error

    p = build_parser()
    args = settings(p.parse_args(argv), p)
    if args.model is not None:  # (here, not in settings(): cluster up's warm start writes it later)
        from t1async.model.modeldir import check_model_dir
        from t1async.protocol.errors import ConfigError

        try:
            check_model_dir(args.model, "--model", weights=False)  # only its tokenizer and chat template are read
        except ConfigError as exc:
            p.error(str(exc))
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
