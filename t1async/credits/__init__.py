"""Credits: the ledger that bounds policy staleness, the credit server and client, settlement, liveness."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
