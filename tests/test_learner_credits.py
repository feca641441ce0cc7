"""The learner's t1.credit server over the in-memory transport: retries are idempotent, turn-less requests
each get their own credit, and η = 0 holds grants while a step trains.

Every test runs on trio's MockClock with autojump (``autojump_clock``): virtual time moves only when every task
is blocked, so "wait 0.2 s, then assert nothing was granted" means "once nothing more can happen without time
passing, nothing was granted", with no wall-clock wait and no race with a slow machine."""

from __future__ import annotations

import anyio

from t1async.credits.client import CREDIT_SUBJECT
from t1async.credits.ledger import CreditGate, CreditLedger
from t1async.credits.server import CreditServer
from t1async.protocol.wire import CreditGrant, CreditRequest
from t1async.transport import MemoryBroker, MemoryTransport
from t1async.transport.base import RequestTimeoutError


async def _with_server(eta: int, body, batch_turns: int = 4) -> None:
    broker = MemoryBroker()
    async with MemoryTransport(broker) as lt, MemoryTransport(broker) as at, anyio.create_task_group() as tg:
        server = CreditServer(CreditGate(CreditLedger(eta, batch_turns, 30.0)), lt)
        await tg.start(server.serve)
        await body(server, at)
        tg.cancel_scope.cancel()


async def test_a_retried_request_gets_the_same_grant_and_turnless_requests_each_get_one(autojump_clock):
    async def body(server: CreditServer, t: MemoryTransport) -> None:
        a = await t.request(CREDIT_SUBJECT, CreditRequest("x", "ep", 1, 0), timeout=5)
        b = await t.request(CREDIT_SUBJECT, CreditRequest("x", "ep", 1, 0), timeout=5)
        assert isinstance(a, CreditGrant) and a.grant_id == b.grant_id
        c = await t.request(CREDIT_SUBJECT, CreditRequest("x", "ep2", 1), timeout=5)
        d = await t.request(CREDIT_SUBJECT, CreditRequest("x", "ep2", 1), timeout=5)
        assert c.grant_id != d.grant_id
        assert server.gate.ledger.running == 3

    await _with_server(1, body)


async def test_eta0_holds_grants_while_a_step_trains(autojump_clock):
    async def body(server: CreditServer, t: MemoryTransport) -> None:
        server.set_training(True)
        try:
            await t.request(CREDIT_SUBJECT, CreditRequest("x", "ep", 1, 0), timeout=0.5)
            raise AssertionError("a credit was granted while an eta=0 step trained")
        except RequestTimeoutError:
            pass
        server.set_training(False)
        g = await t.request(CREDIT_SUBJECT, CreditRequest("x", "ep", 1, 0), timeout=5)
        assert isinstance(g, CreditGrant) and g.granted == 1

    await _with_server(0, body)


async def test_held_turnless_requests_of_one_episode_each_get_their_own_grant(autojump_clock):
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
            assert len(grants) == 1, "capacity for one more: one of the two is granted, the other still held"
            server.gate.on_version(2)
        assert len({g.grant_id for g in grants}) == 2

    await _with_server(0, body, batch_turns=1)


async def test_a_released_actors_held_request_is_never_granted(autojump_clock):
    """A dead actor's request still held when it is released must not turn into a credit later: that credit
    would sit unused until its lease ends, holding the training order (η = 0) for minutes."""

    async def body(server: CreditServer, t: MemoryTransport) -> None:
        await t.request(CREDIT_SUBJECT, CreditRequest("live", "l1", 1, 0), timeout=5)  # capacity 1 used
        seen: list[str] = []
        server.on_actor = seen.append

        async def dead_asks() -> None:
            with anyio.move_on_after(3):
                await t.request(CREDIT_SUBJECT, CreditRequest("dead", "d1", 1, 0), timeout=10)
                raise AssertionError("the released actor's held request was granted")

        async with anyio.create_task_group() as tg:
            tg.start_soon(dead_asks)
            await anyio.sleep(0.3)
            assert seen == ["dead"]  # a request is a sign of life
            server.gate.release_actor("dead")
            server.forget(actor="dead")
            server.gate.on_delivered("l1", 0)
            server.gate.on_version(1)  # capacity for one more
            await anyio.sleep(0.3)
            assert server.gate.ledger.running == 0, "a credit was granted to the released actor"
            g = await t.request(CREDIT_SUBJECT, CreditRequest("live", "l1", 1, 1), timeout=5)
            assert isinstance(g, CreditGrant) and server.gate.ledger.running == 1

    await _with_server(0, body, batch_turns=1)


async def test_a_held_request_waits_for_the_release_not_on_a_lease_already_past_due(mock_clock):
    """η = 0 holds grants while a step trains. A lease that ran out meanwhile (nothing expires it while no grant
    is tried) must not wake the held request over and over: that loop spun the CPU for the whole step, and on
    a MockClock it never lets time move again (the property test's η = 0 scenarios hung in it)."""
    gate = CreditGate(CreditLedger(0, 1, 30.0))
    await gate.acquire("a", "e1", 1, 0)  # capacity 1, used; its lease runs out 30 s from now
    gate.hold(True)
    mock_clock.jump(31.0)  # past due, not expired yet
    wakes = 0
    next_expiry = gate.ledger.next_expiry

    def counted() -> float | None:
        nonlocal wakes
        wakes += 1
        return next_expiry()

    gate.ledger.next_expiry = counted  # type: ignore[method-assign]
    grants: list = []

    async def ask() -> None:
        grants.append(await gate.acquire("b", "e2", 1, 0))

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask)
        for _ in range(50):
            await anyio.lowlevel.checkpoint()
        assert grants == [] and wakes <= 1, f"the held request woke {wakes} times with no change"
        gate.hold(False)  # the step ended: the expired lease's capacity goes to the held request
    assert len(grants) == 1 and gate.ledger.stats.expired == 1
