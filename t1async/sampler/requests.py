"""SGLang's native ``/generate`` API: request parsing and validation. Pure, no I/O. The responses are built
(and read) in response.py; ``ResponseState``, ``encode_routing`` and ``error_body`` are importable here too.

The embedded server (server.py) uses these functions; the field names and shapes are SGLang's
(``python/sglang/srt/managers/io_struct.py`` ``GenerateReqInput`` and the tokenizer manager's ``meta_info``):

- request: ``input_ids`` | ``text``, ``sampling_params``, ``return_logprob``, ``logprob_start_len``,
  ``return_routed_experts``, ``routed_experts_start_len``, ``stream``, ``rid``;
- response: ``text``, ``output_ids``, ``meta_info`` {``id``, ``finish_reason``, ``prompt_tokens``,
  ``completion_tokens``, ``cached_tokens``, ``weight_version``, ``weight_versions`` (SGLang's spans
  ``[{"version", "start", "end"}, ...]`` over the output tokens: the version that produced each, since a
  weight update may land between two decode steps of one request), ``e2e_latency``,
  ``output_token_logprobs`` ([[logprob, token_id, null], ...]), ``routed_experts`` (base64 of little-endian
  int32, logical shape ``[seqlen - 1 - start, num_hidden_layers, num_experts_per_tok]``)};
- our one extension to ``meta_info`` (a real SGLang server does not send it; clients fall back to the
  request's value): ``routed_experts_start_len`` (the position of the first ``routed_experts`` row: the
  request's value, or earlier when the server recomputed positions before it after a prefix-cache flush, so
  the rows are the routes it actually used, design §6);
- errors: HTTP 400 with ``{"error": {"message": ...}}`` (SGLang's shape; we add ``type``, ``code`` and
  ``param``, the offending field).

Every validation failure raises :class:`SamplerRequestError` with a message naming the field and what to send.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from t1async.protocol.errors import SamplerRequestError
from t1async.protocol.sampling import SamplingParams

__all__ = [
    "SGLANG_DEFAULTS",
    "GenerateInput",
    "parse_generate",
    "parse_sampling",
]


_TOP_FIELDS = {
    "input_ids",
    "text",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "return_routed_experts",
    "routed_experts_start_len",
    "stream",
    "rid",
}
_TOP_NEUTRAL: dict[str, Any] = {
    "top_logprobs_num": (0, None),
    "token_ids_logprob": (None,),
    "return_text_in_logprobs": (False, None),
    "return_hidden_states": (False, None),
    "lora_path": (None,),
    "image_data": (None,),
    "input_embeds": (None,),
    "modalities": (None,),
    "session_params": (None,),
    "custom_logit_processor": (None,),
    "log_metrics": None,
    "priority": None,
    "data_parallel_rank": (None,),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    "extra_key": (None,),
    "return_indexer_topk": (False, None),
}
_SP_FIELDS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "skip_special_tokens",
    "no_stop_trim",
    "ignore_eos",
    "sampling_seed",
}
_SP_NEUTRAL: dict[str, Any] = {
    "n": (1, None),
    "min_p": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "min_new_tokens": (0, None),
    "spaces_between_special_tokens": None,
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "custom_params": (None,),
    "stream_interval": None,
    "logit_bias": (None,),
}


# What SGLang assumes for the sampling_params a request leaves out (the client's SamplingParams defaults
# are what an actor asks for, and differ: it always sends every field)
SGLANG_DEFAULTS = SamplingParams(max_new_tokens=128, skip_special_tokens=True, no_stop_trim=False)


@dataclass(frozen=True)
class GenerateInput:
    """One validated generation request (a batch request parses to several)."""

    input_ids: tuple[int, ...]
    sampling: SamplingParams
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    stream: bool = False
    from_text: bool = False


def _unknown(name: str, where: str, known: set[str]) -> SamplerRequestError:
    hint = difflib.get_close_matches(name, sorted(known), n=1)
    did = f" (did you mean {hint[0]!r}?)" if hint else ""
    return SamplerRequestError(
        f"unknown field {where}{name!r}{did}; supported: {', '.join(sorted(known))}", param=f"{where}{name}"
    )


def _check_neutral(body: dict, known: set[str], neutral: dict[str, Any], where: str) -> None:
    for key, value in body.items():
        if key in known:
            continue
        if key not in neutral:
            raise _unknown(key, where, known)
        allowed = neutral[key]
        if allowed is not None and value not in allowed:
            raise SamplerRequestError(
                f"{where}{key}={value!r} is not supported by this sampler; omit it or send one of {list(allowed)}",
                param=f"{where}{key}",
            )


def _int(value: Any, name: str, *, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise SamplerRequestError(f"{name} must be an integer, got {value!r}", param=name)
    if lo is not None and value < lo:
        raise SamplerRequestError(f"{name} must be >= {lo}, got {value}", param=name)
    if hi is not None and value > hi:
        raise SamplerRequestError(f"{name} must be <= {hi}, got {value}", param=name)
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SamplerRequestError(f"{name} must be a finite number, got {value!r}", param=name)
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise SamplerRequestError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _token_ids(value: Any, name: str, vocab_size: int, *, allow_empty: bool = False) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise SamplerRequestError(f"{name} must be a list of token ids, got {type(value).__name__}", param=name)
    if not value and not allow_empty:
        raise SamplerRequestError(f"{name} is empty; send at least one token id", param=name)
    for i, tok in enumerate(value):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise SamplerRequestError(f"{name}[{i}] must be an integer token id, got {tok!r}", param=name)
        if not 0 <= tok < vocab_size:
            raise SamplerRequestError(
                f"{name}[{i}] = {tok} is not a token id of this model "
                f"(vocab_size {vocab_size}: ids 0..{vocab_size - 1})",
                param=name,
            )
    return tuple(value)


def parse_sampling(body: Any, vocab_size: int, *, where: str = "sampling_params.") -> SamplingParams:
    if body is None:
        return SGLANG_DEFAULTS
    if not isinstance(body, dict):
        raise SamplerRequestError(
            f"sampling_params must be an object, got {type(body).__name__}", param="sampling_params"
        )
    _check_neutral(body, _SP_FIELDS, _SP_NEUTRAL, where)
    d = SGLANG_DEFAULTS
    g = body.get
    temperature = _float(g("temperature", d.temperature), where + "temperature")
    if temperature < 0:
        raise SamplerRequestError(
            f"{where}temperature must be >= 0 (0 is greedy), got {temperature}", param=where + "temperature"
        )
    top_p = _float(g("top_p", d.top_p), where + "top_p")
    if not 0 < top_p <= 1:
        raise SamplerRequestError(f"{where}top_p must be in (0, 1], got {top_p}", param=where + "top_p")
    top_k = _int(g("top_k", d.top_k), where + "top_k")
    if top_k == 0 or top_k < -1:
        raise SamplerRequestError(f"{where}top_k must be -1 (all tokens) or >= 1, got {top_k}", param=where + "top_k")
    stop = g("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise SamplerRequestError(
            f"{where}stop must be a string or a list of non-empty strings, got {stop!r}", param=where + "stop"
        )
    stop_ids = g("stop_token_ids") or []
    seed = g("sampling_seed")
    return SamplingParams(
        max_new_tokens=_int(g("max_new_tokens", d.max_new_tokens), where + "max_new_tokens", lo=0),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=tuple(stop),
        stop_token_ids=_token_ids(stop_ids, where + "stop_token_ids", vocab_size, allow_empty=True),
        skip_special_tokens=_bool(g("skip_special_tokens", d.skip_special_tokens), where + "skip_special_tokens"),
        no_stop_trim=_bool(g("no_stop_trim", d.no_stop_trim), where + "no_stop_trim"),
        ignore_eos=_bool(g("ignore_eos", d.ignore_eos), where + "ignore_eos"),
        seed=None if seed is None else _int(seed, where + "sampling_seed", lo=0),
    )


def parse_generate(
    body: Any, *, vocab_size: int, max_seq_len: int, encode: Callable[[str], list[int]]
) -> tuple[list[GenerateInput], bool]:
    """Validate a ``/generate`` body. Returns (requests, is_batch); raises :class:`SamplerRequestError`.

    ``encode`` tokenizes ``text`` (the server's tokenizer); ``input_ids`` wins when both are absent/present
    is an error, as in SGLang ("Either text or input_ids should be provided", not both).
    """
    if not isinstance(body, dict):
        raise SamplerRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_neutral(body, _TOP_FIELDS, _TOP_NEUTRAL, "")
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise SamplerRequestError("send exactly one of input_ids (token ids) or text", param="input_ids")
    if has_ids:
        raw = body["input_ids"]
        batch = isinstance(raw, list) and bool(raw) and isinstance(raw[0], list)
        prompts = [
            _token_ids(p, f"input_ids[{i}]" if batch else "input_ids", vocab_size)
            for i, p in enumerate(raw if batch else [raw])
        ]
    else:
        raw = body["text"]
        batch = isinstance(raw, list)
        texts = raw if batch else [raw]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise SamplerRequestError("text must be a string or a non-empty list of strings", param="text")
        prompts = []
        for i, t in enumerate(texts):
            ids = tuple(encode(t))
            if not ids:
                where = f"text[{i}]" if batch else "text"
                raise SamplerRequestError(f"{where} encodes to no tokens; send non-empty text", param="text")
            prompts.append(ids)
    n = len(prompts)
    stream = _bool(body.get("stream", False), "stream")
    if batch and stream:
        raise SamplerRequestError(
            "stream=true is not supported for a batch request; send one request per prompt", param="stream"
        )
    sp = body.get("sampling_params")
    if batch and isinstance(sp, list):
        if len(sp) != n:
            raise SamplerRequestError(f"sampling_params has {len(sp)} entries for {n} prompts", param="sampling_params")
        specs = [parse_sampling(s, vocab_size, where=f"sampling_params[{i}].") for i, s in enumerate(sp)]
    else:
        specs = [parse_sampling(sp, vocab_size)] * n
    rid = body.get("rid")
    if batch and rid is not None:
        if not isinstance(rid, list) or len(rid) != n or not all(isinstance(r, str) for r in rid):
            raise SamplerRequestError(f"rid must be a list of {n} strings for a batch of {n} prompts", param="rid")
        rids: list[str | None] = list(rid)
    else:
        if rid is not None and not isinstance(rid, str):
            raise SamplerRequestError(f"rid must be a string, got {rid!r}", param="rid")
        rids = [rid] * n
    return_logprob = _bool(body.get("return_logprob", False), "return_logprob")
    logprob_start_len = _int(body.get("logprob_start_len", -1), "logprob_start_len", lo=-1)
    return_routed = _bool(body.get("return_routed_experts", False), "return_routed_experts")
    start = body.get("routed_experts_start_len")
    out = []
    for i, (ids, spec, r) in enumerate(zip(prompts, specs, rids)):
        where = f"input_ids[{i}]" if batch else "input_ids"
        if len(ids) >= max_seq_len:
            raise SamplerRequestError(
                f"{where} has {len(ids)} tokens; this model's context length is {max_seq_len} tokens", param=where
            )
        if len(ids) + spec.max_new_tokens > max_seq_len:
            raise SamplerRequestError(
                f"requested {len(ids)} input + {spec.max_new_tokens} new tokens = {len(ids) + spec.max_new_tokens}, "
                f"more than the context length of {max_seq_len}; lower sampling_params.max_new_tokens "
                f"to at most {max_seq_len - len(ids)}",
                param="sampling_params.max_new_tokens",
            )
        s = 0 if start is None else _int(start, "routed_experts_start_len", lo=0)
        if s > len(ids):
            raise SamplerRequestError(
                f"routed_experts_start_len = {s} is past the prompt ({len(ids)} tokens); it must be in [0, {len(ids)}]",
                param="routed_experts_start_len",
            )
        out.append(
            GenerateInput(
                input_ids=ids,
                sampling=spec,
                rid=r,
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                return_routed_experts=return_routed,
                routed_experts_start_len=s,
                stream=stream,
                from_text=has_text,
            )
        )
    return out, batch
