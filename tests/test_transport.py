"""Transport conformance: one suite, run against MemoryTransport and NatsTransport (a real nats-server).

Plus the pure chunking functions. NATS-only behaviour (64 MB records, server crash and restart, raw
nats-py readers, asyncio backend) is in test_transport_nats.py.
"""

from __future__ import annotations

import random
import time

import anyio
import msgpack
import numpy as np
import pytest

from t1async import wire
from t1async.errors import TransportError
from t1async.natsd import NatsServer
from t1async.transport import (
    MemoryBroker, MemoryTransport, NatsConfig, NatsTransport, NoResponders, RequestTimeout, TransportClosedError,
    default_msg_id, subject_matches, traj_subject,
)  # fmt: skip
from t1async.transport import chunking


def turn(ep: str, k: int, *, reward: float = 0.0, n_out: int = 3) -> wire.TurnRecord:
    delta = np.arange(4, dtype=np.int32) + k
    keep = 10 * k
    return wire.TurnRecord(
        episode=ep, turn=k, policy_version=1, keep=keep, input_delta=delta, input_len=keep + 4,
        input_digest=wire.digest_ids(delta), output_ids=np.arange(n_out, dtype=np.int32) + 100,
        output_logprobs=np.full(n_out, -0.5, np.float32), finish=wire.Finish.STOP,
        routing=wire.Routing(max(keep - 1, 0), np.ones((keep + 4 + n_out - 1 - max(keep - 1, 0), 2, 2), np.uint8)),
        reward=reward, tests_passed=-1, t_sample_s=0.1, t_exec_s=0.2, action="ls", observation="out",
    )  # fmt: skip


def start(ep: str) -> wire.StartRecord:
    return wire.StartRecord(ep, "actor-0", "task-a", 50, 1.0)


def end(ep: str, turns: int) -> wire.EndRecord:
    return wire.EndRecord(ep, turns, wire.EndReason.SOLVED, 3, 3, True)


class MemoryHarness:
    def __init__(self) -> None:
        self.broker = MemoryBroker(ack_wait_s=1.0)

    def open(self) -> MemoryTransport:
        return MemoryTransport(self.broker)

    async def inject(self, subject: str, data: bytes) -> None:
        await self.broker.inject(subject, data)


class NatsHarness:
    def __init__(self, url: str, raw_publish) -> None:
        self.url, self._raw = url, raw_publish

    def open(self) -> NatsTransport:
        return NatsTransport(config=NatsConfig(url=self.url, ack_wait_s=1.0))

    async def inject(self, subject: str, data: bytes) -> None:
        await self._raw(self.url, subject, data)


@pytest.fixture(params=["memory", "nats"])
async def harness(request, tmp_path, nats_raw_publish):
    if request.param == "memory":
        yield MemoryHarness()
    else:
        async with NatsServer.start(tmp_path / "nats") as srv:
            yield NatsHarness(srv.url, nats_raw_publish)


async def take(t, n: int, *, durable: str = "learner", ack: bool = True, timeout: float = 10.0) -> list:
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


async def assert_nothing_pending(t, durable: str = "learner") -> None:
    """The next delivery of ``durable`` is a fresh sentinel: nothing older is left unacknowledged."""
    await t.publish(traj_subject("sentinel"), start("sentinel"))
    got = await take(t, 1, durable=durable)
    assert [d.msg_id for d in got] == ["sentinel/0"], [d.msg_id for d in got]


# ------------------------------------------------------------------------------------------ durable stream


async def test_published_records_reach_a_durable_consumer_in_order(harness):
    recs = [start("ep-a"), turn("ep-a", 0), turn("ep-a", 1), end("ep-a", 2)]
    async with harness.open() as pub, harness.open() as sub:
        for r in recs:
            await pub.publish(traj_subject("ep-a"), r)
        got = await take(sub, 4)
    assert [d.msg_id for d in got] == ["ep-a/0", "ep-a/1", "ep-a/2", "ep-a/end"]
    assert all(d.subject == "t1.traj.ep-a" and d.num_delivered == 1 for d in got)
    for sent, d in zip(recs, got):
        assert wire.records_equal(sent, d.record), (sent, d.record)
    assert len({d.stream_seq for d in got}) == 4


