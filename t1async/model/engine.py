"""The batched inference engine that the embedded SGLang-compatible server wraps.

    engine = Engine(model_dir, EngineConfig(max_batch=64, dtype="float32"))
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)                       # the scheduler loop
        async with engine.submit(req) as events:         # leaving the block early aborts the request
            async for ev in events: ...                  # GenEvent, the last one has finished=True
        result = await engine.collect(req2)              # GenResult, the whole generation
        async with aclosing(engine.generate(req3)) as events: ...   # async-generator form, same events
        await engine.update_weights_from_disk(path, "7")
        tg.cancel_scope.cancel()                         # stops the engine; unfinished requests end "abort"

Requests (``GenRequest``) join the running batch between decode steps (continuous batching): each scheduler
step prefills newly admitted requests (up to ``max_prefill_tokens`` prompt tokens, chunked) and then runs
one batched decode forward over every running sequence. Torch work runs in a worker thread
(``anyio.to_thread.run_sync``), one step at a time, so the event loop stays responsive. A large batch runs
several decode forwards per thread hop (``scheduler.decodes_per_hop``: 8 for 32 sequences), so delivering
tokens (and an HTTP server's per-stream work) is paid once per several tokens; the hop ends early when a
sequence finishes or the event loop has work for the scheduler (a request that fits, an abort, an update).

Events: a consumer receives the tokens produced since its previous event (steps coalesce if it reads slowly;
the scheduler never waits for consumers). ``new_logprobs`` are ``log_softmax`` of the raw logits at
temperature 1 (see sampling.py). ``cached_tokens`` counts prompt positions taken from the prefix cache: a
request extending an earlier request's prompt + output reuses its KV and routing, usually
``len(earlier sequence) - 1`` tokens (the earlier last sampled token was never fed). The final event carries
``routing`` (int32 [seqlen - 1 - routing_start, L, K]) when ``return_routing``.

Weight updates swap weights between steps; the prefix cache is flushed (its KV belongs to the old weights),
and ``weight_version`` becomes the given version or previous + 1. Out of a pause, running requests are
retracted around the swap (scheduler.py): each is re-prefilled over its prompt and tokens so far with the
new weights and decodes on, so no token mixes policies. ``pause(mode)`` / ``resume()`` are SGLang's
``/pause_generation`` modes (``abort``, ``retract``, ``in_place``) and ``/continue_generation``. Each event
reports the version current when it was produced, and ``new_versions`` the version that produced each of
its tokens (an update landing mid-request splits its output between versions). A request whose prompt could
not be taken whole from the prefix cache up to its ``routing_start`` (flushed by an update, or evicted), or
that was retracted under new weights, returns its routing from position 0: the routes it last used
(records.py).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import anyio
import torch

from t1async.log import get_logger
from t1async.model.hf import hf_state_shapes
from t1async.model.records import EngineConfig, GenEvent, GenRequest, GenResult
from t1async.model.sampling import StopStrings
from t1async.model.scheduler import (
    BusyClock,
    EngineCore,
    Seq,
    StepPlan,
    WeightUpdate,
    decodes_per_hop,
    request_seed,
    routing_slice,
    routing_start,
)
from t1async.model.stream import EventStream, Handle
from t1async.model.tokenizer import ChatTokenizer
from t1async.model.weights import load_pretrained
from t1async.protocol.errors import SamplerError, SamplerRequestError

__all__ = ["PAUSE_MODES", "Engine"]

PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's PauseGenerationReqInput.mode

log = get_logger("model.engine")


class Engine:
    def __init__(self, model_dir: Path | str, config: EngineConfig = EngineConfig()) -> None:
        self.model_dir = Path(model_dir)
        self.config = config
        dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
        if config.torch_threads:
            # the model's matrices are tiny: waking a second OpenMP thread per op costs more than it saves
            torch.set_num_threads(config.torch_threads)
        model = load_pretrained(self.model_dir, dtype=dtype)
        tok_dir = self.model_dir if (self.model_dir / "tokenizer.json").is_file() else None
        self.tokenizer = ChatTokenizer.load(tok_dir)
        self._core = EngineCore(model, self.tokenizer, config)
        self.model_cfg = model.cfg
        self.weight_version = "0"
        self._waiting: deque[Handle] = deque()
        self._handles: dict[str, Handle] = {}
        self._aborts: list[Handle] = []
        self._updates: list[tuple[WeightUpdate, anyio.Event]] = []
        self._flush = False
        self._paused: str | None = None  # a pause mode (PAUSE_MODES) while paused
        self._retract = False  # a pause in mode retract not yet carried out by the step loop
        self._pause_acks: list[anyio.Event] = []  # set once the loop has carried out a pause
        self._wake = anyio.Event()
        self._state = "new"
        self._counter = 0
        self._clock = BusyClock()  # the sampler's own busy/idle accounting

    # -- info -------------------------------------------------------------------------------------------

    def model_info(self) -> dict:
        c = self.model_cfg
        return {
            "model_path": str(self.model_dir),
            "tokenizer_path": str(self.tokenizer.path),
            "is_generation": True,
            "num_layers": c.n_layers,
            "num_experts": c.n_experts,
            "topk": c.top_k,
            "vocab_size": c.vocab_size,
            "max_seq_len": self._core.max_seq_len,
            "dtype": self.config.dtype,
            "weight_version": self.weight_version,
            "eos_token_ids": list(self.tokenizer.eos_ids),
        }

    def stats(self) -> dict:
        """Scheduler counters (read between steps; approximate while a step runs), with ``busy_s`` and
        ``uptime_s`` (scheduler.BusyClock)."""
        return {
            **self._core.stats(),
            "waiting": len(self._waiting),
            "paused": self._paused,
            "weight_version": self.weight_version,
            **self._clock.stats(),
        }

    # -- the scheduler loop -----------------------------------------------------------------------------

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        if self._state != "new":
            raise RuntimeError(f"Engine.run called on an engine that is {self._state}; make a new Engine")
        self._state = "running"
        log.info("engine.started", model=str(self.model_dir), dtype=self.config.dtype, max_batch=self.config.max_batch)
        self._clock.t_start = time.perf_counter()
        task_status.started()
        updates: list = []
        acks: list[anyio.Event] = []
        try:
            while True:
                if not self._has_work():
                    await self._wake.wait()
                    self._wake = anyio.Event()
                    continue
                plan, updates = self._plan()
                acks, self._pause_acks = self._pause_acks, []
                decodes = 1 if plan.admit or plan.aborts else decodes_per_hop(len(self._core.active))
                self._clock.step_started()
                try:
                    changed, deferred = await anyio.to_thread.run_sync(
                        partial(self._core.step, plan, decodes=decodes, interrupted=self._interrupted)
                    )
                finally:
                    self._clock.step_ended()
                self._requeue(deferred)
                for u, done in updates:
                    if u.error is None:
                        self.weight_version = u.weight_version
                    done.set()
                updates = []
                self._deliver(changed)
                for a in acks:
                    a.set()
                acks = []
        finally:
            self._state = "stopped"
            for h in list(self._handles.values()):
                h.fail("engine stopped", self.weight_version)
            self._handles.clear()
            self._waiting.clear()
            for u, done in updates + self._updates:
                if done.is_set():
                    continue
                u.error = SamplerError("engine stopped before the weight update was applied")
                done.set()
            for a in acks + self._pause_acks:
                a.set()
            log.info("engine.stopped")

    def _has_work(self) -> bool:
        if self._aborts or self._updates or self._flush or self._pause_acks:
            return True
        return self._paused is None and bool(self._waiting or self._core.active)

    def _interrupted(self) -> bool:
        """Read from the engine's worker thread between the decodes of one hop: does the scheduler have work
        (a request that could be admitted, an abort, a weight update, a cache flush)?"""
        room = self._waiting and len(self._core.active) < self.config.max_batch
        return bool(room or self._aborts or self._updates or self._flush or self._pause_acks)

    def _plan(self) -> tuple[StepPlan, list]:
        # candidates up to the free room; the core admits those whose uncached prompts fit the prefill
        # budget and hands the rest back (see _requeue). While a step runs, candidates count as admitted.
        # Paused: no candidates, and the core neither admits nor decodes.
        admit: list[Seq] = []
        room = self.config.max_batch - len(self._core.active)
        while self._paused is None and self._waiting and len(admit) < room:
            h = self._waiting.popleft()
            h.admitted = True
            admit.append(h.seq)
        aborts = [h.seq for h in self._aborts]
        updates, self._updates = self._updates, []
        plan = StepPlan(
            admit=admit,
            aborts=aborts,
            updates=[u for u, _ in updates],
            flush=self._flush,
            paused=self._paused is not None,
            retract=self._retract,
        )
        self._aborts, self._flush, self._retract = [], False, False
        return plan, updates

    def _requeue(self, deferred: list[Seq]) -> None:
        """Candidates the core did not admit (retracted sequences first) go back to the head of the queue, in
        order (unless aborted)."""
        aborted = {id(h) for h in self._aborts}
        for s in reversed(deferred):
            h = self._handles.get(s.req.rid)
            if h is None or h.seq is not s:
                continue
            if id(h) in aborted:
                self._aborts = [a for a in self._aborts if a is not h]
                del self._handles[h.rid]
                h.fail("aborted by request", self.weight_version)
                continue
            h.admitted = False
            self._waiting.appendleft(h)

    def _deliver(self, changed: list[Seq]) -> None:
        for s in changed:
            h = self._handles.get(s.req.rid)
            if h is None or h.seq is not s:
                continue
            h.cached_tokens = s.cached
            h.weight_version = self.weight_version
            h.pending_ids.extend(s.out_ids[s.reported :])
            h.pending_lps.extend(s.out_lps[s.reported :])
            # every token of this step was sampled after the step's weight updates: the current version
            h.pending_versions.extend([self.weight_version] * (len(s.out_ids) - s.reported))
            s.reported = len(s.out_ids)
            if s.finish is not None:
                h.done = True
                h.finish_reason = s.finish
                if s.req.return_routing:
                    h.routing = routing_slice(s)
                    h.routing_start = routing_start(s)
                del self._handles[h.rid]
            h.wake.set()

    # -- requests ---------------------------------------------------------------------------------------

    def _enqueue(self, req: GenRequest) -> Handle:
        if self._state != "running":
            raise SamplerError(f"engine is {self._state}; start Engine.run in a task group before submitting")
        if req.rid in self._handles:
            raise SamplerRequestError(f"request id {req.rid!r} is already running; rids must be unique")
        ids = req.ids_array(self.model_cfg.vocab_size)
        if len(ids) >= self._core.max_seq_len:
            raise SamplerRequestError(
                f"request {req.rid}: prompt of {len(ids)} tokens does not fit max_seq_len {self._core.max_seq_len}"
            )
        self._counter += 1
        seed = req.seed if req.seed is not None else request_seed(self.config.seed, self._counter)
        seq = Seq(req=req, ids=ids, rng=random.Random(seed), stops=StopStrings(self.tokenizer.decode, req.stop_strings))
        h = Handle(seq)
        h.weight_version = self.weight_version
        self._handles[req.rid] = h
        self._waiting.append(h)
        self._wake.set()
        return h

    @asynccontextmanager
    async def submit(self, req: GenRequest) -> AsyncIterator[EventStream]:
        """Queue ``req``; yields its event stream. Leaving the block before the final event aborts it."""
        h = self._enqueue(req)
        try:
            yield EventStream(h)
        finally:
            if not h.done:
                self.abort(req.rid)

    async def generate(self, req: GenRequest) -> AsyncGenerator[GenEvent, None]:
        """Async-generator form of ``submit``; close it (``contextlib.aclosing``) to abort early."""
        async with self.submit(req) as events:
            async for ev in events:
                yield ev

    async def collect(self, req: GenRequest) -> GenResult:
        """Run ``req`` to the end and return the whole generation."""
        ids: list[int] = []
        lps: list[float] = []
        versions: list[str] = []
        async with self.submit(req) as events:
            async for ev in events:
                ids += ev.new_ids
                lps += ev.new_logprobs
                versions += ev.new_versions or []
                last = ev
        if last.finish_reason is None:  # the final event (finished=True) always carries one
            raise SamplerError(f"request {req.rid}: its event stream ended without a finish reason (an engine bug)")
        return GenResult(
            rid=req.rid,
            output_ids=ids,
            logprobs=lps,
            finish_reason=last.finish_reason,
            prompt_tokens=last.prompt_tokens,
            cached_tokens=last.cached_tokens,
            weight_version=last.weight_version,
            routing=last.routing,
            versions=versions,
            routing_start=last.routing_start,
        )

    def abort(self, rid: str) -> bool:
        """Abort a queued or running request; False if no such request is in flight."""
        h = self._handles.get(rid)
        if h is None:
            return False
        if not h.admitted:
            self._waiting.remove(h)
            del self._handles[rid]
            h.fail("aborted by request", self.weight_version)
        else:
            self._aborts.append(h)
            self._wake.set()
        return True

    async def pause(self, mode: str) -> None:
        """SGLang's ``/pause_generation`` modes; returns once the step loop has carried it out (the step
        running now ends first). Paused, nothing is admitted or decoded; weight updates, aborts and cache
        flushes still apply, between steps.

        - ``abort``: every queued and running request ends with finish_reason abort;
        - ``in_place``: running requests stay where they are, KV and all, and go on at ``resume``; an update
          in between leaves them decoding new weights over old KV (SGLang's in_place: mixed policies);
        - ``retract``: running requests give up their KV and go back to the head of the queue with their
          sampled tokens; at ``resume`` each is re-prefilled (prompt + tokens so far) with the weights of
          then, and decodes on. Nothing is aborted and nothing mixes."""
        if mode not in PAUSE_MODES:
            raise SamplerRequestError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        if self._state != "running":
            raise SamplerError(f"engine is {self._state}; pausing needs a running engine")
        if mode == "abort":
            for rid in list(self._handles):
                self.abort(rid)
        self._paused = mode
        self._retract = self._retract or mode == "retract"
        done = anyio.Event()
        self._pause_acks.append(done)
        self._wake.set()
        await done.wait()
        log.info("engine.paused", mode=mode, running=len(self._core.active), waiting=len(self._waiting))

    def resume(self) -> None:
        """End a pause (``/continue_generation``); harmless when not paused."""
        if self._paused is not None:
            log.info("engine.resumed", mode=self._paused, waiting=len(self._waiting))
        self._paused = None
        self._retract = False
        self._wake.set()

    @property
    def paused(self) -> str | None:
        """The pause mode while paused, else None."""
        return self._paused

    def flush_cache(self) -> None:
        """Drop the prefix cache before the next step."""
        self._flush = True
        self._wake.set()

    async def update_weights_from_disk(self, model_path: str | Path, weight_version: str | None = None) -> None:
        """Load new weights between steps (waits for the current step); raises ConfigError if they don't fit."""
        version = self._update_version(weight_version)
        await self._swap(WeightUpdate(Path(model_path), version))

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """What a distributed update may name, with each tensor's shape: the model's state_dict names, and for
        a Hugging Face architecture its hub names too (one projection or one expert each, as SGLang's
        ``/update_weights_from_distributed`` takes them)."""
        model = self._core.model
        own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        return {**own, **hf_state_shapes(model.cfg, own)} if model.cfg.architecture else own

    async def update_weights_from_tensors(
        self, tensors: dict[str, torch.Tensor], weight_version: str | None = None
    ) -> None:
        """Copy named tensors (some or all of the state dict) into the model between steps, as one update:
        the same swap as ``update_weights_from_disk`` (cache flushed, version set); raises ConfigError if a
        name or shape does not fit (the model is then unchanged)."""
        version = self._update_version(weight_version)
        await self._swap(WeightUpdate(Path(""), version, tensors=dict(tensors)))

    def _update_version(self, weight_version: str | None) -> str:
        """The version a weight update sets (the next one if not given); the engine must be running."""
        if self._state != "running":
            raise SamplerError(f"engine is {self._state}; weight updates need a running engine")
        return str(weight_version if weight_version is not None else self._next_version())

    async def _swap(self, u: WeightUpdate) -> None:
        """Hand ``u`` to the step loop, which applies it between steps; raise its error, if any."""
        done = anyio.Event()
        self._updates.append((u, done))
        self._wake.set()
        await done.wait()
        if u.error is not None:
            raise u.error

    def _next_version(self) -> str:
        try:
            return str(int(self.weight_version) + 1)
        except ValueError:
            return self.weight_version + "+1"
