"""Reusable test kits.

- Conformance checks, one per seam, that any implementation can be run against (trio's
  ``check_two_way_stream`` habit): ``check_transport`` (with ``memory_harness`` or ``nats_harness``),
  ``check_sandbox`` (with ``memory_shell`` for a MemorySandbox) and ``check_sampler``.
- Synthetic episodes with injected drift (``episodes``) and credit simulations (``credits``).

The names below are imported on first use, so ``import t1async.testing`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["check_sampler", "check_sandbox", "check_transport", "memory_harness", "memory_shell", "nats_harness"]

_HOME = {
    "check_sampler": "t1async.testing.sampler",
    "check_sandbox": "t1async.testing.sandbox",
    "memory_shell": "t1async.testing.sandbox",
    "check_transport": "t1async.testing.transport",
    "memory_harness": "t1async.testing.harness",
    "nats_harness": "t1async.testing.harness",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 't1async.testing' has no attribute {name!r}")
