"""Credits: an actor asks the learner's ``t1.credit`` before sampling each turn (DESIGN §7).

The learner holds its reply while granting would break the staleness bound; that wait is the backpressure.
A request that times out is simply asked again: the learner keys grants by episode, so a retried request
gets the grant it may already have been given, never a second one.
"""

from __future__ import annotations

import time
from typing import Sequence

import anyio

from t1async.log import get_logger
from t1async.sampler.base import Generation, Sampler, SamplingParams
from t1async.transport.base import NoResponders, RequestTimeout, Transport
from t1async.wire import CreditGrant, CreditRequest

CREDIT_SUBJECT = "t1.credit"
log = get_logger("actors.credits")


class CreditClient:
    def __init__(self, transport: Transport, actor: str, *, request_timeout_s: float = 20.0) -> None:
        self.transport, self.actor = transport, actor
        self.request_timeout_s = request_timeout_s
        self.wait_s = 0.0  # total time spent waiting for credits (backpressure felt by this actor)
        self.granted = 0

    async def acquire(self, episode: str, turn: int = -1) -> CreditGrant:
        t0 = time.monotonic()
        backoff = 0.2
        while True:
            try:
                reply = await self.transport.request(
                    CREDIT_SUBJECT, CreditRequest(self.actor, episode, 1, turn), timeout=self.request_timeout_s
                )
            except RequestTimeout:
                log.debug("credit.held", episode=episode, waited_s=round(time.monotonic() - t0, 1))
                continue
            except NoResponders:
                log.info("credit.no_learner", episode=episode, retry_in_s=backoff)
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            if isinstance(reply, CreditGrant) and reply.granted > 0:
                self.wait_s += time.monotonic() - t0
                self.granted += 1
                return reply
            log.warning("credit.bad_reply", episode=episode, kind=reply.kind)
            await anyio.sleep(backoff)


class CreditedSampler:
    """A Sampler that takes a credit for ``episode`` before every generate (one credit per turn)."""

    def __init__(self, inner: Sampler, credits: CreditClient, episode: str) -> None:
        self.inner, self.credits, self.episode = inner, credits, episode
        self.last_grant: CreditGrant | None = None
        self.turn = 0  # the agent samples each turn once, in order: the n-th generate is turn n

    async def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        routed_experts_start_len: int | None = None,
        rid: str | None = None,
    ) -> Generation:
        self.last_grant = await self.credits.acquire(self.episode, self.turn)
        self.turn += 1
        return await self.inner.generate(
            input_ids, params, routed_experts_start_len=routed_experts_start_len, rid=rid
        )

    async def aclose(self) -> None:  # the inner sampler is shared and owned by the actor
        return None
