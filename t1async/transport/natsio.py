"""The asyncio side of NatsTransport: everything that touches nats-py, one bridge crossing per call.

``NatsTransport`` (transport/nats.py) runs on the caller's backend and calls these coroutines through a
``Bridge`` (trio-asyncio under trio, directly on asyncio). Each method here is one crossing and does a whole
batch of work: send a batch of publishes, wait for a batch of acks, fetch, settle a batch, drain a queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
import sniffio
from nats.js import api

from t1async.log import get_logger
from t1async.protocol.errors import TransportError
from t1async.transport.auth import NatsCreds, load_creds, redact
from t1async.transport.base import TRAJ_STREAM, TRAJ_SUBJECTS
from t1async.transport.delivery import Fetched
from t1async.transport.pipeline import Outgoing

log = get_logger("transport.nats")
DEFAULT_URL = "nats://127.0.0.1:4222"
DEAD_STREAM = "T1_DEAD"
T = TypeVar("T")

# what JetStream's API answers while a stream's replicas or the meta group elect a leader: wait, then ask again
ELECTING = (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError)


async def while_electing(
    call: Callable[[], Awaitable[T]],
    wait_s: float,
    pause_s: float,
    on_wait: Callable[[BaseException], None] | None = None,
) -> T:
    """``call()``, again every ``pause_s`` while JetStream answers 503 "temporarily unavailable" or not at all.

    A cluster that just restarted, or whose link to a host just came back, answers its JetStream API only once
    it has elected. After ``wait_s`` the last error is raised as it came; ``on_wait`` sees each one before it.
    """
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        try:
            return await call()
        except ELECTING as exc:
            if asyncio.get_running_loop().time() >= deadline:
                raise
            if on_wait is not None:
                on_wait(exc)
            await asyncio.sleep(pause_s)


@dataclasses.dataclass(frozen=True)
class NatsConfig:
    url: str = DEFAULT_URL  # several servers: "nats://a:4222,nats://b:4222"
    name: str = "t1async"
    connect_timeout_s: float = 2.0
    reconnect_wait_s: float = 0.25
    ack_timeout_s: float = 5.0  # one publish attempt; then it is retried with the same msg_id
    publish_deadline_s: float = 120.0  # give up (TransportError) after this long without an ack
    retry_wait_s: float = 0.25
    jetstream_wait_s: float = 60.0  # opening: how long JetStream's API may time out (a cluster electing)
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
    creds: Path | None = None  # --nats-creds: a credentials file (transport/auth.py); None: none, or the URL's


class Bridge:
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


class AioNats:
    """The nats-py connection (``nc``), its JetStream context (``js``) and the publish-ack inbox. Every
    coroutine runs on asyncio and is one crossing of the Bridge."""

    def __init__(self, config: NatsConfig, is_open: Callable[[], bool]) -> None:
        self.config = config
        self._is_open = is_open  # the transport's state: a disconnect is only worth a warning while open
        self.nc: Any = None
        self.js: Any = None
        self._creds = load_creds(config.creds) if config.creds is not None else NatsCreds()  # a bad file fails now

    async def connect(self) -> None:
        cfg, urls = self.config, [u.strip() for u in self.config.url.split(",") if u.strip()]
        creds = self._creds
        where = redact(cfg.url)

        told: list[str] = []  # what the server said while connecting (a refusal comes only here with reconnects)

        async def on_error(exc: Exception) -> None:
            told.append(repr(exc))
            log.warning("nats.error", error=repr(exc))

        async def on_disconnected() -> None:
            if self._is_open():
                log.warning("nats.disconnected", url=where)

        async def on_reconnected() -> None:
            log.info("nats.reconnected", url=where)

        try:
            nc = await nats.connect(
                servers=urls,
                name=cfg.name,
                connect_timeout=cfg.connect_timeout_s,
                allow_reconnect=True,
                reconnect_time_wait=cfg.reconnect_wait_s,
                max_reconnect_attempts=1,
                pending_size=cfg.pending_bytes,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
                **creds.connect_options(),
            )
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            if "authorization violation" in f"{exc!r} {told}".lower():
                given = f"--nats-creds {cfg.creds}" if cfg.creds else "no credentials"
                raise TransportError(
                    f"NATS at {where} refused us ({given}): pass the credentials of this role, e.g. "
                    "--nats-creds <run-dir>/secrets/nats-<role>.json as `cluster up` writes them"
                ) from exc
            raise self._unreachable(where, exc) from exc
        nc.options["max_reconnect_attempts"] = -1  # once connected, ride out server restarts forever
        self.nc, self.js = nc, nc.jetstream(timeout=cfg.ack_timeout_s)

    @staticmethod
    def _unreachable(where: str, exc: BaseException) -> TransportError:
        return TransportError(
            f"cannot reach NATS at {where}: is the server running? start one with "
            f"`python -m t1async.cluster up` ({type(exc).__name__}: {exc})"
        )

    async def ensure_streams(self) -> None:
        cfg = self.config
        r = cfg.stream_replicas or 1
        wanted = [
            api.StreamConfig(
                name=TRAJ_STREAM,
                subjects=[TRAJ_SUBJECTS],
                storage=api.StorageType.FILE,
                duplicate_window=cfg.duplicate_window_s,
                retention=api.RetentionPolicy.LIMITS,
                num_replicas=r,
            ),
            api.StreamConfig(
                name=DEAD_STREAM,
                subjects=["t1.dead.>"],
                storage=api.StorageType.FILE,
                max_msgs=100_000,
                max_bytes=1 << 30,
                discard=api.DiscardPolicy.OLD,
                num_replicas=r,
            ),
        ]
        for sc in wanted:

            def waiting(exc: BaseException, name: str | None = sc.name) -> None:
                log.warning("transport.jetstream_wait", stream=name, error=repr(exc))

            try:
                await while_electing(
                    functools.partial(self._ensure_stream, sc), cfg.jetstream_wait_s, cfg.retry_wait_s, waiting
                )
            except ELECTING as exc:
                raise TransportError(
                    f"JetStream at {redact(cfg.url)} did not answer for {cfg.jetstream_wait_s:.0f} s "
                    f"({type(exc).__name__}): a cluster that just restarted may still be electing, or too "
                    "few of its servers are up for a quorum; start them, or check their logs"
                ) from exc

    async def _ensure_stream(self, sc: api.StreamConfig) -> None:
        cfg = self.config
        try:
            try:
                info = await self.js.stream_info(sc.name)
            except nats.js.errors.NotFoundError:
                try:
                    await self.js.add_stream(sc)
                    return
                except nats.js.errors.BadRequestError:
                    info = await self.js.stream_info(sc.name)  # created concurrently by another client: fine
            have = info.config.num_replicas or 1
            if cfg.stream_replicas is not None and have != cfg.stream_replicas:
                await self.js.update_stream(dataclasses.replace(info.config, num_replicas=cfg.stream_replicas))
                log.info("transport.stream_replicas", stream=sc.name, was=have, now=cfg.stream_replicas)
        except nats.js.errors.ServiceUnavailableError:
            raise  # retried by ensure_streams
        except nats.js.errors.APIError as exc:
            if cfg.stream_replicas and cfg.stream_replicas > 1 and exc.err_code in (10005, 10074, 10023):
                raise TransportError(
                    f"JetStream at {redact(cfg.url)} cannot keep stream {sc.name} with {cfg.stream_replicas} replicas "
                    f"({exc.description}): it needs that many JetStream servers in the cluster; pass "
                    f"--stream-replicas 1 for a single server, or start a cluster (`cluster up --nats-nodes 3`)"
                ) from exc
            raise

    async def init_acks(self) -> None:
        """JetStream publish acks come back on our own inbox, handled in bulk: no future per message (nats-py's
        publish_async costs several asyncio callbacks per message, and each is a trip through trio-asyncio)."""
        self._ack_prefix = self.nc.new_inbox()
        self._ack_seq = 0
        self._ack_live: set[str] = set()  # sent, not yet collected by wait()
        self._ack_results: dict[str, BaseException | None] = {}
        self._ack_waiting: set[str] = set()
        self._ack_event: asyncio.Event | None = None
        await self.nc.subscribe(self._ack_prefix + ".*", cb=self._on_ack)

    async def _on_ack(self, msg: Any) -> None:
        token = msg.subject[len(self._ack_prefix) + 1 :]
        if token not in self._ack_live:
            return  # a late ack for a publish we already gave up on (and retried)
        self._ack_results[token] = _ack_error(msg)
        self._ack_waiting.discard(token)
        if not self._ack_waiting and self._ack_event is not None:
            self._ack_event.set()

    async def send(self, batch: list[Outgoing]) -> list[Any]:
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
                await self.nc.publish(it.subject, it.data, reply=reply, headers=it.headers)
                out.append(token)
            except (nats.errors.Error, OSError) as exc:
                self._ack_live.discard(token or "")
                out.append(exc)
        return out

    async def wait(self, sent: list[Any], timeout: float) -> list[BaseException | None]:
        pending = {t for t in sent if isinstance(t, str) and t not in self._ack_results}
        if pending:
            self._ack_waiting, self._ack_event = pending, asyncio.Event()
            try:
                await asyncio.wait_for(self._ack_event.wait(), timeout)
            except TimeoutError:
                pass
            finally:
                self._ack_waiting, self._ack_event = set(), None
        out: list[BaseException | None] = []
        for t in sent:
            if not isinstance(t, str):
                out.append(t)
                continue
            self._ack_live.discard(t)
            out.append(self._ack_results.pop(t) if t in self._ack_results else TimeoutError("no publish ack"))
        return out

    async def pull_sub(self, durable: str, subject: str) -> Any:
        cc = api.ConsumerConfig(
            durable_name=durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.config.ack_wait_s,
            max_ack_pending=self.config.max_ack_pending,
            deliver_policy=api.DeliverPolicy.ALL,
            filter_subject=subject,
            max_deliver=-1,
        )
        return await self.js.pull_subscribe(subject, durable=durable, stream=TRAJ_STREAM, config=cc)

    @staticmethod
    async def fetch(psub: Any, n: int, max_wait_s: float) -> list[Fetched[Any]]:
        try:
            msgs = await psub.fetch(batch=n, timeout=max_wait_s)
        except (TimeoutError, nats.errors.TimeoutError):  # nats-py raises either when nothing came
            return []
        return [
            Fetched(m.subject, m.data, dict(m.headers or {}), m, m.metadata.sequence.stream, m.metadata.num_delivered)
            for m in msgs
        ]

    async def settle(self, ack: list, term: list, nak: list, dead: list) -> None:
        for m in ack:
            await m.ack()
        for m in term:
            await m.term()
        for m in nak:
            await m.nak()
        for subj, headers, payload in dead:
            await self.nc.publish(subj, payload, headers=headers)
        if ack or term or nak:
            await self.sync()

    async def release(self, psub: Any, held: list) -> None:
        for m in held:
            await m.nak()
        try:
            await psub.unsubscribe()
            await self.sync()
        except nats.errors.Error as exc:
            log.warning("transport.unsubscribe_failed", error=repr(exc))

    async def subscribe(self, subject: str, queue: str) -> tuple[Any, Any]:
        q: asyncio.Queue = asyncio.Queue(maxsize=self.config.queue_size)

        async def cb(msg: Any) -> None:
            await q.put(msg)

        sub = await self.nc.subscribe(subject, queue=queue, cb=cb)
        await self.sync()  # the server knows the subscription when subscribe()/serve() return
        return q, sub

    async def sync(self) -> None:
        """Wait until the server has processed everything we sent. nats-py's flush() alone does not: it
        writes its PING straight to the socket, ahead of commands still in its pending buffer."""
        # nats-py private API, on purpose: it has no public way to push its pending buffer out first
        await self.nc._flush_pending(force_flush=True)
        await self.nc.flush(timeout=max(1, math.ceil(self.config.ack_timeout_s)))

    @staticmethod
    async def drain(q: asyncio.Queue, n: int) -> list[tuple]:
        msgs = [await q.get()]
        while len(msgs) < n:
            try:
                msgs.append(q.get_nowait())
            except asyncio.QueueEmpty:
                break
        return [(m.subject, m.data, dict(m.headers or {}), m.reply) for m in msgs]

    async def unsubscribe(self, sub: Any) -> None:
        try:
            await sub.unsubscribe()
        except nats.errors.Error as exc:
            log.warning("transport.unsubscribe_failed", error=repr(exc))
