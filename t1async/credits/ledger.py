"""Credit accounting: the backpressure rule that bounds policy staleness (design §7). Pure: no I/O, time is
passed in; ``CreditGate`` at the bottom is the thin anyio layer that holds a request until it can be granted.

Definitions (η = ``max_staleness``, B = ``batch_turns``, v = the version the samplers *serve*, v0 = the
version when the ledger started):

- a **credit** admits one turn (a ``Credit`` here); credits are ordered by grant time (see the glossary in
  ``t1async.credits``);
- ``running``  = credits granted, not yet delivered, not expired and not released;
- ``accepted`` = credits delivered and trained or still waiting to be settled (cumulative since start);
- a credit whose lease ran out before delivery (the actor never used it), or whose actor went silent
  (``release_actor``), is released: it leaves ``running`` and does not count in ``accepted``;
- every delivered credit is **settled** exactly once (``settle``) with a reason: ``trained``,
  ``stale_masked``, ``realign_dropped``, ``poisoned`` or ``abandoned``. A credit settled without training
  leaves ``accepted`` like a released one: its capacity goes back to the actors.

**Admission**: grant while ``accepted + running < (η + (v - v0) + 1) · B``. A credit's **rank** is
``accepted + running`` when it is granted; its **deadline** is ``v0 + rank // B``.

**Training order**: the learner's step at version s (the step that turns version s into s + 1) must train
every delivered, unsettled credit whose deadline is <= s (``due(s)``), may train any other delivered credit
too, and may not run while a credit with deadline <= s is still running (``can_train(s)`` is False; it
becomes True on delivery, lease expiry or release).

**Why staleness <= η.** A credit granted while the served version was ``v_g`` has, by admission, rank
``< (η + v_g - v0 + 1) · B``, so its deadline is ``<= v_g + η``: it is trained by the step at a version
``s <= v_g + η``. The sampler served ``u >= v_g`` when it sampled the turn (``on_version(v)`` is called only
once samplers serve v), so the staleness ``s - u <= η``. Releases and untrained settles only lower the rank
of later credits, which keeps the bound. η = 0 is synchronous RL.

**Bounded.** The ledger holds only live credits (running, or delivered and unsettled), indexed by deadline:
a turn that is never settled keeps its own credit and nothing else, and ``due``/``can_train`` cost
O(live credits), however long the run.

A turn delivered with no live credit (its lease expired, its actor was released, or it sampled without
asking) is *unadmitted*: ``on_delivered`` returns None and the learner must decide (train only if
``v - u <= η``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np

from t1async.protocol import wire
from t1async.protocol.errors import ConfigError


class CreditState(StrEnum):
    """Where a granted credit is: running (granted, not delivered), delivered (its turn arrived, not settled),
    settled, or expired (released before delivery: its lease ran out, or its actor or episode was released)."""

    RUNNING = "running"
    DELIVERED = "delivered"
    SETTLED = "settled"
    EXPIRED = "expired"


class SettleReason(StrEnum):
    """Why a delivered turn was settled (``t1async.credits.settle`` says when each applies). The values are
    the names in logs and metrics (``settled``: reason -> count)."""

    TRAINED = "trained"
    STALE_MASKED = "stale_masked"
    REALIGN_DROPPED = "realign_dropped"
    POISONED = "poisoned"
    ABANDONED = "abandoned"

    @classmethod
    def of(cls, reason: str) -> SettleReason:
        """``reason`` as a SettleReason (a member, or its string); ValueError names the valid ones."""
        try:
            return cls(reason)
        except ValueError:
            raise ValueError(f"settle reason {reason!r} is not one of {tuple(r.value for r in cls)}") from None


SEEN_MEMORY = 65_536  # delivered keys remembered to ignore redeliveries (they come within an ack wait, seconds)


@dataclass(eq=False)
class Credit:
    seq: int
    grant_id: str
    actor: str
    episode: str
    policy_version: int  # served version when granted
    expires_at: float
    deadline: int = 0  # the step at this version must settle it (v0 + rank // B)
    state: CreditState = CreditState.RUNNING
    turn: int = -1  # the turn it was asked for (-1: any), then the turn delivered
    reason: SettleReason | None = None  # why it was settled


@dataclass
class LedgerStats:
    granted: int = 0
    delivered: int = 0
    expired: int = 0  # leases that ran out
    released: int = 0  # running credits of a silent actor or a closed episode
    unadmitted: int = 0
    trained: int = 0
    held_requests: int = 0  # requests that could not be granted at once (backpressure)
    settled: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in SettleReason})

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "settled": dict(self.settled)}


class CreditLedger:
    """The admission rule and training order above. Not thread-safe; time is injected as ``now``."""

    def __init__(self, max_staleness: int, batch_turns: int, lease_s: float, policy_version: int = 0) -> None:
        if max_staleness < 0 or batch_turns < 1 or not lease_s > 0:
            raise ConfigError(
                f"credit ledger needs max_staleness >= 0, batch_turns >= 1, lease_s > 0; got "
                f"{max_staleness}, {batch_turns}, {lease_s}"
            )
        self.eta, self.B, self.lease_s = max_staleness, batch_turns, float(lease_s)
        self.v0 = self.policy_version = policy_version
        self.accepted = 0
        self.running = 0
        self.stats = LedgerStats()
        self._seq = 0
        self._by_deadline: dict[int, dict[int, Credit]] = {}  # live credits (running or delivered, unsettled)
        self._live = 0
        self._leases: deque[Credit] = deque()  # running credits in grant (= expiry) order, lazily cleaned
        self._by_episode: dict[str, deque[Credit]] = {}  # running credits per episode, in grant order
        self._delivered: dict[tuple[str, int], Credit] = {}  # delivered, not yet settled
        self._seen: OrderedDict[tuple[str, int], Credit] = OrderedDict()  # redeliveries (at-least-once) are no-ops

    # -- admission -----------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return (self.eta + (self.policy_version - self.v0) + 1) * self.B

    @property
    def available(self) -> int:
        return max(0, self.capacity - self.accepted - self.running)

    @property
    def size(self) -> int:
        """Credits the ledger holds (running, or delivered and unsettled): bounded by the work in flight."""
        return self._live

    def try_grant(self, actor: str, episode: str, n: int, now: float, turn: int = -1) -> wire.CreditGrant | None:
        """Grant up to ``n`` credits for ``episode`` now, or None (hold the request: backpressure)."""
        self.expire(now)
        k = min(n, self.available)
        if k <= 0:
            self.stats.held_requests += 1
            return None
        gid = f"g{self._seq}"
        q = self._by_episode.setdefault(episode, deque())
        for i in range(k):
            rank = self.accepted + self.running
            t = Credit(
                self._seq,
                gid,
                actor,
                episode,
                self.policy_version,
                now + self.lease_s,
                deadline=self.v0 + rank // self.B,
                turn=turn + i if turn >= 0 else -1,
            )
            self._seq += 1
            self._by_deadline.setdefault(t.deadline, {})[t.seq] = t
            self._live += 1
            self._leases.append(t)
            q.append(t)
            self.running += 1
        self.stats.granted += k
        return wire.CreditGrant(granted=k, policy_version=self.policy_version, lease_s=self.lease_s, grant_id=gid)

    def _drop(self, t: Credit) -> None:
        bucket = self._by_deadline[t.deadline]
        del bucket[t.seq]
        if not bucket:
            del self._by_deadline[t.deadline]
        self._live -= 1

    def _release(self, t: Credit) -> None:
        t.state = CreditState.EXPIRED
        self.running -= 1
        q = self._by_episode[t.episode]
        q.remove(t)
        if not q:
            del self._by_episode[t.episode]
        self._drop(t)

    def expire(self, now: float) -> int:
        """Release running credits whose lease ran out (the actor never delivered them)."""
        n = 0
        while self._leases and (self._leases[0].state != CreditState.RUNNING or self._leases[0].expires_at <= now):
            t = self._leases.popleft()
            if t.state == CreditState.RUNNING:
                self._release(t)
                n += 1
        self.stats.expired += n
        return n

    def release_actor(self, actor: str) -> int:
        """Release every running credit of ``actor`` (it went silent): its capacity goes back at once."""
        gone = [t for q in self._by_episode.values() for t in q if t.actor == actor]
        for t in gone:
            self._release(t)
        self.stats.released += len(gone)
        return len(gone)

    def release_episode(self, episode: str, from_turn: int | None = None) -> int:
        """Release the running credits of an episode (None: all of them), or those asked for turns >=
        ``from_turn``: an episode that ended after ``from_turn`` turns never delivers those, but its earlier
        turns may still be on their way (records can arrive after their episode's end)."""
        gone = [t for t in self._by_episode.get(episode, ()) if from_turn is None or t.turn >= from_turn]
        for t in gone:
            self._release(t)
        self.stats.released += len(gone)
        return len(gone)

    def next_expiry(self) -> float | None:
        for t in self._leases:
            if t.state == CreditState.RUNNING:
                return t.expires_at
        return None

    def on_version(self, policy_version: int) -> None:
        """The samplers now serve ``policy_version`` (call after the weight update is acknowledged)."""
        if policy_version > self.policy_version:
            self.policy_version = policy_version

    def on_delivered(self, episode: str, turn: int, now: float) -> Credit | None:
        """A turn arrived: it uses the episode's credit asked for this turn, else the episode's oldest running
        credit (an actor that skips an empty output numbers its turns below its samples: the credit used is
        never newer than the one matched, so the bound holds). None: unadmitted (no live credit). A
        redelivered (episode, turn) returns its credit again and changes nothing."""
        seen = self._seen.get((episode, turn))
        if seen is not None:
            return seen
        self.expire(now)
        q = self._by_episode.get(episode)
        if not q:
            self.stats.unadmitted += 1
            return None
        t = next((x for x in q if x.turn == turn), q[0])
        q.remove(t)
        if not q:
            del self._by_episode[episode]
        t.state, t.turn = CreditState.DELIVERED, turn
        self.running -= 1
        self.accepted += 1
        self.stats.delivered += 1
        self._delivered[(episode, turn)] = t
        self._seen[(episode, turn)] = t
        while len(self._seen) > SEEN_MEMORY:
            self._seen.popitem(last=False)
        return t

    # -- training order ------------------------------------------------------------------------------

    def _due_credits(self, policy_version: int) -> list[Credit]:
        return [t for d, bucket in self._by_deadline.items() if d <= policy_version for t in bucket.values()]

    def can_train(self, policy_version: int) -> bool:
        """May the step at learner version ``policy_version`` run? (None of its due credits is still running.)"""
        return all(t.state != CreditState.RUNNING for t in self._due_credits(policy_version))

    def due(self, policy_version: int) -> list[tuple[str, int]]:
        """(episode, turn) of the delivered turns the step at ``policy_version`` must train, in grant order."""
        return [
            (t.episode, t.turn)
            for t in sorted(self._due_credits(policy_version), key=lambda t: t.seq)
            if t.state == CreditState.DELIVERED
        ]

    def settle(self, turns: Iterable[tuple[str, int]], reason: SettleReason | str) -> int:
        """Settle delivered turns: each credit once (a second settle of a turn is a no-op). Returns how many
        credits this settled. Untrained reasons give the capacity back (like a release)."""
        reason = SettleReason.of(reason)
        n = 0
        for key in turns:
            t = self._delivered.pop(key, None)
            if t is None:
                continue
            t.state, t.reason = CreditState.SETTLED, reason
            self._drop(t)
            if reason is not SettleReason.TRAINED:
                self.accepted -= 1
            n += 1
        self.stats.settled[reason] += n
        if reason is SettleReason.TRAINED:
            self.stats.trained += n
        return n

    def on_trained(self, turns: Iterable[tuple[str, int]]) -> None:
        self.settle(turns, SettleReason.TRAINED)

    def snapshot(self) -> dict[str, Any]:
        return {
            "policy_version": self.policy_version,
            "capacity": self.capacity,
            "accepted": self.accepted,
            "running": self.running,
            "live": self._live,
            **self.stats.as_dict(),
        }


# --------------------------------------------------------------------------------------------- histogram


@dataclass
class StalenessHistogram:
    """Staleness ``v_train - u`` of every trained token (or turn), for the learner's metrics."""

    counts: dict[int, int] = field(default_factory=dict)

    def record(self, v_train: int, versions: np.ndarray) -> None:
        """``versions``: the sampling version of each trained token (entries < 0 are ignored)."""
        v = np.asarray(versions)
        v = v[v >= 0]
        if not v.size:
            return
        stale = v_train - v.astype(np.int64)
        if stale.min() < 0:
            raise ValueError(f"a token sampled by version {int(v.max())} cannot be trained at version {v_train}")
        for s, c in enumerate(np.bincount(stale)):
            if c:
                self.counts[s] = self.counts.get(s, 0) + int(c)

    @property
    def max(self) -> int:
        return max(self.counts) if self.counts else 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, int]:
        return {str(k): self.counts[k] for k in sorted(self.counts)}


