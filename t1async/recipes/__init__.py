"""Experiments, not library: the warm start, SFT on demonstrations, and ``cluster up`` presets."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
