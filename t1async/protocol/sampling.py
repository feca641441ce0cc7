"""The Sampler seam: what an actor needs from a sampler, whatever serves it.

``SGLangClient`` (sampler/client.py, HTTP to a real SGLang or the embedded server) and ``MemorySampler`` (tests)
both implement it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from t1async.protocol.wire import Finish


@dataclass(frozen=True)
class SamplingParams:
    """The sampling parameters of one request, on both sides of the wire: what an actor asks for (these
    defaults) and what the server parses a request's ``sampling_params`` into (``protocol.SGLANG_DEFAULTS``
    for the fields a request leaves out)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = False
    no_stop_trim: bool = True
    seed: int | None = None  # SGLang's sampling_seed: the same seed, weights and input give the same sample
    ignore_eos: bool = False  # sample past the end-of-sequence tokens (stop_token_ids still stop)

    def to_sglang(self) -> dict:
        d: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
        }
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            d["stop"] = list(self.stop)
        if self.seed is not None:
            d["sampling_seed"] = self.seed
        if self.ignore_eos:
            d["ignore_eos"] = True
        return d


@dataclass(frozen=True)
class Generation:
    """One token-in/token-out sample.

    ``routing`` rows cover sequence positions ``[routing_start, len(input_ids) + len(output_ids) - 1)``,
    shape ``[rows, layers, topk]``, dtype u1 when experts <= 256 else u2; None if not requested.
    ``routing_start`` may be earlier than the ``routed_experts_start_len`` asked for: the sampler recomputed
    those positions (its prefix cache was flushed) and returns the routes it actually used (design §6).
    """

    output_ids: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n]
    finish: Finish  # STOP | LENGTH | ABORT; a str given ("stop") is converted, an unknown one raises ValueError
    policy_version: int  # the sampler's weight_version (SGLang's name), as an int
    routing: np.ndarray | None = None
    routing_start: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    latency_s: float = 0.0
    matched_stop: int | str | None = None
    text: str = ""
    # int32 [n]: the policy version that produced each output token (a weight update may land mid-request);
    # None: the sampler did not say, read ``policy_version`` for all of them
    output_versions: np.ndarray | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.finish, Finish):
            object.__setattr__(self, "finish", Finish(self.finish))


class Sampler(Protocol):
    async def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        routed_experts_start_len: int | None = None,
        rid: str | None = None,
    ) -> Generation: ...

    async def aclose(self) -> None: ...


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D arrays (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n