# --------------------------------------------------------------------------------------------- async gate


class CreditGate:
    """The anyio layer over a ledger: ``acquire`` holds the caller until a credit can be granted.

    Every state change (``on_version``, ``on_delivered``, ``on_trained``) wakes the waiters; a waiter also
    wakes at the next lease expiry, which may free capacity. ``clock`` defaults to ``anyio.current_time``
    (trio's autojump clock makes simulated time instant in tests).
    """

    def __init__(self, ledger: CreditLedger, clock: Callable[[], float] = anyio.current_time) -> None:
        self.ledger, self.clock = ledger, clock
        self._changed = anyio.Event()
        self.held = False  # while True nothing is granted (see ``hold``)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def hold(self, held: bool) -> None:
        """Grant nothing while ``held``. The learner holds grants during a step when η = 0: a turn admitted
        then would be sampled by the version being replaced and trained one version later."""
        self.held = held
        self._notify()

    async def acquire(self, actor: str, episode: str, n: int = 1, turn: int = -1) -> wire.CreditGrant:
        while True:
            await anyio.lowlevel.checkpoint_if_cancelled()  # a hold cancelled while it was being woken grants nothing
            grant = None if self.held else self.ledger.try_grant(actor, episode, n, self.clock(), turn)
            if grant is not None:
                self._notify()
                return grant
            changed = self._changed
            # while held only hold(False) can grant (it wakes us); a lease already past due would spin this loop
            nxt = None if self.held else self.ledger.next_expiry()
            with anyio.move_on_after(max(0.0, nxt - self.clock()) if nxt is not None else float("inf")):
                await changed.wait()

    async def wait_trainable(self, policy_version: int) -> None:
        """Wait until the step at ``policy_version`` may run (its due credits delivered or expired)."""
        while True:
            self.ledger.expire(self.clock())
            if self.ledger.can_train(policy_version):
                return
            changed = self._changed
            nxt = self.ledger.next_expiry()
            with anyio.move_on_after(max(0.0, nxt - self.clock()) if nxt is not None else float("inf")):
                await changed.wait()

    def on_version(self, policy_version: int) -> None:
        self.ledger.on_version(policy_version)
        self._notify()

    def on_delivered(self, episode: str, turn: int) -> Credit | None:
        t = self.ledger.on_delivered(episode, turn, self.clock())
        self._notify()
        return t

    def on_trained(self, turns: list[tuple[str, int]]) -> None:
        self.settle(turns, SettleReason.TRAINED)

    def settle(self, turns: Iterable[tuple[str, int]], reason: SettleReason | str) -> int:
        n = self.ledger.settle(turns, reason)
        self._notify()
        return n

    def release_actor(self, actor: str) -> int:
        n = self.ledger.release_actor(actor)
        self._notify()
        return n

    def release_episode(self, episode: str, from_turn: int | None = None) -> int:
        n = self.ledger.release_episode(episode, from_turn)
        self._notify()
        return n
