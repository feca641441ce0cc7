"""The learner's t1.credit server over the in-memory transport: retries are idempotent, turn-less requests
each get their own credit, and η = 0 holds grants while a step trains."""

from __future__ import annotations

import anyio

from t1async.learner.credits import CREDIT_SUBJECT, CreditServer
from t1async.staleness import CreditGate, CreditLedger
from t1async.transport import MemoryBroker, MemoryTransport
from t1async.transport.base import RequestTimeout
from t1async.wire import CreditGrant, CreditRequest


async def _with_server(eta: int, body, batch_turns: int = 4) -> None:
    broker = MemoryBroker()
    async with MemoryTransport(broker) as lt, MemoryTransport(broker) as at, anyio.create_task_group() as tg:
        server = CreditServer(CreditGate(CreditLedger(eta, batch_turns, 30.0)), lt)
        await tg.start(server.serve)
        await body(server, at)
        tg.cancel_scope.cancel()


async def test_a_retried_request_gets_the_same_grant_and_turnless_requests_each_get_one():
    async def body(server: CreditServer, t: MemoryTransport) -> None:
        a = await t.request(CREDIT_SUBJECT, CreditRequest("x", "ep", 1, 0), timeout=5)
        b = await t.request(CREDIT_SUBJECT, CreditRequest("x", "ep", 1, 0), timeout=5)
        assert isinstance(a, CreditGrant) and a.grant_id == b.grant_id
        c = await t.request(CREDIT_SUBJECT, CreditRequest("x", "ep2", 1), timeout=5)
        d = await t.request(CREDIT_SUBJECT, CreditRequest("x", "ep2", 1), timeout=5)
        assert c.grant_id != d.grant_id
        assert server.gate.ledger.running == 3

    await _with_server(1, body)


async def test_eta0_holds_grants_while_a_step_trains():
    async def body(server: CreditServer, t: MemoryTransport) -> None:
        server.set_training(True)
        try:
            await t.request(CREDIT_SUBJECT, CreditRequest("x", "ep", 1, 0), timeout=0.5)
            raise AssertionError("a credit was granted while an eta=0 step trained")
        except RequestTimeout:
            pass
        server.set_training(False)
        g = await t.request(CREDIT_SUBJECT, CreditRequest("x", "ep", 1, 0), timeout=5)
        assert isinstance(g, CreditGrant) and g.granted == 1

    await _with_server(0, body)


async def test_held_turnless_requests_of_one_episode_each_get_their_own_grant():
    async def body(server: CreditServer, t: MemoryTransport) -> None:
        await t.request(CREDIT_SUBJECT, CreditRequest("x", "ep", 1, 0), timeout=5)  # capacity (0+0+1)*1 used
        grants: list = []

        async def ask() -> None:
            grants.append(await t.request(CREDIT_SUBJECT, CreditRequest("x", "ep2", 1), timeout=10))

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            tg.start_soon(ask)
            await anyio.sleep(0.2)
            assert grants == [], "both are held: no capacity"
            server.gate.on_delivered("ep", 0)
            server.gate.on_version(1)
            await anyio.sleep(0.2)
            server.gate.on_version(2)
        assert len({g.grant_id for g in grants}) == 2

    await _with_server(0, body, batch_turns=1)
