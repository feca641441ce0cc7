"""Named ``cluster up`` recipes (``--preset NAME``): a preset sets defaults, a TOML file and flags override.

``learn``: RL that measurably learns on 2 CPU cores (``bench.learning`` runs it). The policy is the ``learn``
warm start (``t1async.recipes.warmstart``: a seeded MoE trained on the demonstrations of a weaker demonstrator
of the ``chores`` family, ``choresome``, which does only the first k of the four chores; cached, built first
if missing); the actors draw the train split of a ``chores`` corpus; every turn is verified
(``verify-every 1``), so each command's reward is the tests it made pass; episodes are short (the full oracle
takes 3 turns: two commands and DONE).

``learn-choresn``: ``learn`` on ``choresn`` (when to stop depends on how many chores were asked).

``quickstart``: the quick start's (``default_preset``): the ``micro`` warm start on ``touch4`` tasks,
one-turn episodes, so that a newcomer watches RL raise the reward within minutes.

``none``: nothing: the shipped model from its random init, on the default task mix. Plumbing tests and the
benches of the machinery (``bench.flatrun``, ``bench.staleness``, ``bench.chaos``) run it.

With no ``--preset``, ``cluster up`` runs ``quickstart`` when the run brings nothing of its own (no ``--model``,
``--sampler-url``, ``--tasks``, ``--warm-start`` or ``--warm-start-steps``, in flags or in the TOML file), and
``none`` when it does: a run on your own model or tasks gets no recipe's settings it did not ask for
(``default_preset``).

A preset is a partial ``UpConfig`` (``cluster/config.py``): its keys are the config's field names, its values
are checked as a TOML file's are (``t1async.config``) when it is used.
"""

from __future__ import annotations

from typing import Any

from t1async.learner.trainer_config import Advantage, Critic, Prefix
from t1async.protocol.errors import ConfigError

PRESETS: dict[str, dict[str, Any]] = {
    # the quick start's (a bare `cluster up`): RL visibly improving a weak warm start within minutes. The
    # ``micro`` warm start imitates a demonstrator that names only the first k of touch4's four files (k uniform
    # 1-4): it samples ~2.5 of 4 tests a task, every name right, and RL teaches it to name all four. The same
    # settings as the CI learning test (tests/test_learning_ci.py runs this preset at η 0); one-turn episodes.
    "quickstart": {
        "warm_start": "micro",
        "synth_families": ("touch4",),
        "synth_tasks": 300,
        "actors": 1,
        "concurrency": 8,
        "max_turns": 1,
        "max_new_tokens": 40,
        "max_context": 1024,
        "verify_every": 1,
        "temperature": 1.0,
        "batch_turns": 16,
        "max_staleness": 1,
        "lr": 1e-4,
        "advantage": Advantage.TURN,
        "critic": Critic.DETACHED,
        "sampler_max_batch": 16,
        "prefix_cache_tokens": 0,
    },
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
        # critic's GAE (detached, its head at lr) 40-80 steps left held-out pass@1 flat or lower (2026-12-01, the
        # old warm start); with this, 25 minutes (88-104 steps) raised greedy pass@1 on chore sets never trained
        # on from the warm start's best decoding, 11.0%, to 83-93%, in each of 3 seeds (docs/results.md,
        # "Learning")
        "advantage": Advantage.TURN,
        "lr": 5e-5,
        "critic": Critic.DETACHED,  # the value loss trains the value head only (TrainerConfig.critic)
        "value_lr": 3e-3,  # the head is only watched under advantage "turn"; at its own rate it tracks the returns
        "sampler_max_batch": 16,
    },
}
# the content-dependent family: ``learn`` on ``choresn`` (n in 2..6 chores, each task's max_turns exactly
# its oracle's, n = 5 held out) from the ``choresn`` warm start; the agent's own cap is the largest oracle's (n 6:
# three replies and DONE), the task's cap binds below it (sandbox_agent/synth/choresn.py)
# RL there is ``rloo`` over groups of 4 episodes of one task: from the same SFT model, 40 steps, it beat ``turn`` on
# each of three folds (+5.2, +3.8, +6.8 points of greedy pass@1 on test keys; docs/results.md, 2026-12-06
# 13:16 UTC), where ``turn``'s per-turn-number mean mixes tasks of 2 to 6 chores; ``learn``'s lr 5e-5 stays: at 1.5e-4
# and 5e-4 RL got worse (fold 1 collapsed at 5e-4), and no lr beat the SFT model on eval (results, 2026-12-06 16:30)
# and it is anchored to its start (--kl-ref-coef 1, which needs --prefix-kv exact): unanchored, every estimator
# fell under the SFT model on eval; anchored, RL tied SFT on eval and beat unanchored rloo there by key
# (docs/results.md, 2026-12-07 02:45)
PRESETS["learn-choresn"] = {
    **PRESETS["learn"],
    "warm_start": "choresn",
    "synth_families": ("choresn",),
    "advantage": Advantage.RLOO,
    "group_size": 4,
    "kl_ref_coef": 1.0,
    "prefix_kv": Prefix.EXACT,
}


NONE = "none"  # no preset: the bare shipped model (its random init) on the default task mix
CHOICES: tuple[str, ...] = (*PRESETS, NONE)


def preset_values(name: str) -> dict[str, Any]:
    if name == NONE:
        return {}
    if name not in PRESETS:
        raise ConfigError(f"unknown --preset {name!r}; known: {', '.join(CHOICES)}")
    return dict(PRESETS[name])


def default_preset(
    *, model: object, sampler_url: tuple[str, ...], tasks: object, warm_start: str, warm_start_steps: int
) -> str:
    """The preset of a ``cluster up`` without ``--preset``: ``quickstart`` when the run names no policy or tasks of
    its own, else ``none`` (a recipe's episodes and warm start would silently replace what it named)."""
    own = model is not None or bool(sampler_url) or tasks is not None or bool(warm_start) or warm_start_steps > 0
    return NONE if own else "quickstart"
