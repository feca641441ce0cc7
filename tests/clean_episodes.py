"""Clean wire episodes for tests of the learner service: the TurnRecords (and EndRecord, with ``end=True``) of
episodes whose turns tile with no drift (t1async.testing.episodes), sampled at a given policy version."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from t1async.protocol import wire
from t1async.testing.episodes import Sizes, make_episode


def episodes(first: int, n: int, policy_version: int, *, end: bool = True) -> list:
    """The records of episodes ``e{first}`` .. ``e{first + n - 1}``: three clean turns each, seeded by the number."""
    out = []
    for i in range(first, first + n):
        case = make_episode(
            np.random.default_rng(i),
            ["clean"] * 3,
            episode=f"e{i}",
            with_end=end,
            sizes=Sizes(prompt=(20, 40), output=(4, 8), observation=(2, 6), vocab=300),
            layers=2,
            topk=2,
            num_experts=4,
        )
        out += [
            replace(r, policy_version=policy_version) if isinstance(r, wire.TurnRecord) else r for r in case.records
        ]
    return out
