"""NATS JetStream transport: the only module in t1async that knows asyncio exists.

nats-py is asyncio-only. Under trio (the default backend) this module opens a trio-asyncio loop for the
lifetime of the transport and crosses the bridge in batches, never once per message:

- ``publish()`` encodes on the caller's side and queues the pieces (transport/pipeline.py). A sender task
  hands everything queued to nats-py in one crossing (pipelined publishes whose acks come back on our
  own inbox, collected in bulk: no asyncio future per message); an acker task awaits a whole batch of
  acks in one crossing and wakes the publishers. Unacknowledged publishes are retried with the same
  ``Nats-Msg-Id`` (the stream stores them once) until ``publish_deadline_s``.
- A durable consumer pulls ``batch`` messages per crossing and acks a whole ``Batch`` per crossing.
- Core subscriptions drain every message already received per crossing.

Under asyncio (anyio on asyncio, ``T1_BACKEND=asyncio``) the same coroutines are awaited directly.
nats-py errors are translated here into TransportError subclasses with the cause and what to do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence

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
    HDR_MSG_ID, TRAJ_STREAM, TRAJ_SUBJECTS, Batch, Message, NoResponders, Record, Request, RequestTimeout, Transport,
    TransportClosedError, TransportStats, default_msg_id, is_traj,
)  # fmt: skip
from t1async.transport.intake import CoreIntake, Fetched, StreamIntake, count_dead
from t1async.transport.pipeline import Outgoing, PipelineConfig, PublishPipeline

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
    # JetStream replicas of the T1 streams; None: create with 1 and leave an existing stream as it is (a
    # set count scales an existing stream to it: `cluster up --stream-replicas` on a 3-node cluster)
    stream_replicas: int | None = None


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


def _ack_error(msg: Any) -> BaseException | None:
    """None for a JetStream publish ack, else what went wrong (no stream, an API error, garbage)."""
    if msg.headers and msg.headers.get("Status") == "503":
        return nats.js.errors.NoStreamResponseError()
    try:
        resp = json.loads(msg.data)
        if "error" in resp:
            nats.js.errors.APIError.from_error(resp["error"])  # raises the matching APIError subclass
    except (ValueError, nats.js.errors.APIError) as exc:
        return exc
    return None


_PERMANENT = (nats.errors.MaxPayloadError, nats.errors.ConnectionClosedError, nats.errors.BadSubjectError,
              nats.js.errors.BadRequestError)


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
            self._js = self._nc.jetstream(timeout=self.config.ack_timeout_s)
            await self._bridge.run(self._aio_ensure_streams)
            await self._bridge.run(self._aio_init_acks)
            c = self.config
            self._pipeline = PublishPipeline(
                PipelineConfig(c.ack_timeout_s, c.publish_deadline_s, c.retry_wait_s, c.max_batch, c.max_batch_bytes,
                               c.max_inflight_batches, c.queue_size),
                partial(self._bridge.run, self._aio_send), partial(self._bridge.run, self._aio_wait),
                fatal=self._fatal, before_retry=self._before_retry,
            )  # fmt: skip
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            self._tg.start_soon(self._pipeline.run)
            self._stack = stack.pop_all()

    async def aclose(self) -> None:
        if self._state in ("closed", "unopened"):
            self._state = "closed"
            return
        self._state = "closed"
        stack, self._stack = self._stack, None
        try:
            self._pipeline.close()  # what is queued is still sent and acknowledged
            with anyio.move_on_after(self.config.publish_deadline_s):
                await self._pipeline.drained.wait()
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
        pieces: Sequence[tuple[dict[str, str] | None, bytes]]
        if js:
            pieces = chunking.split(data, msg_id or default_msg_id(record), self.max_payload)
        elif len(data) > chunking.chunk_size(self.max_payload, ""):
            pieces = [({k: v for k, v in h.items() if k != HDR_MSG_ID}, d) for h, d in
                      chunking.split(data, msg_id or f"core-{self._nc._nuid.next().decode()}", self.max_payload)]  # fmt: skip
        else:
            pieces = [(None, data)]
        await self._pipeline.put(subject, pieces, js)
        self.stats.published += 1

    async def publish_dead(self, subject: str, data: bytes, error: WireError) -> None:
        self._check_open()
        letter = count_dead(self.stats, subject, data, error, self.max_payload)
        await self._bridge.run(self._aio_settle, [], [], [], [letter])
        await self._bridge.run(self._aio_sync)

    def _fatal(self, exc: BaseException, item: Outgoing, expired: bool) -> Exception | None:
        """The error a failed publish raises, or None to retry it."""
        if expired or isinstance(exc, _PERMANENT):
            return self._translate(exc, f"publish to {item.subject}")
        return None

    async def _before_retry(self, results: list[BaseException | None]) -> None:
        if any(isinstance(r, nats.js.errors.NoStreamResponseError) for r in results):  # a fresh server: recreate
            with anyio.move_on_after(self.config.ack_timeout_s):
                try:
                    await self._bridge.run(self._aio_ensure_streams)
                except (nats.errors.Error, nats.js.errors.APIError) as exc:  # a cluster without quorum: retried
                    log.warning("transport.ensure_streams_failed", error=repr(exc))

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
        intake: StreamIntake[Any] = StreamIntake(self.stats, max_payload=self.max_payload,
                                                 chunk_timeout_s=self.config.chunk_timeout_s)  # fmt: skip
        gen = self._batches(psub, batch, max_wait_s, intake)
        try:
            yield gen
        finally:
            await gen.aclose()
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await self._bridge.run(self._aio_release, psub, intake.release_all())

    async def _batches(self, psub: Any, n: int, max_wait_s: float, intake: StreamIntake[Any]) -> AsyncGenerator[Batch, None]:
        while True:
            self._check_open()
            try:
                fetched = await self._bridge.run(self._aio_fetch, psub, n, max_wait_s)
            except nats.errors.ConnectionClosedError as exc:
                raise self._translate(exc, "fetching from the durable consumer") from exc
            except (nats.errors.Error, OSError) as exc:  # disconnected: nats-py reconnects, we ask again
                log.warning("transport.fetch_retry", error=repr(exc))
                await anyio.sleep(self.config.retry_wait_s)
                continue
            got = intake.take(fetched, time.monotonic())
            if got.ack_now or got.term or got.dead:
                await self._bridge.run(self._aio_settle, got.ack_now, got.term, [], got.dead)
            if got.deliveries:
                yield Batch(got.deliveries, self._settler(got.seqs, intake))

    def _settler(self, seqs: list[int], intake: StreamIntake[Any]) -> Callable[[bool], Awaitable[None]]:
        async def settle(ack: bool) -> None:
            self._check_open()
            msgs = intake.settle(seqs, ack)
            try:
                await self._bridge.run(self._aio_settle, msgs if ack else [], [], [] if ack else msgs, [])
            except nats.errors.Error as exc:  # redelivered later, then skipped and re-acked by the intake
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

    async def _received(self, q: Any, include_malformed: bool) -> AsyncIterator[tuple[Message, str]]:
        """(message, reply subject) for each record received; malformed ones dead-lettered unless included."""
        intake = CoreIntake(self.config.chunk_timeout_s)
        while True:
            self._check_open()
            dead = []
            for subject, data, headers, reply in await self._bridge.run(self._aio_drain, q, 1024):
                got = intake.decode(subject, data, headers, time.monotonic())
                if got is None:
                    continue
                data, rec = got
                if isinstance(rec, WireError):
                    if not include_malformed:
                        dead.append(count_dead(self.stats, subject, data, rec, self.max_payload))
                        continue
                    yield Message(subject, data, None, rec, headers), reply
                else:
                    yield Message(subject, data, rec, None, headers), reply
            if dead:
                await self._bridge.run(self._aio_settle, [], [], [], dead)

    @asynccontextmanager
    async def subscribe(self, subject: str, *, include_malformed: bool = False) -> AsyncIterator[AsyncIterator[Message]]:
        async with self._core_sub(subject, "") as q:
            gen = self._messages(q, include_malformed)
            try:
                yield gen
            finally:
                await gen.aclose()

    async def _messages(self, q: Any, include_malformed: bool) -> AsyncGenerator[Message, None]:
        async for msg, _reply in self._received(q, include_malformed):
            yield msg

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

    async def _requests(self, q: Any) -> AsyncGenerator[Request, None]:
        async for msg, reply in self._received(q, include_malformed=False):
            if not reply:
                log.warning("transport.request_without_reply", subject=msg.subject)
            else:
                yield Request(msg.subject, msg.record, self._responder(reply))  # type: ignore[arg-type]

    def _responder(self, reply: str) -> Callable[[Record], Awaitable[None]]:
        async def respond(record: Record) -> None:
            self._check_open()
            await self._pipeline.put(reply, [(None, wire.encode(record))], False)

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
        r = cfg.stream_replicas or 1
        wanted = [
            api.StreamConfig(name=TRAJ_STREAM, subjects=[TRAJ_SUBJECTS], storage=api.StorageType.FILE,
                             duplicate_window=cfg.duplicate_window_s, retention=api.RetentionPolicy.LIMITS,
                             num_replicas=r),
            api.StreamConfig(name=DEAD_STREAM, subjects=["t1.dead.>"], storage=api.StorageType.FILE,
                             max_msgs=100_000, max_bytes=1 << 30, discard=api.DiscardPolicy.OLD, num_replicas=r),
        ]  # fmt: skip
        for sc in wanted:
            try:
                try:
                    info = await self._js.stream_info(sc.name)
                except nats.js.errors.NotFoundError:
                    try:
                        await self._js.add_stream(sc)
                        continue
                    except nats.js.errors.BadRequestError:
                        info = await self._js.stream_info(sc.name)  # created concurrently by another client: fine
                have = info.config.num_replicas or 1
                if cfg.stream_replicas is not None and have != cfg.stream_replicas:
                    await self._js.update_stream(dataclasses.replace(info.config, num_replicas=cfg.stream_replicas))
                    log.info("transport.stream_replicas", stream=sc.name, was=have, now=cfg.stream_replicas)
            except nats.js.errors.APIError as exc:
                if cfg.stream_replicas and cfg.stream_replicas > 1 and exc.err_code in (10005, 10074, 10023):
                    raise TransportError(
                        f"JetStream at {cfg.url} cannot keep stream {sc.name} with {cfg.stream_replicas} replicas "
                        f"({exc.description}): it needs that many JetStream servers in the cluster; pass "
                        f"--stream-replicas 1 for a single server, or start a cluster (`cluster up --nats-nodes 3`)"
                    ) from exc
                raise

    async def _aio_init_acks(self) -> None:
        """JetStream publish acks come back on our own inbox, handled in bulk: no future per message (nats-py's
        publish_async costs several asyncio callbacks per message, and each is a trip through trio-asyncio)."""
        self._ack_prefix = self._nc.new_inbox()
        self._ack_seq = 0
        self._ack_live: set[str] = set()  # sent, not yet collected by _aio_wait
        self._ack_results: dict[str, BaseException | None] = {}
        self._ack_waiting: set[str] = set()
        self._ack_event: asyncio.Event | None = None
        await self._nc.subscribe(self._ack_prefix + ".*", cb=self._aio_on_ack)

    async def _aio_on_ack(self, msg: Any) -> None:
        token = msg.subject[len(self._ack_prefix) + 1 :]
        if token not in self._ack_live:
            return  # a late ack for a publish we already gave up on (and retried)
        self._ack_results[token] = _ack_error(msg)
        self._ack_waiting.discard(token)
        if not self._ack_waiting and self._ack_event is not None:
            self._ack_event.set()

    async def _aio_send(self, batch: list[Outgoing]) -> list[Any]:
        """One handle per message: an ack token (JetStream), None (core publish sent), or the exception."""
        out: list[Any] = []
        for it in batch:
            token = None
            try:
                if it.acked:
                    self._ack_seq += 1
                    token = str(self._ack_seq)
                    self._ack_live.add(token)
                reply = f"{self._ack_prefix}.{token}" if token else ""
                await self._nc.publish(it.subject, it.data, reply=reply, headers=it.headers)
                out.append(token)
            except (nats.errors.Error, OSError) as exc:
                self._ack_live.discard(token or "")
                out.append(exc)
        return out

    async def _aio_wait(self, sent: list[Any], timeout: float) -> list[BaseException | None]:
        pending = {t for t in sent if isinstance(t, str) and t not in self._ack_results}
        if pending:
            self._ack_waiting, self._ack_event = pending, asyncio.Event()
            try:
                await asyncio.wait_for(self._ack_event.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            finally:
                self._ack_waiting, self._ack_event = set(), None
        out: list[BaseException | None] = []
        for t in sent:
            if not isinstance(t, str):
                out.append(t)
                continue
            self._ack_live.discard(t)
            out.append(self._ack_results.pop(t) if t in self._ack_results else asyncio.TimeoutError("no publish ack"))
        return out

    async def _aio_pull_sub(self, durable: str, subject: str) -> Any:
        cc = api.ConsumerConfig(
            durable_name=durable, ack_policy=api.AckPolicy.EXPLICIT, ack_wait=self.config.ack_wait_s,
            max_ack_pending=self.config.max_ack_pending, deliver_policy=api.DeliverPolicy.ALL,
            filter_subject=subject, max_deliver=-1,
        )  # fmt: skip
        return await self._js.pull_subscribe(subject, durable=durable, stream=TRAJ_STREAM, config=cc)

    @staticmethod
    async def _aio_fetch(psub: Any, n: int, max_wait_s: float) -> list[Fetched[Any]]:
        try:
            msgs = await psub.fetch(batch=n, timeout=max_wait_s)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):  # nats-py raises either when nothing came
            return []
        return [Fetched(m.subject, m.data, dict(m.headers or {}), m, m.metadata.sequence.stream,
                        m.metadata.num_delivered) for m in msgs]  # fmt: skip

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
