"""``cluster up``'s flags: one per UpConfig setting, in groups, each defaulting to None so that a value from
``--config FILE.toml`` (or a preset) stands unless a flag overrides it; ``config.from_args`` merges them."""

from __future__ import annotations

import argparse
from pathlib import Path

from sandbox_agent.context import POLICIES
from t1async.cluster.config import UpConfig
from t1async.learner.options import ADVANTAGES, CRITICS

__all__ = ["add_up_arguments"]


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    """Flags for every setting; defaults are None so a TOML file's value stands unless a flag overrides it."""
    d = UpConfig()
    p.add_argument(
        "--config", type=Path, default=None, metavar="FILE.toml", help="read settings from a TOML file (flags win)"
    )
    from t1async.recipes.presets import PRESETS

    p.add_argument(
        "--preset",
        default=None,
        choices=tuple(PRESETS),
        help="start from a named recipe's settings "
        "(then the TOML file, then flags); learn: the warm-started policy on the learnable families",
    )
    g = p.add_argument_group("NATS")
    g.add_argument(
        "--nats",
        default=None,
        metavar="URL",
        help="use this NATS (e.g. nats://a:4222,nats://b:4222) instead of starting one",
    )
    g.add_argument("--nats-port", type=int, default=None, help="port of the embedded nats-server (default: a free one)")
    g.add_argument(
        "--nats-nodes",
        type=int,
        default=None,
        metavar="N",
        help="start an embedded JetStream cluster of N nats-server nodes (default 1; 3 survives losing one node)",
    )
    g.add_argument(
        "--stream-replicas",
        type=int,
        default=None,
        metavar="R",
        help="replicas of the T1_TRAJ stream: "
        "created with R, or scaled to R (default: min(--nats-nodes, 3); with --nats, the stream as it is)",
    )
    g.add_argument(
        "--max-payload",
        type=int,
        default=None,
        metavar="BYTES",
        help="max_payload of the embedded nats-server (default 8 MiB)",
    )
    g = p.add_argument_group("samplers")
    g.add_argument(
        "--sampler-url",
        action="append",
        default=None,
        metavar="URL",
        help="an SGLang server to sample from (repeatable); none: start the embedded sampler",
    )
    g.add_argument(
        "--samplers",
        type=int,
        default=None,
        metavar="N",
        help="start N embedded samplers (default 1); episodes are pinned to one, a dead one is restarted and re-synced",
    )
    g.add_argument("--model", type=Path, default=None, help="model directory (default: the shipped tiny MoE)")
    g.add_argument(
        "--sampler-dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help=f"embedded sampler precision (default {d.sampler_dtype})",
    )
    g.add_argument(
        "--sampler-max-batch", type=int, default=None, help=f"embedded sampler batch (default {d.sampler_max_batch})"
    )
    g.add_argument(
        "--sampler-cpus",
        default=None,
        metavar="LIST",
        help="pin the embedded samplers to these CPUs (taskset list, e.g. 0; default: any)",
    )
    g.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=None,
        help=f"embedded sampler prefix cache (default {d.prefix_cache_tokens})",
    )
    g.add_argument(
        "--warm-start-steps",
        type=int,
        default=None,
        help="first fine-tune on oracle demonstrations for N steps (default 0: no)",
    )
    g.add_argument(
        "--warm-start",
        default=None,
        metavar="RECIPE",
        help="policy = this warm-start recipe's cached "
        "model (built first if missing; python -m t1async.recipes.warmstart)",
    )
    g = p.add_argument_group("actors")
    g.add_argument(
        "--tasks", type=Path, default=None, help="task directory (default: synthesize a corpus into <run-dir>/tasks)"
    )
    g.add_argument(
        "--synth-tasks",
        type=int,
        default=None,
        help=f"tasks to synthesize when --tasks is not given (default {d.synth_tasks})",
    )
    g.add_argument(
        "--synth-families", default=None, metavar="A,B", help="families to synthesize (default: the 11 default ones)"
    )
    g.add_argument("--actors", type=int, default=None, help=f"actor processes (default {d.actors})")
    g.add_argument(
        "--concurrency", type=int, default=None, help=f"episodes per actor at once (default {d.concurrency})"
    )
    g.add_argument("--max-turns", type=int, default=None, help=f"turns per episode at most (default {d.max_turns})")
    g.add_argument(
        "--max-new-tokens", type=int, default=None, help=f"tokens per turn at most (default {d.max_new_tokens})"
    )
    g.add_argument(
        "--max-context", type=int, default=None, help=f"context budget per episode (default {d.max_context})"
    )
    g.add_argument(
        "--context-policy",
        default=None,
        choices=tuple(POLICIES),
        help="when an episode's history would "
        f"not fit --max-context: compact it, or stop the episode (default {d.context_policy})",
    )
    g.add_argument(
        "--context-keep-turns",
        type=int,
        default=None,
        metavar="K",
        help=f"turns truncate-observations keeps whole (default {d.context_keep_turns})",
    )
    g.add_argument("--temperature", type=float, default=None, help=f"sampling temperature (default {d.temperature})")
    g.add_argument(
        "--verify-every",
        type=int,
        default=None,
        help="verify every N turns for dense per-turn rewards (default 0: at the end)",
    )
    g = p.add_argument_group("learner")
    g.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help=f"η, in policy versions (default {d.max_staleness}; 0 = synchronous)",
    )
    g.add_argument(
        "--batch-turns", type=int, default=None, help=f"B, turns per training step (default {d.batch_turns})"
    )
    g.add_argument("--lr", type=float, default=None, help=f"learning rate (default {d.lr})")
    g.add_argument("--lease", type=float, default=None, help=f"seconds an unused credit is held (default {d.lease})")
    g.add_argument(
        "--actor-timeout",
        type=float,
        default=None,
        help="seconds an actor may go without a heartbeat "
        f"before the learner releases its credits and aborts its episodes (default {d.actor_timeout:g})",
    )
    g.add_argument(
        "--advantage",
        choices=ADVANTAGES,
        default=None,
        help="gae: critic-based GAE; turn: each turn's reward minus the step's mean for its turn number (default gae)",
    )
    g.add_argument(
        "--value-lr",
        type=float,
        default=None,
        help="the value head's own learning rate (default: --lr)",
    )
    g.add_argument("--no-replay", action="store_const", const=True, default=None, help="disable R3 routing replay")
    g.add_argument(
        "--critic",
        choices=CRITICS,
        default=None,
        help="shared: the value loss trains "
        "the trunk too; detached: the value head only, clipped on its own (default shared)",
    )
    g.add_argument(
        "--weight-sync",
        default=None,
        choices=("disk", "distributed"),
        help="how each version reaches "
        "the samplers: /update_weights_from_disk, or SGLang's /update_weights_from_distributed over a "
        f"gloo group (default {d.weight_sync})",
    )
    g.add_argument(
        "--weight-bucket-mb",
        type=float,
        default=None,
        help="MiB per /update_weights_from_distributed "
        f"with --weight-sync distributed (default {d.weight_bucket_mb:g})",
    )
    g.add_argument(
        "--learner-cpus",
        default=None,
        metavar="LIST",
        help="pin the learner to these CPUs (taskset list, e.g. 1; default: any)",
    )
    g.add_argument(
        "--learner-procs",
        type=int,
        default=None,
        metavar="N",
        help="ranks of the data-parallel "
        f"learner over torch.distributed, gloo on CPU (learner serve --nproc; default {d.learner_procs})",
    )
    g.add_argument(
        "--wandb",
        action="store_const",
        const=True,
        default=None,
        help="also log the learner's curves to Weights & Biases (needs wandb; WANDB_MODE=offline works)",
    )
    g = p.add_argument_group("eval in the loop")
    g.add_argument(
        "--eval-every",
        type=int,
        default=None,
        metavar="N",
        help="score the held-out split (the tasks' "
        "eval split) every N policy versions, and the starting policy first (default 0: off)",
    )
    g.add_argument(
        "--eval-samples",
        type=int,
        default=None,
        metavar="K",
        help=f"episodes per held-out task (default {d.eval_samples})",
    )
    g = p.add_argument_group("lifetime")
    g.add_argument("--duration", type=float, default=None, metavar="SECONDS", help="stop after this many seconds")
    g.add_argument("--steps", type=int, default=None, help="stop after the learner trained this many steps")
    g.add_argument("--seed", type=int, default=None, help="seed for the task corpus and actors (default 0)")
