"""The learner: the service (``service``), PPO (``ppo``, ``trainer``), batching, checkpoints, the journal,
settling and credits, and the warm start (``sft``). ``python -m t1async.learner serve|sft``."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