async def test_a_retried_publish_is_stored_once(harness):
    async with harness.open() as t:
        await t.publish(traj_subject("ep-b"), turn("ep-b", 0, reward=1.0), msg_id="ep-b/1")
        await t.publish(traj_subject("ep-b"), turn("ep-b", 0, reward=2.0), msg_id="ep-b/1")  # the retry
        await t.publish(traj_subject("ep-b"), turn("ep-b", 1))
        got = await take(t, 2)
        assert [d.msg_id for d in got] == ["ep-b/1", "ep-b/2"]
        assert got[0].record.reward == 1.0
        await assert_nothing_pending(t)


async def test_unacked_records_are_redelivered_to_a_reopened_consumer(harness):
    async with harness.open() as t:
        for k in range(3):
            await t.publish(traj_subject("ep-c"), turn("ep-c", k))
        first = await take(t, 3, ack=False)
        again = await take(t, 3)  # a "restarted learner": same durable, new consume()
        assert [d.msg_id for d in again] == [d.msg_id for d in first] == ["ep-c/1", "ep-c/2", "ep-c/3"]
        assert all(d.num_delivered >= 2 for d in again)
        await assert_nothing_pending(t)


async def test_acknowledged_records_are_not_redelivered_and_durables_are_independent(harness):
    async with harness.open() as t:
        for k in range(3):
            await t.publish(traj_subject("ep-d"), turn("ep-d", k))
        assert len(await take(t, 3, durable="one")) == 3
        assert [d.msg_id for d in await take(t, 3, durable="two")] == ["ep-d/1", "ep-d/2", "ep-d/3"]
        await assert_nothing_pending(t, "one")


async def test_nak_redelivers_the_batch(harness):
    async with harness.open() as t:
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
        assert seen == [["ep-e/1"], ["ep-e/1"]]
        await assert_nothing_pending(t)


async def test_an_expired_ack_wait_does_not_hand_over_a_held_record_twice(harness):
    async with harness.open() as t:
        await t.publish(traj_subject("ep-f"), turn("ep-f", 0))
        with anyio.fail_after(15):
            async with t.consume("learner", max_wait_s=0.2) as batches:
                it = batches.__aiter__()
                held = await it.__anext__()
                await t.publish(traj_subject("ep-f"), turn("ep-f", 1))
                await anyio.sleep(1.5)  # > ack_wait: the server redelivers ep-f/1, which we still hold
                nxt = await it.__anext__()
                assert [d.msg_id for d in nxt] == ["ep-f/2"]
                await held.ack()
                await nxt.ack()
        assert t.stats.redelivered_skipped >= 1
        await assert_nothing_pending(t)


@pytest.mark.parametrize(
    ("garbage", "reason"),
    [(b"\xc1not msgpack", "msgpack"), (msgpack.packb({"v": 1, "kind": "turn"}), "missing"),
     (msgpack.packb({"v": 7, "kind": "turn"}), "version")],
)  # fmt: skip
async def test_malformed_records_are_dead_lettered_and_the_consumer_goes_on(harness, garbage, reason):
    async with harness.open() as t, t.subscribe("t1.dead.>", include_malformed=True) as dead:
        await harness.inject("t1.traj.bad", garbage)
        await t.publish(traj_subject("ep-g"), start("ep-g"))
        got = await take(t, 1)
        assert [d.msg_id for d in got] == ["ep-g/0"]
        assert t.stats.dead[reason] == 1
        with anyio.fail_after(5):
            letter = await dead.__anext__()
        assert letter.subject == f"t1.dead.{reason}" and letter.data == garbage
        assert letter.headers["T1-Dead-Subject"] == "t1.traj.bad" and letter.headers["T1-Dead-Reason"] == reason
        assert letter.headers["T1-Dead-Error"]
        await assert_nothing_pending(t)  # the garbage was settled, not left to be redelivered


# ------------------------------------------------------------------------------------------ core subjects


