"""SGLangClient (against the real embedded server) and MemorySampler: one conformance suite for both;
retries, errors, least-outstanding balancing, lifecycle, and decoding of real-SGLang-shaped responses."""

from __future__ import annotations

import base64
import json
import socket
import time

import anyio
import httpx
import numpy as np
import pytest

from t1async.model.config import MoEConfig
from t1async.model.weights import default_model_dir
from t1async.protocol.errors import SamplerError, SamplerRequestError, SamplerVersionError
from t1async.protocol.sampling import SamplingParams
from t1async.sampler.client import SamplerClosedError, SGLangClient
from t1async.sampler.memory import MemorySampler
from t1async.sampler.response import parse_generation, parse_weight_version
from t1async.testing.sampler import check_sampler

CFG = MoEConfig.load(default_model_dir())
PROMPT = [11, 250, 37, 999, 4, 1200, 77, 3000, 18, 640]


async def test_conformance_sglang_client_on_the_real_server(sampler_url):
    async with SGLangClient([sampler_url]) as c:
        await check_sampler(
            c, prompt=PROMPT, vocab_size=CFG.vocab_size, layers=CFG.n_layers, topk=CFG.top_k, experts=CFG.n_experts
        )


async def test_conformance_memory_sampler():
    async with MemorySampler(vocab_size=500, num_layers=3, topk=2, num_experts=6) as m:
        await check_sampler(m, prompt=[5, 6, 7, 8, 9], vocab_size=500, layers=3, topk=2, experts=6)


def test_a_generation_finish_is_the_wire_finish():
    """One finish type from the sampler to the turn record: Generation.finish is a wire.Finish (a str given
    is converted), which prints and compares as its value."""
    from t1async.protocol.sampling import Generation
    from t1async.protocol.wire import Finish

    g = Generation(np.arange(3, dtype=np.int32), np.zeros(3, np.float32), "length", 0)
    assert g.finish is Finish.LENGTH and g.finish == "length" and f"{g.finish}" == "length"
    with pytest.raises(ValueError, match="'done' is not a valid Finish"):
        Generation(np.arange(3, dtype=np.int32), np.zeros(3, np.float32), "done", 0)


async def test_conformance_catches_a_broken_sampler():
    class Wrong(MemorySampler):
        async def generate(self, *a, **kw):
            g = await super().generate(*a, **kw)
            if g.routing is not None:
                object.__setattr__(g, "routing", g.routing[1:])  # one row short
            return g

    with pytest.raises(AssertionError, match="routing shape"):
        await check_sampler(Wrong(vocab_size=100), prompt=[5, 6, 7, 8], vocab_size=100, layers=4, topk=2, experts=8)


async def test_generation_fields_from_the_real_server(sampler_url):
    async with SGLangClient(sampler_url) as c:
        g = await c.generate(
            PROMPT, SamplingParams(max_new_tokens=5, temperature=0.0), routed_experts_start_len=4, rid="client-1"
        )
    assert g.routing.dtype == np.uint8 and g.routing.shape == (
        len(PROMPT) + len(g.output_ids) - 1 - 4,
        CFG.n_layers,
        CFG.top_k,
    )
    assert g.routing_start == 4 and g.policy_version == 0 and g.extra["weight_version"] == "0"
    assert g.extra["rid"] == "client-1" and g.latency_s > 0 and g.prompt_tokens == len(PROMPT)


async def test_a_second_turn_hits_the_prefix_cache(sampler_url):
    async with SGLangClient(sampler_url) as c:
        first = await c.generate(PROMPT, SamplingParams(max_new_tokens=6))
        turn2 = PROMPT + first.output_ids.tolist() + [42, 43, 44]
        second = await c.generate(turn2, SamplingParams(max_new_tokens=2))
    assert second.cached_tokens >= len(PROMPT), (second.cached_tokens, len(turn2))


async def test_bad_request_is_sampler_request_error_without_retry(sampler_url):
    async with SGLangClient(sampler_url, max_retries=3) as c:
        with pytest.raises(SamplerRequestError, match="routed_experts_start_len"):
            await c.generate(PROMPT, SamplingParams(max_new_tokens=2), routed_experts_start_len=len(PROMPT) + 1)
        with pytest.raises(SamplerRequestError, match="vocab"):
            await c.generate([CFG.vocab_size + 5], SamplingParams(max_new_tokens=2))
        assert c.requests_sent[sampler_url] == 2


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


