"""For tests of ``cluster up``: ``cluster_up`` starts it so that nothing outlives the test, and what its
command line hands the learner: its argv (``learner serve --config FILE.toml``), and that argv resolved by
``learner serve`` into its settings."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def cluster_up(
    run_dir: Path, args: Sequence[str], *, env: dict, stop_timeout_s: float = 60.0, **popen: Any
) -> Iterator[subprocess.Popen]:
    """``python -m t1async.cluster up --run-dir RUN_DIR ARGS`` in a session (process group) of its own; ``popen``
    goes to Popen (stdout, stderr, text). However the block ends (an assertion, pytest-timeout's signal raising
    in the test), ``stop_cluster`` runs. ARGS without a ``--preset`` get ``--preset none`` (``bare``)."""
    proc = subprocess.Popen(up_argv(run_dir, *args), env=env, start_new_session=True, **popen)
    try:
        yield proc
    finally:
        stop_cluster(proc, run_dir, stop_timeout_s)


def up_argv(run_dir: Path | str, *args: str) -> list[str]:
    """``python -m t1async.cluster up --run-dir RUN_DIR ARGS``, ``bare``."""
    return [sys.executable, "-m", "t1async.cluster", "up", "--run-dir", str(run_dir), *bare(args)]


# a small synthetic cluster: the end-to-end tests' shared shape (6 turns a step from 2 actors x 2 episodes of at
# most 6 turns, 32 new tokens a turn, 20 synthetic tasks); the test adds what it is about
SMALL = (
    *("--batch-turns", "6", "--actors", "2", "--concurrency", "2"),
    *("--max-turns", "6", "--max-new-tokens", "32", "--synth-tasks", "20"),
)


def bare(args: Sequence[str]) -> list[str]:
    """``cluster up`` ARGS, with ``--preset none`` unless they name a preset: the plumbing tests run the bare
    shipped model, not the ``quickstart`` warm start a bare ``cluster up`` builds on first use (minutes)."""
    return (
        list(args) if any(a == "--preset" or a.startswith("--preset=") for a in args) else [*args, "--preset", "none"]
    )


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def stop_cluster(proc: subprocess.Popen, run_dir: Path, timeout_s: float = 60.0) -> None:
    """Stop a ``cluster_up`` process: SIGTERM to its process group (the supervisor stops its components),
    SIGKILL to the group after ``timeout_s``, then stop by PID whatever it recorded in cluster.json and left
    (``reap_stale``; its components run in sessions of their own and die with it anyway, design §9)."""
    from t1async.cluster.state import reap_stale

    if proc.poll() is None:
        _killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _killpg(proc.pid, signal.SIGKILL)  # whatever is left in its group (a one-shot job before NATS)
    reap_stale(run_dir, timeout=5.0)


def learner_argv(run_dir: Path, *argv: str) -> list[str]:
    """The learner component's argv for ``cluster up --run-dir run_dir *argv`` (it writes the TOML file)."""
    from t1async.cluster import components
    from t1async.cluster.config import from_args
    from t1async.cluster.flags import add_up_arguments

    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", default=str(run_dir))
    add_up_arguments(p)
    cfg = from_args(p.parse_args(bare(argv)))
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
