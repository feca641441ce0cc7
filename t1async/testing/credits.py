"""A discrete-event simulation of actors, samplers and the learner around a ``CreditLedger``.

Deterministic (seeded, simulated time), so tests can assert the staleness bound and compare throughput
across η, and ``bench.staleness`` can reuse it. Actors loop: ask a credit (held while the ledger refuses),
sample a turn with the version the samplers serve at that moment, execute it, deliver it. The learner
trains a step when ``can_train`` allows and at least B turns wait, training every ``due`` turn (plus the
oldest others up to B), then publishes a new version that samplers serve ``load_s`` later. Some actors
may die holding a credit (``die_p``): their lease expires. Some delivered turns are never trained
(``drop_p``: a REALIGN discarded the output, a poisoned record): they are settled at once, which gives their
capacity back.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import numpy as np

from t1async.credits.ledger import CreditLedger, SettleReason, StalenessHistogram


@dataclass(frozen=True)
class SimConfig:
    max_staleness: int = 1
    batch_turns: int = 8
    actors: int = 16
    episode_turns: int = 20
    lease_s: float = 30.0
    sample_s: tuple[float, float] = (0.5, 4.0)  # uniform; a long tail makes stragglers
    exec_s: tuple[float, float] = (0.1, 1.0)
    train_s: float = 2.0
    load_s: float = 0.5
    die_p: float = 0.0
    drop_p: float = 0.0  # a delivered turn is settled untrained (realign_dropped) instead of trained
    horizon_s: float = 600.0
    seed: int = 0
    respect_order: bool = True  # False: a naive learner that trains any B delivered turns (shows the bound needs it)


@dataclass
class SimResult:
    eta: int
    turns_trained: int
    steps: int
    sim_s: float
    turns_per_s: float
    max_staleness: int
    hist: dict[str, int]
    expired: int
    sampler_idle: float  # share of actor time spent waiting for a credit
    staleness: list[int] = field(repr=False, default_factory=list)


def simulate(cfg: SimConfig) -> SimResult:
    rng = random.Random(cfg.seed)
    led = CreditLedger(cfg.max_staleness, cfg.batch_turns, cfg.lease_s)
    hist = StalenessHistogram()
    events: list[tuple[float, int, str, tuple]] = []
    seq = 0

    def at(t: float, kind: str, *data: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, data))
        seq += 1

    served = 0  # version the samplers serve
    learner_v = 0
    training = False
    delivered: dict[tuple[str, int], int] = {}  # (episode, turn) -> sampling version, delivery order
    waiting: dict[int, float] = {}  # actor -> since when it waits for a credit
    idle = 0.0
    state = {a: (0, 0) for a in range(cfg.actors)}  # actor -> (episode count, next turn)
    staleness: list[int] = []
    steps = 0

    def request(a: int, now: float) -> None:
        ep = f"a{a}e{state[a][0]}"
        if led.try_grant(f"a{a}", ep, 1, now) is None:
            waiting.setdefault(a, now)
            nxt = led.next_expiry()
            if nxt is not None:
                at(nxt, "tick")
            return
        nonlocal idle
        idle += now - waiting.pop(a, now)
        if rng.random() < cfg.die_p:  # dies holding the credit; a replacement starts a new episode later
            at(now + cfg.lease_s * 1.5, "restart", a)
            return
        at(now + rng.uniform(*cfg.sample_s), "sampled", a, served)

    def try_train(now: float) -> None:
        nonlocal training, steps
        if training or len(delivered) < cfg.batch_turns:
            return
        if cfg.respect_order and not led.can_train(learner_v):
            return
        batch = led.due(learner_v) if cfg.respect_order else []
        chosen = set(batch)
        for key in delivered:
            if len(batch) >= cfg.batch_turns:
                break
            if key not in chosen:
                batch.append(key)
        used = [delivered.pop(key) for key in batch]
        staleness.extend(learner_v - u for u in used)
        hist.record(learner_v, np.asarray(used))
        led.on_trained(batch)
        training = True
        steps += 1
        at(now + cfg.train_s, "trained")

    for a in range(cfg.actors):
        at(rng.uniform(0, 0.1), "request", a)
    now = 0.0
    while events:
        now, _, kind, data = heapq.heappop(events)
        if now > cfg.horizon_s:
            break
        if led.expire(now):
            for a in list(waiting):
                request(a, now)
        if kind == "request":
            request(data[0], now)
        elif kind == "sampled":
            a, u = data
            at(now + rng.uniform(*cfg.exec_s), "deliver", a, u)
        elif kind == "deliver":
            a, u = data
            count, turn = state[a]
            ep = f"a{a}e{count}"
            if led.on_delivered(ep, turn, now) is not None:
                if rng.random() < cfg.drop_p:
                    led.settle([(ep, turn)], SettleReason.REALIGN_DROPPED)
                else:
                    delivered[(ep, turn)] = u
            state[a] = (count + 1, 0) if turn + 1 >= cfg.episode_turns else (count, turn + 1)
            request(a, now)
        elif kind == "restart":
            a = data[0]
            state[a] = (state[a][0] + 1, 0)
            request(a, now)
        elif kind == "trained":
            training = False
            learner_v += 1
            at(now + cfg.load_s, "served", learner_v)
        elif kind == "served":
            served = data[0]
            led.on_version(served)
            for a in list(waiting):
                request(a, now)
        try_train(now)
    end = min(now, cfg.horizon_s)
    idle += sum(end - t for t in waiting.values())
    n = len(staleness)
    return SimResult(
        eta=cfg.max_staleness,
        turns_trained=n,
        steps=steps,
        sim_s=end,
        turns_per_s=n / end if end else 0.0,
        max_staleness=max(staleness, default=0),
        hist=hist.as_dict(),
        expired=led.stats.expired,
        sampler_idle=idle / (cfg.actors * end) if end else 0.0,
        staleness=staleness,
    )
