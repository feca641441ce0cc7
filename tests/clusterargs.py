"""What a ``cluster up`` command line hands the learner: its argv (``learner serve --config FILE.toml``), and
that argv resolved by ``learner serve`` into its settings."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def learner_argv(run_dir: Path, *argv: str) -> list[str]:
    """The learner component's argv for ``cluster up --run-dir run_dir *argv`` (it writes the TOML file)."""
    from t1async.cluster import components
    from t1async.cluster.config import from_args
    from t1async.cluster.flags import add_up_arguments

    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", default=str(run_dir))
    add_up_arguments(p)
    cfg = from_args(p.parse_args(list(argv)))
    return next(list(s.argv) for s in components.specs(cfg, "nats://127.0.0.1:1") if s.name == "learner")


def learner_toml(argv: list[str]) -> dict[str, Any]:
    """The TOML file a learner argv from ``learner_argv`` names, as read."""
    import tomllib

    return tomllib.loads(Path(argv[argv.index("--config") + 1]).read_text())


def serve_args(argv: list[str]) -> Any:
    """``learner serve``'s settings (``ServeConfig``) from a learner argv from ``learner_argv``."""
    from t1async.learner import serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_parser(p.add_subparsers())
    return serve_cli.config_from_args(p.parse_args(argv[argv.index("serve") :]))
