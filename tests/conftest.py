"""Shared pytest fixtures. Each block is owned by the engineer named in its header; add yours as a new block."""

from __future__ import annotations

import pytest

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
