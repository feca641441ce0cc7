"""``python -m t1async.sampler serve``: the embedded SGLang-compatible sampler server.

Prints ``t1async sampler ready at http://HOST:PORT`` on stdout once it answers (and writes the URL to
``--ready-file`` if given); stops gracefully on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

READY_PREFIX = "t1async sampler ready at "


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m t1async.sampler",
        description="The embedded SGLang-compatible sampler (POST /generate, token-in/token-out, MoE routing).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="serve the tiny MoE model over SGLang's native HTTP API",
        description="Serve a model over SGLang's native HTTP API (DESIGN §4).",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=30000, help="port to bind; 0 picks a free one (default 30000)")
    s.add_argument("--model", default=None, help="model directory (default: the shipped tiny model)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    s.add_argument("--max-batch", type=int, default=64, help="most sequences decoded together (default 64)")
    s.add_argument("--prefix-cache-tokens", type=int, default=None, help="prefix (KV) cache size in tokens")
    s.add_argument("--served-model-name", default="t1async-tiny-moe", help="the model id in /v1/models")
    s.add_argument(
        "--pause-timeout",
        type=float,
        default=300.0,
        help="seconds a /pause_generation lasts at most before generation goes on with the old weights (default 300)",
    )
    s.add_argument("--ready-file", default=None, help="write the URL to this file once the server answers")
    s.add_argument("--log-level", default=None, help="debug|info|warning|error (default: T1_LOG_LEVEL or info)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.max_batch < 1:
        print(f"--max-batch must be >= 1, got {args.max_batch}", file=sys.stderr)
        return 2
    if not args.pause_timeout > 0:
        print(f"--pause-timeout must be > 0 seconds, got {args.pause_timeout}", file=sys.stderr)
        return 2
    if not 0 <= args.port < 65536:
        print(f"--port must be in 0..65535, got {args.port}", file=sys.stderr)
        return 2
    if args.model is not None and not Path(args.model).is_dir():
        print(f"--model {args.model}: no such directory (pass a model directory holding config.json)", file=sys.stderr)
        return 2

    import trio

    from t1async.log import configure

    configure(args.log_level)  # before importing modules that bind their loggers at import time
    from t1async.sampler.app import ServerConfig
    from t1async.sampler.server import serve
    from t1async.signals import wait_for_stop

    config = ServerConfig(
        host=args.host,
        port=args.port,
        model_dir=args.model,
        seed=args.seed,
        dtype=args.dtype,
        max_batch=args.max_batch,
        prefix_cache_tokens=args.prefix_cache_tokens,
        served_model_name=args.served_model_name,
        pause_timeout_s=args.pause_timeout,
    )

    async def run() -> None:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:

            async def signals() -> None:
                await wait_for_stop()
                stop.set()

            nursery.start_soon(signals)
            url = await nursery.start(
                lambda task_status: serve(config, shutdown_trigger=stop.wait, task_status=task_status)
            )
            print(READY_PREFIX + url, flush=True)
            if args.ready_file:
                tmp = Path(args.ready_file + ".tmp")
                tmp.write_text(url + "\n")
                os.replace(tmp, args.ready_file)
            # serve() returns once the HTTP server has shut down; then stop the signal watcher
            await stop.wait()
        # nursery exits when serve() finished its graceful shutdown

    from t1async.protocol.errors import T1Error

    failed: list[T1Error | ExceptionGroup[T1Error]] = []
    try:
        trio.run(run)
    except* T1Error as group:  # a bad model dir, weights that do not load: say what, without a traceback
        failed.extend(group.exceptions)
    if failed:
        for exc in failed:
            print(f"t1async sampler: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    print("t1async sampler stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
