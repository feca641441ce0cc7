"""The cluster CLI (``python -m t1async.cluster up|down|status|tail|report``) and its supervisor."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
