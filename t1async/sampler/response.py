"""SGLang's ``/generate`` responses from both ends, as pure code (no I/O). The fields are listed in
requests.py's docstring.

- The embedded server builds them: ``ResponseState`` accumulates one request's engine events into SGLang's
  cumulative response object (streamed or not), ``encode_routing`` packs the routing trace, ``error_body``
  is SGLang's error shape.
- SGLangClient reads them: ``parse_generation`` turns one into a Generation (output ids, logprobs, finish,
  per-token weight versions from ``meta_info.weight_versions``, the routing trace), ``parse_weight_version``
  insists on integer versions, ``shape_from_config`` reads the MoE shape from the model's ``config.json``
  (SGLang's ``/model_info`` has none), ``error_message`` an error body.

The layouts are SGLang 0.5.23's (files under ``sglang/srt/``): ``weight_versions`` spans
(``sglang/srt/utils/weight_versions.py`` ``add_weight_versions_to_meta_info``), ``routed_experts`` (base64 of int32
``[seqlen - 1 - start, num_hidden_layers, num_experts_per_tok]``: ``sglang/srt/state_capturer/routed_experts.py``,
``sglang/srt/managers/tokenizer_manager.py``), absent when the server runs without ``--enable-return-routed-experts``.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from t1async.protocol.errors import SamplerError, SamplerVersionError
from t1async.protocol.sampling import Generation
from t1async.protocol.wire import Finish

if TYPE_CHECKING:
    from t1async.sampler.requests import GenerateInput

__all__ = [
    "ResponseState",
    "decode_routing",
    "encode_routing",
    "error_body",
    "error_message",
    "parse_generation",
    "parse_output_versions",
    "parse_weight_version",
    "routing_dtype",
    "shape_from_config",
    "version_spans",
]
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


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


def parse_output_versions(meta: dict, n: int, policy_version: int, url: str) -> np.ndarray:
    """Per-token weight versions from SGLang's ``meta_info.weight_versions`` spans (``[{"version", "start",
    "end"}, ...]``, output-token positions, in order; an update that lands mid-request splits the output), else
    ``policy_version`` for every token. Spans that do not tile ``[0, n)`` raise SamplerError."""
    spans = meta.get("weight_versions")
    if spans is None:
        return np.full(n, policy_version, dtype=np.int32)
    if not isinstance(spans, list) or not spans:
        raise SamplerError(f"{url}/generate: weight_versions is {str(spans)[:100]}, not a list of spans")
    out = np.empty(n, dtype=np.int32)
    at = 0
    for i, span in enumerate(spans):
        if not isinstance(span, dict) or not {"version", "start", "end"} <= set(span):
            raise SamplerError(f"{url}/generate: weight_versions[{i}] is {span!r}, not a version span")
        start, end = span["start"], span["end"]
        if not (isinstance(start, int) and isinstance(end, int) and start == at and start <= end <= n):
            raise SamplerError(f"{url}/generate: weight_versions {spans} do not tile the {n} output tokens (span {i})")
        out[start:end] = parse_weight_version(span["version"], url, f"weight_versions[{i}]")
        at = end
    if at != n:
        raise SamplerError(f"{url}/generate: weight_versions {spans} cover {at} of the {n} output tokens")
    return out


def version_spans(versions: Sequence[str]) -> list[dict]:
    """Per-token versions as SGLang's ``weight_versions`` spans (``add_weight_versions_to_meta_info``)."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


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


