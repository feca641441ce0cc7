"""The embedded SGLang-compatible server, over real HTTP, with the real Engine and tiny model.

Field names and shapes (design §4), streaming, routing traces and routed_experts_start_len, logprobs and
routing replay against a full-sequence forward of the same model, weight updates, bad requests,
disconnects and aborts.
"""

from __future__ import annotations

import base64
import json

import anyio
import httpx
import numpy as np
import pytest
import torch

from t1async.model.config import MoEConfig
from t1async.model.tokenizer import ChatTokenizer
from t1async.model.weights import default_model_dir, load_pretrained, save_pretrained
from t1async.sampler.launch import launch_sampler

CFG = MoEConfig.load(default_model_dir())
L, K, E, V = CFG.n_layers, CFG.top_k, CFG.n_experts, CFG.vocab_size
PROMPT = [11, 250, 37, 999, 4, 1200, 77, 3000, 18, 640]


@pytest.fixture(scope="module")
def model():
    return load_pretrained(default_model_dir(), dtype=torch.float32)


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer.load(default_model_dir())


def routing(meta: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(-1, L, K)


async def gen(url: str, body: dict, status: int = 200) -> dict:
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(url + "/generate", json=body)
    assert r.status_code == status, r.text
    return r.json()


async def test_generate_fields_and_shapes(sampler_url):
    out = await gen(
        sampler_url,
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True},
            "return_logprob": True,
            "return_routed_experts": True,
            "routed_experts_start_len": 0,
            "rid": "shape-1",
        },
    )
    assert set(out) >= {"text", "output_ids", "meta_info"}
    m = out["meta_info"]
    n = len(out["output_ids"])
    assert n == 12 and all(isinstance(t, int) and 0 <= t < V for t in out["output_ids"])
    assert m["id"] == "shape-1"
    assert m["finish_reason"] == {"type": "length", "length": 12}
    assert m["prompt_tokens"] == len(PROMPT) and m["completion_tokens"] == 12
    assert isinstance(m["cached_tokens"], int) and isinstance(m["weight_version"], str)
    assert m["e2e_latency"] > 0
    lps = m["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"] and all(x is None for *_, x in lps)
    assert all(lp <= 0 for lp, *_ in lps)
    r = routing(m)
    assert r.shape == (len(PROMPT) + n - 1, L, K)
    assert r.min() >= 0 and r.max() < E
    assert isinstance(out["text"], str)
    plain = await gen(sampler_url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert "output_token_logprobs" not in plain["meta_info"] and "routed_experts" not in plain["meta_info"]


async def test_text_input_stop_token_and_trim(sampler_url, tok):
    greedy = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    a = await gen(sampler_url, {"text": "hello world", "sampling_params": greedy})
    assert a["meta_info"]["prompt_tokens"] == len(tok.encode("hello world"))
    ids = a["output_ids"]
    stop = ids[3]
    first = ids.index(stop)
    sp = {**greedy, "stop_token_ids": [stop], "skip_special_tokens": False}
    b = await gen(sampler_url, {"text": "hello world", "sampling_params": sp})
    assert b["output_ids"] == ids[: first + 1], "output_ids keep the stop token (exact sampled ids)"
    assert b["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert b["text"] == tok.decode(ids[:first]), "the matched stop token is trimmed from text"
    c = await gen(sampler_url, {"text": "hello world", "sampling_params": {**sp, "no_stop_trim": True}})
    assert c["text"] == tok.decode(ids[: first + 1])


async def test_stream_is_cumulative_and_matches_non_stream(sampler_url):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        "return_routed_experts": True,
        "routed_experts_start_len": 3,
    }
    ref = await gen(sampler_url, body)
    chunks = []
    async with httpx.AsyncClient(timeout=60) as c:
        async with c.stream("POST", sampler_url + "/generate", json={**body, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            raw = (await r.aread()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert len(chunks) >= 2
    for prev, cur in zip(chunks, chunks[1:]):
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"], "chunks are cumulative"
        assert len(cur["meta_info"]["output_token_logprobs"]) == len(cur["output_ids"])
    assert all(ch["meta_info"]["finish_reason"] is None for ch in chunks[:-1])
    assert all(ref["text"].startswith(ch["text"]) and "\ufffd" not in ch["text"][-1:] for ch in chunks), (
        "streamed text grows by whole characters towards the final text"
    )
    last = chunks[-1]
    assert last["output_ids"] == ref["output_ids"] and last["text"] == ref["text"]
    assert last["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
    assert np.array_equal(routing(last["meta_info"]), routing(ref["meta_info"]))


async def test_routed_experts_start_len_returns_the_tail(sampler_url):
    sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    full = await gen(sampler_url, {"input_ids": PROMPT, "sampling_params": sp, "return_routed_experts": True})
    r0 = routing(full["meta_info"])
    n = len(full["output_ids"])
    assert r0.shape[0] == len(PROMPT) + n - 1
    for start in (1, 4, len(PROMPT) - 1, len(PROMPT)):
        out = await gen(
            sampler_url,
            {
                "input_ids": PROMPT,
                "sampling_params": sp,
                "return_routed_experts": True,
                "routed_experts_start_len": start,
            },
        )
        assert out["output_ids"] == full["output_ids"]
        r = routing(out["meta_info"])
        assert r.shape == (len(PROMPT) + n - 1 - start, L, K)
        assert np.array_equal(r, r0[start:])
    bad = await gen(
        sampler_url,
        {
            "input_ids": PROMPT,
            "sampling_params": sp,
            "return_routed_experts": True,
            "routed_experts_start_len": len(PROMPT) + 1,
        },
        status=400,
    )
    assert "routed_experts_start_len" in bad["error"]["message"]


async def test_logprobs_and_routing_match_a_full_forward(sampler_url, model):
    """The server's logprobs equal log_softmax of a full-sequence forward (fp32, 1e-4), and replaying its
    routing in that forward picks exactly the recorded experts (R3 has nothing to repair)."""
    out = await gen(
        sampler_url,
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True},
            "return_logprob": True,
            "return_routed_experts": True,
        },
    )
    ids = out["output_ids"]
    lps = np.array([lp for lp, *_ in out["meta_info"]["output_token_logprobs"]], dtype=np.float64)
    rec = routing(out["meta_info"])
    seq = torch.tensor([PROMPT + ids[:-1]])
    with torch.no_grad():
        free = model(seq)
        replayed = model(seq, replay=torch.from_numpy(rec.astype(np.int64))[None])
    p = len(PROMPT)
    for o in (free, replayed):
        logp = torch.log_softmax(o.logits[0].double(), dim=-1)
        mine = logp[torch.arange(p - 1, p - 1 + len(ids)), torch.tensor(ids)].numpy()
        np.testing.assert_allclose(lps, mine, atol=1e-4)
    assert np.array_equal(replayed.routing[0].numpy(), rec)
    assert np.array_equal(replayed.free_topk[0].sort(-1).values.numpy(), np.sort(rec, -1)), (
        "the router under replay would choose other experts than the sampler recorded"
    )
    assert np.array_equal(free.routing[0].sort(-1).values.numpy(), np.sort(rec, -1))


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, V]}, "input_ids[1]"),
        ({"input_ids": [1, -3]}, "input_ids[1]"),
        ({"input_ids": [1, "x"]}, "input_ids[1]"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_token": 4}}, "max_new_tokens"),
        (
            {"input_ids": [1, 2], "return_routed_experts": True, "routed_experts_start_len": 3},
            "routed_experts_start_len",
        ),
        ({"input_ids": [1, 2], "return_logprobs": True}, "return_logprob"),
        ({"input_ids": [1, 2], "text": "both"}, "input_ids"),
        ({}, "input_ids"),
        ({"input_ids": [[1, 2], [3]], "stream": True}, "stream"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": CFG.max_seq_len}}, "max_new_tokens"),
        ([1, 2, 3], "JSON object"),
    ],
)
async def test_bad_requests_are_400_naming_the_field(sampler_url, body, field):
    err = await gen(sampler_url, body, status=400)
    assert set(err) == {"error"} and err["error"]["code"] == 400
    assert field in err["error"]["message"], err


