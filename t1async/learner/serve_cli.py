"""``python -m t1async.learner serve``: the learner service as a process (see learner/service.py)."""

from __future__ import annotations

import argparse
import os
from contextlib import AsyncExitStack
from pathlib import Path

import anyio

from t1async.learner.options import ADVANTAGES, CRITICS
from t1async.protocol.errors import ConfigError
from t1async.signals import cancel_on_stop


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "serve",
        help="run the learner service: consume trajectories, serve credits, train, push weights",
        description="Consume T1_TRAJ through the durable consumer, assemble episodes with TITO and routing, "
        "serve t1.credit by the staleness rule, train PPO steps with R3, save checkpoints under "
        "<run-dir>/checkpoints, push each version to every --sampler-url and announce it on t1.policy. "
        "Restarted on the same --run-dir it resumes from its newest checkpoint and journal.",
    )
    s.add_argument("--nats", default=os.environ.get("T1_NATS_URL"), help="NATS URL (default: $T1_NATS_URL)")
    s.add_argument(
        "--sampler-url",
        action="append",
        default=[],
        metavar="URL",
        help="a sampler to push weights to (repeatable; none: train without pushing)",
    )
    s.add_argument("--run-dir", type=Path, required=True, help="where checkpoints, journal and state live")
    s.add_argument("--model", type=Path, default=None, help="initial model dir (default: the shipped tiny model)")
    s.add_argument(
        "--max-staleness",
        type=int,
        default=1,
        help="η: max policy versions between sampling and training a token (default 1; 0 = synchronous)",
    )
    s.add_argument("--batch-turns", type=int, default=16, help="B: turns per training step (default 16)")
    s.add_argument("--steps", type=int, default=0, help="exit after this many steps (default 0: never)")
    s.add_argument("--lease", type=float, default=180.0, help="seconds an unused credit is held (default 180)")
    s.add_argument(
        "--actor-timeout",
        type=float,
        default=15.0,
        help="seconds an actor may go without a heartbeat "
        "before its credits are released and its open episodes end as aborted (default 15)",
    )
    s.add_argument("--lr", type=float, default=1e-4, help="learning rate (default 1e-4)")
    s.add_argument(
        "--advantage",
        choices=ADVANTAGES,
        default="gae",
        help="gae: critic-based GAE over the episode; turn: each turn's own reward minus the step's mean reward of "
        "turns with the same number, no critic (default gae)",
    )
    s.add_argument(
        "--value-lr",
        type=float,
        default=None,
        help="the value head's own learning rate (default: --lr; a fresh head needs more, e.g. 100x)",
    )
    s.add_argument("--no-replay", action="store_true", help="disable R3 routing replay in the training forward")
    s.add_argument(
        "--critic",
        choices=CRITICS,
        default="shared",
        help="shared: the value loss "
        "trains the trunk with the policy; detached: it trains the value head only, whose gradient is "
        "clipped on its own (default shared)",
    )
    s.add_argument(
        "--microbatch-tokens",
        type=int,
        default=65536,
        help="padded tokens per forward (default 65536; "
        "a step that fits in one micro-batch needs one forward instead of two)",
    )
    s.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    s.add_argument(
        "--wandb",
        action="store_true",
        help="also log the per-step curves to Weights & Biases "
        "(needs wandb; WANDB_MODE=offline works); TensorBoard files are always in <run-dir>/tb/learner",
    )
    s.add_argument(
        "--weight-sync",
        choices=["disk", "distributed"],
        default="disk",
        help="how each version reaches the samplers: disk (/update_weights_from_disk of the checkpoint, "
        "default) or distributed (SGLang's /update_weights_from_distributed over a torch.distributed "
        "group this learner hosts, in buckets between /pause_generation and /continue_generation)",
    )
    s.add_argument(
        "--weight-bucket-mb",
        type=float,
        default=64.0,
        help="MiB of tensors per /update_weights_from_distributed call with --weight-sync distributed (default 64)",
    )
    s.add_argument(
        "--weight-sync-host",
        default="127.0.0.1",
        help="address the samplers reach this learner's weight-update group at (default 127.0.0.1)",
    )
    s.add_argument("--durable", default="learner", help="JetStream durable consumer name (default learner)")
    s.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="ranks of the data-parallel learner (default 1): this "
        "process is rank 0 (stream, credits, checkpoints, weight push) and starts ranks 1..N-1 over "
        "torch.distributed, gloo on CPU, NCCL on GPU (learner/distributed.py); --threads is per rank",
    )
    s.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    import torch

    from t1async.learner import memory
    from t1async.learner.distributed import RankFailedError
    from t1async.learner.service import Learner, LearnerConfig
    from t1async.learner.trainer_config import TrainerConfig
    from t1async.sampler.client import SGLangClient
    from t1async.transport import NatsConfig, NatsTransport

    if not args.nats:
        raise ConfigError("no NATS: pass --nats nats://HOST:PORT or set T1_NATS_URL")
    if args.batch_turns < 1:
        raise ConfigError(f"--batch-turns must be >= 1, got {args.batch_turns}")
    if not args.actor_timeout > 0:
        raise ConfigError(f"--actor-timeout must be > 0 seconds, got {args.actor_timeout}")
    if args.max_staleness < 0 or args.steps < 0:
        raise ConfigError("--max-staleness and --steps must be >= 0")
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    if not args.weight_bucket_mb > 0:
        raise ConfigError(f"--weight-bucket-mb must be > 0, got {args.weight_bucket_mb}")
    torch.set_num_threads(max(1, args.threads))
    memory.bound_malloc()  # freed tensors go back to the kernel: a flat RSS between steps (learner/memory.py)
    cfg = LearnerConfig(
        run_dir=args.run_dir,
        model_dir=args.model,
        max_staleness=args.max_staleness,
        batch_turns=args.batch_turns,
        steps=args.steps,
        lease_s=args.lease,
        actor_timeout_s=args.actor_timeout,
        durable=args.durable,
        wandb=args.wandb,
        trainer=TrainerConfig(
            lr=args.lr,
            value_lr=args.value_lr,
            advantage=args.advantage,
            replay=not args.no_replay,
            critic=args.critic,
            microbatch_tokens=args.microbatch_tokens,
        ),
    )

    async def main() -> None:
        async with AsyncExitStack() as stack:
            # the learner acks a batch as soon as its journal has it (milliseconds), so a short ack wait only
            # shortens how long a crashed learner's in-flight records wait before they are redelivered
            nats = NatsConfig(url=args.nats, ack_wait_s=10.0)
            transport = await stack.enter_async_context(NatsTransport(config=nats))
            samplers = await stack.enter_async_context(SGLangClient(args.sampler_url)) if args.sampler_url else None
            learner = Learner(cfg, transport, samplers)
            if args.weight_sync == "distributed":
                from t1async.learner.weightpush import DistributedPusher, WeightPushConfig

                if samplers is None:
                    raise ConfigError("--weight-sync distributed needs at least one --sampler-url")
                learner.weight_pusher = DistributedPusher(
                    samplers, WeightPushConfig(bucket_mb=args.weight_bucket_mb, host=args.weight_sync_host)
                )
                stack.push_async_callback(learner.weight_pusher.aclose)
            ranks = None
            if args.nproc > 1:  # the ranks stop first at exit (the stack unwinds in reverse), by PID
                from t1async.learner.ranks import Ranks, RanksConfig

                ranks = Ranks(RanksConfig(nproc=args.nproc, threads=max(1, args.threads)))

                async def close_ranks() -> None:
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(ranks.close, learner.trainer)

                stack.push_async_callback(close_ranks)
                learner.trainer = await anyio.to_thread.run_sync(ranks.start, learner.trainer)
            async with anyio.create_task_group() as tg:
                if ranks is not None:
                    tg.start_soon(ranks.watch)  # a rank that exits stops the learner (RankFailedError)
                tg.start_soon(cancel_on_stop, tg.cancel_scope)
                await learner.run()
                tg.cancel_scope.cancel()

    try:
        anyio.run(main, backend=os.environ.get("T1_BACKEND", "trio"))
    except BaseExceptionGroup as eg:  # a rank's failure reads as one line (RankFailedError is a T1Error)
        failed: BaseException | None = eg.subgroup(RankFailedError)
        while isinstance(failed, BaseExceptionGroup):
            failed = failed.exceptions[0]
        if failed is not None:
            raise failed from eg
        raise
    return 0
