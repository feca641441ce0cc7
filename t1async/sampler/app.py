"""The embedded sampler's request handlers (``SamplerApp``): SGLang's native endpoints over the Engine.

``/generate`` (streamed or not, single or batch; a client that disconnects aborts its requests), the weight
and cache controls, and the model and server info. Requests are parsed by requests.py and answered with
response.py's shapes; server.py routes the endpoints to these methods and serves them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from t1async.log import get_logger
from t1async.protocol.errors import SamplerError, SamplerRequestError
from t1async.sampler import requests as P
from t1async.sampler import response as R
from t1async.sampler.settings import SamplerSettings

if TYPE_CHECKING:
    import torch

    from t1async.model.records import GenEvent, GenRequest

log = get_logger("sampler.server")
# what the engine and the protocol raise for a request they reject (HTTP 400, as SGLang maps its ValueErrors)
_REJECTED = (ValueError, SamplerRequestError)
VERSION = "t1async-embedded-0.1"


# never shown in /server_info: the keys, and where they were read from
_SECRET = ("api_key", "admin_api_key", "api_key_file", "admin_api_key_file")


class ServingEngine(Protocol):
    """The engine seam of the embedded sampler: what ``SamplerApp``'s handlers and ``WeightPushServer``
    (weightpush_server.py) call. ``t1async.model.engine.Engine`` is the one implementation."""

    @property
    def weight_version(self) -> str: ...

    def model_info(self) -> dict: ...

    def stats(self) -> dict: ...

    def generate(self, req: GenRequest) -> AsyncGenerator[GenEvent, None]: ...

    def abort(self, rid: str) -> bool: ...

    async def pause(self, mode: str) -> None: ...

    def resume(self) -> None: ...

    def flush_cache(self) -> None: ...

    async def update_weights_from_disk(self, model_path: str | Path, weight_version: str | None = None) -> None: ...

    def state_shapes(self) -> dict[str, tuple[int, ...]]: ...

    async def update_weights_from_tensors(
        self, tensors: dict[str, torch.Tensor], weight_version: str | None = None
    ) -> None: ...


def _hf_config(model_path: str) -> dict:
    """The model dir's ``config.json`` (``{}`` when there is none): ``/model_info``'s type and architectures."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text()) if model_path else {}
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _plain(v: Any) -> Any:
    """A setting as JSON has it: paths as strings."""
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")), status_code=status, media_type="application/json")


def _bad(message: str, *, param: str = "", status: int = 400) -> Response:
    log.info("sampler.bad_request", message=message, param=param, status=status)
    return json_response(R.error_body(message, param=param, status=status), status)


