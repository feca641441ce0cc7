"""KV storage for the engine: the running batch's slab and the prefix cache of finished sequences.

``KVCache`` is one key and one value tensor of shape [L, slots, H, cap, hd]. A running sequence owns one
slot; the engine keeps live slots compact ([0, n_active)), so a decode step attends over a *view* of the
slab (no per-step copy of anybody's cache). Both dimensions grow by doubling, copying once.

``PrefixCache`` is an LRU of finished sequences (token ids, their KV rows and their recorded routing) held
within a token budget. ``lookup(ids)`` finds the longest stored prefix of ``ids`` (vectorised compare per
entry); ``insert`` drops entries the new one fully covers (turn k is a prefix of turn k+1), so a long
episode holds one entry, not one per turn.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import count

import numpy as np
import torch
from torch import Tensor

from t1async.model.config import MoEConfig


class KVCache:
    def __init__(self, cfg: MoEConfig, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.k = self._alloc(0, 0)
        self.v = self._alloc(0, 0)

    def _alloc(self, slots: int, cap: int) -> Tensor:
        # zeroed, not empty: masked positions get weight 0 in attention, and 0 * NaN-garbage would be NaN
        c = self.cfg
        return torch.zeros(c.n_layers, slots, c.n_kv_heads, cap, c.head_dim, dtype=self.dtype)

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def cap(self) -> int:
        return self.k.shape[3]

    def reserve(self, slots: int, cap: int) -> None:
        """Grow to hold at least ``slots`` sequences of ``cap`` positions (doubling; content kept)."""
        if slots <= self.slots and cap <= self.cap:
            return
        ns = self.slots if slots <= self.slots else max(slots, 2 * self.slots, 4)
        nc = self.cap if cap <= self.cap else max(cap, min(max(2 * self.cap, 256), self.cfg.max_seq_len))
        k, v = self._alloc(ns, nc), self._alloc(ns, nc)
        k[:, : self.slots, :, : self.cap] = self.k
        v[:, : self.slots, :, : self.cap] = self.v
        self.k, self.v = k, v

    def release(self) -> None:
        """Free the slab's memory (call when no sequence is running)."""
        self.k = self._alloc(0, 0)
        self.v = self._alloc(0, 0)

    def layer(self, i: int, slot0: int, b: int) -> tuple[Tensor, Tensor]:
        return self.k[i, slot0 : slot0 + b], self.v[i, slot0 : slot0 + b]

    def read(self, slot: int, n: int) -> Tensor:
        """A copy of slot's first n positions: [L, 2, H, n, hd]."""
        return torch.stack([self.k[:, slot, :, :n], self.v[:, slot, :, :n]], dim=1)  # stack copies

    def write(self, slot: int, kv: Tensor) -> None:
        n = kv.shape[3]
        self.k[:, slot, :, :n] = kv[:, 0]
        self.v[:, slot, :, :n] = kv[:, 1]

    def move(self, src: int, dst: int, n: int) -> None:
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]


@dataclass(frozen=True, eq=False)
class PrefixEntry:
    ids: np.ndarray  # int32 [N]: the sequence's token ids (prompt + output)
    kv: Tensor  # [L, 2, H, n_fed, hd]
    routing: np.ndarray  # [n_fed, L, K] u1 / u2: experts chosen at each fed position

    @property
    def n_fed(self) -> int:
        return self.kv.shape[3]


class PrefixCache:
    def __init__(self, budget_tokens: int) -> None:
        self.budget = budget_tokens
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._ids = count()
        self.tokens = 0
        self.hits = 0
        self.lookups = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    @staticmethod
    def _common(a: np.ndarray, b: np.ndarray) -> int:
        m = min(len(a), len(b))
        if m == 0 or a[0] != b[0]:
            return 0
        ne = np.flatnonzero(a[:m] != b[:m])
        return int(ne[0]) if len(ne) else m

    def lookup(self, ids: np.ndarray) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with ``ids`` and how many of its fed positions match."""
        self.lookups += 1
        best, best_n, best_key = None, 0, None
        for key, e in self._entries.items():
            n = min(self._common(ids, e.ids[: e.n_fed]), e.n_fed)
            if n > best_n:
                best, best_n, best_key = e, n, key
        if best_key is not None:
            self._entries.move_to_end(best_key)
            self.hits += 1
        return best, best_n

    def insert(self, entry: PrefixEntry) -> None:
        n = entry.n_fed
        if n == 0 or n > self.budget:
            return
        covered = [
            k for k, e in self._entries.items() if e.n_fed <= n and self._common(entry.ids, e.ids[: e.n_fed]) == e.n_fed
        ]
        for k in covered:
            self.tokens -= self._entries.pop(k).n_fed
        self._entries[next(self._ids)] = entry
        self.tokens += n
        while self.tokens > self.budget:
            _, old = self._entries.popitem(last=False)
            self.tokens -= old.n_fed
