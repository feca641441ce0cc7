"""The engine's synchronous core: one ``step`` = aborts, weight swap, admissions (prefill), one batched decode.

Runs only inside ``anyio.to_thread.run_sync`` from ``Engine.run``, one step at a time, so nothing here is
shared with the event loop while it runs. ``Engine`` (engine.py) owns the async side.

A running sequence owns KV slot ``seq.slot``; live slots are kept compact ([0, n_active)) by moving
survivors from above the new batch size into freed slots, so a decode step is one forward over slots
[0, n) on a view of the slab. One ``step`` may run several decodes (see ``decodes_per_hop``). Each
live sequence has exactly one sampled-but-unfed token (its last), which the next decode step feeds.

Prefix reuse: at admission the longest prefix of the prompt found in ``PrefixCache`` (at most prompt - 1
tokens, so at least one token is fed) is copied into the slot with its routing rows; the rest of every
prompt admitted in the step is prefilled together, in padded chunks. A finished sequence's KV and routing
go back into the prefix cache (unless a weight update happened while it ran). The slab is kept between
steps and released by ``flush_cache`` when nothing runs.

Retract (SGLang's word): a running sequence gives up its slot and KV and goes back to the queue with its
sampled tokens; its readmission prefills prompt + those tokens (prefix cache first) and samples the next
token from the last logits. A weight update out of a pause retracts every running sequence around the swap,
so every token's logits come from one set of weights over KV of the same weights. The recompute forces the
experts the sequence had used at each position (``MoETransformer.forward_cached(replay=)``, R3's replay):
its routing rows stay what they were, so one row per position replays every token exactly, whichever version sampled it,
and the caller's rows stay valid (no route fork).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from t1async.log import get_logger
from t1async.model.kvcache import KVCache, PrefixCache, PrefixEntry
from t1async.model.moe import MoETransformer
from t1async.model.records import EngineConfig, GenRequest
from t1async.model.sampling import StopStrings, sample
from t1async.model.tokenizer import ChatTokenizer
from t1async.model.weights import load_state_into, load_weights_into

log = get_logger("model.engine")

# multi-decode hops (see EngineCore.step and decodes_per_hop): a batch of 32 delivers every 8 tokens
MAX_DECODES_PER_HOP = 8
SEQS_PER_EXTRA_DECODE = 4
HOP_BUDGET_S = 0.1  # a hop stops adding decodes after this long (bounds the wait between stream chunks)


@dataclass(eq=False)
class Seq:
    req: GenRequest
    ids: np.ndarray  # int32 prompt
    rng: random.Random  # the request's seeded generator: one uniform draw per sampled token
    stops: StopStrings
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[float] = field(default_factory=list)
    routing: list[np.ndarray] = field(default_factory=list)  # chunks of [n, L, K], positions [0, n_fed)
    slot: int = -1
    n_fed: int = 0
    cached: int = 0
    finish: dict | None = None
    reported: int = 0  # how many out_ids the async side has taken
    prefix_kv: torch.Tensor | None = None  # the prefix-cache KV to copy in at admission
    epoch: int = 0  # the weights' epoch at admission; KV spanning a weight update is not cached
    retractions: int = 0  # times its KV was dropped to be recomputed (a retract: pause or weight update)
    kept: np.ndarray | None = None  # after a retract: the routes it had used, forced again when recomputed
    fork: bool = False  # an admission recomputed a position before routing_start: routes are returned from 0

    @property
    def prompt_len(self) -> int:
        return len(self.ids)

    def all_ids(self) -> np.ndarray:
        return np.concatenate([self.ids, np.asarray(self.out_ids, dtype=np.int32)])

    def context(self) -> np.ndarray:
        """What an admission feeds: the prompt, or after a retract the prompt and every token sampled so far
        (the prefill's last logits then sample the next token, as a decode step would)."""
        return self.all_ids() if self.retractions else self.ids

    def routing_rows(self) -> np.ndarray:
        if len(self.routing) > 1:
            self.routing = [np.concatenate(self.routing, axis=0)]
        return self.routing[0]


@dataclass
class WeightUpdate:
    model_path: Path
    weight_version: str
    error: Exception | None = None
    tensors: dict | None = None  # named tensors received over a weight-update group (no model_path then)


@dataclass
class StepPlan:
    admit: list[Seq]
    aborts: list[Seq]
    updates: list[WeightUpdate]
    flush: bool
    paused: bool = False  # no admission, no decode: running sequences stay where they are
    retract: bool = False  # retract every running sequence (their KV dropped, recomputed at readmission)


class BusyClock:
    """The sampler's own busy/idle accounting: seconds inside scheduler steps (the running one included) and
    seconds since the loop started; ``1 - Δbusy_s / Δuptime_s`` over a window is the idle share in it."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.t_start: float | None = None  # when the loop started
        self.t_step: float | None = None  # when the step now running started

    def step_started(self) -> None:
        self.t_step = time.perf_counter()

    def step_ended(self) -> None:
        if self.t_step is not None:
            self.busy += time.perf_counter() - self.t_step
            self.t_step = None

    def stats(self) -> dict:
        now = time.perf_counter()
        busy = self.busy + (now - self.t_step if self.t_step is not None else 0.0)
        return {"busy_s": round(busy, 4), "uptime_s": round(now - self.t_start, 4) if self.t_start else 0.0}


class EngineCore:
    def __init__(self, model: MoETransformer, tokenizer: ChatTokenizer, cfg: EngineConfig) -> None:
        self.model = model
        self.tok = tokenizer
        self.cfg = cfg
        self.mcfg = model.cfg
        self.max_seq_len = min(cfg.max_seq_len or self.mcfg.max_seq_len, self.mcfg.max_seq_len)
        self.dtype = next(model.parameters()).dtype
        self.kv = KVCache(self.mcfg, self.dtype)
        self.prefix = PrefixCache(cfg.prefix_cache_tokens)
        self.active: list[Seq] = []  # index == slot
        self.route_dtype = np.uint8 if self.mcfg.n_experts <= 256 else np.uint16
        self.steps = 0
        self.decode_tokens = 0
        self.decode_forwards = 0  # > steps when hops run several decodes
        self.prefill_tokens = 0
        self.max_running = 0  # the largest batch one decode forward has served
        self.epoch = 0  # bumped by every weight update
        self.deferred = 0  # admission candidates sent back for lack of prefill budget
        self.retracted = 0  # sequences retracted (a pause in mode retract, or a weight update out of a pause)

    # -- one scheduler step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(
        self, plan: StepPlan, *, decodes: int = 1, interrupted: Callable[[], bool] | None = None
    ) -> tuple[list[Seq], list[Seq]]:
        """Run one step. Returns (sequences whose state changed: new tokens or finished, candidates from
        ``plan.admit`` that were not admitted this step, in order).

        ``decodes`` > 1 runs up to that many decode forwards in this one call (one thread hop, one delivery
        for several tokens), stopping early when a sequence finishes, when ``interrupted()`` says the event
        loop has work for the scheduler (a request to admit, an abort, a weight update), or after
        ``HOP_BUDGET_S``.

        A weight update out of a pause retracts every running sequence first and readmits it after the swap
        (its prompt and sampled tokens recomputed under the new weights), so no token is ever computed over KV
        of other weights. ``plan.paused`` admits and decodes nothing (updates then apply to frozen sequences
        as they are: SGLang's in_place); ``plan.retract`` hands the retracted sequences back unadmitted.
        Retracted sequences come first in the returned candidates."""
        t0 = time.perf_counter()
        changed: list[Seq] = []
        for s in plan.aborts:
            if s.slot >= 0 and s.finish is None:
                s.finish = {"type": "abort", "message": "aborted by request"}
                changed.append(s)
        self._retire_finished()
        retracted = self._retract_all() if plan.retract or (plan.updates and not plan.paused) else []
        for u in plan.updates:
            self._apply_update(u)
        if plan.flush or plan.updates:
            self.prefix.clear()
        if plan.flush and not self.active:
            self.kv.release()  # the slab is kept between steps (re-allocating it per turn is costly)
        candidates = retracted + plan.admit
        admitted = self._admit(candidates) if candidates and not plan.paused else []
        changed.extend(admitted)
        self._retire_finished()
        if self.active and not plan.paused:
            fresh = set(map(id, admitted))
            changed.extend(s for s in self.active if id(s) not in fresh)
            self._decode()
            done = self._retire_finished()
            # further decodes serve the same sequences (no admissions), so ``changed`` already holds them
            while (
                decodes > 1
                and not done
                and self.active
                and time.perf_counter() - t0 < HOP_BUDGET_S
                and not (interrupted is not None and interrupted())
            ):
                decodes -= 1
                self._decode()
                done = self._retire_finished()
        self.steps += 1
        self.deferred += len(candidates) - len(admitted)
        return changed, candidates[len(admitted) :]

    def _retract_all(self) -> list[Seq]:
        """Drop every running sequence's slot and KV; each keeps its sampled tokens and logprobs and is
        readmitted over ``context()``. Its KV goes to the prefix cache (same weights: a readmission before any
        update recomputes one token; an update clears the cache, so everything is recomputed)."""
        out = list(self.active)
        for s in out:
            if self.cfg.prefix_cache_tokens and s.n_fed and s.epoch == self.epoch:
                kv = self.kv.read(s.slot, s.n_fed)
                self.prefix.insert(PrefixEntry(ids=s.all_ids(), kv=kv, routing=s.routing_rows()))
            s.kept = s.routing_rows()[: s.n_fed]
            s.routing, s.slot, s.n_fed = [], -1, 0
            s.retractions += 1
        self.active = []
        self.retracted += len(out)
        return out

    def _apply_update(self, u: WeightUpdate) -> None:
        try:
            if u.tensors is not None:
                load_state_into(self.model, u.tensors, where=f"weight update to version {u.weight_version}")
            else:
                load_weights_into(self.model, u.model_path)
        except Exception as exc:  # reported to the caller of update_weights_from_disk
            u.error = exc
            log.warning("engine.weights_update_failed", path=str(u.model_path), error=str(exc))
        else:
            self.epoch += 1
            log.info(
                "engine.weights_updated",
                path=str(u.model_path) if u.tensors is None else "(tensors)",
                weight_version=u.weight_version,
            )

    # -- admission / prefill ----------------------------------------------------------------------------

    def _admit(self, seqs: list[Seq]) -> list[Seq]:
        """Admit candidates in order while their uncached prompt tokens fit ``max_prefill_tokens`` (the
        first always), take their cached prefixes, then prefill the rest in shared, chunked forwards.
        Returns the admitted ones.

        Slots are assigned in order of remaining prompt tokens (longest first), so the rows that still
        need tokens at each chunk are always a contiguous slot range: one padded forward per chunk.
        Padding writes junk KV past a row's end; its own queries never see it and decoding overwrites it.
        """
        chunk = self.cfg.prefill_chunk
        budget = self.cfg.max_prefill_tokens
        taken: list[Seq] = []
        ctx: dict[int, np.ndarray] = {}
        for s in seqs:
            c = s.context()
            entry, hit = self.prefix.lookup(c) if self.cfg.prefix_cache_tokens else (None, 0)
            cached = min(hit, len(c) - 1)
            if taken and len(c) - cached > budget:
                break  # FIFO: this one and the rest wait for the next step
            budget -= len(c) - cached
            taken.append(s)
            ctx[id(s)] = c
            s.epoch = self.epoch
            s.n_fed = cached
            if not s.retractions:
                s.cached = cached  # reported cached_tokens: prompt positions reused at its first admission
            if not s.retractions:  # a readmission recomputes with the routes it had used: they stay valid
                # positions before routing_start are the caller's: recomputed ones mean it must take every row
                s.fork = cached < min(s.req.routing_start, s.prompt_len - 1)
            if cached:
                if entry is None:
                    raise RuntimeError("prefix cache reported a hit without an entry: a kvcache.lookup bug")
                s.routing.append(entry.routing[:cached])
                s.prefix_kv = entry.kv
        seqs = taken
        order = sorted(seqs, key=lambda s: len(ctx[id(s)]) - s.n_fed, reverse=True)
        slot0 = len(self.active)
        # a padded chunk writes junk up to max(m) - 1 past a row's position, and max(m) <= the longest remainder
        pad = min(chunk, len(ctx[id(order[0])]) - order[0].n_fed)
        self.kv.reserve(slot0 + len(order), max(len(ctx[id(s)]) for s in order) + pad)
        for s in order:
            s.slot = len(self.active)
            self.active.append(s)
            if s.n_fed:
                if s.prefix_kv is None:
                    raise RuntimeError("an admitted sequence with a cached prefix has no prefix KV: a scheduler bug")
                self.kv.write(s.slot, s.prefix_kv[:, :, :, : s.n_fed])
                s.prefix_kv = None
            self.prefill_tokens += len(ctx[id(s)]) - s.n_fed
        last: dict[int, torch.Tensor] = {}
        while rows := [s for s in order if s.n_fed < len(ctx[id(s)])]:
            m = [min(chunk, len(ctx[id(s)]) - s.n_fed) for s in rows]
            x = torch.full((len(rows), max(m)), self.tok.pad_id, dtype=torch.long)
            for i, s in enumerate(rows):
                x[i, : m[i]] = torch.from_numpy(ctx[id(s)][s.n_fed : s.n_fed + m[i]].astype(np.int64))
            start = torch.tensor([s.n_fed for s in rows])
            at = torch.tensor(m) - 1
            if any(s.kept is not None and s.n_fed < len(s.kept) for s in rows):
                replay = torch.full((len(rows), max(m), self.mcfg.n_layers, self.mcfg.top_k), -1, dtype=torch.long)
                for i, s in enumerate(rows):
                    if s.kept is not None and s.n_fed < len(s.kept):
                        kept = s.kept[s.n_fed : s.n_fed + m[i]]
                        replay[i, : len(kept)] = torch.from_numpy(kept.astype(np.int64))
                logits, topk = self.model.forward_cached(x, self.kv, slot0, start, at, replay=replay)
            else:
                logits, topk = self.model.forward_cached(x, self.kv, slot0, start, logits_at=at)
            routes = topk.numpy().astype(self.route_dtype)
            for i, s in enumerate(rows):
                s.routing.append(routes[i, : m[i]])
                s.n_fed += m[i]
                if s.n_fed == len(ctx[id(s)]):
                    last[id(s)] = logits[i, 0]
        for s in seqs:
            if s.req.max_new_tokens == 0:
                s.finish = {"type": "length", "length": 0}
        for s in seqs:
            s.kept = None
        go = [s for s in seqs if s.finish is None]
        if go:
            self._sample(go, torch.stack([last[id(s)] for s in go]))
        return seqs

    # -- decode -----------------------------------------------------------------------------------------

    def _decode(self) -> None:
        seqs = list(self.active)
        b = len(seqs)
        last = torch.tensor([[s.out_ids[-1]] for s in seqs], dtype=torch.long)
        start = torch.tensor([s.n_fed for s in seqs], dtype=torch.long)
        self.kv.reserve(b, int(start.max()) + 1)
        logits, topk = self.model.forward_cached(last, self.kv, 0, start)
        rows = topk[:, 0].numpy().astype(self.route_dtype)
        for i, s in enumerate(seqs):
            s.routing.append(rows[i : i + 1])
            s.n_fed += 1
        self.decode_tokens += b
        self.decode_forwards += 1
        self.max_running = max(self.max_running, b)
        self._sample(seqs, logits[:, 0])

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        toks, lps = sample(
            logits,
            [s.req.temperature for s in seqs],
            [s.req.top_p for s in seqs],
            [s.req.top_k for s in seqs],
            [s.rng.random() for s in seqs],
        )
        for s, t, lp in zip(seqs, toks, lps):
            s.out_ids.append(t)
            s.out_lps.append(lp)
            s.finish = self._finish_reason(s, t)

    def _finish_reason(self, s: Seq, t: int) -> dict | None:
        r = s.req
        if (not r.ignore_eos and t in self.tok.eos_ids) or t in r.stop_token_ids:
            return {"type": "stop", "matched": t}
        matched = s.stops.match(s.out_ids)
        if matched is not None:
            return {"type": "stop", "matched": matched}
        if len(s.out_ids) >= r.max_new_tokens or s.prompt_len + len(s.out_ids) >= self.max_seq_len:
            return {"type": "length", "length": len(s.out_ids)}
        return None

    # -- retirement -------------------------------------------------------------------------------------

    def _retire_finished(self) -> int:
        """Store finished sequences in the prefix cache and free their slots, keeping live slots compact:
        survivors above the new batch size move down into the freed slots below it (a batch finishing
        together moves nothing)."""
        done = [s for s in self.active if s.finish is not None]
        if not done:
            return 0
        for s in done:
            if self.cfg.prefix_cache_tokens and s.n_fed and s.epoch == self.epoch:
                kv = self.kv.read(s.slot, s.n_fed)
                self.prefix.insert(PrefixEntry(ids=s.all_ids(), kv=kv, routing=s.routing_rows()))
        keep = [s for s in self.active if s.finish is None]
        n = len(keep)
        holes = iter(sorted(s.slot for s in done if s.slot < n))
        for s in keep:
            if s.slot >= n:
                hole = next(holes)
                self.kv.move(s.slot, hole, s.n_fed)
                s.slot = hole
        for s in done:
            s.slot = -1
        self.active = sorted(keep, key=lambda s: s.slot)
        return len(done)

    def stats(self) -> dict:
        return {
            "steps": self.steps,
            "running": len(self.active),
            "decode_tokens": self.decode_tokens,
            "decode_forwards": self.decode_forwards,
            "max_running": self.max_running,
            "deferred": self.deferred,
            "retracted": self.retracted,
            "prefill_tokens": self.prefill_tokens,
            "prefix_cache_entries": len(self.prefix),
            "prefix_cache_tokens": self.prefix.tokens,
            "prefix_cache_hit_rate": self.prefix.hits / max(1, self.prefix.lookups),
            "kv_slab_slots": self.kv.slots,
            "kv_slab_cap": self.kv.cap,
        }


def decodes_per_hop(running: int) -> int:
    """Decode forwards per thread hop for a batch of ``running`` sequences: delivering a hop's tokens costs
    the event loop (and an HTTP server's streams) a fixed amount per sequence, so a large batch amortises it
    over several tokens; a small one delivers every token at once (its latency is what matters)."""
    return min(MAX_DECODES_PER_HOP, max(1, running // SEQS_PER_EXTRA_DECODE))


def routing_start(s: Seq) -> int:
    """Where a finished sequence's returned rows start: the request's ``routing_start``, or 0 when this request
    recomputed a prompt position before it (its prefix was not all in the cache: flushed by a weight update,
    or evicted). Those rows are then what the sampler actually used, not what the caller holds (design §6);
    the reused cached prefix may come from another sequence, so every row is returned. The prompt's last
    position is always computed by its own request, so it never counts. A retract's recompute keeps the rows
    (forced), so it never forks."""
    start = min(s.req.routing_start, s.prompt_len + len(s.out_ids) - 1)
    return 0 if s.fork else start


def routing_slice(s: Seq) -> np.ndarray:
    """Rows [routing_start(s), seqlen - 1) as int32 [rows, L, K]."""
    rows = s.routing_rows()
    end = s.prompt_len + len(s.out_ids) - 1
    return rows[routing_start(s) : end].astype(np.int32)


def request_seed(engine_seed: int, counter: int) -> int:
    return int(np.random.SeedSequence([engine_seed, counter]).generate_state(1)[0]) % (2**63 - 1)
