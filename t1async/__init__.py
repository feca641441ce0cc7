"""t1async: asynchronous RL infrastructure for terminal agents (see README.md and docs/design.md)."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
