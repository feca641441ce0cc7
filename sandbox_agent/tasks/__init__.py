"""Tasks: the ``Task`` record and its loaders (``task``), Terminal-Bench's test entry point (``tbscript``), the
verifier (``verifier``) and benchmark-overlap checks (``decontam``)."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
