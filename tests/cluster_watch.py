"""Watching a running ``cluster up`` from a test: wait until its run dir says running (``wait_running``), read
a child's output until a needle shows (``read_until``), and check the turns it published for one episode
(``check_episode_turns``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import anyio
import numpy as np

from t1async.cluster.state import ClusterState
from t1async.protocol import wire


def check_episode_turns(turns: list[wire.TurnRecord]) -> None:
    """TITO and routing fields as design §3 defines them, for one episode's turns in order."""
    seq_len = 0
    covered = 0
    for i, t in enumerate(sorted(turns, key=lambda t: t.turn)):
        assert t.turn == i
        assert t.input_len == t.keep + len(t.input_delta)
        assert t.keep == seq_len, "the token-in actor's boundaries are CLEAN"
        assert len(t.output_logprobs) == len(t.output_ids) and np.all(t.output_logprobs <= 0)
        r = t.routing
        # a route fork (design §6): after a weight update flushed the sampler's prefix cache, it re-routed the
        # context and sent the routes it used from an earlier start; otherwise the traces tile exactly
        fork = r is not None and i > 0 and r.start < covered
        assert r is not None and (r.start == covered or fork), "traces leave no gap, and overlap only on a route fork"
        assert r.experts.shape[0] == t.input_len + len(t.output_ids) - 1 - r.start
        assert fork or r.start == (0 if i == 0 else t.keep - 1)
        covered = r.start + r.experts.shape[0]
        seq_len = t.input_len + len(t.output_ids)


async def wait_running(run_dir: Path, proc: subprocess.Popen, timeout: float = 120) -> ClusterState:
    with anyio.fail_after(timeout):
        while True:
            assert proc.poll() is None, f"cluster up exited early with {proc.returncode}"
            try:
                st = ClusterState.load(run_dir)
                if st.status == "running" and st.nats_url:
                    return st
            except Exception:
                pass
            await anyio.sleep(0.2)


async def read_until(stream, buf: bytearray, needle: bytes, timeout: float = 20.0) -> None:
    with anyio.fail_after(timeout):
        while needle not in buf:
            buf.extend(await stream.receive())
