"""Reusable test kits: synthetic episodes with injected drift (``episodes``), credit simulations (``credits``)."""