def shape_from_config(config: dict, where: str = "config.json") -> tuple[int, int, int]:
    """(layers, topk, experts) of SGLang's routing trace from a Hugging Face ``config.json``: SGLang sizes it
    ``num_hidden_layers`` x ``num_experts_per_tok`` of the text config, dense layers included
    (``sglang/srt/state_capturer/routed_experts.py``)."""
    text = config.get("text_config")
    cfg: dict = text if isinstance(text, dict) else config
    layers, topk = cfg.get("num_hidden_layers"), cfg.get("num_experts_per_tok")
    experts = next((cfg[k] for k in _EXPERT_KEYS if isinstance(cfg.get(k), int)), None)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (layers, topk, experts)):
        raise SamplerError(
            f"{where} does not give an MoE shape (num_hidden_layers {layers!r}, num_experts_per_tok {topk!r}, "
            f"num_experts {experts!r}): routes need a mixture-of-experts model's config"
        )
    return int(layers), int(topk), int(experts)  # type: ignore[arg-type]


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
    """An SGLang ``/generate`` response (one object) as a Generation. Tolerates extra fields; anything
    malformed in it raises ``SamplerError`` (and nothing else), naming what was wrong."""
    return guarded(_parse_generation, out, prompt_len, routing_start, shape, latency=latency, url=url, path="/generate")


def guarded(
    parse: Callable[..., Generation],
    out: Any,
    prompt_len: int,
    routing_start: int | None,
    shape: tuple[int, int, int] | None,
    *,
    latency: float,
    url: str,
    path: str,
) -> Generation:
    """``parse(out, ...)``, every failure of it a SamplerError naming ``url + path`` and the body's start: an
    engine's malformed answer never escapes as a TypeError or KeyError (SGLang's and vLLM's decoders)."""
    try:
        return parse(out, prompt_len, routing_start, shape, latency=latency, url=url)
    except SamplerError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as exc:  # binascii too
        raise SamplerError(
            f"{url}{path} answered a malformed response ({type(exc).__name__}: {exc}): {str(out)[:200]}"
        ) from exc


def _parse_generation(
    out: Any,
    prompt_len: int,
    routing_start: int | None,
    shape: tuple[int, int, int] | None,
    *,
    latency: float,
    url: str,
) -> Generation:
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
    if routing_start is not None and meta.get("routed_experts") is None and finish != "abort":
        raise SamplerError(
            f"{url}/generate was asked for routes (return_routed_experts) and answered none: start SGLang with "
            "--enable-return-routed-experts (R3 needs every turn's routes)"
        )
    if routing_start is not None and meta.get("routed_experts") is not None:
        if shape is None:
            raise SamplerError(f"{url}/generate: routes came back but the client knows no routing shape")
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
            raise SamplerError(
                f"{url}: routed_experts has {arr.shape[0]} rows, expected {want} "
                f"(= {prompt_tokens} prompt + {len(output_ids)} output - 1 - start {start})"
            )
        if arr.size and (arr.min() < 0 or (experts and arr.max() >= experts)):
            raise SamplerError(f"{url}: routed_experts holds expert ids outside [0, {experts})")
        dtype = routing_dtype(experts or int(arr.max(initial=0)) + 1)
        routing = arr.astype(dtype)
    raw_version = meta.get("weight_version", "")
    policy_version = parse_weight_version(raw_version, url or "the sampler")
    versions = parse_output_versions(meta, len(output_ids), policy_version, url or "the sampler")
    return Generation(
        output_ids=output_ids,
        logprobs=logprobs,
        finish=Finish(finish) if finish in ("stop", "length", "abort") else Finish.ABORT,
        policy_version=policy_version,
        output_versions=versions,
        routing=routing,
        routing_start=start,
        prompt_tokens=int(meta.get("prompt_tokens", prompt_len)),
        cached_tokens=int(meta.get("cached_tokens", 0) or 0),
        latency_s=latency,
        matched_stop=fr.get("matched"),
        text=out.get("text", "") or "",
        extra={
            "weight_version": raw_version,
            "rid": meta.get("id"),
            "url": url,
            "e2e_latency": meta.get("e2e_latency"),
            "finish_reason": fr,
        },
    )


# ---------------------------------------------------------------- the server side: building responses


def error_body(message: str, *, param: str = "", status: int = 400) -> dict:
    """SGLang's error shape (``{"error": {"message": ...}}``), plus OpenAI-style ``type``/``code``/``param``."""
    kind = {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "code": status, "param": param or None}}


