"""Keeping the learner's resident memory flat: glibc malloc settings, trimming, and reading RSS.

A training step allocates and frees many tensors of a few to a few hundred MB, from the worker threads
``anyio.to_thread`` hands it. With glibc's defaults two things keep freed memory resident:

- the **dynamic mmap threshold**: after a freed mmapped block, glibc raises the threshold (up to 32 MB on
  64-bit), so later tensors of that size come from the heap of an arena instead of a fresh mapping, and a
  heap only shrinks from its top: one live block above a freed region pins all of it;
- **one arena per thread** (up to 8 x cores): each worker thread that ran a step keeps its own heaps.

``bound_malloc()`` fixes the threshold (which turns the dynamic adjustment off), so every block from 1 MB up
is its own mapping and goes back to the kernel when freed, and caps the arenas. ``trim()`` returns the free
top of every arena after a step. Both are no-ops (returning False) off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import lru_cache

from t1async.log import get_logger

log = get_logger("t1async.learner.malloc")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    if not all(hasattr(lib, f) for f in ("mallopt", "malloc_trim")):
        return None  # not glibc (musl has neither)
    return lib


def bound_malloc(*, mmap_threshold: int = 1 << 20, arena_max: int = 2, trim_threshold: int = 64 << 20) -> bool:
    """Set glibc's mmap threshold, arena cap and trim threshold for this process (see the module doc).
    Returns False where glibc is not there. Call it once, early, before the first step."""
    libc = _libc()
    if libc is None:
        log.info("memory.no_glibc")
        return False
    opts = ((_M_MMAP_THRESHOLD, mmap_threshold), (_M_ARENA_MAX, arena_max), (_M_TRIM_THRESHOLD, trim_threshold))
    ok = all(libc.mallopt(opt, val) == 1 for opt, val in opts)
    log.info("memory.malloc_bounded", ok=ok, mmap_threshold=mmap_threshold, arena_max=arena_max)
    return ok


def trim() -> bool:
    """Give the free memory at the top of every malloc arena back to the kernel (glibc ``malloc_trim``)."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of ``pid`` (default this process) from /proc; 0 where /proc is not there."""
    try:
        with open(f"/proc/{pid or os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
