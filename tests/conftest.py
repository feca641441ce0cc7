"""Shared pytest fixtures. Each block is owned by the engineer named in its header; add yours as a new block."""

from __future__ import annotations

import pytest
import structlog

# ---------------------------------------------------------------- logging (owner: lead)


@pytest.fixture(autouse=True)
def _structlog_config_restored():
    """Each test leaves structlog as it found it. A test that runs a bench's ``main()`` in-process configures
    it at WARNING (``t1async.log.configure``: a filtering logger), and a later test's ``capture_logs`` then saw
    no info event (tests/test_learner_checkpoint_every.py failed in the full suite, passed alone)."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


# ---------------------------------------------------------------- sampler fixtures (owner: sampler/server)


@pytest.fixture(scope="session")
def sampler_url():
    """URL of a real embedded sampler (tiny model, fp32, seed 0), one process for the whole session.

    Started with ``python -m t1async.sampler serve --port 0``; stopped by PID (SIGTERM, then SIGKILL) when
    the session ends, also on failure. Tests must not change its weights: start your own with
    ``t1async.sampler.launch.launch_sampler`` for that.
    """
    from t1async.sampler.launch import SamplerProcess

    proc = SamplerProcess(max_batch=64)
    try:
        yield proc.start()
    finally:
        proc.stop()


# ---------------------------------------------------------------- end of sampler fixtures


# ---------------------------------------------------------------- NATS fixtures (owner: transport/natsd/cluster)


@pytest.fixture
async def nats_server(tmp_path):
    """A real nats-server with JetStream on a free loopback port and a fresh store under tmp_path.

    Stopped by PID (SIGTERM, then SIGKILL) when the test ends, also on failure. ``srv.kill()`` and
    ``srv.restart()`` crash it and bring it back on the same port and store.
    """
    from t1async.transport.natsd import NatsServer

    async with NatsServer.start(tmp_path / "nats") as srv:
        yield srv


@pytest.fixture
def repo_env():
    """Environment for subprocesses that run ``python -m t1async...`` from the repo (package not installed)."""
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "T1_LOG_JSON": "1"}


@pytest.fixture
def nats_raw_publish():
    """``await pub(url, subject, data, headers=None)``: publish raw bytes over a bare TCP connection speaking the
    NATS protocol (PUB/HPUB), as a misbehaving client would (t1async.testing.harness.raw_publish)."""
    from t1async.testing.harness import raw_publish

    return raw_publish


# ---------------------------------------------------------------- end of NATS fixtures


# ---------------------------------------------------------------- fixtures shared by several test files (owner: tests)
# (moved here from the test files that defined them: a test file imports no other test file)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A seeded tiny MoE model dir (t1async.testing.models.tiny_model_dir), one per test module. Files that need
    another size define their own ``tiny_model``, which takes precedence."""
    from t1async.testing.models import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def ranks2():
    """``(ranks, holder)``: two real learner ranks (rank 0 this process, rank 1 a ``python -m
    t1async.learner.ranks`` child); put the trainer in ``holder["trainer"]`` and it is closed with them. The
    test ends with no rank process left, and rank 1 exited 0 (or with ``holder["exit_codes"]``, for a test
    that kills it)."""
    from t1async.learner.ranks import Ranks, RanksConfig

    ranks = Ranks(RanksConfig(nproc=2, stop_timeout_s=10))
    holder: dict = {}
    yield ranks, holder
    procs = list(ranks.procs)
    ranks.close(holder.get("trainer"))
    assert all(p.poll() is not None for p in procs)
    if procs:  # the rank exits as it was told (an abort in the interpreter's teardown is -6: ranks.leave)
        assert ranks.exit_codes == holder.get("exit_codes", [0]), ranks.exit_codes


@pytest.fixture(scope="module")
def base_image() -> str:
    """The container backend's base image (built once with podman and cached); fails naming the fix when podman
    is missing."""
    from sandbox_agent.images import build as images

    if not images.podman_available():
        pytest.fail(f"podman is missing: {images.INSTALL_HINT} (then `python -m sandbox_agent images build-base`)")
    return images.build_base()  # cached: returns at once when it exists


# ---------------------------------------------------------------- end of shared fixtures
