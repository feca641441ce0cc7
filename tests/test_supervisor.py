"""The supervisor's account of a component that stopped the run: what it says must be what happened."""

from __future__ import annotations

import sys

import anyio

from t1async.cluster.supervisor import ClusterConfig, ProcessSpec, Supervisor


async def test_a_configuration_error_is_not_restarted_and_the_line_says_so(tmp_path):
    """Exit 2 (a configuration error, e.g. a failed push check) is not restarted. The line used to say
    "restarted 5 times in 600 s already" about a learner restarted zero times."""
    script = "import sys; print('error: the sampler does not serve the weights pushed as v18'); sys.exit(2)"
    learner = ProcessSpec("learner", (sys.executable, "-c", script), restart=True)
    sup = Supervisor(ClusterConfig(run_dir=tmp_path, nats_url="nats://127.0.0.1:1", components=(learner,)))
    with anyio.fail_after(60):
        assert await sup.run() != 0
    assert sup.failed is not None
    assert "exited with code 2 (a configuration error: not restarted)" in sup.failed, sup.failed
    assert "restarted 5 times" not in sup.failed
    assert sup.failed.endswith(": error: the sampler does not serve the weights pushed as v18"), sup.failed
    assert not sup._restarts["learner"]
