"""Assertion helpers for the conformance kits, so that they run without pytest."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["raises"]


@contextmanager
def raises(exc_type: type[BaseException], match: str | None = None) -> Iterator[None]:
    """pytest.raises without pytest: the block must raise ``exc_type`` (its message matching ``match``)."""
    try:
        yield
    except exc_type as exc:
        assert match is None or re.search(match, str(exc)), f"{type(exc).__name__}({exc!s}) does not match {match!r}"
        return
    raise AssertionError(f"did not raise {exc_type.__name__}")
