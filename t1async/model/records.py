"""Typed records of the inference engine (``t1async.model.engine``).

A bad request raises ``SamplerRequestError`` (HTTP 400 at the server) with the offending value.

``finish_reason`` has SGLang's shape: ``{"type": "stop", "matched": token_id_or_str}`` |
``{"type": "length", "length": n}`` | ``{"type": "abort", "message": str}``.

Routing rows: an int32 array [seqlen - 1 - start, L, K] for positions [start, seqlen - 1) of prompt + output
(the last sampled token is never fed, so never routed). ``start`` is the request's ``routing_start``, except
when the engine recomputed a position before it (its prefix cache was flushed, by a weight update or
``flush_cache``, or the entry was evicted): then ``start`` is 0 and the rows are every route this request
used, since the reused prefix may have come from another sequence computed under the current weights, not
the one whose rows the caller holds (design §6). The events report the actual ``routing_start``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from t1async.protocol.errors import ConfigError, SamplerRequestError

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 64  # running sequences decoded together
    dtype: str = "float32"  # serving precision: "float32" | "bfloat16"
    prefix_cache_tokens: int = 2_000_000  # token budget of the LRU prefix cache (0 disables it)
    seed: int = 0  # base seed for requests without their own
    max_seq_len: int | None = None  # None -> the model's
    max_prefill_tokens: int = 4096  # prompt tokens prefilled per scheduler step (at least one request)
    prefill_chunk: int = 512  # prompt tokens per prefill forward (bounds attention memory)
    torch_threads: int = 1  # torch.set_num_threads for the (process-global) intra-op pool; 0 = leave it

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("max_batch", "max_prefill_tokens", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.torch_threads < 0:
            raise ConfigError(f"EngineConfig.torch_threads must be >= 0, got {self.torch_threads}")
        if self.prefix_cache_tokens < 0:
            raise ConfigError(f"EngineConfig.prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ConfigError(f"EngineConfig.max_seq_len must be >= 2, got {self.max_seq_len}")


@dataclass(frozen=True)
class GenRequest:
    rid: str
    input_ids: tuple[int, ...] | np.ndarray
    max_new_tokens: int
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = -1  # <= 0 -> off
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    return_routing: bool = False
    routing_start: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rid, str) or not self.rid:
            raise SamplerRequestError(f"rid must be a non-empty string, got {self.rid!r}")
        if len(self.input_ids) == 0:
            raise SamplerRequestError(f"request {self.rid}: input_ids is empty; send at least one token")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise SamplerRequestError(
                f"request {self.rid}: max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}"
            )
        if not self.temperature >= 0:
            raise SamplerRequestError(f"request {self.rid}: temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise SamplerRequestError(f"request {self.rid}: top_p must be in (0, 1], got {self.top_p!r}")
        if self.routing_start < 0:
            raise SamplerRequestError(f"request {self.rid}: routing_start must be >= 0, got {self.routing_start}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise SamplerRequestError(
                f"request {self.rid}: stop_strings must be non-empty strings, got {self.stop_strings!r}"
            )

    def ids_array(self, vocab_size: int) -> np.ndarray:
        """input_ids as int32, checked against the vocabulary."""
        try:
            a = np.asarray(self.input_ids)
        except (TypeError, ValueError) as exc:
            raise SamplerRequestError(f"request {self.rid}: input_ids is not a list of ints: {exc}") from exc
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise SamplerRequestError(
                f"request {self.rid}: input_ids must be a flat list of ints, got {a.dtype} {a.shape}"
            )
        bad = np.flatnonzero((a < 0) | (a >= vocab_size))
        if len(bad):
            i = int(bad[0])
            raise SamplerRequestError(
                f"request {self.rid}: input_ids[{i}] = {int(a[i])} is outside the vocabulary [0, {vocab_size})"
            )
        return a.astype(np.int32)


@dataclass(frozen=True)
class GenEvent:
    """Tokens produced for one request since its previous event (several steps may be coalesced)."""

    rid: str
    new_ids: list[int]
    new_logprobs: list[float]  # log_softmax of the raw logits (temperature 1), fp32
    finished: bool
    finish_reason: dict | None
    prompt_tokens: int
    cached_tokens: int
    weight_version: str
    routing: np.ndarray | None = None  # final event only, when return_routing
    # the weight version that produced each of ``new_ids`` (a weight update may land between two decode steps)
    new_versions: list[str] | None = None
    routing_start: int = 0  # final event with routing: the position of routing[0] (see GenRequest.routing_start)


@dataclass(frozen=True)
class GenResult:
    """A whole generation, as ``Engine.collect`` returns it."""

    rid: str
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict
    prompt_tokens: int
    cached_tokens: int
    weight_version: str
    routing: np.ndarray | None
    versions: list[str] | None = None  # the weight version that produced each output token
    routing_start: int = 0  # the position of routing[0]
