"""The learner's memory helpers: glibc malloc bounds, trimming, RSS from /proc."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from t1async.learner import malloc


def test_rss_follows_memory_the_process_touches():
    before = malloc.rss_bytes()
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, every page written
    grown = malloc.rss_bytes()
    del block
    assert before > 0 and grown - before > 48 << 20


_CHURN = """
import sys
import numpy as np
from t1async.learner import malloc
if sys.argv[1] == "bound":
    assert malloc.bound_malloc()
warm = np.ones(4 << 20, np.uint8); del warm  # with glibc's defaults this raises the mmap threshold past 4 MiB
base = malloc.rss_bytes()
blocks = [np.ones(2 << 20, np.uint8) for _ in range(100)]
pin = np.ones(1 << 16, np.uint8)  # a live block above them: a heap only shrinks from its top
held = malloc.rss_bytes() - base
del blocks
print(held >> 20, (malloc.rss_bytes() - base) >> 20)
"""


def _churn(mode: str) -> tuple[int, int]:
    p = subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, check=True)
    held, left = p.stdout.strip().splitlines()[-1].split()
    return int(held), int(left)


def test_freed_tensors_go_back_to_the_kernel_with_bounded_malloc():
    """200 MiB of 2 MiB blocks freed under a live block: with glibc's dynamic mmap threshold they came from
    the heap and stay resident; with ``bound_malloc`` (threshold fixed at 1 MiB) each was its own mapping."""
    held, left = _churn("default")
    assert held >= 150 and left >= 150, (held, left)  # what the learner's RSS swing was made of
    held, left = _churn("bound")
    assert held >= 150 and left < 20, (held, left)
