"""The wire records and their msgpack codec, the sampler seam's types, and the error tree."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
