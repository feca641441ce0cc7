"""The agent: its turn loop (``loop``), action format (``actions``), context policies (``context``), typed
surface (``types``) and a task run end to end (``runner``)."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
