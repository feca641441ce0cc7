"""R3 routing traces: SGLang codec, validation, tiling and exact alignment across REALIGN and FORK."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from t1async.ingest.assembly import Assembler
from t1async.ingest.episode import AssemblerConfig
from t1async.ingest.routing import (
    RouteTrack,
    RoutingError,
    RoutingStats,
    compact_dtype,
    decode_sglang,
    encode_sglang,
    expected_rows,
    routing_drift,
    zero_layers,
)
from t1async.protocol import wire
from t1async.testing.episodes import check_segments, make_episode, route_rows


@given(st.integers(0, 30), st.integers(1, 6), st.integers(1, 4), st.sampled_from([8, 256, 257, 4096]), st.data())
@settings(max_examples=100, deadline=None)
def test_sglang_codec_round_trips_into_compact_dtypes(rows, layers, topk, experts, data):
    arr = np.asarray(
        data.draw(st.lists(st.integers(0, experts - 1), min_size=rows * layers * topk, max_size=rows * layers * topk)),
        np.int64,
    ).reshape(rows, layers, topk)
    back = decode_sglang(encode_sglang(arr), layers, topk, experts)
    assert back.dtype == (np.uint8 if experts <= 256 else np.uint16) and np.array_equal(back, arr)


def test_sglang_decode_errors_say_what_is_wrong():
    good = encode_sglang(np.zeros((2, 3, 2)))
    with pytest.raises(RoutingError, match="multiple of layers 4"):
        decode_sglang(good, 4, 2, 8)
    with pytest.raises(RoutingError, match="base64"):
        decode_sglang("not base64!!", 3, 2, 8)
    with pytest.raises(RoutingError, match=r"outside \[0, 8\)"):
        decode_sglang(base64.b64encode(np.array([9] * 6, "<i4").tobytes()), 3, 2, 8)
    with pytest.raises(RoutingError, match="num_experts"):
        compact_dtype(0)


def test_zero_layer_detection():
    ex = np.ones((40, 3, 2), np.uint8)
    ex[:, 1] = 0
    assert zero_layers(ex).tolist() == [False, True, False]
    top1 = np.zeros((5, 2, 1), np.uint8)  # top-1 over few tokens: expert 0 is a legit choice
    assert not zero_layers(top1).any() and zero_layers(np.zeros((40, 2, 1), np.uint8)).all()


def _trace(full: np.ndarray, start: int, layers=3, topk=2, experts=16) -> wire.Routing:
    return wire.Routing(start, route_rows(full, layers, topk, experts)[start : len(full) - 1])


def test_track_tiles_and_counts_gaps_overlaps_and_rejections():
    stats = RoutingStats()
    tr = RouteTrack(stats)
    s0 = np.arange(1, 11, dtype=np.int32)  # input 6 + output 4
    tr.add(_trace(s0, 0), 6, 4)
    assert tr.n == 10 and tr.covered == 9
    s1 = np.concatenate([s0, np.arange(20, 25, dtype=np.int32)])
    tr.add(_trace(s1, 11), 12, 3)  # should start at 9: rows 9, 10 are a gap
    assert (stats.gap_rows, stats.missing_rows) == (2, 2)
    arr = tr.take()
    assert (arr[9:11] == -1).all() and (arr[11:14] >= 0).all() and (arr[14] == -1).all()
    s2 = np.concatenate([s1, [7, 7]]).astype(np.int32)
    tr.add(_trace(s2, 10), 16, 1)  # starts before covered end 14: overlap, newer rows win
    assert stats.overlap_rows == 4
    bad = wire.Routing(16, np.zeros((5, 3, 2), np.uint8))  # 5 rows where 2 are expected
    tr.add(bad, 18, 1)
    assert stats.rejected_traces == 1 and stats.missing_rows == 2 + 2
    assert expected_rows(18, 1, 16) == 2


def test_all_zero_layer_becomes_missing_for_that_trace_only():
    stats = RoutingStats()
    tr = RouteTrack(stats)
    full = np.arange(50, dtype=np.int32)
    rt = _trace(full, 0)
    ex = rt.experts.copy()
    ex[:, 2] = 0
    tr.add(wire.Routing(0, ex), 40, 10)
    arr = tr.take()
    assert stats.rejected_layers == 1 and (arr[:49, 2] == -1).all() and (arr[:49, :2] >= 0).all()


def test_wrong_shape_against_the_segment_is_rejected():
    asm = Assembler(AssemblerConfig(num_experts=16))
    full0 = np.arange(1, 9, dtype=np.int32)
    t0 = wire.TurnRecord(
        "e",
        0,
        0,
        0,
        full0[:5],
        5,
        wire.digest_ids(full0[:5]),
        full0[5:],
        np.zeros(3, np.float32),
        wire.Finish.STOP,
        _trace(full0, 0),
        0.0,
        -1,
        0.0,
        0.0,
    )
    full1 = np.concatenate([full0, [9, 10, 11]]).astype(np.int32)
    t1 = wire.TurnRecord(
        "e",
        1,
        0,
        8,
        full1[8:9],
        9,
        wire.digest_ids(full1[:9]),
        full1[9:],
        np.zeros(2, np.float32),
        wire.Finish.STOP,
        _trace(full1, 7, layers=4),
        0.0,
        -1,
        0.0,
        0.0,
    )
    asm.add(t0)
    asm.add(t1)
    (seg,) = asm.end(wire.EndRecord("e", 2, wire.EndReason.SOLVED, 0, 0, False))
    rs = asm.routing_stats()
    assert rs.rejected_traces == 1 and seg.routing.shape == (11, 3, 2)
    assert (seg.routing[:7] >= 0).all() and (seg.routing[7:] == -1).all()


@pytest.mark.parametrize("kinds", [["clean"] * 6, ["realign"] * 6, ["fork"] * 6, ["fork", "realign", "clean"] * 3])
@pytest.mark.parametrize("mode", ["exact", "under", "zero"])
def test_alignment_is_exact_and_complete_across_every_boundary_kind(kinds, mode):
    rng = np.random.default_rng(len(kinds) * 7 + len(mode))
    case = make_episode(rng, kinds, keep_modes=[mode] * len(kinds), layers=4, topk=2, num_experts=64)
    asm = Assembler()
    segs = [s for r in case.records for s in asm.feed(r)]
    check_segments(case, segs, full_routing=True)  # every present row is from its own context; no gaps
    rs = asm.routing_stats()
    assert rs.missing_rows == 0 and rs.gap_rows == 0 and rs.rejected_traces == 0 and rs.traces == len(case.truth)
    assert rs.dropped_rows > 0 if "realign" in kinds else rs.dropped_rows == 0


def test_a_trace_that_starts_after_the_fork_point_leaves_the_gap_missing():
    """An actor that asked only for rows after its own (too large) keep: positions between the true common
    prefix and that start were computed in another context, so they must stay -1."""
    asm = Assembler()
    i0 = np.arange(1, 7, dtype=np.int32)
    s0 = np.concatenate([i0, [50, 51]]).astype(np.int32)
    asm.add(
        wire.TurnRecord(
            "e",
            0,
            0,
            0,
            i0,
            6,
            wire.digest_ids(i0),
            s0[6:],
            np.zeros(2, np.float32),
            wire.Finish.STOP,
            _trace(s0, 0),
            0.0,
            -1,
            0.0,
            0.0,
        )
    )
    i1 = np.concatenate([s0[:3], [99], s0[4:], [60]]).astype(np.int32)  # FORK at position 3
    s1 = np.concatenate([i1, [70, 71]]).astype(np.int32)
    asm.add(
        wire.TurnRecord(
            "e",
            1,
            0,
            3,
            i1[3:],
            len(i1),
            wire.digest_ids(i1),
            s1[len(i1) :],
            np.zeros(2, np.float32),
            wire.Finish.STOP,
            _trace(s1, 6),
            0.0,
            -1,
            0.0,
            0.0,
        )
    )
    segs = asm.end(wire.EndRecord("e", 2, wire.EndReason.SOLVED, 0, 0, False))
    seg = segs[-1]
    want = route_rows(seg.tokens, 3, 2, 16).astype(np.int16)
    assert np.array_equal(seg.routing[:3], want[:3])  # shared prefix: old rows are exact
    assert (seg.routing[3:6] == -1).all()  # never routed in this context
    assert np.array_equal(seg.routing[6:-1], want[6:-1]) and (seg.routing[-1] == -1).all()
    assert asm.routing_stats().gap_rows == 3


def test_routing_drift_compares_sets_and_skips_missing():
    rec = np.array([[[1, 2], [3, 4]], [[-1, -1], [5, 6]]], np.int16)
    comp = np.array([[[2, 1], [3, 5]], [[0, 0], [5, 6]]], np.int16)
    assert routing_drift(rec, comp) == (1, 3)


# ------------------------------------------------------------------ R3 across a weight update (real engine)


def _replay_logprobs(model, seg) -> np.ndarray:
    """The learner's replay forward of a segment: its logprob of each loss token, with the recorded routing."""
    import torch

    x = torch.from_numpy(seg.tokens[None].astype(np.int64))
    with torch.no_grad():
        out = model(x, replay=torch.from_numpy(seg.routing[None].astype(np.int64)))
    lp = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(-1, x[0, 1:, None]).squeeze(-1).numpy()
    return np.concatenate([[0.0], lp])[seg.loss_mask]


