"""``python -m bench.fuzz``: hypothesis-driven fuzzing of every decoder that reads outside input.

Each target is one function that parses bytes or JSON from another process, with the error types its
docstring promises. An input that makes it raise anything else (a ``TypeError`` from deep inside, an
``IndexError``) is a crash: the bench shrinks it to a minimal example and prints it. The targets:

- ``wire.bytes``: ``wire.decode`` on arbitrary bytes (``WireError`` only);
- ``wire.map``: ``wire.decode`` on valid records' maps with fields replaced, dropped or added, so the
  checks past msgpack are reached (``WireError`` only);
- ``delivery.chunks``: the learner's ``StreamIntake.take`` on chunk headers and payloads (bad ones become
  dead letters; it raises nothing);
- ``sampler.generate`` / ``sampler.sampling``: the embedded sampler's ``/generate`` body parser
  (``SamplerRequestError`` only);
- ``client.generation``: the actors' parser of a sampler's ``/generate`` answer (``SamplerError`` only);
- ``routing.sglang``: ``meta_info.routed_experts`` to the wire's routing array (``RoutingError`` only);
- ``weightpush.dtype``: a dtype name in an update request (``ValueError`` only);
- ``sandbox.action`` / ``sandbox.junit`` / ``sandbox.summary``: a model reply and a verifier's output
  (``parse_action`` never raises; the two verifier parsers raise ``ValueError`` only).

``tests/test_fuzz.py`` runs every target for a bounded number of inputs in the suite; this bench runs them
for ``--minutes`` in rounds of fresh seeds and reports the inputs tried and every crash found.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from bench._common import emit_json, print_grid
from sandbox_agent.agent.actions import parse_action
from sandbox_agent.tasks.verifier import parse_junit, parse_pytest_summary
from t1async.ingest.routing import RoutingError, decode_sglang
from t1async.log import configure
from t1async.protocol import wire
from t1async.protocol.errors import SamplerError, SamplerRequestError, WireError
from t1async.sampler.requests import parse_generate, parse_sampling
from t1async.sampler.response import parse_generation
from t1async.sampler.weightpush import parse_dtype
from t1async.transport import chunking
from t1async.transport.base import TransportStats
from t1async.transport.delivery import Fetched, StreamIntake

VOCAB = 4096

# JSON-like and msgpack-like values, nested a little: what a hostile or buggy peer can send.
_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from([0, 1, -1, 2**31, VOCAB, VOCAB - 1, "", "abort", "stop", "length", float("nan")]),
)
json_values = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
msgpack_values = st.recursive(
    _leaf | st.binary(max_size=16),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.integers(-(2**63), 2**64 - 1), inner, max_size=4)
    ),
    max_leaves=12,
)


def _sample_records() -> list[wire.Record]:
    """One valid record of every kind: the bases the map target mutates."""
    out = np.asarray([5, 6, 7], dtype=np.int32)
    turn = wire.TurnRecord(
        episode="e1",
        turn=0,
        policy_version=1,
        keep=0,
        input_delta=np.asarray([1, 2, 3, 4], dtype=np.int32),
        input_len=4,
        input_digest=wire.digest_ids([1, 2, 3, 4]),
        output_ids=out,
        output_logprobs=np.asarray([-0.1, -0.2, -0.3], dtype=np.float32),
        finish=wire.Finish.STOP,
        routing=wire.Routing(0, np.zeros((6, 2, 2), dtype=np.uint8)),
        reward=1.0,
        tests_passed=1,
        t_sample_s=0.1,
        t_exec_s=0.1,
        output_versions=np.asarray([1, 1, 2], dtype=np.int32),
    )
    return [
        turn,
        wire.StartRecord("e1", "a0", "task", 8, 1.0),
        wire.EndRecord("e1", 1, wire.EndReason.SOLVED, 1, 2, False),
        wire.PolicyRecord(2, 2, "/ckpt"),
        wire.CreditRequest("a0", "e1"),
        wire.CreditGrant(1, 2, 30.0, "g1"),
        wire.Heartbeat("a0", 1.0),
        wire.MetricsRecord("learner", 1, 1, {"loss": 0.5}),
    ]


_BASES = [wire.to_map(r) for r in _sample_records()]


@st.composite
def mutated_maps(draw: st.DrawFn) -> bytes:
    m = dict(draw(st.sampled_from(_BASES)))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["set", "drop", "add", "array"]))
        key = draw(st.sampled_from(sorted(m, key=repr))) if m else "v"
        if op == "set":
            m[key] = draw(msgpack_values)
        elif op == "drop":
            m.pop(key, None)
        elif op == "add":
            m[draw(st.text(max_size=6))] = draw(msgpack_values)
        elif isinstance(m.get(key), dict) and m[key]:  # an array map: corrupt its dtype, shape or bytes
            arr = dict(m[key])
            sub = draw(st.sampled_from(sorted(arr, key=repr)))
            arr[sub] = draw(msgpack_values | st.binary(max_size=24) | st.lists(st.integers(-2, 2**33), max_size=4))
            m[key] = arr
    return msgpack.packb(m, use_bin_type=True)


@st.composite
def chunk_messages(draw: st.DrawFn) -> list[tuple[dict[str, str], bytes]]:
    msgs = []
    for _ in range(draw(st.integers(1, 4))):
        i, n = draw(st.integers(-1, 4)), draw(st.integers(-1, 4))
        headers = {
            chunking.HDR_CHUNK: draw(st.sampled_from([f"{i}/{n}", "", "x/y", "1", "0/0", draw(st.text(max_size=5))])),
            chunking.HDR_CHUNK_OF: draw(st.sampled_from(["m1", "m2", ""])),
            chunking.HDR_CHUNK_LEN: draw(st.sampled_from([str(draw(st.integers(-1, 64))), "", "nan", "1e3"])),
        }
        for k in list(headers):
            if draw(st.booleans()) and draw(st.booleans()):
                del headers[k]
        msgs.append((headers, draw(st.binary(max_size=32))))
    return msgs


def _deliver(msgs: list[tuple[dict[str, str], bytes]]) -> None:
    intake: StreamIntake[int] = StreamIntake(TransportStats(), max_payload=1 << 20, chunk_timeout_s=2.0)
    fetched = [Fetched("t1.traj.a0", data, headers, k, k + 1) for k, (headers, data) in enumerate(msgs)]
    for k in range(len(fetched)):
        intake.take(fetched[k : k + 1], now=float(k))
    intake.take([], now=100.0)  # whatever is still incomplete expires into a dead letter


_GEN_KEYS = ["input_ids", "text", "sampling_params", "stream", "return_logprob", "rid", "return_routed_experts"]
_SAMPLING_KEYS = ["max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "seed", "n", "min_p"]


@st.composite
def generate_bodies(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)
    body: dict[str, Any] = {}
    for k in draw(st.lists(st.sampled_from(_GEN_KEYS), max_size=5, unique=True)):
        if k == "input_ids":
            body[k] = draw(
                st.lists(st.integers(-2, VOCAB + 1), max_size=6)
                | st.lists(st.lists(st.integers(-1, VOCAB), max_size=4), max_size=3)
                | json_values
            )
        elif k == "sampling_params":
            body[k] = draw(sampling_bodies())
        else:
            body[k] = draw(json_values)
    return body


@st.composite
def sampling_bodies(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 5)) == 0:
        return draw(json_values)
    keys = draw(st.lists(st.sampled_from(_SAMPLING_KEYS) | st.text(max_size=4), max_size=5, unique=True))
    return {k: draw(json_values) for k in keys}


@st.composite
def generation_answers(draw: st.DrawFn) -> tuple[Any, int, int | None, tuple[int, int, int] | None]:
    n = draw(st.integers(0, 4))
    meta: dict[str, Any] = {
        "output_token_logprobs": [[-0.5, 7, None] for _ in range(n)],
        "weight_version": "1",
        "finish_reason": {"type": "stop"},
        "routed_experts": wire_b64(draw, n),
    }
    out: Any = {"output_ids": list(range(n)), "meta_info": meta, "text": "x"}
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["top", "meta"]))
        target = out if where == "top" else meta
        key = draw(st.sampled_from(sorted(target, key=repr)) | st.text(max_size=6))
        if draw(st.booleans()):
            target[key] = draw(json_values)
        else:
            target.pop(key, None)
    if draw(st.integers(0, 9)) == 0:
        out = draw(json_values)
    shape = draw(st.none() | st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 300)))
    return out, draw(st.integers(0, 8)), draw(st.none() | st.integers(-1, 8)), shape


def wire_b64(draw: st.DrawFn, rows: int) -> Any:
    import base64

    raw = np.asarray(draw(st.lists(st.integers(-1, 9), min_size=rows * 4, max_size=rows * 4)), dtype="<i4")
    return draw(st.just(base64.b64encode(raw.tobytes()).decode()) | json_values)


def _parse_generation(args: tuple[Any, int, int | None, tuple[int, int, int] | None]) -> None:
    out, prompt_len, start, shape = args
    parse_generation(out, prompt_len, start, shape, url="http://fuzz")


@dataclass(frozen=True)
class Target:
    name: str
    strategy: st.SearchStrategy
    call: Callable[[Any], object]
    allowed: tuple[type[BaseException], ...]


TARGETS: tuple[Target, ...] = (
    Target("wire.bytes", st.binary(max_size=256), wire.decode, (WireError,)),
    Target("wire.map", mutated_maps(), wire.decode, (WireError,)),
    Target("delivery.chunks", chunk_messages(), _deliver, ()),
    Target(
        "sampler.generate",
        generate_bodies(),
        lambda b: parse_generate(b, vocab_size=VOCAB, max_seq_len=64, encode=lambda s: [1] * len(s)),
        (SamplerRequestError,),
    ),
    Target("sampler.sampling", sampling_bodies(), lambda b: parse_sampling(b, VOCAB), (SamplerRequestError,)),
    Target("client.generation", generation_answers(), _parse_generation, (SamplerError,)),
    Target(
        "routing.sglang",
        st.tuples(
            st.text(max_size=40) | st.binary(max_size=40),
            st.integers(-1, 4),
            st.integers(-1, 4),
            st.integers(-1, 70000),
        ),
        lambda a: decode_sglang(*a),
        (RoutingError,),
    ),
    Target("weightpush.dtype", json_values, parse_dtype, (ValueError,)),
    Target("sandbox.action", st.text(max_size=200), parse_action, ()),
    Target("sandbox.junit", st.text(max_size=200), parse_junit, (ValueError,)),
    Target("sandbox.summary", st.text(max_size=200), parse_pytest_summary, (ValueError,)),
)


@dataclass
class Outcome:
    target: str
    inputs: int = 0
    crashes: list[str] = field(default_factory=list)


def fuzz(target: Target, examples: int, rng_seed: int) -> Outcome:
    """Run ``target`` on ``examples`` hypothesis inputs from ``rng_seed``; a crash is shrunk and recorded."""
    outcome = Outcome(target.name)

    @seed(rng_seed)
    @settings(
        max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=False
    )
    @given(target.strategy)
    def check(x: Any) -> None:
        outcome.inputs += 1
        try:
            target.call(x)
        except target.allowed:
            pass

    try:
        check()
    except Exception as exc:  # noqa: BLE001 - the crashes found, already shrunk by hypothesis
        found = list(exc.exceptions) if isinstance(exc, ExceptionGroup) else [exc]
        for e in found:
            notes = " ".join(n.strip() for n in getattr(e, "__notes__", []) if "check(" in n or "x=" in n)
            outcome.crashes.append(f"{type(e).__name__}: {e} | {notes[:400]}")
    return outcome


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0, help="how long to fuzz, over all targets (default 1)")
    ap.add_argument("--examples", type=int, default=2000, help="inputs per target per round (default 2000)")
    ap.add_argument("--seed", type=int, default=0, help="first round's seed; each round adds 1")
    ap.add_argument("--targets", default="", help="comma-separated target names (default: all)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    args = ap.parse_args(argv)
    configure(level="error")  # every rejected input logs a warning (a dead letter): millions of lines
    names = [t.name for t in TARGETS]
    want = [n for n in args.targets.split(",") if n] or names
    unknown = sorted(set(want) - set(names))
    if unknown:
        ap.error(f"unknown --targets {unknown}; the targets are {names}")
    if args.minutes <= 0 or args.examples < 1:
        ap.error("--minutes must be > 0 and --examples >= 1")
    totals = {n: Outcome(n) for n in want}
    deadline = time.monotonic() + 60.0 * args.minutes
    rounds = 0
    while time.monotonic() < deadline:
        for t in TARGETS:
            if t.name not in totals or time.monotonic() >= deadline:
                continue
            o = fuzz(t, args.examples, args.seed + rounds)
            totals[t.name].inputs += o.inputs
            totals[t.name].crashes += o.crashes
        rounds += 1
    rows = [(o.target, o.inputs, len(o.crashes)) for o in totals.values()]
    print_grid(["target", "inputs", "crashes"], rows, title=f"fuzzing, {rounds} round(s) from seed {args.seed}")
    for o in totals.values():
        for c in o.crashes:
            print(f"CRASH {o.target}: {c}")
    result = {
        "inputs": sum(o.inputs for o in totals.values()),
        "crashes": sum(len(o.crashes) for o in totals.values()),
        "rounds": rounds,
        "by_target": {o.target: {"inputs": o.inputs, "crashes": o.crashes} for o in totals.values()},
    }
    if args.json:
        emit_json(result)
    else:
        print(json.dumps({k: result[k] for k in ("inputs", "crashes", "rounds")}))


if __name__ == "__main__":
    main()
