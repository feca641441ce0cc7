"""Reusable test kits: synthetic episodes with injected drift (``episodes``), credit simulations (``credits``)."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
