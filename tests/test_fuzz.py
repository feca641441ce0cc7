"""Every decoder of outside input, fuzzed (bounded): only the documented error types may come out.

``python -m bench.fuzz --minutes N`` runs the same targets for longer."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from hypothesis import strategies as st

from bench.fuzz import TARGETS, Target, fuzz
from t1async.ingest.routing import RoutingError, decode_sglang
from t1async.protocol.errors import SamplerError
from t1async.sampler.response import parse_generation


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_target_raises_only_its_documented_errors(target: Target) -> None:
    outcome = fuzz(target, examples=200, rng_seed=1)
    assert outcome.crashes == []
    assert outcome.inputs >= 50  # hypothesis ran it, not a strategy that filters everything out


def test_the_harness_reports_a_crash() -> None:
    """A target that raises an undocumented type is reported, with the shrunk input."""

    def brittle(x: int) -> None:
        if x > 10:
            raise KeyError("x")

    outcome = fuzz(Target("brittle", st.integers(0, 100), brittle, (ValueError,)), examples=200, rng_seed=0)
    assert len(outcome.crashes) == 1
    assert outcome.crashes[0].startswith("KeyError") and "x=11" in outcome.crashes[0]


def _answer(routed: object) -> dict:
    meta = {"output_token_logprobs": [[-0.5, 7, None]] * 3, "weight_version": "1", "routed_experts": routed}
    return {"output_ids": [7, 7, 7], "meta_info": meta}


@pytest.mark.parametrize("routed", ["0", "é", [1, 2], {"a": 1}])
def test_malformed_routed_experts_is_a_sampler_error(routed: object) -> None:
    """Found by bench.fuzz: a sampler answering routed_experts that is not base64 raised binascii.Error,
    TypeError or ValueError out of parse_generation (seen failing on the old code)."""
    with pytest.raises(SamplerError, match="malformed response"):
        parse_generation(_answer(routed), 1, 0, (1, 1, 4), url="http://s")


def test_well_formed_answer_still_parses() -> None:
    routed = base64.b64encode(np.zeros(3, dtype="<i4").tobytes()).decode()
    gen = parse_generation(_answer(routed), 1, 0, (1, 1, 4), url="http://s")
    assert gen.routing is not None and gen.routing.shape == (3, 1, 1)


def test_routing_shape_below_one_is_a_routing_error() -> None:
    """Found by bench.fuzz: num_layers = topk = -1 reached numpy's reshape (seen failing on the old code)."""
    with pytest.raises(RoutingError, match=">= 1"):
        decode_sglang("", -1, -1, 8)
