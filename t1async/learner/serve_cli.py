"""``python -m t1async.learner serve``: the learner service as a process (see learner/service.py)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from t1async.config import add_arguments, code_only, like, resolve, setting
from t1async.learner.distributed import RankFailedError
from t1async.learner.settings import LearnerConfig
from t1async.protocol.errors import ConfigError
from t1async.sampler.settings import Engine, EngineSettings, SamplerKeys
from t1async.signals import cancel_on_stop
from t1async.transport.auth import NatsClientSettings

PauseMode = Literal["retract", "in_place", "abort", "wait"]


@dataclass(frozen=True)
class ServeConfig(LearnerConfig):
    """``learner serve``'s settings: the learner's (``LearnerConfig``) and the process's wiring; ``--config
    FILE.toml`` (what ``cluster up`` writes) and/or flags."""

    nats: str | None = setting(None, "NATS URL (default: $T1_NATS_URL)", metavar="URL", group="learner service")
    nats_creds: Path | None = like(NatsClientSettings, "nats_creds", group="learner service")
    sampler_url: tuple[str, ...] = setting(
        (),
        "a sampler to push weights to (repeatable; none: train without pushing)",
        metavar="URL",
        group="learner service",
    )
    sampler_api_key: str | None = like(SamplerKeys, "sampler_api_key", group="learner service")
    sampler_admin_key: str | None = like(SamplerKeys, "sampler_admin_key", group="learner service")
    engine: Engine = like(EngineSettings, "engine", group="learner service")
    microbatch_tokens: int = setting(
        65536,
        "padded tokens per forward (a step that fits in one micro-batch needs one forward instead of two)",
        ge=2,
        group="learner",
    )
    threads: int = setting(1, "torch CPU threads (per rank)", ge=1, group="learner service")
    weight_sync_host: str = setting(
        "127.0.0.1", "address the samplers reach this learner's weight-update group at", group="learner service"
    )
    pause_mode: PauseMode = setting(
        "retract",
        "what /pause_generation does to the samplers' running requests around each weight push (both "
        "--weight-sync paths): retract (recomputed with the new weights, none aborted, no mixed policies), "
        "in_place (frozen, then new weights over old KV), abort, or wait (vLLM only: running requests finish "
        "first)",
        group="learner service",
    )
    stream_replicas: int = setting(
        0,
        "create T1_TRAJ and T1_DEAD with R replicas, or scale them to R (a NATS cluster of >= R nodes; default "
        "0: leave them as they are, a missing one is made with 1)",
        ge=0,
        le=5,
        group="learner service",
    )
    nproc: int = setting(
        1,
        "ranks of the learner, the model sharded over them by FSDP2 (learner/distributed.py): with N > 1 this "
        "process starts N ranks with torchrun's launcher; rank 0 is the service (stream, credits, checkpoints, "
        "weight push), ranks 1..N-1 train with it over torch.distributed (gloo on CPU); under an outside "
        "torchrun (several hosts) the world is torchrun's and this flag is left out",
        ge=1,
        group="learner service",
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "serve",
        help="run the learner service: consume trajectories, serve credits, train, push weights",
        description="Consume T1_TRAJ through the durable consumer, assemble episodes with TITO and routing, "
        "serve t1.credit by the staleness rule, train PPO steps with R3, save checkpoints under "
        "<run-dir>/checkpoints, push each version to every --sampler-url and announce it on t1.policy. "
        "Restarted on the same --run-dir it resumes from its newest checkpoint and journal. Settings come from "
        "--config FILE.toml (keys named as the flags; cluster up writes one) and flags, flags winning.",
    )
    add_arguments(s, ServeConfig)
    s.set_defaults(func=serve)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The settings: defaults < --config FILE.toml < flags; NATS from $T1_NATS_URL when neither gives it."""
    cfg: ServeConfig = resolve(ServeConfig, args, exclude=code_only(ServeConfig))
    if cfg.run_dir is None:
        raise ConfigError("no run dir: pass --run-dir DIR (or run_dir in the --config file)")
    if not cfg.nats:
        env = os.environ.get("T1_NATS_URL")
        if not env:
            raise ConfigError("no NATS: pass --nats nats://HOST:PORT or set T1_NATS_URL")
        cfg = resolve(ServeConfig, args, exclude=code_only(ServeConfig), nats=env)
    return cfg


def serve(args: argparse.Namespace) -> int:
    c = config_from_args(args)  # a wrong setting fails before the heavy imports
    assert c.run_dir is not None and c.nats is not None
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ  # ranks.in_torchrun(), before torch
    world = int(os.environ.get("WORLD_SIZE", "1")) if torchrun else 1
    if torchrun and c.nproc > 1 and c.nproc != world:
        raise ConfigError(
            f"--nproc {c.nproc} but torchrun started {world} ranks (WORLD_SIZE): under torchrun leave --nproc out"
        )
    if c.nproc > 1 or world > 1:  # ours (--nproc N), or an outside torchrun's (several hosts: design §10)
        from t1async.learner import ranks

        if not ranks.in_torchrun():  # the launcher: start the N ranks, each this command again
            if "serve" not in sys.argv:
                raise ConfigError("--nproc > 1 runs from the command line: python -m t1async.learner serve ...")
            argv = sys.argv[sys.argv.index("serve") + 1 :]
            return ranks.launch(argv, ranks.RanksConfig(nproc=c.nproc, threads=max(1, c.threads)))
        backend = "nccl" if c.device == "cuda" else "gloo"  # FSDP2's collectives on GPUs (untested: no GPU here)
        if int(os.environ["RANK"]) > 0:  # ranks 1..N-1 follow rank 0's commands
            ranks.follower_setup(c.threads)
            ranks.join(backend=backend)
            return ranks.follow()
        ranks.die_with_parent(signal.SIGTERM)  # rank 0: stop in order if the launcher goes
        ranks.join(backend=backend)
        try:
            return _serve(c)
        except RankFailedError as exc:  # another rank went first: the launcher names it in one line
            from t1async.log import get_logger

            get_logger("t1async.learner").error("learner.rank_failed", rank=0, error=str(exc))
            return ranks.PEER_FAILED
    return _serve(c)


