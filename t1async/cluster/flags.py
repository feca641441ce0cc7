"""``cluster up``'s flags: one per ``UpConfig`` setting, generated from its fields (``t1async/config.py``), in
groups, each "not given" by default so that a value from ``--config FILE.toml`` (or a preset) stands unless a
flag overrides it; ``config.from_args`` merges them."""

from __future__ import annotations

import argparse

from t1async.cluster.config import ACTORS, EVAL, LEARNER, LIFETIME, NATS, SAMPLERS, UpConfig
from t1async.config import add_arguments

__all__ = ["add_up_arguments"]


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    """``--config``, ``--preset`` and a flag for every setting but ``--run-dir`` (a flag of every subcommand)."""
    from t1async.recipes.presets import CHOICES

    add_arguments(p, UpConfig, exclude=("run_dir", "durable"), order=(NATS, SAMPLERS, ACTORS, LEARNER, EVAL, LIFETIME))
    p.add_argument(
        "--preset",
        default=None,
        choices=CHOICES,
        help="start from a named recipe's settings (then the TOML file, then flags); quickstart: RL raising a "
        "weak warm start's reward within minutes (touch4 tasks); learn: the warm-started policy on chores "
        "(bench.learning's); none: the shipped model from its random init (default: quickstart, unless the run "
        "names its own --model, --sampler-url, --tasks or warm start: then none). A recipe's warm start is built "
        "on first use (5-10 min on 2 cores) and cached",
    )
