"""The rollout actor: credited, token-in episodes streamed turn by turn (``python -m actors``)."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