async def test_replay_after_a_weight_update_between_turns_reproduces_both_turns(tmp_path):
    """Turn 0 is sampled under weights w0, then an update flushes the sampler's prefix cache and turn 1 is
    sampled under w1: the sampler re-routes the whole context and returns those rows (routing_start 0), the
    learner cuts a route fork, and replaying each segment with its sampler's weights reproduces every sampled
    logprob (< 1e-4, fp32). Without the fork (turn 0's rows kept for turn 1's context) turn 1 is not
    reproduced: the context was computed with other experts."""
    import trio

    from actors.records import TurnEncoder
    from sandbox_agent.agent.types import TurnResult
    from t1async.model.config import MoEConfig
    from t1async.model.engine import Engine
    from t1async.model.moe import MoETransformer
    from t1async.model.records import EngineConfig, GenRequest
    from t1async.model.tokenizer import ChatTokenizer
    from t1async.model.weights import save_pretrained

    cfg = MoEConfig(
        vocab_size=4096,
        d_model=32,
        n_layers=2,
        n_heads=2,
        n_experts=4,
        top_k=2,
        d_ff=32,
        max_seq_len=512,
        init_std=0.3,
        seed=21,
    )
    w0, w1 = MoETransformer(cfg), MoETransformer(MoEConfig(**{**cfg.__dict__, "seed": 22}))
    tok = ChatTokenizer.load()
    enc = TurnEncoder("ep")
    engine = Engine(save_pretrained(w0, tmp_path / "w0"), EngineConfig(max_batch=4))
    records = []

    async def turn(k: int, ids: list[int], start: int):
        r = await engine.collect(
            GenRequest(
                rid=f"t{k}",
                input_ids=tuple(ids),
                max_new_tokens=8,
                temperature=1.0,
                seed=k,
                ignore_eos=True,
                return_routing=True,
                routing_start=start,
            )
        )
        res = TurnResult(
            turn=k,
            input_ids=np.asarray(ids, np.int32),
            output_ids=np.asarray(r.output_ids, np.int32),
            logprobs=np.asarray(r.logprobs, np.float32),
            finish="length",
            policy_version=int(r.weight_version),
            routing=r.routing.astype(np.uint8),
            routing_start=r.routing_start,
            action_kind="none",
            action_text="",
            observation="",
            exit_code=None,
            timed_out=False,
            truncated=False,
            tests_passed=None,
            reward=1.0,
            t_sample_s=0.0,
            t_exec_s=0.0,
            output_versions=np.asarray([int(v) for v in r.versions], np.int32),
        )
        records.append(wire.decode(wire.encode(enc.encode(res))))
        return r

    async with trio.open_nursery() as n:
        await n.start(engine.run)
        p0 = tok.render([{"role": "user", "content": "list the files in /tmp and count them"}])
        r0 = await turn(0, p0, 0)
        await engine.update_weights_from_disk(save_pretrained(w1, tmp_path / "w1"), "1")
        p1 = p0 + r0.output_ids + tok.bridge_ids(r0.output_ids) + tok.message_ids("tool", "a b c")
        p1 += tok.generation_prompt_ids()
        start = len(p0) + len(r0.output_ids) - 1
        r1 = await turn(1, p1, start)
        n.cancel_scope.cancel()
    assert r1.routing_start == 0 and records[1].routing.start == 0 and records[1].policy_version == 1
    asm = Assembler()
    segs = [s for r in records for s in asm.feed(r)]
    segs += asm.end(wire.EndRecord("ep", 2, wire.EndReason.MAX_TURNS, 0, 1, False))
    assert [s.turn_numbers.tolist() for s in segs] == [[0], [1]], "turn 1 trains in its own segment"
    assert asm.stats().route_forks == 1 and asm.stats().rerouted_rows > 0 and asm.stats().fork == 0
    assert asm.stats().stale_context_routes == 0
    a, b = segs
    assert not a.done and b.done and b.forked and len(b) == len(p1) + 8 and (b.routing[:-1] >= 0).all()
    assert np.abs(_replay_logprobs(w0, a) - a.logprobs[a.loss_mask]).max() < 1e-4
    assert np.abs(_replay_logprobs(w1, b) - b.logprobs[b.loss_mask]).max() < 1e-4
    # what the learner replayed before: turn 0's rows (w0's routes) for the context turn 1 was sampled in
    stale = b.routing.copy()
    stale[: len(a) - 1] = a.routing[:-1]
    assert not np.array_equal(stale, b.routing)
    stale_seg = type(b)(**{**b.__dict__, "routing": stale})
    assert np.abs(_replay_logprobs(w1, stale_seg) - b.logprobs[b.loss_mask]).max() > 1e-3


