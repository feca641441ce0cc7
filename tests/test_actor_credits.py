"""The actor's credit client: waits a held reply out and keeps the waits it felt (count, mean, p50/p99, max)
for its metrics record.

On trio's MockClock (``mock_clock``: time moves only when the test jumps it), so each wait is known exactly:
no wall clock, no latency bound. How long credit waits are in a real run is bench.staleness's figure
(``credit_wait_mean_s``, ``credit_wait_p99_s``, ``credit_wait_max_s``, ``credit_wait_share``)."""

from __future__ import annotations

import anyio
import pytest

from t1async.credits.client import CREDIT_SUBJECT, CreditClient
from t1async.protocol.wire import CreditGrant
from t1async.transport.memory import MemoryTransport

HELD_S = 0.3


async def test_credit_waits_are_counted_with_the_held_time(mock_clock):
    async with MemoryTransport() as t:
        held, release = anyio.Event(), anyio.Event()

        async def learner(*, task_status=anyio.TASK_STATUS_IGNORED):
            async with t.serve(CREDIT_SUBJECT) as requests:
                task_status.started()
                n = 0
                async for req in requests:
                    n += 1
                    if n == 3:  # the third request is held until the test releases it (backpressure)
                        held.set()
                        await release.wait()
                    await req.respond(CreditGrant(1, 0, 30.0, f"g{n}"))

        client = CreditClient(t, "a0")
        assert client.wait_stats()["credit_waits"] == 0 and client.wait_stats()["credit_wait_p99_s"] == 0.0
        async with anyio.create_task_group() as tg:
            await tg.start(learner)
            await client.acquire("e", 0)
            await client.acquire("e", 1)

            async def let_go():
                await held.wait()  # the learner holds the third request: HELD_S pass, then it is granted
                mock_clock.jump(HELD_S)
                release.set()

            tg.start_soon(let_go)
            g = await client.acquire("e", 2)
            assert release.is_set() and g.grant_id == "g3", "the held request returned before it was granted"
            tg.cancel_scope.cancel()
    s = client.wait_stats()
    assert s["credit_waits"] == 3
    # the two granted at once waited no time at all; the held one waited exactly as long as it was held
    assert s["credit_wait_max_s"] == pytest.approx(HELD_S) and s["credit_wait_p99_s"] == s["credit_wait_max_s"]
    assert s["credit_wait_p50_s"] == 0.0
    assert s["credit_wait_s"] == pytest.approx(HELD_S)
    assert s["credit_wait_s"] == pytest.approx(3 * s["credit_wait_mean_s"])