async def test_malformed_json_is_400(sampler_url):
    async with httpx.AsyncClient() as c:
        r = await c.post(sampler_url + "/generate", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


async def test_batch_request(sampler_url):
    out = await gen(
        sampler_url,
        {
            "input_ids": [PROMPT, PROMPT[:4]],
            "rid": ["b-1", "b-2"],
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        },
    )
    assert isinstance(out, list) and [o["meta_info"]["id"] for o in out] == ["b-1", "b-2"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(PROMPT), 4]


async def test_control_endpoints(sampler_url):
    async with httpx.AsyncClient(timeout=30) as c:
        info = (await c.get(sampler_url + "/get_model_info")).json()
        assert {"model_path", "is_generation", "weight_version"} <= set(info)
        assert "num_hidden_layers" not in info  # as SGLang's: the MoE shape is the model's config.json
        server = (await c.get(sampler_url + "/get_server_info")).json()
        assert "version" in server and isinstance(server["internal_states"], list)
        st = server["internal_states"][0]  # the sampler's own busy/idle accounting (bench.staleness reads it)
        assert 0 <= st["busy_s"] <= st["uptime_s"] and st["uptime_s"] > 0
        models = (await c.get(sampler_url + "/v1/models")).json()
        assert models["object"] == "list" and models["data"][0]["object"] == "model"
        assert (await c.get(sampler_url + "/health")).status_code == 200
        assert (await c.get(sampler_url + "/health_generate")).status_code == 200
        assert (await c.post(sampler_url + "/flush_cache")).status_code == 200
        assert (await c.post(sampler_url + "/abort_request", json={"rid": "nobody"})).status_code == 200
        assert (await c.get(sampler_url + "/nope")).status_code == 404


async def _running(c: httpx.AsyncClient, url: str) -> int:
    st = (await c.get(url + "/get_server_info")).json()["internal_states"][0]
    return st["running"] + st["waiting"]


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_aborts_the_request(sampler_url, stream):
    body = {
        "input_ids": PROMPT,
        "stream": stream,
        "rid": f"gone-{stream}",
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
    }
    async with httpx.AsyncClient(timeout=60) as c:
        with anyio.move_on_after(0.8):
            async with c.stream("POST", sampler_url + "/generate", json=body) as r:
                await r.aread()
        with anyio.fail_after(5):  # 3000 tokens take far longer than this if still running
            while await _running(c, sampler_url):
                await anyio.sleep(0.05)


async def test_abort_request_ends_a_running_request(sampler_url):
    async with httpx.AsyncClient(timeout=60) as c:
        result = {}

        async def long() -> None:
            result["out"] = (
                await c.post(
                    sampler_url + "/generate",
                    json={
                        "input_ids": PROMPT,
                        "rid": "to-abort",
                        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
                    },
                )
            ).json()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(long)
                while not await _running(c, sampler_url):
                    await anyio.sleep(0.02)
                await anyio.sleep(0.2)
                dup = await c.post(sampler_url + "/generate", json={"input_ids": PROMPT, "rid": "to-abort"})
                assert dup.status_code == 400 and "already in use" in dup.json()["error"]["message"]
                assert (await c.post(sampler_url + "/abort_request", json={"rid": "to-abort"})).status_code == 200
    meta = result["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 3000


async def test_weight_update_changes_version_and_outputs(tmp_path, model):
    new = load_pretrained(default_model_dir())
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    save_pretrained(new, tmp_path / "v1")
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
    }
    async with launch_sampler(max_batch=8, allowed_weight_roots=(tmp_path,)) as url:
        before = await gen(url, body)
        assert before["meta_info"]["weight_version"] == "0"
        async with httpx.AsyncClient(timeout=60) as c:
            r = await c.post(
                url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "v1"), "weight_version": "1"}
            )
            assert r.status_code == 200 and r.json()["success"] is True, r.text
            assert (await c.get(url + "/get_model_info")).json()["weight_version"] == "1"
            bad = await c.post(
                url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "missing"), "weight_version": "2"}
            )
            assert bad.status_code == 400 and bad.json()["success"] is False
            assert "missing" in bad.json()["message"]
            missing_field = await c.post(url + "/update_weights_from_disk", json={"weight_version": "3"})
            assert missing_field.status_code == 400 and "model_path" in missing_field.json()["error"]["message"]
        after = await gen(url, body)
    assert after["meta_info"]["weight_version"] == "1", "a failed update must not change the version"
    lb = [lp for lp, *_ in before["meta_info"]["output_token_logprobs"]]
    la = [lp for lp, *_ in after["meta_info"]["output_token_logprobs"]]
    assert after["output_ids"] != before["output_ids"] or not np.allclose(la, lb, atol=1e-3)
    # the new outputs are the perturbed model's: check the first logprob against a forward of it
    with torch.no_grad():
        logits = new(torch.tensor([PROMPT])).logits[0, -1].double()
    first = after["output_ids"][0]
    assert abs(torch.log_softmax(logits, -1)[first].item() - la[0]) < 1e-4


