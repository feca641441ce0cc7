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
