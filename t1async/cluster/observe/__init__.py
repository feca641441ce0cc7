"""Watching a run: the dashboard, ``cluster tail``, ``cluster report``."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
