"""The allowed values of the trainer's string options, in one place for ``TrainerConfig``, ``cluster up``'s
config and the ``--advantage``/``--critic`` flags of ``cluster up`` and ``learner serve`` (light to import)."""

from __future__ import annotations

ADVANTAGES = ("gae", "turn")  # TrainerConfig.advantage
CRITICS = ("shared", "detached")  # TrainerConfig.critic
