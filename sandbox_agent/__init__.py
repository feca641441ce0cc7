"""By concept: sandboxes (``sandbox``), their images (``images``), tasks and the verifier (``tasks``), the agent
turn loop (``agent``, the loop itself in ``agent/loop.py``) and the synthetic corpus (``synth``);
``python -m sandbox_agent`` is the command line."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
