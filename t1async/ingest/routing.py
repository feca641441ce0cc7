"""R3 routing traces: the SGLang codec, trace validation, and alignment to assembled positions (design §6).

Positions. Row p of a trace holds the experts chosen at every MoE layer when the sampler *computed* token p
(prefill or decode). A turn's trace covers ``[start, input_len + len(output_ids) - 1)`` of that turn's full
sequence: the sampler never routes a request's last token, the next request's prefill does.

Why prefix rows are reused exactly. Attention is causal, so the routing of position p depends only on tokens
``0..p``. Rows recorded by an earlier request are therefore valid in a later sequence exactly at the
positions ``p < lcp`` where both sequences agree (``lcp`` = their common prefix). This covers all three
boundary kinds: CLEAN and REALIGN keep the rows below ``lcp`` and drop the rest (REALIGN drops the discarded
run's rows); a FORK segment copies the old segment's rows below ``lcp`` and takes every later position from
the new request's trace, which must start at or before ``lcp`` (the actor asks for rows from the first
position it had not been told about). A position whose rows came from a *different* context is never used:
if the new trace starts after ``lcp`` the gap stays -1 (route freely) and is counted as missing.

A trace that reaches back into positions the segment already holds is compared with them
(``RouteTrack.rerouted``): identical rows are an overlap (an actor that asked from an earlier position);
different rows mean the sampler recomputed the context with other routes (a weight update flushed its prefix
cache), and the assembler starts a new segment for that turn, a counted "route fork", so every turn is
replayed with the routes the sampler used for it.

``RouteTrack`` keeps one segment's aligned routing (as references to the traces, turned into int16
``[T, L, K]`` with -1 for missing when the segment is returned) and the end of the contiguous covered run,
so tiling is checked as traces arrive: a trace starting after the covered end is
a gap (rows missing), one starting before it overlaps (the newer rows win: they come from exactly this
context). A trace with the wrong row count or shape is rejected whole; a layer whose entries are all 0 over
the trace is a broken capture (no real top-k of width >= 2 picks expert 0 twice) and that layer's rows of
the trace become -1. Counters live in ``RoutingStats``.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from t1async.protocol import wire
from t1async.protocol.errors import T1Error

MISSING = -1
ZERO_LAYER_MIN_ROWS = 32  # with top-1 routing, an all-zero layer is only suspicious over this many tokens


class RoutingError(T1Error):
    """A routing trace cannot be decoded (bad base64, wrong size, expert ids out of range)."""


# --------------------------------------------------------------------------------------------- codec


def compact_dtype(num_experts: int) -> np.dtype:
    """u1 when expert ids fit a byte (<= 256 experts), else u2 (design §3)."""
    if num_experts < 1 or num_experts > 65536:
        raise RoutingError(f"num_experts must be in [1, 65536], got {num_experts}")
    return np.dtype("u1") if num_experts <= 256 else np.dtype("<u2")


def decode_sglang(b64: str | bytes, num_layers: int, topk: int, num_experts: int) -> np.ndarray:
    """SGLang's ``meta_info.routed_experts`` (base64 of little-endian int32, logical ``[rows, layers, topk]``)
    to a compact ``[rows, num_layers, topk]`` array of u1 (<= 256 experts) or u2."""
    if num_layers < 1 or topk < 1:
        raise RoutingError(f"routed_experts needs num_layers and topk >= 1, got {num_layers} and {topk}")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise RoutingError(f"routed_experts is not valid base64 ({exc}); expected base64 of int32 LE") from exc
    per_row = num_layers * topk * 4
    if per_row <= 0 or len(raw) % per_row:
        raise RoutingError(
            f"routed_experts holds {len(raw)} bytes, not a multiple of layers {num_layers} x topk {topk} x 4 bytes"
        )
    arr = np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, topk)
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= num_experts:
            raise RoutingError(f"routed_experts holds expert ids in [{lo}, {hi}], outside [0, {num_experts})")
    return arr.astype(compact_dtype(num_experts))


def encode_sglang(experts: np.ndarray) -> str:
    """The inverse of ``decode_sglang`` (what the embedded sampler returns): base64 of int32 LE."""
    return base64.b64encode(np.ascontiguousarray(experts, dtype="<i4").tobytes()).decode("ascii")


def expected_rows(input_len: int, n_out: int, start: int) -> int:
    """Rows a turn's trace must hold: positions ``[start, input_len + n_out - 1)``."""
    return input_len + n_out - 1 - start


# --------------------------------------------------------------------------------------------- checks