# SGLang GenerateReqInput fields we implement, and those we accept only at their neutral value.


def encode_routing(routing: np.ndarray) -> str:
    """base64 of little-endian int32, C order (SGLang's ``meta_info["routed_experts"]``)."""
    return base64.b64encode(np.ascontiguousarray(routing, dtype="<i4").tobytes()).decode("ascii")


def decode_routing(data: str, *, layers: int, topk: int) -> np.ndarray:
    """Inverse of :func:`encode_routing`: int32 ``[rows, layers, topk]``; raises ValueError on a bad size."""
    raw = base64.b64decode(data)
    per_row = 4 * layers * topk
    if per_row == 0 or len(raw) % per_row:
        raise ValueError(f"routed_experts has {len(raw)} bytes, not a multiple of 4 * {layers} layers * {topk} topk")
    return np.frombuffer(raw, dtype="<i4").reshape(-1, layers, topk)


@dataclass
class ResponseState:
    """Accumulates one request's engine events into SGLang's cumulative response object."""

    req: GenerateInput
    rid: str
    started: float
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str = ""
    versions: list[str] = field(default_factory=list)  # the weight version of each output token
    routing: np.ndarray | None = None
    routing_start: int = 0  # the position of routing[0]: the request's start, or earlier (see to_json)
    # streaming decodes only the new ids: text of output_ids[:_done_n] (a whole number of characters)
    _done_n: int = field(default=0, repr=False)
    _done_text: str = field(default="", repr=False)

    def apply(self, ev: Any) -> None:
        self.output_ids.extend(int(t) for t in ev.new_ids)
        self.logprobs.extend(float(x) for x in ev.new_logprobs)
        per_token = getattr(ev, "new_versions", None)
        if per_token is None:  # an engine that does not report per-token versions
            per_token = [ev.weight_version] * len(ev.new_ids)
        self.versions.extend(str(v) for v in per_token)
        self.prompt_tokens = ev.prompt_tokens or len(self.req.input_ids)
        self.cached_tokens = ev.cached_tokens
        self.weight_version = str(ev.weight_version)
        if ev.finished:
            self.finish_reason = ev.finish_reason
            if ev.routing is not None:
                self.routing = ev.routing
                self.routing_start = int(getattr(ev, "routing_start", self.req.routed_experts_start_len))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def text(self, decode: Callable[[Sequence[int], bool], str]) -> str:
        spec = self.req.sampling
        ids = self.output_ids
        if not self.finished:  # incremental (byte-level BPE decodes piecewise at character boundaries)
            tail = decode(ids[self._done_n :], spec.skip_special_tokens)
            if tail and not tail.endswith("\ufffd"):
                self._done_n, self._done_text = len(ids), self._done_text + tail
                return self._done_text
            return self._done_text + tail.rstrip("\ufffd")  # hold back a partial UTF-8 character
        matched = (self.finish_reason or {}).get("matched")
        trim = not spec.no_stop_trim
        if trim and isinstance(matched, int) and not isinstance(matched, bool) and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = decode(ids, spec.skip_special_tokens)  # the final text: one whole decode, exact
        if trim and isinstance(matched, str):
            pos = text.find(matched)
            if pos != -1:
                text = text[:pos]
        return text

    def to_json(self, decode: Callable[[Sequence[int], bool], str], now: float) -> dict:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "weight_version": self.weight_version,
            "e2e_latency": now - self.started,
        }
        if self.versions:  # SGLang's spans, and its weight_version: the last span's
            meta["weight_versions"] = version_spans(self.versions)
            meta["weight_version"] = self.versions[-1]
        if self.req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(self.logprobs, self.output_ids)]
        if self.req.return_routed_experts and self.routing is not None:
            meta["routed_experts"] = encode_routing(self.routing)
            meta["routed_experts_start_len"] = self.routing_start
        return {"text": self.text(decode), "output_ids": list(self.output_ids), "meta_info": meta}
