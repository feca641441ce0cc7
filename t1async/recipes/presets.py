"""Named ``cluster up`` recipes (``--preset NAME``): a preset sets defaults, a TOML file and flags override.

``learn``: RL that measurably learns on 2 CPU cores (``bench.learning`` runs it). The policy is the ``learn``
warm start (``t1async.recipes.warmstart``: a seeded MoE trained on oracle demonstrations of the ``chores``
family, cached, built first if missing); the actors draw the train split of a corpus of the same family; every
turn is verified (``verify-every 1``), so each command's reward is the tests it made pass; episodes are short (a
demonstration takes 3 turns: two commands and DONE).

A preset is a partial ``UpConfig`` (``cluster/config.py``): its keys are the config's field names, its values
are checked as a TOML file's are (``t1async.config``) when it is used.
"""

from __future__ import annotations

from typing import Any

from t1async.learner.options import Advantage, Critic
from t1async.protocol.errors import ConfigError

PRESETS: dict[str, dict[str, Any]] = {
    "learn": {
        "warm_start": "learn",
        "synth_families": ("chores",),
        "synth_tasks": 600,
        "actors": 2,
        "concurrency": 4,
        "max_turns": 4,
        "max_new_tokens": 64,
        "max_context": 4096,
        "temperature": 1.0,
        "verify_every": 1,
        "max_staleness": 1,
        "batch_turns": 64,
        # each turn's own reward against the step's mean for its turn number (TrainerConfig.advantage): with the
        # critic's GAE (detached, its head at lr) 40-80 steps left held-out pass@1 flat or lower; with this, 200
        # steps at lr 5e-5 raised it 28.2% -> 45.5%, and -> 35.9% in a rerun; 300 steps 28.2% -> 45.5% and mean
        # tests 2.51 -> 3.11 (1.24x; docs/results.md, "Learning")
        "advantage": Advantage.TURN,
        "lr": 5e-5,
        "critic": Critic.DETACHED,  # the value loss trains the value head only (TrainerConfig.critic)
        "value_lr": 3e-3,  # the head is only watched under advantage "turn"; at its own rate it tracks the returns
        "sampler_max_batch": 16,
    },
}


def preset_values(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ConfigError(f"unknown --preset {name!r}; known: {', '.join(PRESETS)}")
    return dict(PRESETS[name])