@dataclass
class RoutingStats:
    traces: int = 0  # traces received
    absent_traces: int = 0  # turns sent without routing
    rejected_traces: int = 0  # wrong row count, shape or expert range: whole trace unused
    rejected_layers: int = 0  # (trace, layer) pairs rejected as all-zero captures
    gap_rows: int = 0  # positions no trace covered (tiling gap)
    overlap_rows: int = 0  # positions covered twice (the newer row kept)
    missing_rows: int = 0  # positions left -1 at every layer (gaps, absent or rejected traces)
    dropped_rows: int = 0  # rows of a REALIGN's discarded run

    def merge(self, other: RoutingStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def zero_layers(experts: np.ndarray, min_rows: int = ZERO_LAYER_MIN_ROWS) -> np.ndarray:
    """bool [L]: layers whose every entry is 0 over the trace and that cannot be a real capture."""
    rows, layers, topk = experts.shape
    if rows == 0 or (topk < 2 and rows < min_rows):
        return np.zeros(layers, dtype=bool)
    # OR over rows, 8 bytes at a time (a zero value is zero bytes, whatever the dtype), then "any" per layer
    b = np.ascontiguousarray(experts).view(np.uint8).reshape(rows, -1)
    if b.shape[1] % 8 == 0:
        b = b.view(np.uint64)
    ored = np.bitwise_or.reduce(b, axis=0).view(np.uint8).reshape(layers, -1)
    return ~ored.any(axis=1)


def check_trace(
    routing: wire.Routing, input_len: int, n_out: int, layers: int | None, topk: int | None, num_experts: int | None
) -> str:
    """'' when the trace is usable, else why it is rejected (row count, shape, expert range)."""
    ex = routing.experts
    want = expected_rows(input_len, n_out, routing.start)
    if want < 0:
        return f"routing.start {routing.start} is past the last routed position {input_len + n_out - 2}"
    if ex.ndim != 3 or ex.shape[0] != want:
        return (
            f"routing has {ex.shape[0] if ex.ndim else 0} rows, expected {want} "
            f"(input_len {input_len} + {n_out} outputs - 1 - start {routing.start})"
        )
    if layers is not None and (ex.shape[1], ex.shape[2]) != (layers, topk):
        return f"routing shape [.., {ex.shape[1]}, {ex.shape[2]}] differs from this segment's [.., {layers}, {topk}]"
    if num_experts is not None and ex.size and int(ex.max()) >= num_experts:
        return f"routing holds expert id {int(ex.max())} >= num_experts {num_experts}"
    return ""


# --------------------------------------------------------------------------------------------- alignment


@dataclass(frozen=True, eq=False)
class _Chunk:
    start: int  # first position
    end: int  # one past the last position
    rows: np.ndarray  # the trace's own array (u1/u2), rows[0] is position ``start``: never copied while building
    bad: np.ndarray | None  # bool [L]: layers rejected as all-zero captures


class RouteTrack:
    """One segment's routing, aligned to its positions; ``take()`` gives int16 ``[n, L, K]``, -1 missing.

    While the segment grows it only keeps references to the traces' own arrays (chunks in position order, no
    overlap), so adding a turn, a REALIGN (trim) and a FORK (share the prefix chunks) copy nothing; the one
    conversion to int16 happens when a segment is returned. ``covered`` is the end of the contiguous run of
    positions whose routing is settled (known, or given up as missing). ``shape`` is (L, K) once a usable
    trace was seen (None: this segment has no routing).
    """

    def __init__(self, stats: RoutingStats, num_experts: int | None = None) -> None:
        self.stats = stats
        self.num_experts = num_experts
        self.chunks: list[_Chunk] = []
        self.shape: tuple[int, int] | None = None
        self.n = 0  # positions in the segment
        self.covered = 0

    def _trim(self, pos: int) -> None:
        """Forget routing at positions >= pos (chunks may be shared with a forked track: replace, never mutate)."""
        while self.chunks and self.chunks[-1].start >= pos:
            self.chunks.pop()
        if self.chunks and self.chunks[-1].end > pos:
            c = self.chunks[-1]
            self.chunks[-1] = _Chunk(c.start, pos, c.rows, c.bad)

    def truncate(self, lcp: int) -> None:
        """Keep positions ``< lcp`` (REALIGN: the discarded run's rows are dropped)."""
        if lcp < self.n:
            self.stats.dropped_rows += max(0, min(self.covered, self.n) - lcp)
            self._trim(lcp)
            self.n = lcp
            self.covered = min(self.covered, lcp)

    def fork_from(self, old: RouteTrack, lcp: int) -> None:
        """Start a FORK segment: take the old segment's rows below ``lcp`` (same tokens, same causal context)."""
        keep = min(lcp, old.n)
        self.chunks, self.shape = list(old.chunks), old.shape
        self._trim(keep)
        self.n = keep
        self.covered = min(old.covered, keep)

    def add(self, routing: wire.Routing | None, input_len: int, n_out: int) -> None:
        """Align one turn's trace; the segment now has ``input_len + n_out`` positions and ends with this turn."""
        new_n = input_len + n_out
        end = new_n - 1  # the last token is routed by the next request
        why = "absent"
        if routing is not None:
            self.stats.traces += 1
            layers, topk = self.shape or (None, None)
            why = check_trace(routing, input_len, n_out, layers, topk, self.num_experts)
            if why:
                self.stats.rejected_traces += 1
        else:
            self.stats.absent_traces += 1
        if why:
            if self.shape is not None:
                self.stats.missing_rows += max(0, end - self.covered)
            self.n, self.covered = new_n, max(self.covered, end)
            return
        assert routing is not None
        ex, start = routing.experts, routing.start
        if self.shape is None:  # first trace of this segment: everything before it is missing (uncounted)
            self.shape = (ex.shape[1], ex.shape[2])
        if start > self.covered:
            gap = start - self.covered
            self.stats.gap_rows += gap
            self.stats.missing_rows += gap
        elif start < self.covered:
            self.stats.overlap_rows += self.covered - start
        self._trim(start)
        if len(ex):
            bad = zero_layers(ex)
            if bad.any():
                self.stats.rejected_layers += int(bad.sum())
            self.chunks.append(_Chunk(start, end, ex, bad if bad.any() else None))
        self.n, self.covered = new_n, end

    def rows(self, a: int, b: int) -> np.ndarray:
        """Positions ``[a, b)`` as int16 ``[b - a, L, K]``, -1 where missing (needs ``shape``)."""
        assert self.shape is not None
        out = np.full((max(b - a, 0), *self.shape), MISSING, dtype=np.int16)
        for c in self.chunks:
            lo, hi = max(a, c.start), min(b, c.end)
            if lo >= hi:
                continue
            out[lo - a : hi - a] = c.rows[lo - c.start : hi - c.start]
            if c.bad is not None:
                out[lo - a : hi - a, c.bad] = MISSING
        return out

    def rerouted(self, routing: wire.Routing | None, input_len: int, n_out: int, upto: int) -> int:
        """How many positions below ``upto`` the new trace routes differently from the rows this segment holds
        for them (0 when it does not reach back into them, or would be rejected). A sampler that recomputed
        those positions under new weights (its prefix cache was flushed) returns the routes it actually used
        (design §6): a turn whose context was routed differently needs its own segment (a "route fork")."""
        if routing is None or self.shape is None:
            return 0
        hi = min(upto, self.covered, self.n)
        if routing.start >= hi or check_trace(routing, input_len, n_out, *self.shape, self.num_experts):
            return 0
        held = self.rows(routing.start, hi)
        new = np.sort(routing.experts[: hi - routing.start].astype(np.int16), axis=-1)
        present = (held >= 0).all(axis=-1)
        differ = (np.sort(held, axis=-1) != new).any(axis=-1) & present
        return int(differ.any(axis=-1).sum())

    def take(self) -> np.ndarray | None:
        """The segment's routing as a new int16 ``[n, L, K]`` array, -1 where missing; None without routing."""
        if self.shape is None:
            return None
        out = np.empty((self.n, *self.shape), dtype=np.int16)
        pos = 0
        for c in self.chunks:
            if c.start > pos:
                out[pos : c.start] = MISSING
            out[c.start : c.end] = c.rows[: c.end - c.start]
            if c.bad is not None:
                out[c.start : c.end, c.bad] = MISSING
            pos = c.end
        out[pos:] = MISSING
        return out


def routing_drift(recorded: np.ndarray, computed: np.ndarray) -> tuple[int, int]:
    """(differing, compared): (token, layer) pairs whose recorded top-k *set* differs from ``computed``'s,
    over rows where the recorded routing is present (no -1). Vectorised; order within top-k is ignored."""
    if recorded.shape != computed.shape:
        raise ValueError(f"recorded {recorded.shape} and computed {computed.shape} routing differ in shape")
    present = (recorded >= 0).all(axis=-1)
    a = np.sort(recorded, axis=-1)
    b = np.sort(computed.astype(recorded.dtype, copy=False), axis=-1)
    differ = (a != b).any(axis=-1) & present
    return int(differ.sum()), int(present.sum())
