"""Task groups in episode ids: ``actors --group-size K`` runs each task K times, and the learner's group-relative
baselines (``--advantage grpo|rloo``, ``ppo.StepBaseline``) centre each episode on the others of its group.

A grouped episode's id is ``<group>~g<k>`` (k = 0 .. K-1); the group (``<actor>-<hex>``) is unique per draw of
a task. Any other id is a group of its own. Light to import (the actors use it): no torch.
"""

from __future__ import annotations

MARK = "~g"


def grouped_episode_id(group: str, k: int) -> str:
    """The id of member ``k`` of ``group`` (``group`` must not contain the mark)."""
    if MARK in group or k < 0:
        raise ValueError(f"group {group!r} must not contain {MARK!r} and k must be >= 0, got {k}")
    return f"{group}{MARK}{k}"


def episode_group(episode: str) -> str:
    """The group of an episode id: the part before ``~g<k>``, or the id itself when it has no such suffix."""
    head, sep, k = episode.rpartition(MARK)
    return head if sep and head and k.isdigit() else episode
