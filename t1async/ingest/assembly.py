"""Episode assembly: from a stream of turn records (any order, at-least-once) to trainable ``Segment``s.

``Assembler`` takes the records of many episodes; each episode has an ``EpisodeAssembler`` that buffers
out-of-order turns until the gap fills, drops exact redeliveries (counted), counts and logs a conflicting
duplicate (same turn, different content: the first one wins), checks and repairs every boundary
(``t1async.ingest.tito``) and aligns routing (``t1async.ingest.routing``).

Segments come out when they are complete:

- a FORK closes the open segment (``done=False``; its last turn's value is the bootstrap);
- so does a "route fork": a turn whose trace reaches back into the context with routes other than the ones
  recorded there (the sampler recomputed it after a weight update flushed its prefix cache, design §6). Its
  new segment replays that turn's own routes for the context; counted in ``DriftStats.route_forks``;
- the episode's ``end`` record (once every turn up to ``end.turns`` has arrived) closes it with ``done=True``;
- ``cut()`` returns the open segment *so far* (``done=False``) for partial-trajectory training (``done=True``
  when its last turn is the episode's ``last``: the episode ended there, its end record is on the way, so
  there is nothing to bootstrap; a one-turn episode cut before its end record must not get the value head's
  estimate on top of its reward). The segment
  stays open: its next return re-includes the whole context (so every later turn is still trained in exactly
  the context it was sampled in) with the loss only on turns not returned before, and gets the next
  ``index``. Turns already returned are context there (``loss_mask`` False, logprob 0, version -1) and are
  not listed in ``turn_ends``.

If an episode ends right after a cut, with no new turn, nothing is returned (nothing is left to train): the
cut segment was trained with ``done=False``, i.e. bootstrapped where the true return is 0. It is counted
(``DriftStats.ended_after_cut``); the learner limits it by cutting only the turns a batch needs.

One episode's part is episode.py (``EpisodeAssembler``, ``AssemblerConfig``: both import from here).
Buffered out-of-order turns are bounded per episode (``max_pending_turns``); past it the episode is abandoned
(logged, its trainable part returned, the rest counted as untrainable) rather than growing without bound.
"""

from __future__ import annotations

from collections import OrderedDict

from t1async.ingest.episode import AssemblerConfig, EpisodeAssembler
from t1async.ingest.routing import RoutingStats
from t1async.ingest.tito import DriftStats, Segment
from t1async.log import get_logger
from t1async.protocol import wire

__all__ = ["Assembler"]


class Assembler:
    """Assembles the turn stream of many episodes. Not thread-safe; one per learner ingest task.

    ``add(turn)``, ``end(end_record)`` and ``feed(record)`` return the segments that became complete;
    ``cut(episode=None)`` returns open segments so far (all open episodes when ``episode`` is None).
    """

    def __init__(self, config: AssemblerConfig | None = None) -> None:
        self.config = config or AssemblerConfig()
        self.log = get_logger("t1async.ingest.assembly")
        self.open: dict[str, EpisodeAssembler] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.recent: OrderedDict[str, DriftStats] = OrderedDict()
        self._done_drift = DriftStats()
        self._done_routing = RoutingStats()
        self._late_after_end = 0
        self._dropped: list[tuple[str, int, str]] = []  # of retired episodes (late turns)

    def _episode(self, episode: str, turn: int | None = None) -> EpisodeAssembler | None:
        if episode in self.ended:
            self._late_after_end += 1
            if turn is not None:
                self._dropped.append((episode, turn, "abandoned"))
            return None
        ep = self.open.get(episode)
        if ep is None:
            ep = self.open[episode] = EpisodeAssembler(episode, self.config, self.log)
        return ep

    def _retire(self, ep: EpisodeAssembler) -> None:
        if not ep.finished:
            return
        self._dropped += [(ep.episode, t, r) for t, r in ep.dropped]
        del self.open[ep.episode]
        self.ended[ep.episode] = None
        while len(self.ended) > self.config.ended_memory:
            self.ended.popitem(last=False)
        self._done_drift.merge(ep.stats)
        self._done_routing.merge(ep.routing)
        self.recent[ep.episode] = ep.stats
        while len(self.recent) > self.config.episode_stats_memory:
            self.recent.popitem(last=False)

    def add(self, turn: wire.TurnRecord) -> list[Segment]:
        ep = self._episode(turn.episode, turn.turn)
        if ep is None:
            return []
        out = ep.add(turn)
        self._retire(ep)
        return out

    def end(self, rec: wire.EndRecord) -> list[Segment]:
        ep = self._episode(rec.episode)
        if ep is None:
            return []
        out = ep.end(rec)
        self._retire(ep)
        return out

    def feed(self, rec: wire.Record) -> list[Segment]:
        """Any record of ``t1.traj.<episode>``: turns and ends are assembled; ``start`` is ignored."""
        if isinstance(rec, wire.TurnRecord):
            return self.add(rec)
        if isinstance(rec, wire.EndRecord):
            return self.end(rec)
        return []

    def stop(self, episode: str, turns: int, *, emit: bool = True) -> list[Segment]:
        """End ``episode`` before turn ``turns`` (the learner poisoned that turn): see ``EpisodeAssembler.stop``."""
        ep = self._episode(episode)
        if ep is None:
            return []
        out = ep.stop(turns, emit=emit)
        self._retire(ep)
        return out

    def drain_dropped(self, episode: str | None = None) -> list[tuple[str, int, str]]:
        """(episode, turn, reason) of turns that will never reach a segment since the last drain: a REALIGN
        discarded the whole output (``realign_dropped``), or the turn is untrainable, late, or its episode
        was abandoned (``abandoned``). ``episode``: drain that episode (and the late turns) only."""
        out, self._dropped = self._dropped, []
        eps = self.open.values() if episode is None else [e for e in [self.open.get(episode)] if e]
        for ep in eps:
            out += [(ep.episode, t, r) for t, r in ep.dropped]
            ep.dropped = []
        return out

    def cut(self, episode: str | None = None) -> list[Segment]:
        eps = list(self.open.values()) if episode is None else [e for e in [self.open.get(episode)] if e]
        return [s for ep in eps for s in ep.cut()]

    def episode_stats(self, episode: str) -> DriftStats | None:
        ep = self.open.get(episode)
        return ep.stats if ep is not None else self.recent.get(episode)

    def stats(self) -> DriftStats:
        """Drift counters over every episode seen (finished and open)."""
        total = DriftStats()
        total.merge(self._done_drift)
        for ep in self.open.values():
            total.merge(ep.stats)
        total.late_turns += self._late_after_end
        return total

    def routing_stats(self) -> RoutingStats:
        total = RoutingStats()
        total.merge(self._done_routing)
        for ep in self.open.values():
            total.merge(ep.routing)
        return total

    @property
    def pending_turns(self) -> int:
        return sum(len(ep.pending) for ep in self.open.values())