def _serve(c: ServeConfig) -> int:
    """The learner service (rank 0 of N when the process group is up)."""
    if c.engine == "vllm":  # vLLM serves Hugging Face formats only
        c = dataclasses.replace(c, hf_format="MixtralForCausalLM")
    assert c.run_dir is not None and c.nats is not None
    import anyio
    import torch
    import torch.distributed as dist

    from t1async.learner import malloc
    from t1async.learner.service import Learner
    from t1async.learner.weightpush import DiskPushClient
    from t1async.sampler.client import SGLangClient
    from t1async.transport import NatsConfig, NatsTransport

    torch.set_num_threads(max(1, c.threads))
    malloc.bound_malloc()  # freed tensors go back to the kernel: a flat RSS between steps (learner/malloc.py)
    distributed = dist.is_initialized()
    nats_url = c.nats

    async def main() -> None:
        async with AsyncExitStack() as stack:
            # the learner acks a batch as soon as its journal has it (milliseconds), so a short ack wait only
            # shortens how long a crashed learner's in-flight records wait before they are redelivered
            nats = NatsConfig(
                url=nats_url, ack_wait_s=10.0, stream_replicas=c.stream_replicas or None, creds=c.nats_creds
            )
            transport = await stack.enter_async_context(NatsTransport(config=nats))
            samplers: SGLangClient | None = None
            if c.sampler_url and c.engine == "vllm":  # pause, reload, version, resume (sampler/vllm_client.py)
                from t1async.sampler.engines import sampler_client

                samplers = await stack.enter_async_context(
                    sampler_client(
                        "vllm", c.sampler_url, model_dir=c.model, pause_mode=c.pause_mode, api_key=c.sampler_api_key
                    )
                )
            elif c.sampler_url:  # the disk push runs between /pause_generation and /continue_generation
                samplers = await stack.enter_async_context(
                    DiskPushClient(
                        c.sampler_url,
                        pause_mode=c.pause_mode,
                        api_key=c.sampler_api_key,
                        admin_key=c.sampler_admin_key,
                    )
                )
            if distributed:  # the other ranks stop first at exit (the stack unwinds in reverse)
                stack.push_async_callback(_stop_ranks, learner_box)
            learner = Learner(c, transport, samplers, make_trainer=_make_trainer if distributed else None)
            learner_box.append(learner)
            if c.weight_sync == "distributed":
                from t1async.learner.weightpush import DistributedPusher, WeightPushConfig

                if samplers is None:
                    raise ConfigError("--weight-sync distributed needs at least one --sampler-url")
                if c.engine == "vllm":  # vLLM's own NCCL transfer (sampler/vllm_nccl.py: UNTESTED, GPU only)
                    from t1async.sampler.vllm_nccl import VLLMNcclPusher
                    from t1async.transport.natsd import free_port

                    if len(c.sampler_url) != 1:
                        raise ConfigError("--engine vllm --weight-sync distributed pushes to one --sampler-url")
                    learner.weight_pusher = VLLMNcclPusher(
                        c.sampler_url[0], host=c.weight_sync_host, port=free_port(), pause_mode=c.pause_mode
                    )
                else:
                    learner.weight_pusher = DistributedPusher(
                        samplers,
                        WeightPushConfig(
                            bucket_mb=c.weight_bucket_mb, host=c.weight_sync_host, pause_mode=c.pause_mode
                        ),
                    )
                stack.push_async_callback(learner.weight_pusher.aclose)
            async with anyio.create_task_group() as tg:
                await tg.start(cancel_on_stop, tg.cancel_scope)
                await learner.run()
                tg.cancel_scope.cancel()

    learner_box: list = []
    try:
        anyio.run(main, backend=os.environ.get("T1_BACKEND", "trio"))
    except BaseExceptionGroup as group:  # a task group wrapped our one error (a failed push check): say it plainly
        from t1async.protocol.errors import T1Error

        mine, _ = group.split(T1Error)
        while isinstance(mine, BaseExceptionGroup) and len(mine.exceptions) == 1:
            mine = mine.exceptions[0]  # type: ignore[assignment]
        if isinstance(mine, T1Error):
            raise mine from None
        raise
    return 0


def _make_trainer(model_dir, config):  # noqa: ANN001, ANN202 - Learner's make_trainer, typed there
    from t1async.learner.ranks import make_trainer

    return make_trainer(model_dir, config)


async def _stop_ranks(learner_box: list) -> None:
    """Rank 0 at exit: the ``stop`` command to ranks 1..N-1 (when the group still stands), then leave it."""
    import anyio
    import torch.distributed as dist

    from t1async.learner.distributed import DistributedTrainer, RankFailedError

    def stop() -> None:
        trainer = learner_box[0].trainer if learner_box else None
        try:
            if isinstance(trainer, DistributedTrainer):
                trainer.stop_ranks()
        except RankFailedError as exc:
            from t1async.log import get_logger

            get_logger("t1async.learner").warning("learner.ranks_stop_failed", error=str(exc))
        finally:
            dist.destroy_process_group()

    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(stop)
