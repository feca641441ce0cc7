"""The actor's credit client: waits a held reply out and keeps the waits it felt (count, mean, p50/p99, max)
for its metrics record."""

from __future__ import annotations

import anyio
import pytest

from t1async.credits.client import CREDIT_SUBJECT, CreditClient
from t1async.protocol.wire import CreditGrant
from t1async.transport.memory import MemoryTransport


async def test_credit_waits_are_counted_with_the_held_time():
    async with MemoryTransport() as t:
        release = anyio.Event()

        async def learner(*, task_status=anyio.TASK_STATUS_IGNORED):
            async with t.serve(CREDIT_SUBJECT) as requests:
                task_status.started()
                n = 0
                async for req in requests:
                    n += 1
                    if n == 3:  # the third request is held until the test releases it (backpressure)
                        await release.wait()
                    await req.respond(CreditGrant(1, 0, 30.0, f"g{n}"))

        client = CreditClient(t, "a0")
        assert client.wait_stats()["credit_waits"] == 0 and client.wait_stats()["credit_wait_p99_s"] == 0.0
        async with anyio.create_task_group() as tg:
            await tg.start(learner)
            await client.acquire("e", 0)
            await client.acquire("e", 1)

            async def let_go():
                await anyio.sleep(0.3)
                release.set()

            tg.start_soon(let_go)
            await client.acquire("e", 2)
            tg.cancel_scope.cancel()
    s = client.wait_stats()
    assert s["credit_waits"] == 3
    assert s["credit_wait_max_s"] >= 0.3  # the held request waited at least as long as it was held
    assert s["credit_wait_p99_s"] == s["credit_wait_max_s"] and s["credit_wait_p50_s"] < 0.3
    assert s["credit_wait_s"] == pytest.approx(3 * s["credit_wait_mean_s"])