async def test_subscribers_see_live_records_on_core_and_stream_subjects(harness):
    async with harness.open() as pub, harness.open() as sub:
        async with sub.subscribe("t1.metrics.*") as metrics, sub.subscribe("t1.traj.>") as traj:
            await pub.publish("t1.policy", wire.PolicyRecord(3, 30, "/ckpt/3"))  # nobody listens: dropped
            await pub.publish("t1.metrics.learner", wire.MetricsRecord("learner", 5, 3, {"loss": 0.5}))
            await pub.publish(traj_subject("ep-h"), turn("ep-h", 0))
            with anyio.fail_after(5):
                m = await metrics.__anext__()
                tr = await traj.__anext__()
        assert m.subject == "t1.metrics.learner" and m.record.values == {"loss": 0.5} and m.error is None
        assert tr.subject == "t1.traj.ep-h" and wire.records_equal(tr.record, turn("ep-h", 0))


async def test_malformed_core_messages_are_dead_lettered_or_shown(harness):
    async with harness.open() as t:
        async with t.subscribe("t1.policy") as policy, t.subscribe("t1.policy", include_malformed=True) as raw:
            await harness.inject("t1.policy", b"\x00\x01")
            await t.publish("t1.policy", wire.PolicyRecord(4, 40, "/ckpt/4"))
            with anyio.fail_after(5):
                p = await policy.__anext__()
                bad = await raw.__anext__()
                good = await raw.__anext__()
        assert p.record.version == 4  # the garbage was skipped
        assert bad.record is None and bad.error is not None and bad.error.reason == "msgpack" and bad.data == b"\x00\x01"
        assert good.record.version == 4
        assert t.stats.dead["msgpack"] == 1


async def test_request_reply_with_a_held_reply(harness):
    async with harness.open() as learner, harness.open() as actor:
        async with learner.serve("t1.credit") as requests, anyio.create_task_group() as tg:

            async def grant_later() -> None:
                async for req in requests:
                    await anyio.sleep(0.5)  # backpressure: hold the reply
                    await req.respond(wire.CreditGrant(req.record.n, 7, 30.0, f"g-{req.record.episode}"))

            tg.start_soon(grant_later)
            t0 = time.monotonic()
            reply = await actor.request("t1.credit", wire.CreditRequest("a0", "ep-i", 2), timeout=5)
            assert time.monotonic() - t0 >= 0.45
            assert isinstance(reply, wire.CreditGrant) and reply.granted == 2 and reply.grant_id == "g-ep-i"
            tg.cancel_scope.cancel()


async def test_request_timeout_and_no_responders(harness):
    async with harness.open() as learner, harness.open() as actor:
        with pytest.raises(NoResponders, match="t1.credit"):
            await actor.request("t1.credit", wire.CreditRequest("a0", "ep-j"), timeout=1)
        async with learner.serve("t1.credit") as requests, anyio.create_task_group() as tg:
            held = []

            async def never_answer() -> None:
                async for req in requests:
                    held.append(req)

            tg.start_soon(never_answer)
            t0 = time.monotonic()
            with pytest.raises(RequestTimeout, match="retry"):
                await actor.request("t1.credit", wire.CreditRequest("a0", "ep-j"), timeout=0.3)
            assert 0.25 < time.monotonic() - t0 < 3
            assert len(held) == 1
            await held[0].respond(wire.CreditGrant(1, 1, 1.0, "late"))  # the requester is gone: harmless
            tg.cancel_scope.cancel()


async def test_a_malformed_request_is_dead_lettered_and_serving_goes_on(harness):
    async with harness.open() as learner, harness.open() as actor:
        async with learner.serve("t1.credit") as requests, anyio.create_task_group() as tg:

            async def serve() -> None:
                async for req in requests:
                    await req.respond(wire.CreditGrant(1, 0, 1.0, "ok"))

            tg.start_soon(serve)
            await harness.inject("t1.credit", b"\xc1")
            reply = await actor.request("t1.credit", wire.CreditRequest("a0", "ep-k"), timeout=5)
            assert reply.grant_id == "ok" and learner.stats.dead["msgpack"] == 1
            tg.cancel_scope.cancel()


