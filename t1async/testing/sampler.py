"""Conformance checks for any Sampler (trio's ``check_two_way_stream`` habit): one suite, run by the tests
against both MemorySampler and SGLangClient + the real embedded server.

``await check_sampler(sampler, prompt=..., vocab_size=..., layers=..., topk=..., experts=...)`` raises
AssertionError naming the broken property.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from t1async.protocol.errors import SamplerRequestError
from t1async.protocol.sampling import Generation, SamplingParams

__all__ = ["check_sampler"]


def _check_generation(g: Generation, prompt_len: int, params: SamplingParams, vocab_size: int) -> None:
    n = len(g.output_ids)
    assert g.output_ids.dtype == np.int32, f"output_ids dtype {g.output_ids.dtype}, want int32"
    assert g.logprobs.dtype == np.float32, f"logprobs dtype {g.logprobs.dtype}, want float32"
    assert g.logprobs.shape == (n,), f"{g.logprobs.shape} logprobs for {n} output ids"
    assert 1 <= n <= params.max_new_tokens, f"{n} output tokens for max_new_tokens={params.max_new_tokens}"
    assert ((g.output_ids >= 0) & (g.output_ids < vocab_size)).all(), "output id outside the vocabulary"
    assert np.isfinite(g.logprobs).all() and (g.logprobs <= 1e-6).all(), f"bad logprobs {g.logprobs[:8]}"
    assert g.finish in ("stop", "length"), f"finish {g.finish!r}"
    if g.finish == "length":
        assert n == params.max_new_tokens, f"finish=length after {n} of {params.max_new_tokens} tokens"
    assert isinstance(g.policy_version, int), f"policy_version {g.policy_version!r} is not an int"
    ov = g.output_versions
    if ov is not None:  # per-token versions: one int per output token, none newer than the reported version
        assert ov.dtype == np.int32 and ov.shape == (n,), f"output_versions {ov.dtype} {ov.shape} for {n} tokens"
        assert (ov <= g.policy_version).all(), f"output_versions {ov[:8]} newer than policy_version {g.policy_version}"
    assert g.prompt_tokens == prompt_len, f"prompt_tokens {g.prompt_tokens}, sent {prompt_len}"
    assert 0 <= g.cached_tokens < prompt_len, f"cached_tokens {g.cached_tokens} of {prompt_len}"


def _check_routing(g: Generation, prompt_len: int, start: int, layers: int, topk: int, experts: int) -> None:
    assert g.routing is not None, "no routing returned although routed_experts_start_len was given"
    rows = prompt_len + len(g.output_ids) - 1 - start
    assert g.routing_start == start, f"routing_start {g.routing_start}, asked {start}"
    assert g.routing.shape == (rows, layers, topk), f"routing shape {g.routing.shape}, want {(rows, layers, topk)}"
    want = np.uint8 if experts <= 256 else np.uint16
    assert g.routing.dtype == want, f"routing dtype {g.routing.dtype}, want {np.dtype(want)}"
    assert (g.routing < experts).all(), "expert id >= num_experts"
    srt = np.sort(g.routing, axis=-1)
    assert (np.diff(srt.astype(np.int64), axis=-1) != 0).all(), "an expert chosen twice in one row"


async def check_sampler(
    sampler: Any,
    *,
    prompt: Sequence[int],
    vocab_size: int,
    layers: int,
    topk: int,
    experts: int,
    max_new_tokens: int = 8,
) -> None:
    prompt = [int(t) for t in prompt]
    n = len(prompt)
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)

    # shapes, dtypes and ranges; greedy is repeatable
    a = await sampler.generate(prompt, greedy)
    _check_generation(a, n, greedy, vocab_size)
    assert a.routing is None, "routing returned although not asked for"
    b = await sampler.generate(prompt, greedy, routed_experts_start_len=0)
    _check_generation(b, n, greedy, vocab_size)
    assert np.array_equal(a.output_ids, b.output_ids), f"greedy not repeatable: {a.output_ids} vs {b.output_ids}"
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4, err_msg="greedy logprobs not repeatable")
    _check_routing(b, n, 0, layers, topk, experts)

    # routed_experts_start_len returns the tail of the same trace
    for start in (1, n - 1, n):
        c = await sampler.generate(prompt, greedy, routed_experts_start_len=start)
        assert np.array_equal(c.output_ids, a.output_ids), "greedy output changed with routed_experts_start_len"
        _check_routing(c, n, start, layers, topk, experts)
        assert np.array_equal(c.routing, b.routing[start:]), f"routing from start={start} is not the tail"

    # a stop token ends the turn at its first occurrence, and is kept in output_ids
    if len(a.output_ids) >= 3:
        stop = int(a.output_ids[2])
        first = int(np.flatnonzero(a.output_ids == stop)[0])
        s = await sampler.generate(
            prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(stop,))
        )
        assert s.finish == "stop", f"finish {s.finish!r} with stop token {stop} in the output"
        assert s.output_ids.tolist() == a.output_ids[: first + 1].tolist(), "stop token not where greedy put it"
        assert s.matched_stop == stop, f"matched_stop {s.matched_stop!r}, want {stop}"

    # sampling at temperature 1 stays within the limits
    t = await sampler.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0))
    _check_generation(t, n, SamplingParams(max_new_tokens=max_new_tokens), vocab_size)

    # bad requests are the caller's fault
    for bad, kwargs, what in (
        ([], {}, "empty input"),
        ([vocab_size], {}, "token id >= vocab_size"),
        (prompt, {"routed_experts_start_len": n + 1}, "routed_experts_start_len past the prompt"),
    ):
        try:
            await sampler.generate(bad, greedy, **kwargs)
        except SamplerRequestError:
            continue
        raise AssertionError(f"{what} was accepted; want SamplerRequestError")
