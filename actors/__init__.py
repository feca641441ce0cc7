"""The rollout actor: credited, token-in episodes streamed turn by turn (``python -m actors``).

The turn loop each episode runs is ``sandbox_agent/agent/loop.py``: it needs no RL machinery, so the sandbox
command line, the evaluator and the warm start run it too; this package adds credits, streaming and seeds."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