async def test_launch_sampler_stops_its_child_when_cancelled():
    with anyio.CancelScope() as scope:
        async with launch_sampler(max_batch=2, start_timeout_s=60) as url:
            async with httpx.AsyncClient() as c:
                assert (await c.get(url + "/health")).status_code == 200
            scope.cancel()
            await anyio.sleep(30)
    async with httpx.AsyncClient() as c:
        with pytest.raises(httpx.ConnectError):
            await c.get(url + "/health")


async def test_launch_sampler_reports_a_failed_start(tmp_path):
    from t1async.protocol.errors import ServerStartError

    want = r"(?s)exited with code 2 .*is not a model dir: it lacks config\.json"  # the one-line check
    with pytest.raises(ServerStartError, match=want):
        async with launch_sampler(tmp_path, start_timeout_s=60):
            pass


def test_the_sampling_params_an_actor_sends_parse_back_to_the_same_params():
    """One sampling-params type on both sides: the client's SamplingParams, sent as sampling_params, is
    what the server's validation returns; a bad field is a SamplerRequestError naming it."""
    from t1async.protocol.errors import SamplerRequestError
    from t1async.protocol.sampling import SamplingParams
    from t1async.sampler.requests import SGLANG_DEFAULTS, parse_sampling

    sent = SamplingParams(
        max_new_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        stop_token_ids=(3, 4),
        stop=("$ ",),
        skip_special_tokens=True,
        no_stop_trim=False,
        seed=11,
        ignore_eos=True,
    )
    assert parse_sampling(sent.to_sglang(), vocab_size=100) == sent
    assert parse_sampling(SamplingParams().to_sglang(), vocab_size=100) == SamplingParams()
    assert parse_sampling(None, vocab_size=100) == SGLANG_DEFAULTS and isinstance(SGLANG_DEFAULTS, SamplingParams)
    with pytest.raises(SamplerRequestError, match="top_k") as info:
        parse_sampling({"top_k": 0}, vocab_size=100)
    assert info.value.param == "sampling_params.top_k"


