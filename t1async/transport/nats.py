"""NATS JetStream transport: the only module in t1async that knows asyncio exists.

nats-py is asyncio-only. Under trio (the default backend) this module opens a trio-asyncio loop for the
lifetime of the transport and crosses the bridge in batches, never once per message:

- ``publish()`` encodes on the caller's side and queues ``_Pub`` items into a bounded channel. A sender
  task takes everything queued (up to ``max_batch``/``max_batch_bytes``) and hands it to nats-py in one
  crossing (``publish_async``: pipelined, one ack future per message); an acker task awaits a whole batch
  of acks in one crossing and wakes the publishers. Unacknowledged publishes are retried with the same
  ``Nats-Msg-Id`` (the stream stores them once) until ``publish_deadline_s``.
- A durable consumer pulls ``batch`` messages per crossing and acks a whole ``Batch`` per crossing.
- Core subscriptions drain every message already received per crossing.

Under asyncio (anyio on asyncio, ``T1_BACKEND=asyncio``) the same coroutines are awaited directly.
nats-py errors are translated here into TransportError subclasses with the cause and what to do.
"""

from __future__ import annotations

import asyncio
import math
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
import nats
import nats.errors
import nats.js.errors
import sniffio
from nats.js import api

from t1async import wire
from t1async.errors import TransportError, WireError
from t1async.log import get_logger
from t1async.transport import chunking
from t1async.transport.base import (
    HDR_MSG_ID, TRAJ_STREAM, TRAJ_SUBJECTS, Batch, Delivery, Message, NoResponders, Record, Request, RequestTimeout,
    SeenSeqs, Transport, TransportClosedError, TransportStats, dead_letter, default_msg_id, is_traj,
)  # fmt: skip

log = get_logger("transport.nats")
DEFAULT_URL = "nats://127.0.0.1:4222"
DEAD_STREAM = "T1_DEAD"


@dataclass(frozen=True)
class NatsConfig:
    url: str = DEFAULT_URL  # several servers: "nats://a:4222,nats://b:4222"
    name: str = "t1async"
    connect_timeout_s: float = 2.0
    reconnect_wait_s: float = 0.25
    ack_timeout_s: float = 5.0  # one publish attempt; then it is retried with the same msg_id
    publish_deadline_s: float = 120.0  # give up (TransportError) after this long without an ack
    retry_wait_s: float = 0.25
    duplicate_window_s: float = 120.0
    ack_wait_s: float = 120.0  # a consumer's unacknowledged message is redelivered after this
    max_ack_pending: int = 100_000
    chunk_timeout_s: float = 300.0  # an incomplete chunked record is dead-lettered after this
    max_batch: int = 1024
    max_batch_bytes: int = 32 << 20
    max_inflight_batches: int = 8
    pending_bytes: int = 2 << 20  # nats-py flushes to the socket past this; also what it buffers while reconnecting
    queue_size: int = 4096


@dataclass(eq=False)
class _Pub:
    subject: str
    data: bytes
    headers: dict[str, str] | None
    js: bool
    deadline: float
    done: anyio.Event = field(default_factory=anyio.Event)
    error: Exception | None = None


