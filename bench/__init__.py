"""Measurements, each ``python -m bench.NAME`` (see README, "How to measure")."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