@pytest.mark.parametrize("seed", range(6))
def test_a_fork_followed_by_a_turn_without_routing_keeps_no_row_from_the_old_context(seed):
    """After a FORK the new segment shares the old rows only below the fork point (RouteTrack.fork_from trims
    the rest). When the turn after the fork brings no trace, nothing else trims them: every row the new segment
    holds past the fork point would come from the old, different context."""
    rng = np.random.default_rng(seed)
    kinds = ["clean", "fork", "clean", "fork", "realign", "fork"]
    after_fork = [i + 1 for i, k in enumerate(kinds) if k == "fork"]
    case = make_episode(rng, kinds, layers=3, topk=2, num_experts=16, no_routing=after_fork)
    asm = Assembler()
    segs = [s for r in case.records for s in asm.feed(r)]
    assert asm.stats().fork == 3 and asm.routing_stats().absent_traces == 3
    check_segments(case, segs, full_routing=False)  # every row present is from its own context
    forked = [s for s in segs if s.forked]
    assert len(forked) == 3 and all((s.routing[-1] == -1).all() for s in forked)
    assert asm.routing_stats().missing_rows > 0


@pytest.mark.parametrize("seed", range(4))
def test_a_newer_version_whose_trace_does_not_reach_back_is_counted(seed):
    """A sampler without the routing-start extension (a real SGLang) returns rows only from the asked start
    after a weight update flushed its cache: the context it re-routed is not in the trace, so the learner
    replays the old weights' rows there. It cannot repair that, but it counts every such turn."""
    rng = np.random.default_rng(seed)
    case = make_episode(rng, ["clean"] * 10)  # its version goes up now and then, traces never reach back
    want = sum(b.policy_version > a.policy_version for a, b in zip(case.truth, case.truth[1:]))
    asm = Assembler()
    for r in case.records:
        asm.feed(r)
    assert want > 0 and asm.stats().stale_context_routes == want and asm.stats().route_forks == 0