class _Bridge:
    """Runs nats-py coroutines from the current backend: via trio-asyncio under trio, directly on asyncio."""

    def __init__(self) -> None:
        self._loop: Any = None

    async def open(self, stack: AsyncExitStack) -> None:
        if sniffio.current_async_library() == "trio":
            import trio_asyncio

            self._loop = await stack.enter_async_context(trio_asyncio.open_loop())

    async def run(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Any:
        if self._loop is None:
            return await fn(*args, **kw)
        return await self._loop.run_aio_coroutine(fn(*args, **kw))


def _single_leaf(group: BaseExceptionGroup) -> BaseException | None:
    while len(group.exceptions) == 1 and isinstance(group.exceptions[0], BaseExceptionGroup):
        group = group.exceptions[0]
    return group.exceptions[0] if len(group.exceptions) == 1 else None


_PERMANENT = (nats.errors.MaxPayloadError, nats.errors.ConnectionClosedError, nats.errors.BadSubjectError)


class NatsTransport(Transport):
    """``async with NatsTransport("nats://127.0.0.1:4222") as t: ...`` (creates stream T1_TRAJ if missing)."""

    def __init__(self, url: str | None = None, *, config: NatsConfig | None = None):
        self.config = config or NatsConfig(url=url or DEFAULT_URL)
        self.stats = TransportStats()
        self._state = "unopened"
        self._bridge = _Bridge()
        self._stack: AsyncExitStack | None = None
        self._nc: Any = None
        self._js: Any = None
        self._drained = anyio.Event()

    # ------------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> NatsTransport:
        if self._state != "unopened":
            raise TransportClosedError(f"NatsTransport is {self._state}: a transport is opened once; make a new one")
        try:
            await self._open()
        except ExceptionGroup as group:  # the bridge's nurseries wrapped our one error: raise it plainly
            leaf = _single_leaf(group)
            if isinstance(leaf, TransportError):
                raise leaf from leaf.__cause__
            raise
        self._state = "open"
        log.info("transport.connected", url=self._nc.connected_url.geturl() if self._nc.connected_url else self.config.url,
                 max_payload=self.max_payload)  # fmt: skip
        return self

    async def _open(self) -> None:
        async with AsyncExitStack() as stack:
            await self._bridge.open(stack)
            self._nc = await self._bridge.run(self._aio_connect)
            stack.push_async_callback(self._bridge.run, self._nc.close)
            self._js = self._nc.jetstream(timeout=self.config.ack_timeout_s, publish_async_max_pending=1 << 20)
            await self._bridge.run(self._aio_ensure_streams)
            self._pub_tx, self._pub_rx = anyio.create_memory_object_stream[_Pub](self.config.queue_size)
            self._infl_tx, self._infl_rx = anyio.create_memory_object_stream[tuple](self.config.max_inflight_batches)
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            self._tg.start_soon(self._sender)
            self._tg.start_soon(self._acker)
            self._stack = stack.pop_all()

    async def aclose(self) -> None:
        if self._state in ("closed", "unopened"):
            self._state = "closed"
            return
        self._state = "closed"
        stack, self._stack = self._stack, None
        try:
            self._pub_tx.close()  # the sender finishes what is queued, the acker sets _drained
            with anyio.move_on_after(self.config.publish_deadline_s):
                await self._drained.wait()
        finally:
            self._tg.cancel_scope.cancel()
            if stack is not None:
                await stack.aclose()

    def _check_open(self) -> None:
        if self._state != "open":
            raise TransportClosedError(f"NatsTransport used while {self._state} (outside its `async with` block)")

    @property
    def max_payload(self) -> int:
        return int(self._nc.max_payload) if self._nc is not None else 1 << 20

    # ------------------------------------------------------------------------ publishing

    async def publish(self, subject: str, record: Record, *, msg_id: str | None = None) -> None:
        self._check_open()
        data = wire.encode(record)
        js = is_traj(subject)
        if js:
            pieces = chunking.split(data, msg_id or default_msg_id(record), self.max_payload)
        elif len(data) > chunking.chunk_size(self.max_payload, ""):
            pieces = [({k: v for k, v in h.items() if k != HDR_MSG_ID}, d) for h, d in
                      chunking.split(data, msg_id or f"core-{self._nc._nuid.next().decode()}", self.max_payload)]  # fmt: skip
        else:
            pieces = [(None, data)]
        await self._send_and_wait(subject, pieces, js)
        self.stats.published += 1

    async def _send_and_wait(self, subject: str, pieces: list, js: bool) -> None:
        deadline = time.monotonic() + self.config.publish_deadline_s
        items = [_Pub(subject, d, h, js, deadline) for h, d in pieces]
        try:
            for it in items:
                await self._pub_tx.send(it)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise TransportClosedError("NatsTransport closed while publishing") from None
        for it in items:
            await it.done.wait()
            if it.error is not None:
                raise it.error

    async def _sender(self) -> None:
        cfg = self.config
        async with self._infl_tx:
            async for first in self._pub_rx:
                batch, size = [first], len(first.data)
                while len(batch) < cfg.max_batch and size < cfg.max_batch_bytes:
                    try:
                        it = self._pub_rx.receive_nowait()
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                    batch.append(it)
                    size += len(it.data)
                sent = await self._bridge.run(self._aio_send, batch)
                await self._infl_tx.send((batch, sent))

    async def _acker(self) -> None:
        cfg = self.config
        async for batch, sent in self._infl_rx:
            while batch:
                results = await self._bridge.run(self._aio_wait, sent, cfg.ack_timeout_s)
                retry, now = [], time.monotonic()
                for it, res in zip(batch, results):
                    if res is None:
                        it.done.set()
                    elif isinstance(res, _PERMANENT) or now > it.deadline:
                        it.error = self._translate(res, f"publish to {it.subject}")
                        it.done.set()
                    else:
                        retry.append(it)
                if not retry:
                    break
                log.warning("transport.publish_retry", n=len(retry), error=repr(results[batch.index(retry[0])]))
                if any(isinstance(r, nats.js.errors.NoStreamResponseError) for r in results):
                    with anyio.move_on_after(cfg.ack_timeout_s):
                        await self._bridge.run(self._aio_ensure_streams)
                await anyio.sleep(cfg.retry_wait_s)
                batch, sent = retry, await self._bridge.run(self._aio_send, retry)
        self._drained.set()

    def _translate(self, exc: BaseException, doing: str) -> TransportError:
        url = self.config.url
        if isinstance(exc, (asyncio.TimeoutError, nats.errors.TimeoutError)):
            what = f"no acknowledgement from NATS at {url} within {self.config.publish_deadline_s}s"
        elif isinstance(exc, nats.errors.MaxPayloadError):
            what = f"payload exceeds the server's max_payload of {self.max_payload} bytes"
        elif isinstance(exc, nats.js.errors.NoStreamResponseError):
            what = f"no JetStream stream {TRAJ_STREAM} answers (is JetStream enabled on {url}?)"
        else:
            what = f"{type(exc).__name__}: {exc}"
        err = TransportError(f"{doing} failed: {what}; is nats-server running? start one with "
                             f"`python -m t1async.cluster up`")  # fmt: skip
        err.__cause__ = exc
        return err

    # ------------------------------------------------------------------------ durable consumer

    @asynccontextmanager
    async def consume(
        self, durable: str, subject: str = TRAJ_SUBJECTS, *, batch: int = 256, max_wait_s: float = 1.0
    ) -> AsyncIterator[AsyncIterator[Batch]]:
        self._check_open()
        try:
            psub = await self._bridge.run(self._aio_pull_sub, durable, subject)
        except nats.errors.Error as exc:
            raise self._translate(exc, f"creating durable consumer {durable!r} on {subject}") from exc
        held: dict[int, Any] = {}  # stream seq -> nats msg, delivered to us and not settled
        gen = self._batches(psub, batch, max_wait_s, SeenSeqs(), held)
        try:
            yield gen
        finally:
            await gen.aclose()
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await self._bridge.run(self._aio_release, psub, list(held.values()))

    async def _batches(self, psub: Any, n: int, max_wait_s: float, seen: SeenSeqs, held: dict) -> AsyncIterator[Batch]:
        rejoin: chunking.Rejoiner[tuple[int, Any]] = chunking.Rejoiner()
        while True:
            self._check_open()
            try:
                raw = await self._bridge.run(self._aio_fetch, psub, n, max_wait_s)
            except nats.errors.ConnectionClosedError as exc:
                raise self._translate(exc, "fetching from the durable consumer") from exc
            except (nats.errors.Error, OSError) as exc:  # disconnected: nats-py reconnects, we ask again
                log.warning("transport.fetch_retry", error=repr(exc))
                await anyio.sleep(self.config.retry_wait_s)
                continue
            deliveries, seqs, ack_now, term, dead = [], [], [], [], []
            for subject, data, headers, msg, seq, ndel in raw:
                if seq in seen.holding or seen.acked(seq):
                    self.stats.redelivered_skipped += 1
                    if seen.acked(seq):
                        ack_now.append(msg)
                    continue
                parts = [(seq, msg)]
                msg_id = headers.get(HDR_MSG_ID) or f"seq/{seq}"
                try:
                    if chunking.is_chunk(headers):
                        seen.holding.add(seq)
                        held[seq] = msg
                        joined = rejoin.add(subject, headers, data, (seq, msg), time.monotonic())
                        if joined is None:
                            continue
                        subject, data, parts, msg_id = joined.subject, joined.data, joined.handles, joined.msg_id
                    rec = wire.decode(data)
                except WireError as err:
                    parts = getattr(err, "handles", None) or parts
                    dead.append(dead_letter(subject, data, err, self.max_payload))
                    term.extend(m for _, m in parts)
                    self._forget(seen, held, [s for s, _ in parts])
                    continue
                deliveries.append(Delivery(subject, rec, msg_id, parts[0][0], ndel))
                for s, m in parts:
                    seqs.append(s)
                    held[s] = m
                    seen.holding.add(s)
            for group, parts, have, count in rejoin.expire(time.monotonic(), self.config.chunk_timeout_s):
                err = WireError(f"chunk: record {group!r} incomplete after {self.config.chunk_timeout_s}s "
                                f"({have} of {count} chunks)", field="T1-Chunk", reason="chunk")  # fmt: skip
                dead.append(dead_letter(group, b"", err, self.max_payload))
                term.extend(m for _, m in parts)
                self._forget(seen, held, [s for s, _ in parts])
            if ack_now or term or dead:
                self._count_dead(dead)
                await self._bridge.run(self._aio_settle, ack_now, term, [], dead)
            if deliveries:
                self.stats.delivered += len(deliveries)
                yield Batch(deliveries, self._settler(seqs, seen, held))

    @staticmethod
    def _forget(seen: SeenSeqs, held: dict, seqs: list[int]) -> None:
        seen.release(seqs)
        for s in seqs:
            held.pop(s, None)

    def _count_dead(self, dead: list) -> None:
        for subj, headers, payload in dead:
            self.stats.dead[headers["T1-Dead-Reason"]] += 1
            log.warning("transport.dead_letter", subject=headers["T1-Dead-Subject"], dead_subject=subj,
                        error=headers["T1-Dead-Error"], size=int(headers["T1-Dead-Size"]))  # fmt: skip

    def _settler(self, seqs: list[int], seen: SeenSeqs, held: dict) -> Callable[[bool], Awaitable[None]]:
        async def settle(ack: bool) -> None:
            self._check_open()
            msgs = [held.pop(s) for s in seqs if s in held]
            (seen.mark_acked if ack else seen.release)(seqs)
            try:
                await self._bridge.run(self._aio_settle, msgs if ack else [], [], [] if ack else msgs, [])
            except nats.errors.Error as exc:  # redelivered later, then skipped and re-acked by SeenSeqs
                log.warning("transport.ack_failed", n=len(msgs), error=repr(exc))

        return settle

    # ------------------------------------------------------------------------ core: subscribe, request, serve

    @asynccontextmanager
    async def _core_sub(self, subject: str, queue: str) -> AsyncIterator[Any]:
        self._check_open()
        try:
            q, sub = await self._bridge.run(self._aio_subscribe, subject, queue)
        except nats.errors.Error as exc:
            raise self._translate(exc, f"subscribing to {subject}") from exc
        try:
            yield q
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await self._bridge.run(self._aio_unsubscribe, sub)

    async def _received(self, q: Any) -> AsyncIterator[tuple[str, bytes, dict, str, WireError | None, Record | None]]:
        rejoin: chunking.Rejoiner[None] = chunking.Rejoiner()
        while True:
            self._check_open()
            for subject, data, headers, reply in await self._bridge.run(self._aio_drain, q, 1024):
                try:
                    if chunking.is_chunk(headers):
                        joined = rejoin.add(subject, headers, data, None, time.monotonic())
                        if joined is None:
                            continue
                        data = joined.data
                    yield subject, data, headers, reply, None, wire.decode(data)
                except WireError as err:
                    yield subject, data, headers, reply, err, None
            rejoin.expire(time.monotonic(), self.config.chunk_timeout_s)

    async def _dead(self, subject: str, data: bytes, err: WireError) -> None:
        dead = [dead_letter(subject, data, err, self.max_payload)]
        self._count_dead(dead)
        await self._bridge.run(self._aio_settle, [], [], [], dead)

    @asynccontextmanager
    async def subscribe(self, subject: str, *, include_malformed: bool = False) -> AsyncIterator[AsyncIterator[Message]]:
        async with self._core_sub(subject, "") as q:
            gen = self._messages(q, include_malformed)
            try:
                yield gen
            finally:
                await gen.aclose()

    async def _messages(self, q: Any, include_malformed: bool) -> AsyncIterator[Message]:
        async for subject, data, headers, _reply, err, rec in self._received(q):
            if err is not None and not include_malformed:
                await self._dead(subject, data, err)
                continue
            yield Message(subject, data, rec, err, headers)

    async def request(self, subject: str, record: Record, *, timeout: float) -> Record:
        self._check_open()
        data = wire.encode(record)
        try:
            msg = await self._bridge.run(self._nc.request, subject, data, timeout=timeout)
        except nats.errors.NoRespondersError:
            raise NoResponders(f"no server for request on {subject!r} (is the learner running?): retry later") from None
        except nats.errors.TimeoutError:
            raise RequestTimeout(f"no reply on {subject!r} within {timeout}s (the server may be holding it): retry") from None
        except nats.errors.Error as exc:
            raise self._translate(exc, f"request on {subject}") from exc
        return wire.decode(msg.data)

    @asynccontextmanager
    async def serve(self, subject: str, *, queue: str = "") -> AsyncIterator[AsyncIterator[Request]]:
        async with self._core_sub(subject, queue) as q:
            gen = self._requests(q)
            try:
                yield gen
            finally:
                await gen.aclose()

    async def _requests(self, q: Any) -> AsyncIterator[Request]:
        async for subject, data, _headers, reply, err, rec in self._received(q):
            if err is not None:
                await self._dead(subject, data, err)
            elif not reply:
                log.warning("transport.request_without_reply", subject=subject)
            else:
                yield Request(subject, rec, self._responder(reply))  # type: ignore[arg-type]

    def _responder(self, reply: str) -> Callable[[Record], Awaitable[None]]:
        async def respond(record: Record) -> None:
            self._check_open()
            await self._send_and_wait(reply, [(None, wire.encode(record))], False)

        return respond

    # ------------------------------------------------------------------------ the asyncio side (one crossing each)

    async def _aio_connect(self) -> Any:
        cfg, urls = self.config, [u.strip() for u in self.config.url.split(",") if u.strip()]

        async def on_error(exc: Exception) -> None:
            log.warning("nats.error", error=repr(exc))

        async def on_disconnected() -> None:
            if self._state == "open":
                log.warning("nats.disconnected", url=cfg.url)

        async def on_reconnected() -> None:
            log.info("nats.reconnected", url=cfg.url)

        try:
            nc = await nats.connect(
                servers=urls, name=cfg.name, connect_timeout=cfg.connect_timeout_s, allow_reconnect=True,
                reconnect_time_wait=cfg.reconnect_wait_s, max_reconnect_attempts=1, pending_size=cfg.pending_bytes,
                error_cb=on_error, disconnected_cb=on_disconnected, reconnected_cb=on_reconnected,
            )  # fmt: skip
        except (nats.errors.Error, OSError, asyncio.TimeoutError) as exc:
            raise TransportError(
                f"cannot reach NATS at {cfg.url}: is the server running? start one with "
                f"`python -m t1async.cluster up` ({type(exc).__name__}: {exc})"
            ) from exc
        nc.options["max_reconnect_attempts"] = -1  # once connected, ride out server restarts forever
        return nc

    async def _aio_ensure_streams(self) -> None:
        cfg = self.config
        wanted = [
            api.StreamConfig(name=TRAJ_STREAM, subjects=[TRAJ_SUBJECTS], storage=api.StorageType.FILE,
                             duplicate_window=cfg.duplicate_window_s, retention=api.RetentionPolicy.LIMITS),
            api.StreamConfig(name=DEAD_STREAM, subjects=["t1.dead.>"], storage=api.StorageType.FILE,
                             max_msgs=100_000, max_bytes=1 << 30, discard=api.DiscardPolicy.OLD),
        ]  # fmt: skip
        for sc in wanted:
            try:
                await self._js.stream_info(sc.name)
            except nats.js.errors.NotFoundError:
                try:
                    await self._js.add_stream(sc)
                except nats.js.errors.BadRequestError:
                    await self._js.stream_info(sc.name)  # created concurrently by another client: fine

    async def _aio_send(self, batch: list[_Pub]) -> list[Any]:
        out: list[Any] = []
        for it in batch:
            try:
                if it.js:
                    out.append(await self._js.publish_async(it.subject, it.data, headers=it.headers))
                else:
                    await self._nc.publish(it.subject, it.data, headers=it.headers)
                    out.append(None)
            except (nats.errors.Error, OSError) as exc:
                out.append(exc)
        return out

    @staticmethod
    async def _aio_wait(sent: list[Any], timeout: float) -> list[BaseException | None]:
        futs = [f for f in sent if isinstance(f, asyncio.Future)]
        if futs:
            await asyncio.wait(futs, timeout=timeout)
        out: list[BaseException | None] = []
        for f in sent:
            if not isinstance(f, asyncio.Future):
                out.append(f)
            elif not f.done() or f.cancelled():
                f.cancel()
                out.append(asyncio.TimeoutError("no publish acknowledgement"))
            else:
                out.append(f.exception())
        return out

    async def _aio_pull_sub(self, durable: str, subject: str) -> Any:
        cc = api.ConsumerConfig(
            durable_name=durable, ack_policy=api.AckPolicy.EXPLICIT, ack_wait=self.config.ack_wait_s,
            max_ack_pending=self.config.max_ack_pending, deliver_policy=api.DeliverPolicy.ALL,
            filter_subject=subject, max_deliver=-1,
        )  # fmt: skip
        return await self._js.pull_subscribe(subject, durable=durable, stream=TRAJ_STREAM, config=cc)

    @staticmethod
    async def _aio_fetch(psub: Any, n: int, max_wait_s: float) -> list[tuple]:
        try:
            msgs = await psub.fetch(batch=n, timeout=max_wait_s)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):  # nats-py raises either when nothing came
            return []
        out = []
        for m in msgs:
            md = m.metadata
            out.append((m.subject, m.data, dict(m.headers or {}), m, md.sequence.stream, md.num_delivered))
        return out

    async def _aio_settle(self, ack: list, term: list, nak: list, dead: list) -> None:
        for m in ack:
            await m.ack()
        for m in term:
            await m.term()
        for m in nak:
            await m.nak()
        for subj, headers, payload in dead:
            await self._nc.publish(subj, payload, headers=headers)
        if ack or term or nak:
            await self._aio_sync()

    async def _aio_release(self, psub: Any, held: list) -> None:
        for m in held:
            await m.nak()
        try:
            await psub.unsubscribe()
            await self._aio_sync()
        except nats.errors.Error as exc:
            log.warning("transport.unsubscribe_failed", error=repr(exc))

    async def _aio_subscribe(self, subject: str, queue: str) -> tuple[Any, Any]:
        q: asyncio.Queue = asyncio.Queue(maxsize=self.config.queue_size)

        async def cb(msg: Any) -> None:
            await q.put(msg)

        sub = await self._nc.subscribe(subject, queue=queue, cb=cb)
        await self._aio_sync()  # the server knows the subscription when subscribe()/serve() return
        return q, sub

    async def _aio_sync(self) -> None:
        """Wait until the server has processed everything we sent. nats-py's flush() alone does not: it
        writes its PING straight to the socket, ahead of commands still in its pending buffer."""
        await self._nc._flush_pending(force_flush=True)
        await self._nc.flush(timeout=max(1, math.ceil(self.config.ack_timeout_s)))

    @staticmethod
    async def _aio_drain(q: asyncio.Queue, n: int) -> list[tuple]:
        msgs = [await q.get()]
        while len(msgs) < n:
            try:
                msgs.append(q.get_nowait())
            except asyncio.QueueEmpty:
                break
        return [(m.subject, m.data, dict(m.headers or {}), m.reply) for m in msgs]

    async def _aio_unsubscribe(self, sub: Any) -> None:
        try:
            await sub.unsubscribe()
        except nats.errors.Error as exc:
            log.warning("transport.unsubscribe_failed", error=repr(exc))
