"""Conformance checks for any Transport (trio's ``check_two_way_stream`` habit): the durable stream, core
subjects, request/reply, dead letters and the lifecycle, as one suite that every implementation passes.

    from t1async.testing import check_transport, memory_harness

    await check_transport(memory_harness)          # MemoryTransport
    await check_transport(nats_harness(tmp_dir))   # NatsTransport, a real nats-server per check
    await check_transport(my_harness)              # yours: an async context manager giving a fresh harness

A harness (``TransportHarness``, in harness.py) opens transports to one fresh broker (``open()``, not yet
entered) and puts raw bytes on a subject past the codec (``inject()``), as a misbehaving client would. Each
check gets a fresh harness: the checks reuse episode ids and durable names. A failed check raises
AssertionError that names it. The tests run every check against MemoryTransport and NatsTransport on a real
nats-server.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import msgpack

from t1async.protocol import wire
from t1async.testing.asserts import raises
from t1async.testing.harness import (
    TransportHarness,
    end,
    start,
    turn,
)
from t1async.transport.base import (
    NoRespondersError,
    RequestTimeoutError,
    Transport,
    TransportClosedError,
    traj_subject,
)

__all__ = [
    "TRANSPORT_CHECKS",
    "assert_nothing_pending",
    "check_transport",
    "take",
]


Check = Callable[[TransportHarness], Awaitable[None]]


async def check_transport(
    fresh: Callable[[], AbstractAsyncContextManager[TransportHarness]], *, checks: Iterable[Check] | None = None
) -> None:
    """Run ``checks`` (default: all of TRANSPORT_CHECKS), each against a fresh harness from ``fresh()``."""
    for check in TRANSPORT_CHECKS if checks is None else checks:
        async with fresh() as h:
            try:
                await check(h)
            except AssertionError as exc:
                raise AssertionError(f"transport check {check.__name__} failed: {exc}") from exc


# ------------------------------------------------------------------------------------------ helpers


async def take(t: Transport, n: int, *, durable: str = "learner", ack: bool = True, timeout: float = 10.0) -> list:
    """Consume until ``n`` deliveries arrived (acking each batch unless ack=False)."""
    out: list = []
    with anyio.fail_after(timeout):
        async with t.consume(durable, batch=64, max_wait_s=0.2) as batches:
            async for batch in batches:
                out.extend(batch)
                if ack:
                    await batch.ack()
                if len(out) >= n:
                    break
    return out


async def assert_nothing_pending(t: Transport, durable: str = "learner") -> None:
    """The next delivery of ``durable`` is a fresh sentinel: nothing older is left unacknowledged."""
    await t.publish(traj_subject("sentinel"), start("sentinel"))
    got = await take(t, 1, durable=durable)
    assert [d.msg_id for d in got] == ["sentinel/0"], [d.msg_id for d in got]


# ------------------------------------------------------------------------------------------ durable stream


async def published_records_reach_a_durable_consumer_in_order(h: TransportHarness) -> None:
    recs: list[wire.Record] = [start("ep-a"), turn("ep-a", 0), turn("ep-a", 1), end("ep-a", 2)]
    async with h.open() as pub, h.open() as sub:
        for r in recs:
            await pub.publish(traj_subject("ep-a"), r)
        got = await take(sub, 4)
    assert [d.msg_id for d in got] == ["ep-a/0", "ep-a/1", "ep-a/2", "ep-a/end"], [d.msg_id for d in got]
    assert all(d.subject == "t1.traj.ep-a" and d.num_delivered == 1 for d in got)
    for sent, d in zip(recs, got):
        assert wire.records_equal(sent, d.record), (sent, d.record)
    assert len({d.stream_seq for d in got}) == 4


async def a_retried_publish_is_stored_once(h: TransportHarness) -> None:
    async with h.open() as t:
        await t.publish(traj_subject("ep-b"), turn("ep-b", 0, reward=1.0), msg_id="ep-b/1")
        await t.publish(traj_subject("ep-b"), turn("ep-b", 0, reward=2.0), msg_id="ep-b/1")  # the retry
        await t.publish(traj_subject("ep-b"), turn("ep-b", 1))
        got = await take(t, 2)
        assert [d.msg_id for d in got] == ["ep-b/1", "ep-b/2"], [d.msg_id for d in got]
        assert got[0].record.reward == 1.0
        await assert_nothing_pending(t)


async def unacked_records_are_redelivered_to_a_reopened_consumer(h: TransportHarness) -> None:
    async with h.open() as t:
        for k in range(3):
            await t.publish(traj_subject("ep-c"), turn("ep-c", k))
        first = await take(t, 3, ack=False)
        again = await take(t, 3)  # a "restarted learner": same durable, new consume()
        assert [d.msg_id for d in again] == [d.msg_id for d in first] == ["ep-c/1", "ep-c/2", "ep-c/3"]
        assert all(d.num_delivered >= 2 for d in again)
        await assert_nothing_pending(t)


async def acknowledged_records_are_not_redelivered_and_durables_are_independent(h: TransportHarness) -> None:
    async with h.open() as t:
        for k in range(3):
            await t.publish(traj_subject("ep-d"), turn("ep-d", k))
        assert len(await take(t, 3, durable="one")) == 3
        assert [d.msg_id for d in await take(t, 3, durable="two")] == ["ep-d/1", "ep-d/2", "ep-d/3"]
        await assert_nothing_pending(t, "one")


async def nak_redelivers_the_batch(h: TransportHarness) -> None:
    async with h.open() as t:
        await t.publish(traj_subject("ep-e"), turn("ep-e", 0))
        seen = []
        with anyio.fail_after(10):
            async with t.consume("learner", max_wait_s=0.2) as batches:
                async for batch in batches:
                    seen.append([d.msg_id for d in batch])
                    if len(seen) == 1:
                        await batch.nak()
                    else:
                        await batch.ack()
                        break
        assert seen == [["ep-e/1"], ["ep-e/1"]], seen
        await assert_nothing_pending(t)


async def an_expired_ack_wait_does_not_hand_over_a_held_record_twice(h: TransportHarness) -> None:
    async with h.open() as t:
        await t.publish(traj_subject("ep-f"), turn("ep-f", 0))
        with anyio.fail_after(15):
            async with t.consume("learner", max_wait_s=0.2) as batches:
                it = batches.__aiter__()
                held = await it.__anext__()
                await t.publish(traj_subject("ep-f"), turn("ep-f", 1))
                await anyio.sleep(1.5)  # > ack_wait: the server redelivers ep-f/1, which we still hold
                nxt = await it.__anext__()
                assert [d.msg_id for d in nxt] == ["ep-f/2"], [d.msg_id for d in nxt]
                await held.ack()
                await nxt.ack()
        assert t.stats.redelivered_skipped >= 1
        await assert_nothing_pending(t)


GARBAGE = [
    (b"\xc1not msgpack", "msgpack"),
    (msgpack.packb({"v": 1, "kind": "turn"}), "missing"),
    (msgpack.packb({"v": 7, "kind": "turn"}), "version"),
]


async def malformed_records_are_dead_lettered_and_the_consumer_goes_on(h: TransportHarness) -> None:
    async with h.open() as t, t.subscribe("t1.dead.>", include_malformed=True) as dead:
        for k, (garbage, reason) in enumerate(GARBAGE):
            await h.inject("t1.traj.bad", garbage)
            await t.publish(traj_subject(f"ep-g{k}"), start(f"ep-g{k}"))
            got = await take(t, 1)
            assert [d.msg_id for d in got] == [f"ep-g{k}/0"], [d.msg_id for d in got]
            assert t.stats.dead[reason] == 1, dict(t.stats.dead)
            with anyio.fail_after(5):
                letter = await dead.__anext__()
            assert letter.subject == f"t1.dead.{reason}" and letter.data == garbage, (letter.subject, letter.data)
            assert letter.headers["T1-Dead-Subject"] == "t1.traj.bad" and letter.headers["T1-Dead-Reason"] == reason
            assert letter.headers["T1-Dead-Error"]
        await assert_nothing_pending(t)  # the garbage was settled, not left to be redelivered


# ------------------------------------------------------------------------------------------ core subjects


async def subscribers_see_live_records_on_core_and_stream_subjects(h: TransportHarness) -> None:
    async with h.open() as pub, h.open() as sub:
        async with sub.subscribe("t1.metrics.*") as metrics, sub.subscribe("t1.traj.>") as traj:
            await pub.publish("t1.policy", wire.PolicyRecord(3, 30, "/ckpt/3"))  # nobody listens: dropped
            await pub.publish("t1.metrics.learner", wire.MetricsRecord("learner", 5, 3, {"loss": 0.5}))
            await pub.publish(traj_subject("ep-h"), turn("ep-h", 0))
            with anyio.fail_after(5):
                m = await metrics.__anext__()
                tr = await traj.__anext__()
    assert m.subject == "t1.metrics.learner" and m.error is None and m.record is not None
    assert isinstance(m.record, wire.MetricsRecord) and m.record.values == {"loss": 0.5}, m.record
    assert tr.subject == "t1.traj.ep-h" and tr.record is not None and wire.records_equal(tr.record, turn("ep-h", 0))


async def malformed_core_messages_are_dead_lettered_or_shown(h: TransportHarness) -> None:
    async with h.open() as t:
        async with t.subscribe("t1.policy") as policy, t.subscribe("t1.policy", include_malformed=True) as raw:
            await h.inject("t1.policy", b"\x00\x01")
            await t.publish("t1.policy", wire.PolicyRecord(4, 40, "/ckpt/4"))
            with anyio.fail_after(5):
                p = await policy.__anext__()
                bad = await raw.__anext__()
                good = await raw.__anext__()
        assert isinstance(p.record, wire.PolicyRecord) and p.record.policy_version == 4  # the garbage was skipped
        assert (
            bad.record is None and bad.error is not None and bad.error.reason == "msgpack" and bad.data == b"\x00\x01"
        )
        assert isinstance(good.record, wire.PolicyRecord) and good.record.policy_version == 4
        assert t.stats.dead["msgpack"] == 1, dict(t.stats.dead)


async def request_reply_with_a_held_reply(h: TransportHarness) -> None:
    async with h.open() as learner, h.open() as actor:
        async with learner.serve("t1.credit") as requests, anyio.create_task_group() as tg:

            async def grant_later() -> None:
                async for req in requests:
                    await anyio.sleep(0.5)  # backpressure: hold the reply
                    assert isinstance(req.record, wire.CreditRequest)
                    await req.respond(wire.CreditGrant(req.record.n, 7, 30.0, f"g-{req.record.episode}"))

            tg.start_soon(grant_later)
            t0 = time.monotonic()
            reply = await actor.request("t1.credit", wire.CreditRequest("a0", "ep-i", 2), timeout=5)
            assert time.monotonic() - t0 >= 0.45  # the reply came when it was sent, not before
            assert isinstance(reply, wire.CreditGrant) and reply.granted == 2 and reply.grant_id == "g-ep-i", reply
            tg.cancel_scope.cancel()


async def request_timeout_and_no_responders(h: TransportHarness) -> None:
    async with h.open() as learner, h.open() as actor:
        with raises(NoRespondersError, match="t1.credit"):
            await actor.request("t1.credit", wire.CreditRequest("a0", "ep-j"), timeout=1)
        async with learner.serve("t1.credit") as requests, anyio.create_task_group() as tg:
            held: list[Any] = []

            async def never_answer() -> None:
                async for req in requests:
                    held.append(req)

            tg.start_soon(never_answer)
            t0 = time.monotonic()
            with raises(RequestTimeoutError, match="retry"):
                await actor.request("t1.credit", wire.CreditRequest("a0", "ep-j"), timeout=0.3)
            assert time.monotonic() - t0 > 0.25  # it waited for its timeout
            assert len(held) == 1
            await held[0].respond(wire.CreditGrant(1, 1, 1.0, "late"))  # the requester is gone: harmless
            tg.cancel_scope.cancel()


async def a_malformed_request_is_dead_lettered_and_serving_goes_on(h: TransportHarness) -> None:
    async with h.open() as learner, h.open() as actor:
        async with learner.serve("t1.credit") as requests, anyio.create_task_group() as tg:

            async def serve() -> None:
                async for req in requests:
                    await req.respond(wire.CreditGrant(1, 0, 1.0, "ok"))

            tg.start_soon(serve)
            await h.inject("t1.credit", b"\xc1")
            reply = await actor.request("t1.credit", wire.CreditRequest("a0", "ep-k"), timeout=5)
            assert isinstance(reply, wire.CreditGrant) and reply.grant_id == "ok", reply
            assert learner.stats.dead["msgpack"] == 1, dict(learner.stats.dead)
            tg.cancel_scope.cancel()


async def use_after_close_fails_loudly(h: TransportHarness) -> None:
    t = h.open()
    async with t:
        await t.publish("t1.policy", wire.PolicyRecord(1, 1, "w"))
    with raises(TransportClosedError):
        await t.publish(traj_subject("ep-l"), start("ep-l"))
    with raises(TransportClosedError):
        await t.request("t1.credit", wire.CreditRequest("a", "ep-l"), timeout=1)
    with raises(TransportClosedError):
        async with t.subscribe("t1.policy"):
            pass
    with raises(TransportClosedError):
        async with t.consume("learner"):
            pass


TRANSPORT_CHECKS: tuple[Check, ...] = (
    published_records_reach_a_durable_consumer_in_order,
    a_retried_publish_is_stored_once,
    unacked_records_are_redelivered_to_a_reopened_consumer,
    acknowledged_records_are_not_redelivered_and_durables_are_independent,
    nak_redelivers_the_batch,
    an_expired_ack_wait_does_not_hand_over_a_held_record_twice,
    malformed_records_are_dead_lettered_and_the_consumer_goes_on,
    subscribers_see_live_records_on_core_and_stream_subjects,
    malformed_core_messages_are_dead_lettered_or_shown,
    request_reply_with_a_held_reply,
    request_timeout_and_no_responders,
    a_malformed_request_is_dead_lettered_and_serving_goes_on,
    use_after_close_fails_loudly,
)
