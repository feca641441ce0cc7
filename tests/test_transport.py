"""Transport conformance: the kit t1async.testing.check_transport, run against MemoryTransport and
NatsTransport (a real nats-server), and shown to catch a broken transport.

Plus the pure chunking functions. NATS-only behaviour (64 MB records, server crash and restart, raw
nats-py readers, asyncio backend) is in test_transport_nats.py.
"""

from __future__ import annotations

import random
import time
from contextlib import asynccontextmanager

import pytest

from t1async.protocol import wire
from t1async.protocol.errors import TransportError
from t1async.testing.harness import MemoryHarness, end, memory_harness, nats_harness, start, turn
from t1async.testing.transport import TRANSPORT_CHECKS, check_transport
from t1async.transport import (
    MemoryBroker,
    MemoryTransport,
    chunking,
    default_msg_id,
    subject_matches,
    traj_subject,
)


@pytest.fixture(params=["memory", "nats"])
def fresh(request, tmp_path):
    """What check_transport takes: a maker of fresh harnesses (a new broker, or a new nats-server, each)."""
    return memory_harness if request.param == "memory" else nats_harness(tmp_path)


# ------------------------------------------------------------------------------------------ the conformance kit


@pytest.mark.parametrize("check", TRANSPORT_CHECKS, ids=lambda c: c.__name__)
async def test_transport_conformance(fresh, check):
    """Each check of t1async.testing.check_transport, against MemoryTransport and NatsTransport."""
    await check_transport(fresh, checks=[check])


class _ForgetfulTransport(MemoryTransport):
    """A broken transport: it ignores the msg_id it is given, so a retried publish is stored twice."""

    async def publish(self, subject, record, *, msg_id=None):
        await super().publish(subject, record, msg_id=None if msg_id is None else f"{msg_id}-{time.monotonic_ns()}")


class _ForgetfulHarness(MemoryHarness):
    def open(self) -> MemoryTransport:
        return _ForgetfulTransport(self.broker)


async def test_check_transport_names_the_check_a_broken_transport_fails():
    @asynccontextmanager
    async def forgetful():
        yield _ForgetfulHarness()

    with pytest.raises(AssertionError, match="a_retried_publish_is_stored_once"):
        await check_transport(forgetful)
    await check_transport(memory_harness)  # and the whole suite passes on the real MemoryTransport


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
    [
        ("t1.traj.>", "t1.traj.ep", True),
        ("t1.traj.>", "t1.traj", False),
        ("t1.*.x", "t1.a.x", True),
        ("t1.*", "t1.a.b", False),
        ("t1.policy", "t1.policy", True),
        (">", "a", True),
    ],
)
def test_subject_matching(pattern, subject, ok):
    assert subject_matches(pattern, subject) is ok


def test_msg_ids_and_subjects_follow_design():
    assert (
        default_msg_id(start("e")) == "e/0"
        and default_msg_id(turn("e", 4)) == "e/5"
        and default_msg_id(end("e", 1)) == "e/end"
    )
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