async def test_unreachable_url_raises_sampler_error_after_retries_quickly():
    url = f"http://127.0.0.1:{_dead_port()}"
    t0 = time.perf_counter()
    async with SGLangClient([url], max_retries=2, backoff_s=0.01) as c:
        with pytest.raises(SamplerError) as ei:
            await c.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        assert c.requests_sent[url] == 3
    assert not isinstance(ei.value, SamplerRequestError)
    assert url in str(ei.value) and "3 attempts" in str(ei.value) and "ConnectError" in str(ei.value)
    assert time.perf_counter() - t0 < 3.0


async def test_fails_over_from_a_dead_url_to_a_live_one(sampler_url):
    dead = f"http://127.0.0.1:{_dead_port()}"
    async with SGLangClient([dead, sampler_url], max_retries=2, backoff_s=0.01) as c:
        for _ in range(4):
            g = await c.generate(PROMPT, SamplingParams(max_new_tokens=2))
            assert len(g.output_ids) >= 1
        health = await c.health()
    assert health == {dead: False, sampler_url: True}


def _response(ids: list[int], version: str = "3") -> dict:
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "id": "x",
            "finish_reason": {"type": "length", "length": len(ids)},
            "prompt_tokens": 3,
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": version,
            "e2e_latency": 0.01,
            "output_token_logprobs": [[-1.0, t, None] for t in ids],
        },
    }


async def test_retries_503_then_succeeds():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) < 3:
            return httpx.Response(503, json={"error": {"message": "warming up"}})
        return httpx.Response(200, json=_response([7, 8]))

    async with SGLangClient("http://s", transport=httpx.MockTransport(handler), backoff_s=0.001) as c:
        g = await c.generate([1, 2, 3], SamplingParams(max_new_tokens=2), rid="r")
    assert g.output_ids.tolist() == [7, 8] and g.policy_version == 3 and len(calls) == 3
    rids = [json.loads(r.content)["rid"] for r in calls]
    assert rids[0] == "r" and len(set(rids)) == 3, "a retried request needs a fresh rid (the first may still run)"


async def test_500_is_not_retried_and_names_the_url():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(500, text="boom")

    async with SGLangClient("http://s", transport=httpx.MockTransport(handler), backoff_s=0.001) as c:
        with pytest.raises(SamplerError, match=r"http://s/generate failed with HTTP 500: boom"):
            await c.generate([1], SamplingParams(max_new_tokens=1))
    assert len(calls) == 1


