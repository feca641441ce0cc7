"""Sandboxes, task formats, the verifier, the agent turn loop and the synthetic corpus
(``python -m sandbox_agent``)."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