def test_streamed_text_holds_back_partial_characters(tok):
    """protocol.ResponseState decodes only new ids while streaming; a character split across tokens shows
    up whole, once its last byte arrives, and the final text is one exact decode."""
    from dataclasses import replace
    from types import SimpleNamespace

    from t1async.sampler.requests import SGLANG_DEFAULTS, GenerateInput
    from t1async.sampler.response import ResponseState

    ids = tok.encode("héllo 世界 ✓ ok 🙂!")
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids))), "no split character"
    st = ResponseState(
        req=GenerateInput(input_ids=(1,), sampling=replace(SGLANG_DEFAULTS, skip_special_tokens=False)),
        rid="r",
        started=0.0,
    )
    decode = lambda xs, skip: tok.decode(list(xs), skip_special_tokens=skip)  # noqa: E731
    seen = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        st.apply(
            SimpleNamespace(
                new_ids=[t],
                new_logprobs=[-1.0],
                prompt_tokens=1,
                cached_tokens=0,
                weight_version="0",
                finished=last,
                routing=None,
                finish_reason={"type": "length", "length": len(ids)} if last else None,
            )
        )
        seen.append(st.to_json(decode, 1.0)["text"])
    final = tok.decode(ids)
    assert seen[-1] == final
    assert all(final.startswith(t) and not t.endswith("\ufffd") for t in seen)


