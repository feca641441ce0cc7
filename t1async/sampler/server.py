"""The embedded SGLang-compatible HTTP server (design §4): starlette on hypercorn, under trio.

``build_app(engine, tokenizer, ...)`` is the ASGI app (tests drive it in-process with
``httpx.ASGITransport`` or over a socket); ``serve(config)`` loads the model, runs the Engine and the HTTP
server in one task group, and reports the bound URL through ``task_status``. The handlers are app.py's
``SamplerApp``; request parsing (requests.py) and response building (response.py) are pure.

A client that disconnects aborts its request: streaming responses are cancelled by starlette when the
client goes away; non-streaming ones watch the ASGI ``receive`` channel for ``http.disconnect``. Either way
the engine's generator is closed, which aborts the request in the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from t1async.log import get_logger
from t1async.sampler import response as R
from t1async.sampler.app import SamplerApp, ServingEngine, json_response
from t1async.sampler.settings import SamplerSettings

__all__ = ["build_app", "serve"]
log = get_logger("sampler.server")


def build_app(
    engine: ServingEngine,
    tokenizer: Any,
    *,
    config: SamplerSettings | None = None,
    model_path: str = "",
    request_type: Any = None,
) -> Starlette:
    """The ASGI app. ``request_type`` defaults to the engine's ``GenRequest`` (tests may pass their own)."""
    a = SamplerApp(engine, tokenizer, config or SamplerSettings(), model_path, request_type)
    get_post = ["GET", "POST"]
    from t1async.sampler.weightpush_server import WeightPushServer

    ws = WeightPushServer(a)  # SGLang's distributed weight update over a gloo group; pausing gates /generate
    routes = [
        Route("/generate", ws.gate(a.generate), methods=["POST", "PUT"]),
        *ws.routes(),
        Route("/update_weights_from_disk", a.update_weights_from_disk, methods=["POST"]),
        Route("/flush_cache", a.flush_cache, methods=get_post),
        Route("/abort_request", a.abort_request, methods=["POST"]),
        Route("/model_info", a.get_model_info, methods=["GET"]),
        Route("/get_model_info", a.get_model_info, methods=["GET"]),
        Route("/server_info", a.get_server_info, methods=["GET"]),
        Route("/get_server_info", a.get_server_info, methods=["GET"]),
        Route("/health", a.health, methods=["GET"]),
        Route("/health_generate", ws.hold(a.health_generate, a.config.health_timeout), methods=["GET"]),
        Route("/v1/models", a.models, methods=["GET"]),
    ]

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("sampler.internal_error", path=request.url.path, error=repr(exc), exc_info=exc)
        return json_response(R.error_body(f"internal error: {exc!r}", status=500), 500)

    cfg = a.config
    middleware = []
    if cfg.api_key or cfg.admin_api_key:  # design §4 "Keys"
        from starlette.middleware import Middleware

        from t1async.sampler.auth import KeyMiddleware

        middleware.append(Middleware(KeyMiddleware, api_key=cfg.api_key, admin_key=cfg.admin_api_key))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={Exception: internal_error})
    app.state.sampler = a
    app.state.weightpush = ws
    return app


async def serve(
    config: SamplerSettings,
    *,
    shutdown_trigger: Any = None,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Load the model, run the engine and the HTTP server until ``shutdown_trigger`` returns (or cancelled).

    Reports the URL (``http://host:port``, the real port when ``config.port`` is 0) through ``task_status``.
    """
    import hypercorn.trio
    from hypercorn.config import Config as HyperConfig

    from t1async.model.engine import Engine
    from t1async.model.records import EngineConfig
    from t1async.model.weights import default_model_dir

    model_dir = config.model if config.model is not None else Path(default_model_dir())
    ecfg: dict[str, Any] = {"max_batch": config.max_batch, "dtype": config.dtype, "seed": config.seed}
    if config.prefix_cache_tokens is not None:
        ecfg["prefix_cache_tokens"] = config.prefix_cache_tokens
    engine = Engine(model_dir, EngineConfig(**ecfg))
    app = build_app(engine, engine.tokenizer, config=config, model_path=str(model_dir))
    hc = HyperConfig()
    hc.bind = [f"{config.host}:{config.port}"]
    hc.accesslog = None
    hc.errorlog = None
    hc.graceful_timeout = 2.0
    hc.keep_alive_timeout = 75.0
    async with anyio.create_task_group() as tg:

        async def http(*, task_status: anyio.abc.TaskStatus[list[str]]) -> None:
            # ignore: Starlette's ASGI signature is untyped MutableMappings, hypercorn's is TypedDicts (both ASGI 3);
            # under the trio backend anyio hands over trio's own TaskStatus, which hypercorn expects
            await hypercorn.trio.serve(app, hc, shutdown_trigger=shutdown_trigger, task_status=task_status)  # type: ignore[arg-type]
            tg.cancel_scope.cancel()  # the HTTP server shut down gracefully: stop the engine as well

        await tg.start(engine.run)
        binds = await tg.start(http)
        url = binds[0]
        log.info(
            "sampler.ready",
            url=url,
            model_dir=str(model_dir),
            dtype=config.dtype,
            max_batch=config.max_batch,
            api_key=config.api_key is not None,
            admin_api_key=config.admin_api_key is not None,
            weight_roots=[str(r) for r in app.state.sampler.weight_roots],
        )
        task_status.started(url)
        # hypercorn's serve returns after a graceful shutdown; then stop the engine too
