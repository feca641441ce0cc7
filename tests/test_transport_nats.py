"""NatsTransport against a real nats-server: what only NATS can show.

64 MB records through a 1 MB max_payload, a server crash mid-stream with nothing lost or duplicated,
dedupe that survives a restart, plain nats-py + msgpack readers, dead-lettered chunk garbage, the asyncio
backend, and the error for an unreachable server.
"""

from __future__ import annotations

import asyncio

import anyio
import msgpack
import nats
import numpy as np
import pytest

from t1async.protocol import wire
from t1async.protocol.errors import TransportError
from t1async.testing.harness import end, start, turn
from t1async.testing.transport import take
from t1async.transport import NatsConfig, NatsTransport, traj_subject
from t1async.transport.natsd import NatsServer, free_port


def fast(url: str) -> NatsConfig:
    return NatsConfig(url=url, ack_timeout_s=1.0, retry_wait_s=0.1, reconnect_wait_s=0.1, ack_wait_s=5.0)


@pytest.mark.slow
async def test_a_64mb_record_is_chunked_and_rejoined(nats_server):
    rows = (64 << 20) // (48 * 8) + 1
    big = wire.TurnRecord(
        episode="big",
        turn=0,
        policy_version=1,
        keep=0,
        input_delta=np.arange(rows, dtype=np.int32) % 50_000,
        input_len=rows,
        input_digest=b"\x01" * 16,
        output_ids=np.array([5], np.int32),
        output_logprobs=np.array([-1.0], np.float32),
        finish=wire.Finish.LENGTH,
        routing=wire.Routing(0, (np.arange(rows * 48 * 8) % 251).astype(np.uint8).reshape(rows, 48, 8)),
        reward=0.0,
        tests_passed=-1,
        t_sample_s=1.0,
        t_exec_s=0.0,
    )
    assert len(wire.encode(big)) > 64 << 20
    async with NatsTransport(config=fast(nats_server.url)) as pub, NatsTransport(config=fast(nats_server.url)) as sub:
        assert pub.max_payload == 1 << 20  # the server's default: the record must be split
        async with sub.subscribe("t1.traj.>") as live:
            await pub.publish(traj_subject("big"), big)
            await pub.publish(traj_subject("big"), end("big", 1))
            with anyio.fail_after(60):
                seen_live = await live.__anext__()
        got = await take(sub, 2, timeout=60)
    assert [d.msg_id for d in got] == ["big/1", "big/end"]
    assert wire.records_equal(got[0].record, big) and wire.records_equal(seen_live.record, big)
    assert got[1].stream_seq - got[0].stream_seq >= 64  # stored as 65+ chunk messages, then the end record


@pytest.mark.slow
async def test_a_server_crash_mid_stream_loses_and_duplicates_nothing(nats_server):
    n, published, received = 400, [], []
    async with NatsTransport(config=fast(nats_server.url)) as pub, NatsTransport(config=fast(nats_server.url)) as sub:

        async def publisher(lane: int) -> None:
            for k in range(lane, n, 4):
                await pub.publish(traj_subject(f"ep{lane}"), turn(f"ep{lane}", k))
                published.append(k)

        async def consumer() -> None:
            async with sub.consume("learner", max_wait_s=0.3) as batches:
                async for batch in batches:
                    received.extend(d.record.turn for d in batch)
                    await batch.ack()
                    if len(received) >= n:
                        return

        async def crasher() -> None:
            while len(published) < n // 4:
                await anyio.sleep(0.005)
            await nats_server.kill()  # SIGKILL mid-stream
            await anyio.sleep(0.5)
            await nats_server.restart()  # same port, same store dir

        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                for lane in range(4):
                    tg.start_soon(publisher, lane)
                tg.start_soon(crasher)
                tg.start_soon(consumer)
    assert len(published) == n
    assert sorted(received) == list(range(n)), f"missing {set(range(n)) - set(received)}, {len(received) - n} extra"


async def test_dedupe_survives_a_server_restart(nats_server):
    async with NatsTransport(config=fast(nats_server.url)) as t:
        await t.publish(traj_subject("ep-r"), turn("ep-r", 0, reward=1.0))
    await nats_server.restart()
    async with NatsTransport(config=fast(nats_server.url)) as t:
        await t.publish(traj_subject("ep-r"), turn("ep-r", 0, reward=9.0))  # a retry after the restart
        await t.publish(traj_subject("ep-r"), turn("ep-r", 1))
        got = await take(t, 2)
    assert [(d.msg_id, d.record.reward) for d in got] == [("ep-r/1", 1.0), ("ep-r/2", 0.0)]


async def _raw_read(url: str, n: int) -> list:
    nc = await nats.connect(url)
    try:
        psub = await nc.jetstream().pull_subscribe("t1.traj.>", durable="raw-reader", stream="T1_TRAJ")
        msgs = await psub.fetch(n, timeout=5)
        for m in msgs:
            await m.ack()
        return [(m.subject, dict(m.headers or {}), msgpack.unpackb(m.data)) for m in msgs]
    finally:
        await nc.close()


