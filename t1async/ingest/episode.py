"""One episode's assembly (``EpisodeAssembler``): its turns in order, each boundary checked and repaired,
routing aligned, segments closed on a FORK, a route fork, its end record or a cut. ``assembly.Assembler``
keeps one per open episode; assembly.py's docstring describes the whole flow.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from t1async.ingest.routing import RoutingStats
from t1async.ingest.tito import Boundary, DriftStats, Segment, SegmentBuilder, check_input, hash_update, new_hasher
from t1async.log import get_logger
from t1async.protocol import wire

_EMPTY = np.zeros(0, dtype=np.int32)


@dataclass(frozen=True)
class AssemblerConfig:
    max_pending_turns: int = 4096  # out-of-order turns buffered per episode before it is abandoned
    num_experts: int | None = None  # when known, traces with expert ids >= this are rejected
    ended_memory: int = 100_000  # ended episode ids remembered, so late redeliveries are dropped
    episode_stats_memory: int = 1024  # finished episodes whose DriftStats stay inspectable


def _fingerprint(rec: wire.TurnRecord) -> tuple:
    """What tells an exact redelivery from a conflicting record of the same turn. Either way the later one is
    dropped, so a checksum (crc32, ~10x cheaper than a cryptographic hash) is enough: it only decides which
    counter a dropped record lands in."""
    out = np.ascontiguousarray(rec.output_ids, dtype="<i4")
    lps = np.ascontiguousarray(rec.output_logprobs, dtype="<f4")
    # ignore[arg-type]: ndarray is a buffer; numpy types __buffer__ for Python 3.12+ only
    crc = zlib.crc32(memoryview(lps).cast("B"), zlib.crc32(memoryview(out).cast("B")))  # type: ignore[arg-type]
    rt = None if rec.routing is None else (rec.routing.start, rec.routing.experts.shape)
    return (rec.keep, rec.input_len, rec.input_digest, rec.policy_version, rec.finish, rec.reward, len(out), crc, rt)


class EpisodeAssembler:
    """The assembly state of one episode. Use through ``Assembler`` unless you hold a single episode."""

    def __init__(self, episode: str, config: AssemblerConfig | None = None, log: Any = None) -> None:
        self.episode = episode
        self.config = config or AssemblerConfig()
        self.stats = DriftStats()
        self.routing = RoutingStats()
        self.log = log or get_logger("t1async.ingest.assembly")
        self.next_turn = 0
        self.pending: dict[int, wire.TurnRecord] = {}
        self.seen: dict[int, tuple] = {}
        self.builder: SegmentBuilder | None = None
        self.lost = False  # a turn could not be reconstructed; waiting for a full input (keep = 0)
        self.end_record: wire.EndRecord | None = None
        self.finished = False
        self.index = 0
        self.last_version = 0  # the newest version that sampled the last assembled turn
        # turns that will never reach a segment, with why ("realign_dropped" or "abandoned"): the learner
        # drains them (Assembler.drain_dropped) to settle their credits (design §7)
        self.dropped: list[tuple[int, str]] = []
        self.stop_at: int | None = None  # the learner poisoned this turn: the episode stops before it (stop())
        self.last_turn: int | None = None  # the turn whose record says it is the episode's last
        self.cut_final = False  # a cut already returned the last turn as done: nothing was bootstrapped

    # -- public --------------------------------------------------------------------------------------

    def add(self, rec: wire.TurnRecord) -> list[Segment]:
        if self.finished:
            self.stats.late_turns += 1
            self.dropped.append((rec.turn, "abandoned"))
            return []
        fp = _fingerprint(rec)
        prior = self.seen.get(rec.turn)
        if prior is not None:
            if prior == fp:
                self.stats.duplicates += 1
            else:
                self.stats.conflicts += 1
                self.log.warning(
                    "tito.conflicting_duplicate",
                    episode=self.episode,
                    turn=rec.turn,
                    hint="two different records claim this turn; the first is kept",
                )
            return []
        if self.end_record is not None and rec.turn >= self.end_record.turns:
            self.stats.late_turns += 1
            self.log.warning("tito.turn_after_end", episode=self.episode, turn=rec.turn, turns=self.end_record.turns)
            self.dropped.append((rec.turn, "abandoned"))
            return []
        if self.stop_at is not None and rec.turn >= self.stop_at:
            self.stats.late_turns += 1
            self.dropped.append((rec.turn, "abandoned"))
            return []
        self.seen[rec.turn] = fp
        self.pending[rec.turn] = rec
        out: list[Segment] = []
        while self.next_turn in self.pending:
            out += self._process(self.pending.pop(self.next_turn))
            self.next_turn += 1
        if len(self.pending) > self.config.max_pending_turns:
            self.log.error(
                "tito.episode_abandoned",
                episode=self.episode,
                waiting_for=self.next_turn,
                pending=len(self.pending),
                hint="a turn never arrived; raise max_pending_turns if legit",
            )
            self.stats.untrainable_turns += len(self.pending)
            self.dropped += [(t, "abandoned") for t in self.pending]
            self.pending.clear()
            out += self._close(done=False)
            self.finished = True
        return out + self._maybe_finish()

    def end(self, rec: wire.EndRecord) -> list[Segment]:
        if self.finished or self.end_record is not None:
            self.stats.duplicates += 1  # a redelivered end is harmless
            return []
        self.end_record = rec
        late = [t for t in self.pending if t >= rec.turns]
        for t in late:
            del self.pending[t]
            self.dropped.append((t, "abandoned"))
        self.stats.late_turns += len(late)
        return self._maybe_finish()

    def stop(self, turns: int, *, emit: bool = True) -> list[Segment]:
        """The learner poisoned turn ``turns`` (design §3): the episode stops before it. Later turns are
        dropped (``abandoned``); the turns before it are returned once all have arrived, as a cut
        (``done=False``: the episode did not end there). If the episode was assembled past ``turns`` (a step
        failed on those turns), its open segment is dropped, unreturned; so it is with ``emit=False`` (taking a
        turn raised: the open segment may hold half of it)."""
        if self.finished:
            return []
        self.stop_at = turns if self.stop_at is None else min(self.stop_at, turns)
        late = [t for t in self.pending if t >= self.stop_at]
        for t in late:
            del self.pending[t]
            self.dropped.append((t, "abandoned"))
        self.stats.late_turns += len(late)
        if self.next_turn > self.stop_at or not emit:
            self.builder, self.finished = None, True
            return []
        return self._maybe_finish()

    def cut(self) -> list[Segment]:
        if self.builder is None or self.finished:
            return []
        spans = self.builder.spans
        final = bool(spans) and spans[-1].turn == self.last_turn and not self.lost
        seg = self.builder.emit(self.episode, self.index, done=final, copy=True)
        self.cut_final |= final and seg is not None
        return self._count([seg])

    # -- internals -----------------------------------------------------------------------------------

    def _count(self, segs: list[Segment | None]) -> list[Segment]:
        out = [s for s in segs if s is not None]
        for s in out:
            self.index += 1
            self.stats.segments += 1
            self.stats.loss_tokens += s.loss_tokens
        return out

    def _close(self, done: bool) -> list[Segment]:
        b, self.builder = self.builder, None
        if b is None:
            return []
        return self._count([b.emit(self.episode, self.index, done=done, copy=False)])

    def _maybe_finish(self) -> list[Segment]:
        stop = self.stop_at
        if (
            not self.finished
            and stop is not None
            and self.next_turn >= stop
            and (self.end_record is None or self.end_record.turns > stop)
        ):
            self.finished = True
            return self._close(done=False)
        if self.finished or self.end_record is None or self.next_turn < self.end_record.turns:
            return []
        self.finished = True
        self._apply_unstreamed(self.end_record)
        out = self._close(done=True)
        self.stats.ended_after_cut += not out and self.next_turn > 0 and not self.lost and not self.cut_final
        return out

    def _apply_unstreamed(self, end: wire.EndRecord) -> None:
        """The end's unstreamed reward belongs to the last turn (its action led to the verified state)."""
        reward = end.unstreamed_reward
        if not reward:
            return
        spans = self.builder.spans if self.builder is not None else []
        if spans and not spans[-1].trained and spans[-1].turn == end.turns - 1:
            spans[-1].reward += reward
        else:
            self.stats.unstreamed_unapplied += 1

    def _process(self, rec: wire.TurnRecord) -> list[Segment]:
        st, b = self.stats, self.builder
        out: list[Segment] = []
        st.turns += 1
        st.compactions += rec.compacted
        if rec.last:
            self.last_turn = rec.turn
        prev = _EMPTY if b is None else b.tokens[: b.n]
        chk = check_input(
            prev,
            b.spans[-1].out_start if b else 0,
            b.hasher if b else new_hasher(),
            rec.keep,
            rec.input_delta,
            rec.input_digest,
            b.ckpt if b else None,
        )
        if b is not None:
            st.boundaries += 1
        if not chk.ok:
            st.untrainable_turns += 1
            st.digest_mismatch += rec.keep <= len(prev)
            self.log.warning(
                "tito.untrainable_turn",
                episode=self.episode,
                turn=rec.turn,
                keep=rec.keep,
                assembled=len(prev),
                reason=chk.reason,
            )
            self.lost = True
            self.dropped.append((rec.turn, "abandoned"))
            return self._close(done=False)
        st.tokens_in += len(rec.input_delta) + len(rec.output_ids)
        if chk.lcp > rec.keep:
            st.keep_understated += 1
        keep, lcp, n, carry = rec.keep, chk.lcp, len(prev), 0.0
        # the sampler recomputed context rows with other routes (a weight update flushed its prefix cache):
        # this turn gets its own segment, replayed with the routes the sampler used for it (design §6)
        rerouted = 0
        if b is not None and chk.kind is not Boundary.FORK:
            rerouted = b.track.rerouted(rec.routing, chk.input_len, len(rec.output_ids), lcp)
            # newer weights than the last turn's flushed the sampler's cache, yet its trace did not reach back
            # (a sampler without our routing-start extension, e.g. a real SGLang): the context rows replayed
            # are the old weights' (counted, not fixable here)
            if rec.routing is not None and rec.policy_version > self.last_version:
                st.stale_context_routes += rec.routing.start >= min(b.track.covered, lcp)
        if b is None:  # first turn, or a resync after untrainable turns
            st.resyncs += self.lost
            b = self.builder = SegmentBuilder(self.routing, self.config.num_experts)
            b.forked = self.lost
            self.lost = False
            b.append_context(rec.input_delta)
        elif chk.kind is Boundary.CLEAN:
            st.clean += 1
            if not rerouted:
                b.append_context(rec.input_delta[n - keep :])
        elif chk.kind is Boundary.REALIGN:
            st.realign += 1
            st.note_first_diff(lcp - n)
            last, spans = b.spans[-1], len(b.spans)
            dropped, after_cut, carry = b.truncate(lcp)
            if len(b.spans) < spans and not last.trained:  # its whole output left the sequence
                self.dropped.append((last.turn, "realign_dropped"))
            st.tokens_dropped += dropped
            st.dropped_after_cut += after_cut
            if not rerouted:
                b.append_context(rec.input_delta[lcp - keep :])
        else:
            st.fork += 1
            st.note_first_diff(lcp - n)
            st.tokens_recontextualised += chk.input_len - lcp
            b, out = self._fork(b, rec, lcp, chk.input_len)
        if rerouted:
            st.route_forks += 1
            st.rerouted_rows += rerouted
            self.log.debug(
                "tito.route_fork",
                episode=self.episode,
                turn=rec.turn,
                rerouted_rows=rerouted,
                routing_start=rec.routing.start if rec.routing else None,
                context=b.n,
            )
            b, out = self._fork(b, rec, b.n, chk.input_len)  # b.n: S_k, or its shared part after a REALIGN
        assert b.n == chk.input_len, (b.n, chk.input_len)
        b.hasher = chk.hasher
        b.checkpoint()
        hash_update(b.hasher, rec.output_ids)
        b.append_output(rec, carry)
        b.checkpoint()
        b.track.add(rec.routing, chk.input_len, len(rec.output_ids))
        ov = rec.output_versions
        self.last_version = rec.policy_version if ov is None else int(ov.max())
        return out

    def _fork(
        self, old: SegmentBuilder, rec: wire.TurnRecord, lcp: int, input_len: int
    ) -> tuple[SegmentBuilder, list[Segment]]:
        """End the open segment at the boundary, in its own context, and open one whose context is this turn's
        input: ``old``'s first ``lcp`` tokens (and routing rows) and the rest of the input."""
        b = SegmentBuilder(self.routing, self.config.num_experts, cap=max(4096, 2 * input_len))
        b.forked = True
        b.append_context(old.tokens[:lcp], old.turn_ids[:lcp])
        b.append_context(rec.input_delta[lcp - rec.keep :])
        b.track.fork_from(old.track, lcp)
        b.share_checkpoints(old, lcp)
        out = self._close(done=False)
        self.builder = b
        return b, out
