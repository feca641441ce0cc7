"""Which sampler serves a request, when there are several (``SGLangClient`` with N URLs).

- **Pinning**: every turn of an episode goes to the sampler that served its first turn, so its prefix cache
  holds the episode's context (a turn re-sends the whole context; only the new tokens are computed there).
- **Load cap**: a *new* episode goes to the least-loaded live sampler below ``load_cap`` outstanding
  requests (ties rotate), never to a saturated one while another is below the cap. Pinned episodes stay
  where they are. Hashing alone thrashes a saturated engine's KV cache (prime-rl #3255); least-outstanding
  alone loses prefix locality (verl #6383).
- **Health**: a sampler that fails a request (connection refused, timeout, 5xx after retries) is taken out at
  once; its episodes are re-pinned to a live one on their next turn (the new sampler recomputes the prefix and
  returns routes from where it recomputed them: design §6's route fork, so the learner replays the routes
  actually used). ``SamplerPool.monitor`` probes ``/health_generate`` every ``probe_every_s``; a sampler
  that fails the probe is taken out, and one that passes it comes back only once its live ``weight_version``
  (``/model_info``'s) has caught up with the newest among the live samplers (the learner pushes every version
  to every URL, so a restarted sampler is re-synced by the next push). A sampler held by a weight push
  (``/ready`` 503, its health token waiting out the pause, as SGLang's does) is neither taken out nor brought
  back: the probe answers None for it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from t1async.log import get_logger

log = get_logger("sampler.pool")


@dataclass(frozen=True)
class PoolConfig:
    load_cap: int = 16  # outstanding requests on one sampler above which new episodes go to another (0: no cap)
    probe_every_s: float = 2.0
    probe_timeout_s: float = 10.0
    max_pins: int = 65_536  # episodes remembered (least recently used forgotten first)


# probe(url) -> (healthy, or None: paused, left as it is; weight_version or None); raises nothing
Probe = Callable[[str], Awaitable[tuple[bool | None, int | None]]]


class SamplerPool:
    def __init__(self, urls: list[str], outstanding: dict[str, int], config: PoolConfig | None = None):
        self.urls = list(urls)
        self.config = config or PoolConfig()
        self.outstanding = outstanding  # shared with the client, which counts requests in flight
        self.live: set[str] = set(self.urls)
        self.pins: OrderedDict[str, str] = OrderedDict()
        self.versions: dict[str, int] = {}
        self.moved = 0  # pinned episodes moved off a dead sampler
        self._rr = itertools.count()

    def pick(self, key: str | None = None, avoid: str | None = None) -> str:
        """The URL for a request of episode ``key`` (None: not pinned), not ``avoid`` where another is live."""
        pinned = self.pins.get(key) if key is not None else None
        if pinned is not None and pinned in self.live and pinned != avoid:
            self.pins.move_to_end(key)  # type: ignore[arg-type]
            return pinned
        live = [u for u in self.urls if u in self.live]
        candidates = [u for u in live if u != avoid] or live or [u for u in self.urls if u != avoid] or self.urls
        cap = self.config.load_cap
        below = [u for u in candidates if not cap or self.outstanding[u] < cap] or candidates
        low = min(self.outstanding[u] for u in below)
        best = [u for u in below if self.outstanding[u] == low]
        url = best[next(self._rr) % len(best)]
        if key is not None:
            if pinned is not None:
                self.moved += 1
                log.info("sampler.episode_moved", episode=key, was=pinned, now=url)
            self.pins[key] = url
            self.pins.move_to_end(key)
            while len(self.pins) > self.config.max_pins:
                self.pins.popitem(last=False)
        return url

    def mark_down(self, url: str, cause: str) -> None:
        if url in self.live and len(self.urls) > 1:
            self.live.discard(url)
            log.warning("sampler.down", url=url, cause=cause, live=len(self.live))

    def mark_up(self, url: str) -> None:
        if url not in self.live:
            self.live.add(url)
            log.info("sampler.up", url=url, policy_version=self.versions.get(url), live=len(self.live))

    async def probe_all(self, probe: Probe) -> None:
        """One round: probe every URL; take out the failed ones, bring back the healthy and current ones."""
        results: dict[str, tuple[bool | None, int | None]] = {}

        async def one(u: str) -> None:
            with anyio.move_on_after(self.config.probe_timeout_s):
                results[u] = await probe(u)
                return
            results[u] = (False, None)

        async with anyio.create_task_group() as tg:
            for u in self.urls:
                tg.start_soon(one, u)
        for u, (ok, policy_version) in results.items():
            if policy_version is not None:
                self.versions[u] = policy_version
            if ok is False:
                self.mark_down(u, "health_generate failed")
        current = max((self.versions.get(u, 0) for u in self.live if results[u][0]), default=0)
        for u, (ok, policy_version) in results.items():
            if ok and u not in self.live:
                if policy_version is not None and policy_version >= current:
                    self.mark_up(u)
                else:
                    log.info("sampler.waiting_for_weights", url=u, policy_version=policy_version, current=current)

    async def monitor(self, probe: Probe) -> None:
        """Probe forever (run it in the owner's task group; cancel it to stop)."""
        while True:
            await self.probe_all(probe)
            await anyio.sleep(self.config.probe_every_s)