async def test_a_weight_update_mid_turn_splits_the_turns_versions(tmp_path):
    """A weight update landing between two decode steps of one request: each output token carries the
    version that produced it (our meta_info extension), the client reads them as ints, and the turn record
    and the learner's segment keep them per token, with policy_version the oldest."""
    from actors.records import TurnEncoder
    from sandbox_agent.agent.types import TurnResult
    from t1async.ingest.assembly import Assembler
    from t1async.protocol import wire
    from t1async.sampler.response import parse_generation

    new = load_pretrained(default_model_dir())
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1.01)
    save_pretrained(new, tmp_path / "v1")
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "stream": True,
        "return_routed_experts": True,
        "routed_experts_start_len": 0,
        "sampling_params": {"max_new_tokens": 600, "temperature": 1.0, "ignore_eos": True},
    }
    async with (
        launch_sampler(max_batch=4, allowed_weight_roots=(tmp_path,)) as url,
        httpx.AsyncClient(timeout=120) as c,
    ):
        chunks = []
        async with c.stream("POST", url + "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 1:  # the request is decoding: push new weights under it
                    up = await c.post(
                        url + "/update_weights_from_disk",
                        json={"model_path": str(tmp_path / "v1"), "weight_version": "1"},
                    )
                    assert up.json()["success"] is True, up.text
    last = chunks[-1]
    meta = last["meta_info"]
    spans = meta["weight_versions"]  # SGLang's spans (sglang/srt/utils/weight_versions.py)
    assert len(last["output_ids"]) == 600 and meta["weight_version"] == "1"
    assert [s["version"] for s in spans] == ["0", "1"], "one switch, 0 then 1"
    split = spans[1]["start"]
    assert 0 < split < 600 and spans[0] == {"version": "0", "start": 0, "end": split} and spans[1]["end"] == 600
    g = parse_generation(last, len(PROMPT), 0, (L, K, E), url=url)
    assert g.policy_version == 1 and g.output_versions.dtype == np.int32
    assert g.output_versions.tolist() == [0] * split + [1] * (600 - split)
    t = TurnResult(
        turn=0,
        input_ids=np.asarray(PROMPT, np.int32),
        output_ids=g.output_ids,
        logprobs=g.logprobs,
        finish=g.finish,
        policy_version=g.policy_version,
        routing=g.routing,
        routing_start=g.routing_start,
        action_kind="none",
        action_text="",
        observation="",
        exit_code=None,
        timed_out=False,
        truncated=False,
        tests_passed=None,
        reward=0.0,
        t_sample_s=0.0,
        t_exec_s=0.0,
        output_versions=g.output_versions,
    )
    rec = wire.decode(wire.encode(TurnEncoder("mid").encode(t)))
    assert rec.policy_version == 0 and rec.output_versions.tolist() == g.output_versions.tolist()
    asm = Assembler()
    asm.add(rec)
    (seg,) = asm.end(wire.EndRecord("mid", 1, wire.EndReason.MAX_TURNS, 0, 1, False))
    assert seg.versions[seg.loss_mask].tolist() == g.output_versions.tolist()
    # the learner at version 1 with eta 0: only the tokens version 0 sampled are too stale
    from t1async.learner.service import Learner
    from t1async.learner.settings import LearnerConfig
    from t1async.transport import MemoryTransport

    learner = Learner(LearnerConfig(run_dir=tmp_path / "run", max_staleness=0), MemoryTransport(), None)
    kept = learner.inputs.mask(seg, 1, learner.state.trained)
    assert learner.stale_masked_tokens == split and kept.versions[kept.loss_mask].tolist() == [1] * (600 - split)
