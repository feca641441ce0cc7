"""From the trajectory stream to trainable segments: validate, poison, journal, assembly, TITO, routing."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
