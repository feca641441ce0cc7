"""The batched inference engine on a real tiny MoE: batching, prefix reuse, logprobs/routing vs the full
forward (fp32, 1e-4), sampling controls, abort, weight updates."""

from __future__ import annotations

import math
from contextlib import aclosing

import numpy as np
import pytest
import torch
import trio

from t1async.model.config import MoEConfig
from t1async.model.engine import Engine
from t1async.model.moe import MoETransformer
from t1async.model.records import EngineConfig, GenRequest
from t1async.model.tokenizer import ChatTokenizer
from t1async.model.weights import load_pretrained, save_pretrained
from t1async.protocol.errors import ConfigError, SamplerError, SamplerRequestError

CFG = MoEConfig(
    vocab_size=4096,
    d_model=32,
    n_layers=2,
    n_heads=2,
    n_experts=4,
    top_k=2,
    d_ff=32,
    max_seq_len=512,
    init_std=0.3,
    seed=11,
)
TOK = ChatTokenizer.load()
PROMPTS = [
    TOK.render([{"role": "user", "content": c}])
    for c in (
        "ls -la /tmp",
        "count lines in data.csv",
        "print the date",
        "grep error /var/log/app.log",
        "what is in /etc",
        "make a directory named out",
    )
]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny matrices: a second OpenMP thread costs more than it saves on 2 shared cores (restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_pretrained(MoETransformer(CFG), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def ref(model_dir):
    return load_pretrained(model_dir)


@pytest.fixture
async def engine(model_dir):
    eng = Engine(model_dir, EngineConfig(max_batch=8))
    async with trio.open_nursery() as n:
        await n.start(eng.run)
        yield eng
        n.cancel_scope.cancel()


def req(rid, ids, n=12, **kw) -> GenRequest:
    kw.setdefault("temperature", 0.0)
    return GenRequest(rid=rid, input_ids=tuple(ids), max_new_tokens=n, **kw)


@torch.no_grad()
def full_forward(model, seq):
    out = model(torch.tensor([list(seq)]))
    return torch.log_softmax(out.logits[0].float(), -1), out.routing[0].numpy()


def check_against_full_forward(model, prompt, res):
    """Engine logprobs and routing equal a full-sequence forward of prompt + output (fp32, 1e-4)."""
    seq = list(prompt) + res.output_ids
    lp, routing = full_forward(model, seq)
    n0 = len(prompt)
    ref_lps = [lp[n0 - 1 + i, t].item() for i, t in enumerate(res.output_ids)]
    assert np.max(np.abs(np.array(ref_lps) - np.array(res.logprobs))) < 1e-4
    start = len(seq) - 1 - res.routing.shape[0]
    assert res.routing.dtype == np.int32
    assert np.array_equal(res.routing, routing[start : len(seq) - 1])
    replayed = model(torch.tensor([seq[:-1]]), replay=torch.from_numpy(routing[: len(seq) - 1][None]).long())
    assert np.array_equal(replayed.routing[0].numpy(), routing[: len(seq) - 1])


async def test_concurrent_requests_batch_and_match_sequential(engine, ref):
    sequential = [await engine.collect(req(f"s{i}", p, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    engine.flush_cache()
    steps0 = engine.stats()["steps"]
    results = {}

    async def one(i, p):
        results[i] = await engine.collect(req(f"c{i}", p, ignore_eos=True, return_routing=True))

    async with trio.open_nursery() as n:
        for i, p in enumerate(PROMPTS):
            n.start_soon(one, i, p)
    st = engine.stats()
    assert st["max_running"] == len(PROMPTS)  # one decode forward served every request
    assert st["steps"] - steps0 < len(PROMPTS) * 12  # far fewer steps than tokens produced
    for i, p in enumerate(PROMPTS):
        assert results[i].output_ids == sequential[i].output_ids
        assert results[i].finish_reason == {"type": "length", "length": 12}
        assert results[i].prompt_tokens == len(p) and results[i].cached_tokens == 0
        check_against_full_forward(ref, p, results[i])


async def test_busy_idle_accounting(engine):
    """stats() carries the sampler's own busy/idle accounting: no step runs while nothing is asked, so busy_s
    stands still while uptime_s moves; a request adds busy time, never more than the time that passed."""
    a = engine.stats()
    with trio.fail_after(10):  # until 0.1 s of uptime has passed with nothing asked, busy_s still at each look
        while (b := engine.stats())["uptime_s"] <= a["uptime_s"] + 0.1:
            assert b["busy_s"] == a["busy_s"]
            await trio.sleep(0.01)
    assert b["busy_s"] == a["busy_s"] and b["uptime_s"] > a["uptime_s"] + 0.1
    await engine.collect(req("busy", PROMPTS[0], ignore_eos=True))
    c = engine.stats()
    assert 0 < c["busy_s"] - b["busy_s"] <= c["uptime_s"] - b["uptime_s"]
    assert c["busy_s"] <= c["uptime_s"]


async def test_staggered_finishes_in_multi_decode_hops(model_dir, ref):
    """A batch large enough for several decodes per thread hop, finishing at different steps: survivors move
    into freed slots and keep decoding; every result equals its sequential run and the full forward."""
    prompts = [PROMPTS[i % len(PROMPTS)] + TOK.encode(f" case {i}") for i in range(16)]
    lengths = [4 + 9 * (i % 3) + i % 2 for i in range(16)]  # finishing in groups, steps apart
    eng = Engine(model_dir, EngineConfig(max_batch=16))
    async with trio.open_nursery() as n:
        await n.start(eng.run)
        sequential = [await eng.collect(req(f"q{i}", p, n=lengths[i], ignore_eos=True)) for i, p in enumerate(prompts)]
        eng.flush_cache()
        before = eng.stats()
        results = {}

        async def one(i):
            results[i] = await eng.collect(req(f"b{i}", prompts[i], n=lengths[i], ignore_eos=True, return_routing=True))

        async with trio.open_nursery() as inner:
            for i in range(len(prompts)):
                inner.start_soon(one, i)
        after = eng.stats()
        n.cancel_scope.cancel()
    assert after["max_running"] == 16
    assert after["decode_forwards"] - before["decode_forwards"] > after["steps"] - before["steps"]  # multi-decode hops
    for i, p in enumerate(prompts):
        assert results[i].output_ids == sequential[i].output_ids
        assert results[i].finish_reason == {"type": "length", "length": lengths[i]}
        check_against_full_forward(ref, p, results[i])


async def test_mixed_admission_with_small_prefill_chunks(model_dir, ref):
    """Cached and fresh prompts of different lengths admitted in one step, prefilled in padded 7-token chunks."""
    eng = Engine(model_dir, EngineConfig(prefill_chunk=7))
    async with trio.open_nursery() as n:
        await n.start(eng.run)
        first = await eng.collect(req("m0", PROMPTS[0], n=5, ignore_eos=True))
        longer = PROMPTS[0] + first.output_ids + TOK.message_ids("tool", "x")
        prompts = [longer, PROMPTS[1], PROMPTS[2][:3], longer + TOK.encode(" and more")]
        results = {}

        async def one(i):
            results[i] = await eng.collect(req(f"m{i + 1}", prompts[i], n=6, ignore_eos=True, return_routing=True))

        async with trio.open_nursery() as inner:
            for i in range(len(prompts)):
                inner.start_soon(one, i)
        n.cancel_scope.cancel()
    assert results[0].cached_tokens == len(PROMPTS[0]) + 5 - 1
    shared = next(i for i, (a, b) in enumerate(zip(PROMPTS[0], PROMPTS[1])) if a != b)
    assert results[1].cached_tokens == shared > 0  # the template's "<|im_start|>user\n" is shared
    for i, p in enumerate(prompts):
        check_against_full_forward(ref, p, results[i])


async def test_prefix_reuse_across_turns(engine, ref):
    p1 = PROMPTS[0]
    r1 = await engine.collect(req("t1", p1, n=10, temperature=1.0, seed=1, return_routing=True, ignore_eos=True))
    seq1 = p1 + r1.output_ids
    p2 = seq1 + TOK.bridge_ids(r1.output_ids) + TOK.message_ids("tool", "out.txt") + TOK.generation_prompt_ids()
    start = len(p1) - 5  # inside the cached region
    r2 = await engine.collect(req("t2", p2, n=10, temperature=1.0, seed=2, return_routing=True, routing_start=start))
    assert r2.cached_tokens == len(seq1) - 1
    assert r2.routing.shape == (len(p2) + len(r2.output_ids) - 1 - start, CFG.n_layers, CFG.top_k)
    assert np.array_equal(r2.routing[: len(seq1) - 1 - start], r1.routing[start:])
    check_against_full_forward(ref, p2, r2)
    assert r2.routing_start == start  # the cache held everything before start
    # the same request again with the cache flushed: identical tokens and logprobs, nothing cached; it
    # recomputed positions before start, so it returns every row it used (here the same weights: same rows)
    engine.flush_cache()
    r3 = await engine.collect(req("t3", p2, n=10, temperature=1.0, seed=2, return_routing=True, routing_start=start))
    assert r3.cached_tokens == 0
    assert r3.output_ids == r2.output_ids
    assert np.allclose(r3.logprobs, r2.logprobs, atol=1e-5)
    assert r3.routing_start == 0 and np.array_equal(r3.routing[start:], r2.routing)


async def test_episode_routing_tiles_the_sequence(engine, ref):
    """Ten token-in turns, each asking only for rows no earlier turn covered: the traces tile the episode
    with no gap or overlap and equal the full forward's routing; every turn after the first hits the cache."""
    ids = list(PROMPTS[0])
    traces, start = [], 0
    for turn in range(10):
        r = await engine.collect(
            req(f"ep{turn}", ids, n=6, temperature=1.0, seed=turn, return_routing=True, routing_start=start)
        )
        if turn:
            assert r.cached_tokens == start  # the previous turn's sequence less its last token
        traces.append(r.routing)
        start = len(ids) + len(r.output_ids) - 1
        ids = ids + r.output_ids + TOK.bridge_ids(r.output_ids) + TOK.message_ids("tool", f"  out {turn}")
        ids += TOK.generation_prompt_ids()
    episode = np.concatenate(traces)
    assert episode.shape[0] == start
    _, routing = full_forward(ref, ids)
    assert np.array_equal(episode, routing[:start])


async def test_routing_rows_and_start_semantics(engine):
    p = PROMPTS[1]
    r = await engine.collect(req("r0", p, n=5, ignore_eos=True, return_routing=True))
    seqlen = len(p) + 5
    assert r.routing.shape == (seqlen - 1, CFG.n_layers, CFG.top_k)
    assert ((r.routing >= 0) & (r.routing < CFG.n_experts)).all()
    r_start = await engine.collect(req("r1", p, n=5, ignore_eos=True, return_routing=True, routing_start=len(p) - 1))
    assert r_start.routing.shape == (5, CFG.n_layers, CFG.top_k)
    assert np.array_equal(r_start.routing, r.routing[len(p) - 1 :])
    late = await engine.collect(req("r2", p, n=5, ignore_eos=True, return_routing=True, routing_start=10_000))
    assert late.routing.shape == (0, CFG.n_layers, CFG.top_k)
    no = await engine.collect(req("r3", p, n=5, ignore_eos=True))
    assert no.routing is None


async def test_sampling_controls(engine):
    p = PROMPTS[2]
    greedy = await engine.collect(req("g", p, n=8, ignore_eos=True))
    top1 = await engine.collect(req("k1", p, n=8, temperature=1.0, top_k=1, ignore_eos=True))
    assert top1.output_ids == greedy.output_ids
    a = await engine.collect(req("a", p, n=16, temperature=1.0, seed=7, ignore_eos=True))
    b = await engine.collect(req("b", p, n=16, temperature=1.0, seed=7, ignore_eos=True))
    c = await engine.collect(req("c", p, n=16, temperature=1.0, seed=8, ignore_eos=True))
    assert a.output_ids == b.output_ids and a.output_ids != c.output_ids
    nucleus = await engine.collect(req("p", p, n=16, temperature=1.0, top_p=0.5, seed=7, ignore_eos=True))
    assert all(lp <= 0 for lp in nucleus.logprobs) and len(nucleus.output_ids) == 16
    # stop on a token id: the greedy run's 4th token
    stop_tok = greedy.output_ids[3]
    s = await engine.collect(req("st", p, n=8, stop_token_ids=frozenset({stop_tok})))
    k = greedy.output_ids.index(stop_tok)
    assert s.output_ids == greedy.output_ids[: k + 1]
    assert s.finish_reason == {"type": "stop", "matched": stop_tok}
    # stop on a string: the decoded text of the greedy run's 3rd..4th tokens
    text = TOK.decode(greedy.output_ids[2:4])
    ss = await engine.collect(req("ss", p, n=8, stop_strings=(text,)))
    assert ss.finish_reason == {"type": "stop", "matched": text}
    assert text in TOK.decode(ss.output_ids) and len(ss.output_ids) <= 4
    zero = await engine.collect(req("z", p, n=0, return_routing=True))
    assert zero.output_ids == [] and zero.finish_reason == {"type": "length", "length": 0}
    assert zero.routing.shape == (len(p) - 1, CFG.n_layers, CFG.top_k)


async def test_eos_stops_unless_ignored(model_dir, tmp_path):
    """A doctored model whose im_end logit doubles the greedy first token's: eos wins at the first step."""
    m = load_pretrained(model_dir)
    p = PROMPTS[3]
    with torch.no_grad():
        first = int(m(torch.tensor([p])).logits[0, -1].argmax())
        m.lm_head.weight[TOK.end_of_turn_id] = 2 * m.lm_head.weight[first]
    eng = Engine(save_pretrained(m, tmp_path / "eos"), EngineConfig())
    async with trio.open_nursery() as n:
        await n.start(eng.run)
        stopped = await eng.collect(req("e1", p, n=6))
        ignored = await eng.collect(req("e2", p, n=6, ignore_eos=True))
        n.cancel_scope.cancel()
    assert stopped.output_ids == [TOK.end_of_turn_id]
    assert stopped.finish_reason == {"type": "stop", "matched": TOK.end_of_turn_id}
    assert len(ignored.output_ids) == 6 and ignored.output_ids[0] == TOK.end_of_turn_id


async def test_abort_running_and_queued_requests(engine):
    p = PROMPTS[4]
    assert engine.abort("nope") is False
    events = []
    async with engine.submit(req("long", p, n=400, ignore_eos=True)) as stream:
        async for ev in stream:
            events.append(ev)
            if len(events) == 1:
                assert engine.abort("long") is True
    assert events[-1].finished and events[-1].finish_reason["type"] == "abort"
    assert sum(len(e.new_ids) for e in events) < 400
    # leaving the block early aborts too
    async with aclosing(engine.generate(req("early", p, n=400, ignore_eos=True))) as gen:
        async for _ in gen:
            break
    with trio.fail_after(10):
        while engine.stats()["running"]:
            await trio.sleep(0.01)
    assert engine.abort("early") is False


async def test_prefill_budget_defers_and_queue_aborts(model_dir, ref):
    """A one-token prefill budget admits one request per step; deferred ones keep their order and results.
    With max_batch=1 a second request waits in the queue, and aborting it ends it at once."""
    eng = Engine(model_dir, EngineConfig(max_prefill_tokens=1))
    results = {}

    async def one(i):
        results[i] = await eng.collect(req(f"d{i}", PROMPTS[i], n=4, ignore_eos=True, return_routing=True))

    async with trio.open_nursery() as n:
        await n.start(eng.run)
        async with trio.open_nursery() as inner:
            for i in range(4):
                inner.start_soon(one, i)
        n.cancel_scope.cancel()
    assert eng.stats()["deferred"] > 0
    for i in range(4):
        assert len(results[i].output_ids) == 4
        check_against_full_forward(ref, PROMPTS[i], results[i])
    solo = Engine(model_dir, EngineConfig(max_batch=1))
    async with trio.open_nursery() as n:
        await n.start(solo.run)
        async with solo.submit(req("run", PROMPTS[0], n=300, ignore_eos=True)) as running:
            await running.__anext__()
            async with solo.submit(req("queued", PROMPTS[1], n=5)) as queued:
                assert solo.stats()["waiting"] == 1
                assert solo.abort("queued")
                ev = await queued.__anext__()
                assert ev.finished and ev.finish_reason["type"] == "abort" and ev.new_ids == []
        n.cancel_scope.cancel()


async def test_weight_update_bumps_version_and_changes_outputs(engine, tmp_path):
    p = PROMPTS[5]
    before = await engine.collect(req("w0", p, ignore_eos=True))
    assert before.weight_version == engine.weight_version == "0"
    other = save_pretrained(MoETransformer(MoEConfig(**{**CFG.__dict__, "seed": 99})), tmp_path / "v1")
    await engine.update_weights_from_disk(other)
    assert engine.weight_version == "1"
    after = await engine.collect(req("w1", p, ignore_eos=True, return_routing=True))
    assert after.weight_version == "1" and after.output_ids != before.output_ids
    assert after.cached_tokens == 0  # the prefix cache was flushed with the old weights
    check_against_full_forward(load_pretrained(other), p, after)
    # a request running across an update is retracted around it and recomputed with the new weights (so its
    # KV, all new, is cached when it ends); each token carries the version that produced it
    out, versions, per_token = [], [], []
    async with engine.submit(req("span", p, n=60, ignore_eos=True)) as events:
        async for ev in events:
            out += ev.new_ids
            per_token += ev.new_versions
            versions.append(ev.weight_version)
            if len(versions) == 1:
                await engine.update_weights_from_disk(other, "step-7")
    assert engine.weight_version == "step-7" and versions[0] == "1" and versions[-1] == "step-7"
    assert len(per_token) == len(out) == 60
    split = per_token.index("step-7")
    assert 0 < split < 60 and set(per_token[:split]) == {"1"} and set(per_token[split:]) == {"step-7"}
    follow = await engine.collect(req("follow", p + out + TOK.encode("ok"), n=2))
    assert follow.cached_tokens == len(p) + 60 - 1
    wrong = save_pretrained(MoETransformer(MoEConfig(**{**CFG.__dict__, "n_experts": 8})), tmp_path / "bad")
    with pytest.raises(ConfigError, match="does not match"):
        await engine.update_weights_from_disk(wrong)
    assert engine.weight_version == "step-7"


async def test_bad_requests_are_rejected_with_the_reason(engine):
    with pytest.raises(SamplerRequestError, match="outside the vocabulary"):
        await engine.collect(req("v", [1, 2, 99999]))
    with pytest.raises(SamplerRequestError, match="empty"):
        req("e", [])
    with pytest.raises(SamplerRequestError, match="top_p"):
        req("t", [1], top_p=0.0)
    with pytest.raises(SamplerRequestError, match="max_seq_len"):
        await engine.collect(req("l", [5] * 600))
    async with engine.submit(req("dup", PROMPTS[0], n=50, ignore_eos=True)):
        with pytest.raises(SamplerRequestError, match="already running"):
            await engine.collect(req("dup", PROMPTS[0]))


async def test_engine_must_be_running(model_dir):
    eng = Engine(model_dir, EngineConfig())
    with pytest.raises(SamplerError, match="start Engine.run"):
        await eng.collect(req("x", PROMPTS[0]))


async def test_bf16_serving_is_close_but_not_exact(model_dir, ref):
    eng = Engine(model_dir, EngineConfig(dtype="bfloat16"))
    async with trio.open_nursery() as n:
        await n.start(eng.run)
        r = await eng.collect(req("bf", PROMPTS[0], n=8, ignore_eos=True, return_routing=True))
        n.cancel_scope.cancel()
    lp, _ = full_forward(ref, list(PROMPTS[0]) + r.output_ids)
    n0 = len(PROMPTS[0])
    diffs = [abs(lp[n0 - 1 + i, t].item() - r.logprobs[i]) for i, t in enumerate(r.output_ids)]
    assert 0 < max(diffs) < 0.5 and all(math.isfinite(d) for d in diffs)
    assert eng.model_info()["dtype"] == "bfloat16"


async def test_a_turn_after_a_weight_update_returns_the_routes_it_recomputed(engine, tmp_path):
    """The update flushes the prefix cache, so the next turn of an episode re-routes its whole context under
    the new weights: it returns every row it used (routing_start 0), each equal to the new model's own
    routing, not only the rows from routed_experts_start_len (which would leave the old weights' rows in the
    learner's context)."""
    p1 = PROMPTS[2]
    r1 = await engine.collect(req("u1", p1, n=8, temperature=1.0, seed=3, return_routing=True, ignore_eos=True))
    assert r1.routing_start == 0 and r1.versions == ["0"] * 8
    new = MoETransformer(MoEConfig(**{**CFG.__dict__, "seed": 5}))
    await engine.update_weights_from_disk(save_pretrained(new, tmp_path / "v1"))
    p2 = (
        p1 + r1.output_ids + TOK.bridge_ids(r1.output_ids) + TOK.message_ids("tool", "ok") + TOK.generation_prompt_ids()
    )
    start = len(p1) + 8 - 1
    r2 = await engine.collect(req("u2", p2, n=6, temperature=1.0, seed=4, return_routing=True, routing_start=start))
    assert r2.cached_tokens == 0 and r2.versions == ["1"] * 6
    assert r2.routing_start == 0 and r2.routing.shape[0] == len(p2) + 6 - 1
    check_against_full_forward(new, p2, r2)
    _, old_routing = full_forward(load_pretrained(engine.model_dir), p2)
    assert not np.array_equal(r2.routing[:start], old_routing[:start])  # the held rows are no longer the ones used
    # the next turn hits the (new) cache again: rows from its start only
    p3 = p2 + r2.output_ids + TOK.encode("x")
    r3 = await engine.collect(req("u3", p3, n=2, return_routing=True, routing_start=len(p2) + 6 - 1))
    assert r3.cached_tokens == len(p2) + 6 - 1 and r3.routing_start == len(p2) + 6 - 1
