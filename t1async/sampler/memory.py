"""``MemorySampler``: an in-process Sampler for fast tests of the layers above (actors, TITO, R3).

Deterministic: the output is a function of (seed, weight_version, input_ids) (or a script you give), the
routing of a position is a function of (weight_version, position, token), so a prefix routes the same
way turn after turn, as a real MoE does. It validates its input as the server does (SamplerRequestError),
honours max_new_tokens, stop_token_ids (the eos token unless ignored), temperature 0 (greedy: no
dependence on the call count) and routed_experts_start_len, and reports prefix-cache hits
(``cached_tokens``: the longest prefix shared with an earlier request). Like the embedded server, a request
that recomputed positions before its routed_experts_start_len (the cache was flushed by a weight update)
returns every row from 0, and each output token's version in ``output_versions``. Stop strings need a tokenizer and
are ignored.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
import numpy as np
from anyio.lowlevel import checkpoint

from t1async.protocol.errors import SamplerRequestError
from t1async.protocol.sampling import Generation, SamplingParams
from t1async.protocol.wire import Finish
from t1async.sampler.client import SamplerClosedError
from t1async.sampler.response import routing_dtype

Script = Callable[[Sequence[int]], Sequence[int]]


@dataclass(frozen=True)
class MemoryCall:
    input_ids: tuple[int, ...]
    params: SamplingParams
    routed_experts_start_len: int | None
    rid: str | None


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


class MemorySampler:
    def __init__(
        self,
        *,
        vocab_size: int = 4096,
        num_layers: int = 4,
        topk: int = 2,
        num_experts: int = 8,
        eos_token_id: int | None = None,
        seed: int = 0,
        script: Script | None = None,
        weight_version: int = 0,
        latency_s: float = 0.0,
        max_seq_len: int = 32768,
    ) -> None:
        if topk > num_experts:
            raise ValueError(f"topk={topk} exceeds num_experts={num_experts}")
        self.vocab_size, self.num_layers, self.topk, self.num_experts = vocab_size, num_layers, topk, num_experts
        self.eos_token_id = eos_token_id
        self.seed, self.script, self.weight_version = seed, script, weight_version
        self.latency_s, self.max_seq_len = latency_s, max_seq_len
        self.calls: list[MemoryCall] = []
        self.weight_paths: list[str] = []
        self._seen: list[tuple[int, ...]] = []
        self._counter = 0
        self._closed = False

    async def model_info(self) -> dict:
        """Like ``SGLangClient.model_info`` (the embedded server's ``/get_model_info`` keys)."""
        return {
            "num_layers": self.num_layers,
            "topk": self.topk,
            "num_hidden_layers": self.num_layers,
            "num_experts_per_tok": self.topk,
            "num_experts": self.num_experts,
            "vocab_size": self.vocab_size,
            "max_seq_len": self.max_seq_len,
            "weight_version": str(self.weight_version),
        }

    def update_weights(self, weight_version: int) -> None:
        """What /update_weights_from_disk does to a real sampler: new outputs, new version, cache flushed."""
        self.weight_version = weight_version
        self._seen.clear()

    async def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None) -> list[dict]:
        """``SGLangClient.update_weights_from_disk``'s signature; the path is only recorded."""
        weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
        self.update_weights(weight_version)
        self.weight_paths.append(str(model_path))
        return [{"success": True, "message": f"Weight version updated to {weight_version}.", "num_paused_requests": 0}]

    async def health(self) -> dict[str, bool]:
        return {"memory": not self._closed}

    def routing_for(self, tokens: Sequence[int], policy_version: int | None = None) -> np.ndarray:
        """The experts of each position of ``tokens`` under ``policy_version`` (default: the current weights):
        [len, layers, topk], distinct within a row."""
        v = self.weight_version if policy_version is None else policy_version
        out = np.empty((len(tokens), self.num_layers, self.topk), dtype=np.int64)
        for pos, tok in enumerate(tokens):
            rng = np.random.default_rng(_seed("route", self.seed, v, pos, int(tok)))
            for layer in range(self.num_layers):
                out[pos, layer] = rng.choice(self.num_experts, size=self.topk, replace=False)
        return out.astype(routing_dtype(self.num_experts))

    def _validate(self, ids: list[int], params: SamplingParams, start: int | None) -> None:
        if not ids:
            raise SamplerRequestError("input_ids is empty; send at least one token id")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise SamplerRequestError(
                f"input_ids holds {bad[0]}, not a token id of this model (vocab_size {self.vocab_size})"
            )
        if params.max_new_tokens < 0:
            raise SamplerRequestError(f"sampling_params.max_new_tokens must be >= 0, got {params.max_new_tokens}")
        if len(ids) + params.max_new_tokens > self.max_seq_len:
            raise SamplerRequestError(
                f"{len(ids)} input + {params.max_new_tokens} new tokens exceed the context length of {self.max_seq_len}"
            )
        if start is not None and not 0 <= start <= len(ids):
            raise SamplerRequestError(f"routed_experts_start_len = {start} must be in [0, {len(ids)}]")

    async def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        routed_experts_start_len: int | None = None,
        rid: str | None = None,
    ) -> Generation:
        if self._closed:
            raise SamplerClosedError("this MemorySampler was closed")
        ids = [int(t) for t in input_ids]
        self._validate(ids, params, routed_experts_start_len)
        self.calls.append(MemoryCall(tuple(ids), params, routed_experts_start_len, rid))
        t0 = time.perf_counter()
        # a request runs in two halves of ``latency_s``: the prompt and the first half of the output under the
        # version current after the first half, the rest under the version current after the second, so a
        # weight update landing meanwhile splits the output (its tokens, logprobs and routing rows) as it does
        # in a real engine; the prefix cache is flushed by the update and a mixed sequence is not cached
        if self.latency_s:
            await anyio.sleep(self.latency_s / 2)
        else:
            await checkpoint()
        self._counter += 1
        v0 = self.weight_version
        cached = max((_common_prefix(ids, s) for s in self._seen), default=0)
        cached = min(cached, len(ids) - 1) if cached else 0
        if self.script is not None:
            proposal = [int(t) for t in self.script(ids)]
        else:
            nonce = 0 if params.temperature == 0 else self._counter
            rng = np.random.default_rng(_seed("gen", self.seed, v0, tuple(ids), nonce))
            proposal = rng.integers(0, self.vocab_size, size=params.max_new_tokens).tolist()
        stops = set(params.stop_token_ids)
        if self.eos_token_id is not None:
            stops.add(self.eos_token_id)
        out: list[int] = []
        finish, matched = "length", None
        for tok in proposal[: params.max_new_tokens]:
            out.append(tok)
            if tok in stops:
                finish, matched = "stop", tok
                break
        if len(out) < params.max_new_tokens and finish == "length" and self.script is not None:
            finish = "stop"  # a script that ends early is an end of turn
        if self.latency_s:
            await anyio.sleep(self.latency_s / 2)
        v1 = self.weight_version
        half = (len(out) + 1) // 2
        versions = np.array([v0] * half + [v1] * (len(out) - half), dtype=np.int32)
        logprobs = np.array(
            [-((_seed("lp", int(v), len(ids) + i, t) % 4000) / 1000.0) for i, (t, v) in enumerate(zip(out, versions))],
            dtype=np.float32,
        )
        if v1 == v0:
            self._seen.append(tuple(ids + out))
            del self._seen[:-64]
        routing, start = None, 0
        if routed_experts_start_len is not None:
            start = routed_experts_start_len
            if cached < min(start, len(ids) - 1):  # recomputed positions the caller holds: every row it used
                start = 0
            full = ids + out
            split = len(ids) + half - 1  # position p is computed by the step that samples output p - len(ids) + 1
            rows = self.routing_for(full[:split], policy_version=v0)
            if len(full) - 1 > split:
                rows = np.concatenate([rows, self.routing_for(full[: len(full) - 1], policy_version=v1)[split:]])
            routing = rows[start:]
        return Generation(
            output_ids=np.asarray(out, dtype=np.int32),
            logprobs=logprobs,
            finish=Finish(finish),
            policy_version=v1,
            routing=routing,
            routing_start=start,
            prompt_tokens=len(ids),
            cached_tokens=cached,
            latency_s=time.perf_counter() - t0,
            matched_stop=matched,
            output_versions=versions,
            extra={"weight_version": str(v1), "rid": rid},
        )

    async def aclose(self) -> None:
        self._closed = True

    async def __aenter__(self) -> MemorySampler:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