async def test_a_plain_nats_py_and_msgpack_reader_sees_design_field_names(nats_server):
    async with NatsTransport(nats_server.url) as t:
        for r in (start("ep-m"), turn("ep-m", 0), end("ep-m", 1)):
            await t.publish(traj_subject("ep-m"), r)
    msgs = await anyio.to_thread.run_sync(asyncio.run, _raw_read(nats_server.url, 3))
    assert [(s, h["Nats-Msg-Id"]) for s, h, _ in msgs] == [("t1.traj.ep-m", f"ep-m/{x}") for x in ("0", "1", "end")]
    (_, _, s), (_, _, tm), (_, _, e) = msgs
    assert s["v"] == 1 and s["kind"] == "start" and {"episode", "actor", "task", "max_turns", "created_at"} <= s.keys()
    assert {
        "episode",
        "turn",
        "policy_version",
        "keep",
        "input_delta",
        "input_len",
        "input_digest",
        "output_ids",
        "output_logprobs",
        "finish",
        "routing",
        "reward",
        "tests_passed",
        "t_sample_s",
        "t_exec_s",
    } <= tm.keys()
    assert tm["routing"]["dtype"] == "u1" and tm["routing"]["start"] == 0 and len(tm["routing"]["shape"]) == 3
    assert np.frombuffer(tm["output_ids"]["data"], "<i4").tolist() == [100, 101, 102]
    assert {"episode", "turns", "reason", "tests_passed", "tests_total", "resolved"} <= e.keys() and e[
        "reason"
    ] == "solved"


async def test_lying_chunks_published_raw_are_dead_lettered(nats_server, nats_raw_publish):
    async with (
        NatsTransport(config=fast(nats_server.url)) as t,
        t.subscribe("t1.dead.>", include_malformed=True) as dead,
    ):
        await nats_raw_publish(
            nats_server.url, "t1.traj.x", b"abc", {"T1-Chunk": "0/2", "T1-Chunk-Of": "x/1", "T1-Chunk-Len": "6"}
        )
        await nats_raw_publish(
            nats_server.url, "t1.traj.x", b"de", {"T1-Chunk": "1/2", "T1-Chunk-Of": "x/1", "T1-Chunk-Len": "6"}
        )
        await nats_raw_publish(nats_server.url, "t1.traj.x", b"zz", {"T1-Chunk": "one/two"})
        await t.publish(traj_subject("ep-z"), start("ep-z"))
        got = await take(t, 1)
        with anyio.fail_after(5):
            letters = [await dead.__anext__(), await dead.__anext__()]
    assert [d.msg_id for d in got] == ["ep-z/0"] and t.stats.dead["chunk"] == 2
    assert {m.subject for m in letters} == {"t1.dead.chunk"}
    assert any("promised 6" in m.headers["T1-Dead-Error"] for m in letters)


def test_the_asyncio_backend_works_too(tmp_path):
    async def main() -> None:
        async with NatsServer.start(tmp_path / "nats") as srv, NatsTransport(config=fast(srv.url)) as t:
            async with t.serve("t1.credit") as requests, anyio.create_task_group() as tg:

                async def grant() -> None:
                    async for req in requests:
                        await req.respond(wire.CreditGrant(1, 2, 3.0, "g"))

                tg.start_soon(grant)
                assert (await t.request("t1.credit", wire.CreditRequest("a", "e"), timeout=5)).grant_id == "g"
                tg.cancel_scope.cancel()
            for r in (start("ep-a"), turn("ep-a", 0)):
                await t.publish(traj_subject("ep-a"), r)
            got = await take(t, 2)
            assert [d.msg_id for d in got] == ["ep-a/0", "ep-a/1"]

    anyio.run(main, backend="asyncio")


async def test_an_unreachable_server_says_what_to_do():
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(TransportError, match=r"cannot reach NATS at .*cluster up"):
        async with NatsTransport(config=NatsConfig(url=url, connect_timeout_s=0.5, reconnect_wait_s=0.05)):
            pass


async def test_a_server_without_jetstream_is_waited_for_and_then_named(tmp_path):
    """JetStream's API answers "no responders" (503 to nats-py) on a server without it, as on a cluster that is
    electing: opening asks again for ``jetstream_wait_s``, then says what to check instead of hanging."""
    import subprocess

    from t1async.transport.natsd import find_binary

    port = free_port()
    proc = subprocess.Popen(
        [str(find_binary()), "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        with anyio.fail_after(30):
            while True:  # listening: the connection below must get as far as JetStream
                try:
                    await (await anyio.connect_tcp("127.0.0.1", port)).aclose()
                    break
                except OSError:
                    await anyio.sleep(0.05)
        cfg = NatsConfig(url=f"nats://127.0.0.1:{port}", connect_timeout_s=5, jetstream_wait_s=1.0, retry_wait_s=0.1)
        with pytest.raises(TransportError, match=r"did not answer for 1 s .*electing.*quorum"):
            async with NatsTransport(config=cfg):
                pass
    finally:
        proc.terminate()
        proc.wait(10)
