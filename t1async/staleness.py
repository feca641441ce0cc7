"""Credit accounting: the backpressure rule that bounds policy staleness (DESIGN §7). Pure: no I/O, time is
passed in; ``CreditGate`` at the bottom is the thin anyio layer that holds a request until it can be granted.

Definitions (η = ``max_staleness``, B = ``batch_turns``, v = the version the samplers *serve*, v0 = the
version when the ledger started):

- a **credit** (ticket) admits one turn; tickets are ordered by grant time;
- ``running``  = tickets granted, not yet delivered and not expired;
- ``accepted`` = tickets delivered (cumulative since start; a delivered turn is always trained);
- an expired ticket (lease ran out before delivery: the actor never used it) is released: it leaves
  ``running`` and the order, and does not count in ``accepted``.

**Admission**: grant while ``accepted + running < (η + (v - v0) + 1) · B``.

**Training order**: the learner's step at version s (the step that turns version s into s + 1) must train
every delivered ticket among the first ``(s - v0 + 1) · B`` live tickets in grant order (``due(s)``), may
train any other delivered tickets too, and may not run while one of those first tickets is still running
(``can_train(s)`` is False; it becomes True on delivery or lease expiry).

**Why staleness <= η.** A ticket granted while the served version was ``v_g`` had, at grant time, fewer
than ``(η + v_g - v0 + 1) · B`` live tickets before it; expiries only lower that count. By the training
order it is trained by the step ``s`` with ``(s - v0 + 1) · B > rank``, i.e. ``s <= v_g + η``. The sampler
served ``u >= v_g`` when it sampled the turn (``on_version(v)`` is called only once samplers serve v), so
the staleness ``s - u <= η``. Admitted work is never thrown away; η = 0 is synchronous RL.

A turn delivered with no live ticket (its lease expired, or an actor sampled without asking) is
*unadmitted*: ``on_delivered`` returns None and the learner must decide (train only if ``v - u <= η``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import anyio
import numpy as np

from t1async import wire
from t1async.errors import ConfigError

RUNNING, DELIVERED, TRAINED, EXPIRED = "running", "delivered", "trained", "expired"
SEEN_MEMORY = 1_000_000  # delivered (episode, turn) keys remembered to ignore redeliveries


@dataclass(eq=False)
class Ticket:
    seq: int
    grant_id: str
    actor: str
    episode: str
    version: int  # served version when granted
    expires_at: float
    state: str = RUNNING
    turn: int = -1  # set on delivery


@dataclass
class LedgerStats:
    granted: int = 0
    delivered: int = 0
    expired: int = 0
    unadmitted: int = 0
    trained: int = 0
    held_requests: int = 0  # requests that could not be granted at once (backpressure)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class CreditLedger:
    """The admission rule and training order above. Not thread-safe; time is injected as ``now``."""

    def __init__(self, max_staleness: int, batch_turns: int, lease_s: float, version: int = 0) -> None:
        if max_staleness < 0 or batch_turns < 1 or not lease_s > 0:
            raise ConfigError(
                f"credit ledger needs max_staleness >= 0, batch_turns >= 1, lease_s > 0; got "
                f"{max_staleness}, {batch_turns}, {lease_s}"
            )
        self.eta, self.B, self.lease_s = max_staleness, batch_turns, float(lease_s)
        self.v0 = self.version = version
        self.accepted = 0
        self.running = 0
        self.stats = LedgerStats()
        self._seq = 0
        self._order: deque[Ticket] = deque()  # live tickets in grant order, trained prefix popped
        self._popped = 0  # trained tickets popped from the front of _order
        self._leases: deque[Ticket] = deque()  # running tickets in grant (= expiry) order, lazily cleaned
        self._by_episode: dict[str, deque[Ticket]] = {}
        self._delivered: dict[tuple[str, int], Ticket] = {}  # delivered, not yet trained
        self._seen: OrderedDict[tuple[str, int], Ticket] = OrderedDict()  # redeliveries (at-least-once) are no-ops

    # -- admission -----------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return (self.eta + (self.version - self.v0) + 1) * self.B

    @property
    def available(self) -> int:
        return max(0, self.capacity - self.accepted - self.running)

    def try_grant(self, actor: str, episode: str, n: int, now: float) -> wire.CreditGrant | None:
        """Grant up to ``n`` credits for ``episode`` now, or None (hold the request: backpressure)."""
        self.expire(now)
        k = min(n, self.available)
        if k <= 0:
            self.stats.held_requests += 1
            return None
        gid = f"g{self._seq}"
        q = self._by_episode.setdefault(episode, deque())
        for _ in range(k):
            t = Ticket(self._seq, gid, actor, episode, self.version, now + self.lease_s)
            self._seq += 1
            self._order.append(t)
            self._leases.append(t)
            q.append(t)
        self.running += k
        self.stats.granted += k
        return wire.CreditGrant(granted=k, version=self.version, lease_s=self.lease_s, grant_id=gid)

    def expire(self, now: float) -> int:
        """Release running tickets whose lease ran out (the actor never delivered them)."""
        n = 0
        while self._leases and (self._leases[0].state != RUNNING or self._leases[0].expires_at <= now):
            t = self._leases.popleft()
            if t.state == RUNNING:
                t.state = EXPIRED
                self.running -= 1
                self._by_episode[t.episode].remove(t)
                n += 1
        if n:
            self.stats.expired += n
            self._order = deque(t for t in self._order if t.state != EXPIRED)
        return n

    def next_expiry(self) -> float | None:
        for t in self._leases:
            if t.state == RUNNING:
                return t.expires_at
        return None

    def on_version(self, version: int) -> None:
        """The samplers now serve ``version`` (call after the weight update is acknowledged)."""
        if version > self.version:
            self.version = version

    def on_delivered(self, episode: str, turn: int, now: float) -> Ticket | None:
        """A turn arrived: it uses the episode's oldest running ticket. None: unadmitted (no live ticket).
        A redelivered (episode, turn) returns its ticket again and changes nothing."""
        seen = self._seen.get((episode, turn))
        if seen is not None:
            return seen
        self.expire(now)
        q = self._by_episode.get(episode)
        if not q:
            self.stats.unadmitted += 1
            return None
        t = q.popleft()
        if not q:
            del self._by_episode[episode]
        t.state, t.turn = DELIVERED, turn
        self.running -= 1
        self.accepted += 1
        self.stats.delivered += 1
        self._delivered[(episode, turn)] = t
        self._seen[(episode, turn)] = t
        while len(self._seen) > SEEN_MEMORY:
            self._seen.popitem(last=False)
        return t

    # -- training order ------------------------------------------------------------------------------

    def _head(self, version: int) -> list[Ticket]:
        """The live tickets among the first ``(version - v0 + 1) * B`` in grant order, not yet popped."""
        n = (version - self.v0 + 1) * self.B - self._popped
        return [self._order[i] for i in range(min(max(n, 0), len(self._order)))]

    def can_train(self, version: int) -> bool:
        """May the step at learner version ``version`` run? (None of its due tickets is still running.)"""
        return all(t.state != RUNNING for t in self._head(version))

    def due(self, version: int) -> list[tuple[str, int]]:
        """(episode, turn) of the delivered turns the step at ``version`` must train."""
        return [(t.episode, t.turn) for t in self._head(version) if t.state == DELIVERED]

    def on_trained(self, turns: list[tuple[str, int]]) -> None:
        for key in turns:
            t = self._delivered.pop(key, None)
            if t is not None:
                t.state = TRAINED
                self.stats.trained += 1
        while self._order and self._order[0].state == TRAINED:
            self._order.popleft()
            self._popped += 1

    def snapshot(self) -> dict[str, Any]:
        return {"version": self.version, "capacity": self.capacity, "accepted": self.accepted,
                "running": self.running, **self.stats.as_dict()}  # fmt: skip


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

    async def acquire(self, actor: str, episode: str, n: int = 1) -> wire.CreditGrant:
        while True:
            grant = None if self.held else self.ledger.try_grant(actor, episode, n, self.clock())
            if grant is not None:
                self._notify()
                return grant
            changed = self._changed
            nxt = self.ledger.next_expiry()
            with anyio.move_on_after(max(0.0, nxt - self.clock()) if nxt is not None else float("inf")):
                await changed.wait()

    async def wait_trainable(self, version: int) -> None:
        """Wait until the step at ``version`` may run (its due tickets delivered or expired)."""
        while True:
            self.ledger.expire(self.clock())
            if self.ledger.can_train(version):
                return
            changed = self._changed
            nxt = self.ledger.next_expiry()
            with anyio.move_on_after(max(0.0, nxt - self.clock()) if nxt is not None else float("inf")):
                await changed.wait()

    def on_version(self, version: int) -> None:
        self.ledger.on_version(version)
        self._notify()

    def on_delivered(self, episode: str, turn: int) -> Ticket | None:
        t = self.ledger.on_delivered(episode, turn, self.clock())
        self._notify()
        return t

    def on_trained(self, turns: list[tuple[str, int]]) -> None:
        self.ledger.on_trained(turns)
        self._notify()
