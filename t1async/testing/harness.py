"""Harnesses for the transport kit (transport.py) and the records its checks send.

A harness opens transports to one broker and injects raw bytes past the codec: ``MemoryHarness`` over a
MemoryBroker, ``NatsHarness`` over a real nats-server (``raw_publish`` speaks the NATS protocol over bare
TCP, as a misbehaving client would). ``memory_harness`` and ``nats_harness(dir)`` make a fresh one per check.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Protocol

import anyio
import numpy as np

from t1async.protocol import wire
from t1async.transport.base import Transport
from t1async.transport.memory import MemoryBroker, MemoryTransport
from t1async.transport.nats import NatsTransport
from t1async.transport.natsd import NatsServer
from t1async.transport.natsio import NatsConfig

__all__ = [
    "MemoryHarness",
    "NatsHarness",
    "TransportHarness",
    "end",
    "memory_harness",
    "nats_harness",
    "raw_publish",
    "start",
    "turn",
]


class TransportHarness(Protocol):
    def open(self) -> Transport:
        """A new, unopened transport to this harness's broker, with an ack wait of about 1 s."""
        ...

    async def inject(self, subject: str, data: bytes) -> None:
        """Publish raw ``data`` on ``subject`` without the codec (the checks inject garbage)."""
        ...


class MemoryHarness:
    def __init__(self) -> None:
        self.broker = MemoryBroker(ack_wait_s=1.0)

    def open(self) -> MemoryTransport:
        return MemoryTransport(self.broker)

    async def inject(self, subject: str, data: bytes) -> None:
        await self.broker.inject(subject, data)


@asynccontextmanager
async def memory_harness() -> AsyncIterator[MemoryHarness]:
    yield MemoryHarness()


async def raw_publish(url: str, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
    """Publish raw bytes to the NATS server at ``url`` over a bare TCP connection speaking the protocol
    (PUB/HPUB), as a misbehaving client would; returns after the server answered PING."""
    host, port = url.removeprefix("nats://").rsplit(":", 1)
    async with await anyio.connect_tcp(host, int(port)) as s:
        await s.receive()  # INFO
        if headers:
            hdr = b"NATS/1.0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) + b"\r\n"
            cmd = f"HPUB {subject} {len(hdr)} {len(hdr) + len(data)}\r\n".encode() + hdr + data + b"\r\n"
        else:
            cmd = f"PUB {subject} {len(data)}\r\n".encode() + data + b"\r\n"
        await s.send(b'CONNECT {"verbose":false,"headers":true}\r\n' + cmd + b"PING\r\n")
        buf = b""
        with anyio.fail_after(5):
            while b"PONG" not in buf:
                buf += await s.receive()
        assert b"-ERR" not in buf, buf


class NatsHarness:
    """NatsTransports to the nats-server at ``url``; garbage is injected with ``raw_publish``."""

    def __init__(self, url: str) -> None:
        self.url = url

    def open(self) -> NatsTransport:
        return NatsTransport(config=NatsConfig(url=self.url, ack_wait_s=1.0))

    async def inject(self, subject: str, data: bytes) -> None:
        await raw_publish(self.url, subject, data)


def nats_harness(store_root: str | Path) -> Callable[[], AbstractAsyncContextManager[NatsHarness]]:
    """A ``fresh`` for check_transport: each harness gets its own nats-server (JetStream, a free port, a new
    store dir under ``store_root``), stopped when the check ends."""
    count = itertools.count()

    @asynccontextmanager
    async def fresh() -> AsyncIterator[NatsHarness]:
        async with NatsServer.start(Path(store_root) / f"nats-{next(count)}") as srv:
            yield NatsHarness(srv.url)

    return fresh


def turn(ep: str, k: int, *, reward: float = 0.0, n_out: int = 3) -> wire.TurnRecord:
    delta = np.arange(4, dtype=np.int32) + k
    keep = 10 * k
    return wire.TurnRecord(
        episode=ep,
        turn=k,
        policy_version=1,
        keep=keep,
        input_delta=delta,
        input_len=keep + 4,
        input_digest=wire.digest_ids(delta),
        output_ids=np.arange(n_out, dtype=np.int32) + 100,
        output_logprobs=np.full(n_out, -0.5, np.float32),
        finish=wire.Finish.STOP,
        routing=wire.Routing(max(keep - 1, 0), np.ones((keep + 4 + n_out - 1 - max(keep - 1, 0), 2, 2), np.uint8)),
        reward=reward,
        tests_passed=-1,
        t_sample_s=0.1,
        t_exec_s=0.2,
        action="ls",
        observation="out",
    )


def start(ep: str) -> wire.StartRecord:
    return wire.StartRecord(ep, "actor-0", "task-a", 50, 1.0)


def end(ep: str, turns: int) -> wire.EndRecord:
    return wire.EndRecord(ep, turns, wire.EndReason.SOLVED, 3, 3, True)
