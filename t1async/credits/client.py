"""Credits: an actor asks the learner's ``t1.credit`` before sampling each turn (design §7).

The learner holds its reply while granting would break the staleness bound; that wait is the backpressure.
A request that times out is simply asked again: the learner keys grants by episode, so a retried request
gets the grant it may already have been given, never a second one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import anyio

from t1async.log import get_logger
from t1async.protocol.sampling import Generation, Sampler, SamplingParams
from t1async.protocol.wire import CreditGrant, CreditRequest
from t1async.transport.base import NoRespondersError, RequestTimeoutError, Transport

CREDIT_SUBJECT = "t1.credit"  # the learner's CreditServer serves it; actors request credits on it
log = get_logger("t1async.credits.client")


class CreditClient:
    def __init__(self, transport: Transport, actor: str, *, request_timeout_s: float = 20.0) -> None:
        self.transport, self.actor = transport, actor
        self.request_timeout_s = request_timeout_s
        self.wait_s = 0.0  # total time spent waiting for credits (backpressure felt by this actor)
        self.wait_max_s = 0.0
        self.granted = 0
        self._recent: deque[float] = deque(maxlen=4096)  # the latest waits, for percentiles

    def wait_stats(self) -> dict[str, float | int]:
        """The credit waits this actor felt: how many, their total and mean, and p50 / p99 of the latest 4096
        and the longest, in seconds (the metrics record's ``credit_wait_*`` keys)."""
        recent = sorted(self._recent)

        def pct(q: float) -> float:
            return recent[min(len(recent) - 1, int(q * len(recent)))] if recent else 0.0

        return {
            "credit_waits": self.granted,
            "credit_wait_s": self.wait_s,
            "credit_wait_mean_s": self.wait_s / self.granted if self.granted else 0.0,
            "credit_wait_p50_s": pct(0.5),
            "credit_wait_p99_s": pct(0.99),
            "credit_wait_max_s": self.wait_max_s,
        }

    async def acquire(self, episode: str, turn: int = -1) -> CreditGrant:
        t0 = anyio.current_time()  # the event loop's clock: a test's MockClock drives it
        backoff = 0.2
        while True:
            try:
                reply = await self.transport.request(
                    CREDIT_SUBJECT, CreditRequest(self.actor, episode, 1, turn), timeout=self.request_timeout_s
                )
            except RequestTimeoutError:
                log.debug("credit.held", episode=episode, waited_s=round(anyio.current_time() - t0, 1))
                continue
            except NoRespondersError:
                log.info("credit.no_learner", episode=episode, retry_in_s=backoff)
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            if isinstance(reply, CreditGrant) and reply.granted > 0:
                waited = anyio.current_time() - t0
                self.wait_s += waited
                self.wait_max_s = max(self.wait_max_s, waited)
                self._recent.append(waited)
                self.granted += 1
                return reply
            log.warning("credit.bad_reply", episode=episode, kind=reply.kind)
            await anyio.sleep(backoff)


class CreditedSampler:
    """A Sampler that takes a credit for ``episode`` before every generate (one credit per turn).

    A generate that returned no output tokens is not a turn (the wire has no empty turn; actors/episode.py
    does not stream it), so its credit is not spent: the next generate uses it, and the turn numbers the
    credits name stay the streamed turn numbers. A credit still unspent when the episode ends is released
    by the learner when the ``end`` arrives.

    ``wait_turn()`` takes the next turn's credit ahead of ``generate``: the agent calls it outside its wall
    clock (``sandbox_agent.agent.types.TurnGate``), because the learner's backpressure pauses the episode; it is
    not time the agent spent."""

    def __init__(self, inner: Sampler, credits: CreditClient, episode: str) -> None:
        self.inner, self.credits, self.episode = inner, credits, episode
        self.last_grant: CreditGrant | None = None
        self.turn = 0  # the n-th generate that returned tokens is turn n
        self.unspent: CreditGrant | None = None  # granted for ``turn``, not used by a streamed turn yet
        self.empty = 0  # generates that returned no tokens (their credit carried to the next)

    async def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        routed_experts_start_len: int | None = None,
        rid: str | None = None,
    ) -> Generation:
        await self.wait_turn()
        self.last_grant = self.unspent
        gen = await self.inner.generate(input_ids, params, routed_experts_start_len=routed_experts_start_len, rid=rid)
        if len(gen.output_ids) == 0:
            self.empty += 1
            log.info(
                "credit.carried",
                episode=self.episode,
                turn=self.turn,
                finish=gen.finish,
                hint="the sampler returned no tokens; this credit pays for the next sample",
            )
        else:
            self.unspent = None
            self.turn += 1
        return gen

    async def wait_turn(self) -> None:
        """Hold a credit for the next turn (waits while the learner holds it back)."""
        if self.unspent is None:
            self.unspent = await self.credits.acquire(self.episode, self.turn)

    async def aclose(self) -> None:  # the inner sampler is shared and owned by the actor
        return None