async def test_least_outstanding_balancing_favours_the_faster_server(autojump_clock):
    """Two servers, one 10x slower: with least-outstanding routing the fast one takes most requests, and
    no server ever holds more than its share plus one while both are busy."""
    sent = {"slow": 0, "fast": 0}

    class Transport(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            host = request.url.host
            sent[host] += 1
            await anyio.sleep(0.1 if host == "slow" else 0.01)
            return httpx.Response(200, json=_response([5]))

    async with SGLangClient(["http://slow", "http://fast"], transport=Transport()) as c:
        peak = {"http://slow": 0, "http://fast": 0}

        async def worker() -> None:
            for _ in range(10):
                await c.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
                for u, n in c.outstanding.items():
                    peak[u] = max(peak[u], n)

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(worker)
    assert sent["slow"] + sent["fast"] == 40
    assert sent["fast"] > 2 * sent["slow"], sent
    assert max(peak.values()) <= 3, peak


async def test_round_robin_when_equally_loaded(sampler_url):
    alias = sampler_url.replace("127.0.0.1", "localhost")
    async with SGLangClient([sampler_url, alias]) as c:
        for _ in range(6):
            await c.generate(PROMPT, SamplingParams(max_new_tokens=1))
    assert c.requests_sent == {sampler_url: 3, alias: 3}


async def test_use_after_close_fails_loudly(sampler_url):
    c = SGLangClient(sampler_url)
    async with c:
        pass
    with pytest.raises(SamplerClosedError, match="closed"):
        await c.generate([1], SamplingParams(max_new_tokens=1))
    with pytest.raises(SamplerClosedError):
        async with c:
            pass
    m = MemorySampler()
    await m.aclose()
    with pytest.raises(SamplerClosedError):
        await m.generate([1], SamplingParams(max_new_tokens=1))


def test_parse_generation_tolerates_real_sglang_responses():
    rows = np.arange(2 * 6 * 2, dtype="<i4").reshape(6, 2, 2) % 300  # experts up to 299 -> u2
    out = _response([4, 5, 6], version="7")
    out["meta_info"]["routed_experts"] = base64.b64encode(rows.tobytes()).decode()
    out["meta_info"]["prompt_tokens"] = 4
    out["meta_info"]["spec_verify_ct"] = 0  # extra fields are fine
    del out["output_ids"]  # older servers: ids from output_token_logprobs
    # a server that ignores routed_experts_start_len returns all rows: the client keeps the tail
    g = parse_generation(out, 4, 2, (2, 2, 300))
    assert g.output_ids.tolist() == [4, 5, 6] and g.policy_version == 7 and g.extra["weight_version"] == "7"
    assert g.output_versions.tolist() == [7, 7, 7]  # no per-token versions from a real SGLang: the request's
    assert g.routing.dtype == np.uint16 and np.array_equal(g.routing, rows[2:])
    with pytest.raises(SamplerError, match="rows"):
        parse_generation(out, 4, 1, (3, 2, 300))  # 4 rows of 3x2: neither 4 + 3 - 1 - 1 nor 4 + 3 - 1
    assert parse_weight_version(" 12 ") == 12 and parse_weight_version(3) == 3


@pytest.mark.parametrize("version", ["default", "v2", "-1", "", None, 1.5, True])
def test_a_non_integer_weight_version_is_an_error_naming_the_sampler(version):
    """A real SGLang server answers weight_version "default" until someone sets it: staleness would be
    meaningless, so it is an error that names the sampler and says how to fix it, never a silent -1."""
    out = _response([4, 5], version=version)
    with pytest.raises(SamplerVersionError, match=r"http://sglang-a:30000 reports weight_version .*--weight-version"):
        parse_generation(out, 3, None, None, url="http://sglang-a:30000")
    with pytest.raises(SamplerVersionError, match="the sampler reports"):
        parse_weight_version(version)


def test_per_token_versions_and_an_earlier_routing_start_are_read():
    out = _response([4, 5, 6], version="2")
    spans = [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 3}]
    out["meta_info"]["weight_versions"] = spans  # SGLang's (sglang/srt/utils/weight_versions.py)
    rows = np.arange(5 * 2 * 2, dtype="<i4").reshape(5, 2, 2) % 8
    out["meta_info"]["routed_experts"] = base64.b64encode(rows.tobytes()).decode()
    out["meta_info"]["routed_experts_start_len"] = 0  # the server recomputed positions before the asked 2
    g = parse_generation(out, 3, 2, (2, 2, 8))
    assert g.policy_version == 2 and g.output_versions.tolist() == [1, 1, 2]
    assert g.routing_start == 0 and np.array_equal(g.routing, rows)
    out["meta_info"]["weight_versions"] = [spans[0], {**spans[1], "version": "default"}]
    with pytest.raises(SamplerVersionError, match=r"weight_versions\[1\] 'default'"):
        parse_generation(out, 3, 2, (2, 2, 8))
    out["meta_info"]["weight_versions"] = [{"v": 1}]
    with pytest.raises(SamplerError, match=r"weight_versions\[0\] is \{'v': 1\}"):
        parse_generation(out, 3, 2, (2, 2, 8))
    out["meta_info"]["weight_versions"] = [spans[0], {**spans[1], "start": 1}]
    with pytest.raises(SamplerError, match="do not tile the 3 output tokens"):
        parse_generation(out, 3, 2, (2, 2, 8))


