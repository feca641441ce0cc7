"""What SGLangClient reads from a sampler's answers, as pure functions (no I/O): a ``/generate`` response as
a Generation (output ids, logprobs, finish, per-token weight versions, the routing trace), integer weight
versions, the MoE shape from ``/get_model_info``, and an error body's message."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from t1async.errors import SamplerError, SamplerVersionError
from t1async.sampler.base import Generation

__all__ = [
    "error_message", "parse_generation", "parse_output_versions", "parse_weight_version", "routing_dtype",
    "shape_from_info",
]  # fmt: skip
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layers")
_TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "topk")
_EXPERT_KEYS = ("num_experts", "n_experts", "n_routed_experts")


def parse_weight_version(raw: Any, url: str = "the sampler", what: str = "weight_version") -> int:
    """SGLang's weight_version is a free string (a real server's default is ``"default"``); ours are ints,
    set by the learner on every push. Anything else raises ``SamplerVersionError`` naming the sampler."""
    if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
        return raw
    text = str(raw).strip() if isinstance(raw, str) else ""
    if text.isascii() and text.isdigit():
        return int(text)
    raise SamplerVersionError(
        f"{url} reports {what} {raw!r}, not a non-negative integer; t1async needs integer policy versions: start "
        "SGLang with --weight-version 0 (the learner then sets the version on every weight push)"
    )


def parse_output_versions(meta: dict, n: int, version: int, url: str) -> np.ndarray:
    """Per-token weight versions from ``meta_info.output_token_weight_versions`` (the embedded server's
    extension; a weight update may land mid-request), else ``version`` for every token (a real SGLang)."""
    raw = meta.get("output_token_weight_versions")
    if raw is None:
        return np.full(n, version, dtype=np.int32)
    if not isinstance(raw, list) or len(raw) != n:
        got = f"{len(raw)} entries" if isinstance(raw, list) else type(raw).__name__
        raise SamplerError(f"{url}/generate: output_token_weight_versions has {got} for {n} output tokens")
    if all(v == raw[0] for v in raw):  # the usual case: one version for the whole turn (no hashing: any JSON)
        return np.full(n, parse_weight_version(raw[0], url, "output_token_weight_versions[0]"), dtype=np.int32)
    return np.asarray([parse_weight_version(v, url, f"output_token_weight_versions[{i}]")
                       for i, v in enumerate(raw)], dtype=np.int32)  # fmt: skip


def error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]


def _first(info: dict, keys: Sequence[str]) -> int | None:
    for k in keys:
        if isinstance(info.get(k), int):
            return int(info[k])
    return None


def shape_from_info(info: dict, url: str) -> tuple[int, int, int]:
    layers, topk, experts = _first(info, _LAYER_KEYS), _first(info, _TOPK_KEYS), _first(info, _EXPERT_KEYS)
    if layers is None or topk is None:
        raise SamplerError(
            f"{url}/get_model_info does not say the MoE shape (keys {sorted(info)}); "
            "pass SGLangClient(routing_shape=(num_layers, topk, num_experts))"
        )
    return layers, topk, experts or 0


def routing_dtype(num_experts: int) -> np.dtype:
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype("<u2")


def parse_generation(
    out: Any,
    prompt_len: int,
    routing_start: int | None,
    shape: tuple[int, int, int] | None,
    *,
    latency: float = 0.0,
    url: str = "",
) -> Generation:
    """An SGLang ``/generate`` response (one object) as a Generation. Tolerates extra fields."""
    if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
        raise SamplerError(f"{url}/generate answered without meta_info: {str(out)[:200]}")
    meta = out["meta_info"]
    lps = meta.get("output_token_logprobs") or []
    ids = out.get("output_ids")
    if ids is None:
        ids = [t for _, t, *_ in lps]
    output_ids = np.asarray(ids, dtype=np.int32)
    logprobs = np.asarray([lp if lp is not None else np.nan for lp, *_ in lps], dtype=np.float32)
    if len(logprobs) != len(output_ids):
        raise SamplerError(f"{url}/generate returned {len(output_ids)} output ids but {len(logprobs)} logprobs")
    fr = meta.get("finish_reason") or {"type": "abort", "message": "no finish_reason"}
    if isinstance(fr, str):  # some versions answer a bare string
        fr = {"type": fr}
    finish = fr.get("type", "abort")
    routing = None
    start = 0
    if routing_start is not None and meta.get("routed_experts") is not None and shape is not None:
        layers, topk, experts = shape
        start = int(routing_start)
        actual = meta.get("routed_experts_start_len")  # our server: earlier when it recomputed those positions
        if isinstance(actual, int) and not isinstance(actual, bool) and 0 <= actual <= start:
            start = actual
        raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
        prompt_tokens = int(meta.get("prompt_tokens", prompt_len))
        want = prompt_tokens + len(output_ids) - 1 - start
        per_row = layers * topk
        if per_row == 0 or raw.size % per_row:
            raise SamplerError(f"{url}: routed_experts has {raw.size} values, not rows of {layers}x{topk}")
        arr = raw.reshape(-1, layers, topk)
        if arr.shape[0] == want + start and start:  # a server that ignores routed_experts_start_len
            arr = arr[start:]
        if arr.shape[0] != want:
            raise SamplerError(f"{url}: routed_experts has {arr.shape[0]} rows, expected {want} "
                               f"(= {prompt_tokens} prompt + {len(output_ids)} output - 1 - start {start})")
        if arr.size and (arr.min() < 0 or (experts and arr.max() >= experts)):
            raise SamplerError(f"{url}: routed_experts holds expert ids outside [0, {experts})")
        dtype = routing_dtype(experts or int(arr.max(initial=0)) + 1)
        routing = arr.astype(dtype)
    raw_version = meta.get("weight_version", "")
    version = parse_weight_version(raw_version, url or "the sampler")
    versions = parse_output_versions(meta, len(output_ids), version, url or "the sampler")
    return Generation(
        output_ids=output_ids,
        logprobs=logprobs,
        finish=finish if finish in ("stop", "length", "abort") else "abort",
        weight_version=version,
        output_versions=versions,
        routing=routing,
        routing_start=start,
        prompt_tokens=int(meta.get("prompt_tokens", prompt_len)),
        cached_tokens=int(meta.get("cached_tokens", 0) or 0),
        latency_s=latency,
        matched_stop=fr.get("matched"),
        text=out.get("text", "") or "",
        extra={"weight_version": raw_version, "rid": meta.get("id"), "url": url,
               "e2e_latency": meta.get("e2e_latency"), "finish_reason": fr},
    )
