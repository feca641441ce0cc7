"""Which actors are alive (design §7): credits are granted to live actors only.

Actors publish a ``heartbeat`` on ``t1.actor.<id>`` every few seconds (actors/actor.py); a credit request
is a sign of life too. The learner knows each open episode's actor from its ``start`` record (journaled, so
a restarted learner knows it too) or, failing that, from its credit requests and its id
(``<actor>-<hex>``). An actor silent for ``timeout_s`` is released: the learner frees its running credits at
once and publishes an ``end`` (reason ``aborted``) for each of its open episodes, which ingest journals and
assembles like any end, so what arrived is trained and compaction can drop the episode.

A restarted actor (``cluster up`` restarts one that dies, under the same id) is not silent: its heartbeats go
on. Each heartbeat says when its process started; an open episode of that actor created before then (its
``start`` record's ``created_at``, the same host's clock) belongs to the dead process and is closed the same
way at once, its credits freed, instead of holding the staleness bound until a timeout.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import anyio.lowlevel

from t1async.log import get_logger

if TYPE_CHECKING:
    from t1async.transport.base import Transport

log = get_logger("t1async.credits.liveness")
RELEASED_MEMORY = 10_000
HEARTBEAT_SUBJECTS = "t1.actor.>"  # an actor heartbeats on t1.actor.<actor id>


def actor_of(episode: str) -> str:
    """The actor named in an episode id made by ``actors.episode.new_episode_id`` (``<actor>-<hex>``)."""
    return episode.rsplit("-", 1)[0] if "-" in episode else episode


class ActorLiveness:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = anyio.current_time) -> None:
        if not timeout_s > 0:
            raise ValueError(f"actor timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s, self.clock = float(timeout_s), clock
        self.last_seen: dict[str, float] = {}
        self.owner: dict[str, str] = {}  # open episode -> actor
        self.created: dict[str, float] = {}  # open episode -> its start record's created_at (the actor's clock)
        self.started: dict[str, float] = {}  # actor -> the newest process start its heartbeats told
        self.released: OrderedDict[str, float] = OrderedDict()  # actors declared silent -> when
        self.timeouts = 0  # actors released with work (open episodes) in hand

    def seen(self, actor: str) -> None:
        self.last_seen[actor] = self.clock()
        self.released.pop(actor, None)

    def owns(self, episode: str, actor: str, created_at: float | None = None) -> None:
        """``episode`` is open and run by ``actor``; its silence clock starts now if it has none yet.
        ``created_at``: its start record's (None: not known, then it is never taken for an orphan)."""
        self.owner[episode] = actor
        if created_at is not None:
            self.created[episode] = created_at
        self.last_seen.setdefault(actor, self.clock())

    def closed(self, episode: str) -> None:
        self.owner.pop(episode, None)
        self.created.pop(episode, None)

    def orphaned(self, actor: str, started_at: float) -> list[str]:
        """A heartbeat of ``actor`` from a process started at ``started_at``: its open episodes created
        before that (an earlier process of this actor id, now gone). Each is reported once."""
        if started_at <= 0:
            return []
        self.started[actor] = max(started_at, self.started.get(actor, 0.0))
        out = sorted(ep for ep, a in self.owner.items() if a == actor and self.created.get(ep, started_at) < started_at)
        for ep in out:
            self.created.pop(ep, None)  # reported: not again
        return out

    def episodes_of(self, actor: str) -> list[str]:
        return sorted(ep for ep, a in self.owner.items() if a == actor)

    def silent(self) -> list[str]:
        """Actors not heard from for ``timeout_s``; each is reported once (until it is heard from again)."""
        now = self.clock()
        out = [a for a, t in self.last_seen.items() if now - t > self.timeout_s]
        for a in out:
            del self.last_seen[a]
            self.released[a] = now
            while len(self.released) > RELEASED_MEMORY:
                self.released.popitem(last=False)
        return out

    def restart_clocks(self) -> None:
        """After a restart nothing was heard yet: every known actor gets a full timeout to show up."""
        now = self.clock()
        for a in set(self.owner.values()) | set(self.last_seen):
            self.last_seen[a] = now


async def watch_actors(
    liveness: ActorLiveness,
    transport: Transport,
    on_silent: Callable[[str], Awaitable[None]],
    on_orphans: Callable[[str, list[str]], Awaitable[None]] | None = None,
    *,
    task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Record heartbeats from ``t1.actor.>``, call ``on_silent(actor)`` for each actor that goes silent, and
    ``on_orphans(actor, episodes)`` for the open episodes a restarted actor's earlier process left."""
    from t1async.protocol import wire

    async def reap() -> None:
        interval = min(1.0, liveness.timeout_s / 4)
        last = liveness.clock()
        while True:
            await anyio.sleep(interval)
            now = liveness.clock()
            if now - last > interval + liveness.timeout_s / 2:
                # this process stalled (a long step, swap): heartbeats wait unread, so silence means nothing
                log.warning("liveness.stalled", stalled_s=round(now - last, 1), hint="every actor gets a fresh timeout")
                liveness.restart_clocks()
            else:
                for _ in range(3):  # let heartbeats already received be read first
                    await anyio.lowlevel.checkpoint()
                for actor in liveness.silent():
                    await on_silent(actor)
            last = now

    async with transport.subscribe(HEARTBEAT_SUBJECTS) as msgs, anyio.create_task_group() as tg:
        tg.start_soon(reap)
        task_status.started()
        async for m in msgs:
            if isinstance(m.record, wire.Heartbeat):
                liveness.seen(m.record.actor)
                orphans = liveness.orphaned(m.record.actor, m.record.started_at)
                if orphans and on_orphans is not None:
                    await on_orphans(m.record.actor, orphans)
