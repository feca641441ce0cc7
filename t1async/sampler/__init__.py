"""Samplers: the SGLang HTTP client (``client``), the embedded SGLang-compatible server (``server``, its
handlers in ``app``), the protocol subset (``requests`` parses them, ``response`` builds and reads the
answers) and the in-memory ``MemorySampler`` (``memory``). ``python -m t1async.sampler serve``."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
