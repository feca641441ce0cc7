"""Evaluation of a policy on a task set (design §13): ``python -m t1async.eval``.

``run_eval`` runs every (task, sample) as one seeded episode of the real agent loop in the sandbox;
``stats`` turns the episodes into pass@k and mean tests passed with bootstrap CIs, per task and family.
"""

from t1async.eval.run import EvalConfig, SeededSampler, episode_seed, run_eval
from t1async.eval.stats import TaskScore, bootstrap_ci, by_family, pass_at_k, summarise, task_scores

__all__ = [
    "EvalConfig",
    "SeededSampler",
    "TaskScore",
    "bootstrap_ci",
    "by_family",
    "episode_seed",
    "pass_at_k",
    "run_eval",
    "summarise",
    "task_scores",
]