class SamplerApp:
    """The HTTP handlers around one Engine and its tokenizer."""

    def __init__(
        self, engine: ServingEngine, tokenizer: Any, config: SamplerSettings, model_path: str, request_type: Any = None
    ) -> None:
        self.engine, self.tokenizer, self.config, self.model_path = engine, tokenizer, config, model_path
        if request_type is None:
            from t1async.model.records import GenRequest as request_type
        self.request_type = request_type
        info = dict(engine.model_info())
        self.info = info
        self.vocab_size = int(info.get("vocab_size") or tokenizer.vocab_size)
        self.max_seq_len = int(info.get("max_seq_len") or 1 << 30)
        self.active: set[str] = set()
        roots = config.allowed_weight_roots or ((Path(model_path).parent,) if model_path else ())
        self.weight_roots = tuple(r.resolve() for r in roots)
        self.started = time.time()
        self.served = 0
        self.startup_version = str(engine.weight_version)  # /server_info's (SGLang's start-up)
        self.hf_config = _hf_config(model_path)

    # ---------------------------------------------------------------- generate

    def _decode(self, ids: Sequence[int], skip_special: bool) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def make_request(self, gi: P.GenerateInput, rid: str) -> Any:
        """The engine's GenRequest for one validated request."""
        s = gi.sampling
        return self.request_type(
            rid=rid,
            input_ids=list(gi.input_ids),
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            stop_token_ids=frozenset(s.stop_token_ids),
            stop_strings=s.stop,
            ignore_eos=s.ignore_eos,
            return_routing=gi.return_routed_experts,
            routing_start=gi.routed_experts_start_len,
            seed=s.seed,
        )

    async def _events(self, gi: P.GenerateInput, state: R.ResponseState) -> AsyncGenerator[R.ResponseState, None]:
        """Run one request through the engine, yielding the state after each event. Closing aborts it."""
        if state.rid in self.active:
            raise SamplerRequestError(f"rid {state.rid!r} is already running; use a unique rid", param="rid")
        self.active.add(state.rid)
        try:
            async with aclosing(self.engine.generate(self.make_request(gi, state.rid))) as events:
                async for ev in events:
                    state.apply(ev)
                    yield state
        finally:
            self.active.discard(state.rid)
            self._log_done(state)

    def _log_done(self, state: R.ResponseState) -> None:
        self.served += 1
        # no finish_reason: the client went away (or the engine refused it) and the generator was closed
        finish = state.finish_reason["type"] if state.finish_reason else "closed"
        log.info(
            "sampler.request",
            rid=state.rid,
            prompt_tokens=len(state.req.input_ids),
            completion_tokens=len(state.output_ids),
            cached_tokens=state.cached_tokens,
            finish=finish,
            latency_s=round(time.perf_counter() - state.started, 4),
            stream=state.req.stream,
        )

    def _new_state(self, gi: P.GenerateInput) -> R.ResponseState:
        return R.ResponseState(req=gi, rid=gi.rid or uuid.uuid4().hex, started=time.perf_counter())

    async def _run_to_end(self, gi: P.GenerateInput) -> dict:
        state = self._new_state(gi)
        async with aclosing(self._events(gi, state)) as events:
            async for _ in events:
                pass
        return state.to_json(self._decode, time.perf_counter())

    async def generate(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body() or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _bad(f"the request body is not valid JSON: {exc}")
        try:
            reqs, batch = P.parse_generate(
                body, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len, encode=self.tokenizer.encode
            )
            rids = [gi.rid for gi in reqs if gi.rid is not None]
            for rid in rids:
                if rid in self.active or rids.count(rid) > 1:
                    raise SamplerRequestError(f"rid {rid!r} is already in use; send a unique rid", param="rid")
        except SamplerRequestError as exc:
            return _bad(str(exc), param=exc.param)
        if reqs[0].stream:
            return self._stream(reqs[0])
        results: list[dict | Exception | None] = [None] * len(reqs)
        disconnected = False
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal disconnected
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                disconnected = True
                tg.cancel_scope.cancel()

            async def one(i: int, gi: P.GenerateInput) -> None:
                try:
                    results[i] = await self._run_to_end(gi)
                except _REJECTED as exc:  # the engine rejected it
                    results[i] = exc
                except SamplerError as exc:  # the engine is not running (starting or shutting down)
                    results[i] = exc

            async with anyio.create_task_group() as work:
                tg.start_soon(watch)
                for i, gi in enumerate(reqs):
                    work.start_soon(one, i, gi)
            tg.cancel_scope.cancel()  # all done: stop the disconnect watcher
        if disconnected:
            return Response(status_code=499)  # nobody is listening; the engine requests were aborted
        for r in results:
            if isinstance(r, _REJECTED):
                return _bad(str(r), param=getattr(r, "param", ""))
            if isinstance(r, Exception):  # 503: clients retry elsewhere
                return _bad(f"the sampler cannot serve now: {r}", status=503)
        return json_response(results if batch else results[0])

    def _stream(self, gi: P.GenerateInput) -> Response:
        state = self._new_state(gi)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async with aclosing(self._events(gi, state)) as events:
                    async for st in events:
                        yield b"data: " + json.dumps(st.to_json(self._decode, time.perf_counter())).encode() + b"\n\n"
            except _REJECTED as exc:  # a duplicate rid or the engine's own rejection
                param = getattr(exc, "param", "")
                log.info("sampler.bad_request", message=str(exc), param=param, status=400)
                yield b"data: " + json.dumps(R.error_body(str(exc), param=param)).encode() + b"\n\n"
            except SamplerError as exc:  # the engine stopped under us
                log.warning("sampler.unavailable", rid=state.rid, error=str(exc))
                yield b"data: " + json.dumps(R.error_body(str(exc), status=503)).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    # ---------------------------------------------------------------- control endpoints

    async def _json_body(self, request: Request) -> dict:
        raw = await request.body()
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SamplerRequestError(f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise SamplerRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
        return body

    async def update_weights_from_disk(self, request: Request) -> Response:
        try:
            body = await self._json_body(request)
            path = body.get("model_path")
            if not isinstance(path, str) or not path:
                raise SamplerRequestError(
                    "model_path must be a non-empty string (a directory of weights)", param="model_path"
                )
            weight_version = body.get("weight_version")
            if weight_version is not None and (
                not isinstance(weight_version, (str, int)) or isinstance(weight_version, bool)
            ):
                raise SamplerRequestError(
                    f"weight_version must be a string, got {weight_version!r}", param="weight_version"
                )
            self._check_root(path)
        except SamplerRequestError as exc:
            return _bad(str(exc), param=exc.param)
        weight_version = None if weight_version is None else str(weight_version)
        t0 = time.perf_counter()
        try:
            await self.engine.update_weights_from_disk(path, weight_version=weight_version)
        except Exception as exc:  # any load failure is reported to the caller, as SGLang does; the old weights stay
            log.warning("sampler.update_weights_failed", model_path=path, error=repr(exc))
            return json_response(
                {"success": False, "message": f"Failed to update weights from {path}: {exc}", "num_paused_requests": 0},
                400,
            )
        log.info(
            "sampler.weights_updated",
            model_path=path,
            weight_version=self.engine.weight_version,
            seconds=round(time.perf_counter() - t0, 3),
        )
        msg = "Succeeded to update model weights."
        if weight_version is not None:
            msg += f" Weight version updated to {weight_version}."
        return json_response({"success": True, "message": msg, "num_paused_requests": 0})

    def _check_root(self, path: str) -> None:
        """``path`` (symlinks and ``..`` resolved) must lie under an allowed weight root."""
        real = Path(path).resolve()
        if any(real.is_relative_to(root) for root in self.weight_roots):
            return
        roots = ", ".join(str(r) for r in self.weight_roots) or "(none)"
        raise SamplerRequestError(
            f"model_path {path} (resolved: {real}) is outside the allowed weight roots {roots}; start the "
            "sampler with --allowed-weight-roots DIR,... to allow it",
            param="model_path",
        )

    async def flush_cache(self, request: Request) -> Response:
        self.engine.flush_cache()
        log.info("sampler.cache_flushed")
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )

    async def abort_request(self, request: Request) -> Response:
        try:
            body = await self._json_body(request)
        except SamplerRequestError as exc:
            return _bad(str(exc), param=exc.param)
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            return _bad(f"rid must be a string and abort_all a boolean, got {rid!r}, {abort_all!r}", param="rid")
        targets = list(self.active) if abort_all else [rid] if rid else []
        aborted = [r for r in targets if self.engine.abort(r)]
        log.info("sampler.abort", rid=rid, abort_all=abort_all, aborted=len(aborted))
        return Response(status_code=200)

    async def get_model_info(self, request: Request) -> Response:
        """SGLang's ``/model_info`` keys and nothing else (``sglang/srt/entrypoints/http_server.py`` ``model_info``): no
        layer count (a client reads the MoE shape from the model's ``config.json``); ``weight_version`` is
        the live one."""
        cfg = self.hf_config
        return json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.config.served_model_name,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": str(self.engine.weight_version),
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": cfg.get("model_type"),
                "architectures": cfg.get("architectures"),
            }
        )

    async def get_server_info(self, request: Request) -> Response:
        """As SGLang's ``/server_info``: the start-up configuration (its ``weight_version`` is the start-up
        one; the live one is ``/model_info``'s), one worker (``tp_size`` 1), and the state per DP rank, whose
        ``env_vars`` (SGLang's, with ``SGLANG_EXPOSE_OWN_ENV_VARS=1``) say that logprobs are the model's own
        at temperature 1, as SGLang's with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``."""
        return json_response(
            {
                **{k: _plain(v) for k, v in asdict(self.config).items() if k not in _SECRET},
                "model_path": self.model_path,
                "weight_version": self.startup_version,
                "tp_size": 1,
                "pp_size": 1,
                "dp_size": 1,
                "enable_return_routed_experts": True,
                "internal_states": [
                    {
                        "running_requests": len(self.active),
                        "served_requests": self.served,
                        **self.engine.stats(),
                        "env_vars": {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"},
                    }
                ],
                "version": VERSION,
            }
        )

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def health_generate(self, request: Request) -> Response:
        """One greedy token, as SGLang's; server.py holds it while paused (SGLang's waits out a pause too)."""
        gi = P.GenerateInput(
            input_ids=(0,),
            sampling=replace(P.SGLANG_DEFAULTS, max_new_tokens=1, temperature=0.0),
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        )
        with anyio.move_on_after(self.config.health_timeout):
            result = await self._run_to_end(gi)
            return Response(status_code=200 if result["meta_info"]["completion_tokens"] == 1 else 503)
        return Response(status_code=503)

    async def models(self, request: Request) -> Response:
        name = self.config.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": int(self.started),
            "owned_by": "sglang",
            "root": name,
            "max_model_len": self.max_seq_len,
        }
        return json_response({"object": "list", "data": [card]})
