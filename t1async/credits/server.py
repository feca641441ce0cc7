"""The learner's side of ``t1.credit``: hold each request until the staleness rule lets it be granted.

Requests are keyed by ``(episode, turn)``. An actor whose request timed out asks again; the retry takes over
the pending hold (the reply goes to the newest request), and a request for a turn already granted gets
the same grant back at once, so one turn never holds two credits.

With η = 0 nothing is granted while a step trains: a turn admitted then would be sampled by the version
being replaced and trained one version later (staleness 1).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import anyio

from t1async.credits.client import CREDIT_SUBJECT
from t1async.credits.ledger import CreditGate
from t1async.log import get_logger
from t1async.protocol.wire import CreditGrant, CreditRequest
from t1async.transport.base import Request, Transport

log = get_logger("t1async.credits.server")


class CreditServer:
    def __init__(self, gate: CreditGate, transport: Transport, on_actor: Callable[[str], None] | None = None) -> None:
        self.gate, self.transport = gate, transport
        self.on_actor = on_actor  # every request is a sign of life of its actor (credits/liveness.py)
        self.training = False
        self._pending: dict[tuple[str, int], Request] = {}  # the latest request of each held (episode, turn)
        self._granted: dict[
            tuple[str, int], tuple[str, CreditGrant]
        ] = {}  # granted, turn not delivered: (actor, grant)
        self._holds: dict[tuple[str, int], tuple[str, anyio.CancelScope]] = {}  # running holds: (actor, scope)
        self.bad_requests = 0
        self._anonymous = itertools.count(1)  # requests that name no turn cannot be deduplicated

    def set_training(self, training: bool) -> None:
        self.training = training
        if self.gate.ledger.eta == 0:
            self.gate.hold(training)

    def on_delivered(self, episode: str, turn: int) -> None:
        self._granted.pop((episode, turn), None)

    def forget(self, *, actor: str | None = None, episodes: set[str] | frozenset[str] = frozenset()) -> int:
        """Drop the remembered grants of a released actor or of closed episodes (their credits are gone), and
        cancel their held requests: a grant made later would be a credit nobody uses until its lease ends."""
        gone = [k for k, (a, _) in self._granted.items() if a == actor or k[0] in episodes]
        for k in gone:
            del self._granted[k]
        for k, (a, scope) in list(self._holds.items()):
            if a == actor or k[0] in episodes:
                scope.cancel()
                del self._holds[k]
                self._pending.pop(k, None)
        return len(gone)

    async def serve(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        async with self.transport.serve(CREDIT_SUBJECT) as requests, anyio.create_task_group() as tg:
            task_status.started()
            async for req in requests:
                rec = req.record
                if not isinstance(rec, CreditRequest):
                    self.bad_requests += 1
                    log.warning("credit.bad_request", kind=rec.kind)
                    continue
                if self.on_actor is not None:
                    self.on_actor(rec.actor)
                key = (rec.episode, rec.turn) if rec.turn >= 0 else (rec.episode, -next(self._anonymous))
                if key in self._granted:
                    await self._reply(req, self._granted[key][1])
                elif key in self._pending:
                    self._pending[key] = req  # a retry: the hold already running answers the newest request
                else:
                    self._pending[key] = req
                    tg.start_soon(self._hold, key, rec)

    async def _hold(self, key: tuple[str, int], rec: CreditRequest) -> None:
        with anyio.CancelScope() as scope:
            self._holds[key] = (rec.actor, scope)
            grant = await self.gate.acquire(rec.actor, rec.episode, 1, rec.turn)
        if scope.cancel_called or self._holds.pop(key, None) is None:
            return  # its actor was released or its episode closed: no reply (the actor, if alive, asks again)
        if rec.turn >= 0:
            self._granted[key] = (rec.actor, grant)
        req = self._pending.pop(key)
        await self._reply(req, grant)

    async def _reply(self, req: Request, grant: CreditGrant) -> None:
        try:
            await req.respond(grant)
        except Exception as exc:  # the requester gave up (inbox gone): its retry will get the same grant
            log.debug("credit.reply_failed", error=str(exc))