async def test_use_after_close_fails_loudly(harness):
    t = harness.open()
    async with t:
        await t.publish("t1.policy", wire.PolicyRecord(1, 1, "w"))
    with pytest.raises(TransportClosedError):
        await t.publish(traj_subject("ep-l"), start("ep-l"))
    with pytest.raises(TransportClosedError):
        await t.request("t1.credit", wire.CreditRequest("a", "ep-l"), timeout=1)
    with pytest.raises(TransportClosedError):
        async with t.subscribe("t1.policy"):
            pass
    with pytest.raises(TransportClosedError):
        async with t.consume("learner"):
            pass


# ------------------------------------------------------------------------------------------ pure helpers


@pytest.mark.parametrize("size", [0, 1, 3071, 3072, 3073, 10_000, 65_537])
def test_chunks_rejoin_in_any_order_with_duplicates(size):
    data = random.Random(size).randbytes(size)
    pieces = chunking.split(data, "ep/1", 4096)
    assert all(len(d) <= chunking.chunk_size(4096, "ep/1") for _, d in pieces)
    if len(pieces) == 1:
        assert pieces[0][0] == {"Nats-Msg-Id": "ep/1"} and pieces[0][1] == data
        return
    assert [h["Nats-Msg-Id"] for h, _ in pieces] == [f"ep/1#{i}" for i in range(len(pieces))]
    order = list(pieces)
    random.Random(1).shuffle(order)
    order = order[:-1] + order[:-1][:2] + order[-1:]  # a redelivered chunk or two, before the group completes
    r: chunking.Rejoiner[int] = chunking.Rejoiner()
    results = [r.add("t1.traj.ep", h, d, i, 0.0) for i, (h, d) in enumerate(order)]
    joined = [j for j in results if j is not None]
    assert len(joined) == 1 and joined[0].data == data and joined[0].msg_id == "ep/1" and len(r) == 0


def test_contradictory_or_stale_chunks_are_errors_with_their_handles():
    pieces = chunking.split(b"x" * 10_000, "ep/2", 4096)
    r: chunking.Rejoiner[str] = chunking.Rejoiner()
    assert r.add("s", pieces[0][0], pieces[0][1], "h0", 0.0) is None
    lying = {**pieces[1][0], "T1-Chunk-Len": "5"}
    with pytest.raises(chunking.ChunkError) as info:
        r.add("s", lying, pieces[1][1], "h1", 0.0)
    assert info.value.reason == "chunk" and info.value.handles == ["h0", "h1"]
    with pytest.raises(chunking.ChunkError, match="bad chunk headers"):
        r.add("s", {"T1-Chunk": "x/y"}, b"", "h2", 0.0)
    r.add("s", pieces[0][0], pieces[0][1], "h3", 0.0)
    assert r.expire(now=10.0, max_age_s=60) == []
    assert r.expire(now=100.0, max_age_s=60) == [("ep/2", ["h3"], 1, len(pieces))]


@pytest.mark.parametrize(
    ("pattern", "subject", "ok"),
    [("t1.traj.>", "t1.traj.ep", True), ("t1.traj.>", "t1.traj", False), ("t1.*.x", "t1.a.x", True),
     ("t1.*", "t1.a.b", False), ("t1.policy", "t1.policy", True), (">", "a", True)],
)  # fmt: skip
def test_subject_matching(pattern, subject, ok):
    assert subject_matches(pattern, subject) is ok


def test_msg_ids_and_subjects_follow_design():
    assert default_msg_id(start("e")) == "e/0" and default_msg_id(turn("e", 4)) == "e/5" and default_msg_id(end("e", 1)) == "e/end"
    with pytest.raises(TransportError, match="pass msg_id"):
        default_msg_id(wire.PolicyRecord(1, 1, "w"))
    assert traj_subject("ep-1") == "t1.traj.ep-1"
    for bad in ("", "a.b", "a b", "a>", "*"):
        with pytest.raises(TransportError, match="cannot be a subject token"):
            traj_subject(bad)


def test_a_memory_broker_can_be_built_outside_async_code():
    broker = MemoryBroker()
    assert broker.store("t1.traj.x", b"raw", {"Nats-Msg-Id": "x/0"}) == 1
    assert broker.store("t1.traj.x", b"raw", {"Nats-Msg-Id": "x/0"}) is None  # deduplicated