async def test_routing_needs_a_shape_for_a_server_that_does_not_say_it():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "m", "is_generation": True})
        out = _response([5])
        out["meta_info"]["routed_experts"] = base64.b64encode(np.zeros((3, 2, 2), "<i4").tobytes()).decode()
        return httpx.Response(200, json=out)

    async with SGLangClient("http://s", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(SamplerError, match="model_dir"):
            await c.generate([1, 2, 3], SamplingParams(max_new_tokens=1), routed_experts_start_len=0)
    async with SGLangClient("http://s", transport=httpx.MockTransport(handler), routing_shape=(2, 2, 8)) as c:
        g = await c.generate([1, 2, 3], SamplingParams(max_new_tokens=1), routed_experts_start_len=0)
    assert g.routing.shape == (3, 2, 2) and g.routing.dtype == np.uint8


async def test_update_weights_from_disk_reaches_every_url():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, json.loads(request.content)))
        if request.url.host == "b":
            return httpx.Response(400, json={"success": False, "message": "no such dir /w"})
        return httpx.Response(200, json={"success": True, "message": "ok", "num_paused_requests": 0})

    async with SGLangClient(["http://a", "http://b"], transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(SamplerError, match=r"1 of 2 samplers: http://b.*no such dir /w"):
            await c.update_weights_from_disk("/w", 5)
    assert sorted(seen, key=lambda x: x[0]) == [
        ("a", {"model_path": "/w", "weight_version": "5"}),
        ("b", {"model_path": "/w", "weight_version": "5"}),
    ]


async def test_memory_sampler_scripts_versions_and_cache():
    m = MemorySampler(vocab_size=50, script=lambda ids: [ids[-1] + 1, ids[-1] + 2, 3], eos_token_id=3)
    g = await m.generate([1, 5], SamplingParams(max_new_tokens=10), routed_experts_start_len=1)
    assert g.output_ids.tolist() == [6, 7, 3] and g.finish == "stop" and g.matched_stop == 3
    # nothing was cached, so position 0 was recomputed too: every row comes back, from 0
    assert g.routing_start == 0 and g.routing.shape == (2 + 3 - 1, 4, 2)
    assert np.array_equal(g.routing, m.routing_for([1, 5, 6, 7]))
    assert g.output_versions.tolist() == [0, 0, 0]
    g2 = await m.generate([1, 5, 6, 7, 3, 9], SamplingParams(max_new_tokens=1), routed_experts_start_len=4)
    assert g2.cached_tokens == 5 and g2.finish == "length"
    assert g2.routing_start == 4 and np.array_equal(g2.routing, m.routing_for([1, 5, 6, 7, 3, 9])[4:])
    await m.update_weights_from_disk("/ckpt/4", 4)
    g3 = await m.generate([1, 5, 6, 7, 3, 9], SamplingParams(max_new_tokens=1), routed_experts_start_len=4)
    assert g3.policy_version == 4 and g3.cached_tokens == 0 and m.weight_paths == ["/ckpt/4"]
    assert g3.routing_start == 0 and g3.output_versions.tolist() == [4]  # the flush re-routed the context
    assert (await m.model_info())["weight_version"] == "4" and await m.health() == {"memory": True}
    assert [c.input_ids for c in m.calls][0] == (1, 5)


async def test_memory_sampler_splits_a_turn_that_a_weight_update_lands_in(autojump_clock):
    """An update landing mid-request: the first half of the output is the old version's (tokens' versions,
    logprobs' version, the rows computed then), the rest the new one's; the mixed sequence is not cached, so
    the next turn recomputes its context and returns every row from 0."""
    m = MemorySampler(vocab_size=50, num_experts=8, latency_s=10.0, script=lambda ids: list(range(10, 16)))
    prompt = [1, 2, 3, 4]
    got = {}

    async def sample():
        got["g"] = await m.generate(prompt, SamplingParams(max_new_tokens=6), routed_experts_start_len=0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(sample)
        await anyio.sleep(7.0)  # after the prompt and the first half, before the rest
        m.update_weights(3)
    g = got["g"]
    assert g.output_versions.tolist() == [0, 0, 0, 3, 3, 3] and g.policy_version == 3
    seq = prompt + list(range(10, 16))
    split = len(prompt) + 3 - 1  # the row of position p is computed when output p - len(prompt) + 1 is sampled
    assert np.array_equal(g.routing[:split], m.routing_for(seq[:split], policy_version=0))
    assert np.array_equal(g.routing[split:], m.routing_for(seq[:-1], policy_version=3)[split:])
    nxt = await m.generate(seq + [7], SamplingParams(max_new_tokens=1), routed_experts_start_len=len(seq) - 1)
    assert nxt.cached_tokens == 0 and nxt.routing_start == 0 and nxt.output_versions.tolist() == [3]
